"""``TpuTcpConnector``: prefill/decode disaggregation for vLLM on ``tpu``, the KV moved over TCP.

A vLLM KV connector (vLLM's ``KVConnectorBase_V1`` API), loaded with
``--kv-transfer-config '{"kv_connector": "TpuTcpConnector", "kv_connector_module_path":
"torchtpu.integrations.vllm.kv_connector", "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
"kv_port": PORT}'``. It speaks the same request protocol as vLLM's NIXL connector, so a P/D
router (``vllm-router --vllm-pd-disaggregation``, vLLM's toy proxy) drives it unchanged:

1. The router sends the request to the prefill instance with ``max_tokens=1`` and
   ``kv_transfer_params={"do_remote_decode": true}``. In the step that computes the prompt's
   last token, the prefill worker copies the request's KV blocks from the tpu cache to host
   memory (one gather per layer) and keeps them, by request id, for a TCP server thread of the
   worker (``kv_port`` on ``host``, extra config). The response's ``kv_transfer_params`` say
   where: ``remote_host``, ``remote_port``, ``remote_request_id``, ``remote_block_ids``.
2. The router sends the original request to the decode instance with those parameters. Its
   scheduler reserves blocks for the prompt and parks the request (``WAITING_FOR_REMOTE_KVS``,
   vLLM's asynchronous load) while running decodes go on; a worker thread pulls the blocks
   over TCP; between two steps the worker writes them into its tpu cache (one ``index_copy_``
   per layer) and reports the request loaded. The decode instance then computes only the
   prompt's last token again (for its logits) and decodes.

The host copy is the transfer buffer, as NIXL's ``kv_buffer_device=cpu`` mode has: the device
cache is only touched on the engine's own thread, between steps. Staged KV nobody fetches is
dropped after ``stage_ttl_s`` (extra config, default 300 s). Tensor parallelism is refused
(one worker per instance); a decode instance with a longer block list than the prefill's, a
different block size or layer set gets an error back, and vLLM fails the request
(``kv_load_failure_policy``).

The wire: a request is 4 bytes of big-endian length and a JSON object ``{"request_id",
"first_block", "num_blocks"}``; the reply is a length and a JSON header ``{"ok", "error",
"layers": [[name, dtype, shape], ...]}`` then each layer's bytes, in that order.
"""

from __future__ import annotations

import json
import math
import queue
import socket
import socketserver
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from vllm.logger import init_logger

from torchtpu.serving.buckets import power_of_two_at_least
from torchtpu.serving.paged_kv import block_slots

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger("vllm.torchtpu.kv_connector")  # under "vllm.": into the server's log

DEFAULT_HOST = "127.0.0.1"
DEFAULT_STAGE_TTL_S = 300.0
FETCH_TIMEOUT_S = 60.0
_LEN = struct.Struct("!I")


# ---------------------------------------------------------------- the wire

def _send_msg(sock: socket.socket, obj: dict, payload: list[memoryview] = ()) -> None:
    header = json.dumps(obj).encode()
    sock.sendall(_LEN.pack(len(header)) + header)
    for chunk in payload:
        sock.sendall(chunk)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
        got += k
    return buf


def _recv_msg(sock: socket.socket) -> dict:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    return json.loads(_recv_exact(sock, n))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def fetch_blocks(host: str, port: int, request_id: str, first_block: int, num_blocks: int,
                 timeout: float = FETCH_TIMEOUT_S) -> dict[str, torch.Tensor]:
    """Pull ``num_blocks`` staged blocks of ``request_id`` from a producer: host tensors by layer,
    each ``[num_blocks * block_size, heads, k|v]``."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        _send_msg(sock, {"request_id": request_id, "first_block": first_block,
                         "num_blocks": num_blocks})
        header = _recv_msg(sock)
        if not header.get("ok"):
            raise RuntimeError(f"tpu KV transfer: producer {host}:{port} refused request "
                               f"{request_id}: {header.get('error')}")
        out = {}
        for name, dtype, shape in header["layers"]:
            dtype = getattr(torch, dtype)
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            raw = _recv_exact(sock, nbytes)
            out[name] = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)
        return out


class _StagedKV:
    """Producer side: the host copies of finished prefills, by request id, and the server that
    hands them out."""

    def __init__(self, host: str, port: int, block_size: int, ttl_s: float):
        self.block_size, self.ttl_s = block_size, ttl_s
        self.lock = threading.Lock()
        self.entries: dict[str, tuple[float, dict[str, torch.Tensor]]] = {}
        staged = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                try:
                    staged.serve(self.request)
                except (OSError, ValueError) as e:  # a consumer that went away
                    logger.warning("tpu KV transfer: serving a fetch failed: %s", e)

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self.server = socketserver.ThreadingTCPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="tpu-kv-server",
                                       daemon=True)
        self.thread.start()
        logger.info("tpu KV transfer: serving staged KV on %s:%d", host, port)

    def put(self, request_id: str, layers: dict[str, torch.Tensor]) -> None:
        now = time.monotonic()
        with self.lock:
            for rid in [r for r, (t, _) in self.entries.items() if now - t > self.ttl_s]:
                logger.warning("tpu KV transfer: staged KV of %s not fetched in %.0f s; dropped",
                               rid, self.ttl_s)
                del self.entries[rid]
            self.entries[request_id] = (now, layers)

    def serve(self, sock: socket.socket) -> None:
        ask = _recv_msg(sock)
        with self.lock:
            entry = self.entries.pop(ask["request_id"], None)
        if entry is None:
            _send_msg(sock, {"ok": False, "error": "no staged KV for this request id (never "
                             "prefilled here, already fetched, or expired)"})
            return
        layers = entry[1]
        bs = self.block_size
        lo, hi = ask["first_block"] * bs, (ask["first_block"] + ask["num_blocks"]) * bs
        rows = next(iter(layers.values())).shape[0]
        if hi > rows:
            _send_msg(sock, {"ok": False, "error": f"asked for slots [{lo}, {hi}) of {rows} staged"})
            return
        parts = {name: t[lo:hi].contiguous() for name, t in layers.items()}
        _send_msg(sock, {"ok": True, "layers": [[n, _dtype_name(t.dtype), list(t.shape)]
                                                for n, t in parts.items()]},
                  [memoryview(t.view(torch.uint8).numpy()).cast("B") for t in parts.values()])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ---------------------------------------------------------------- what the scheduler tells workers

@dataclass
class SaveSpec:
    request_id: str
    block_ids: list[int]


@dataclass
class RecvSpec:
    request_id: str
    local_block_ids: list[int]  # where the fetched blocks go, in order
    host: str
    port: int
    remote_request_id: str
    first_block: int  # index in the remote request's block list of the first fetched block


@dataclass
class TpuTcpConnectorMetadata(KVConnectorMetadata):
    save: list[SaveSpec] = field(default_factory=list)
    recv: list[RecvSpec] = field(default_factory=list)


# ---------------------------------------------------------------- the connector

class TpuTcpConnector(KVConnectorBase_V1):
    """Prefill/decode KV transfer for vLLM on tpu: host-staged blocks pulled over TCP."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = self._kv_transfer_config
        if vllm_config.parallel_config.world_size > 1:
            raise NotImplementedError(
                "tpu: TpuTcpConnector moves one worker's KV cache; tensor/pipeline parallel "
                "instances (--tensor-parallel-size > 1) are not supported by it yet.")
        self.block_size = vllm_config.cache_config.block_size
        self.host = config.get_from_extra_config("host", DEFAULT_HOST)
        self.port = int(config.kv_port)
        self.engine_id = config.engine_id
        self.is_producer = config.is_kv_producer
        # scheduler side
        self._to_save: dict[str, Request] = {}
        self._num_computed: dict[str, int] = {}
        self._pending_recv: list[RecvSpec] = []
        # worker side
        self._caches: dict[str, torch.Tensor] = {}
        self._staged: _StagedKV | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._fetched: queue.Queue = queue.Queue()
        self._load_errors: set[int] = set()
        self._aborted: set[str] = set()
        self._in_flight: set[str] = set()
        if role == KVConnectorRole.WORKER:
            if self.is_producer:
                ttl = float(config.get_from_extra_config("stage_ttl_s", DEFAULT_STAGE_TTL_S))
                self._staged = _StagedKV(self.host, self.port, self.block_size, ttl)
            if config.is_kv_consumer:
                self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tpu-kv-fetch")

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        seen, self._caches = set(), {}
        for name, cache in sorted(kv_caches.items()):
            if id(cache) not in seen:  # layers that share a cache move it once
                seen.add(id(cache))
                self._caches[name] = cache
        self._device = next(iter(self._caches.values())).device

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TpuTcpConnectorMetadata)
        for spec in meta.recv:
            self._in_flight.add(spec.request_id)
            self._pool.submit(self._fetch, spec)

    def _fetch(self, spec: RecvSpec) -> None:
        start = time.perf_counter()
        try:
            layers = fetch_blocks(spec.host, spec.port, spec.remote_request_id, spec.first_block,
                                  len(spec.local_block_ids))
            rows = len(spec.local_block_ids) * self.block_size
            for name, cache in self._caches.items():
                got = layers.get(name)
                if got is None or got.dtype != cache.dtype or tuple(got.shape) != (rows, *cache.shape[1:]):
                    raise RuntimeError(
                        f"tpu KV transfer: the producer's KV for layer {name} is "
                        f"{None if got is None else (got.dtype, tuple(got.shape))}, this cache wants "
                        f"{(cache.dtype, (rows, *cache.shape[1:]))} (another model, dtype or block size?)")
            self._fetched.put((spec, layers, None, time.perf_counter() - start))
        except Exception as e:  # noqa: BLE001  (reported to the scheduler as a failed load)
            self._fetched.put((spec, None, e, time.perf_counter() - start))

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass  # whole requests are loaded between steps

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata,
                      **kwargs: Any) -> None:
        pass  # saved whole, in wait_for_save

    def wait_for_save(self) -> None:
        """Copy each request whose prefill this step finished to host memory, for the server."""
        meta = self._connector_metadata
        if not isinstance(meta, TpuTcpConnectorMetadata) or not meta.save:
            return
        for spec in meta.save:
            # Block counts padded to a power of two (the last block again): each count is an
            # eager program of its own, and a new one would compile in the middle of serving.
            n = len(spec.block_ids)
            padded = spec.block_ids + spec.block_ids[-1:] * (power_of_two_at_least(n) - n)
            slots = block_slots(padded, self.block_size).to(self._device)
            rows = n * self.block_size
            layers = {name: cache.index_select(0, slots).cpu()[:rows] for name, cache in self._caches.items()}
            self._staged.put(spec.request_id, layers)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Write the blocks fetched since the last step into the cache; report those requests."""
        self._aborted |= finished_req_ids & self._in_flight
        done = set()
        while True:
            try:
                spec, layers, error, fetch_s = self._fetched.get_nowait()
            except queue.Empty:
                break
            self._in_flight.discard(spec.request_id)
            done.add(spec.request_id)
            if spec.request_id in self._aborted:  # its blocks may be someone else's by now
                self._aborted.discard(spec.request_id)
                continue
            if error is not None:
                logger.error("tpu KV transfer: loading %s from %s:%d failed: %s",
                             spec.request_id, spec.host, spec.port, error)
                self._load_errors.update(spec.local_block_ids)
                continue
            # Padded to a power of two as in wait_for_save: the extra rows go to the cache's
            # scratch block (its last), where padded tokens' keys and values go too.
            start = time.perf_counter()
            n = len(spec.local_block_ids)
            extra = power_of_two_at_least(n) - n
            scratch = next(iter(self._caches.values())).shape[0] // self.block_size - 1
            slots = block_slots(spec.local_block_ids + [scratch] * extra, self.block_size).to(self._device)
            for name, cache in self._caches.items():
                values = layers[name]
                if extra:
                    values = torch.cat([values, values.new_zeros((extra * self.block_size, *values.shape[1:]))])
                cache.index_copy_(0, slots, values.to(self._device))
            logger.info("tpu KV transfer: loaded %d blocks (%d KiB) of %s from %s:%d (fetched in %.1f ms on a "
                        "worker thread; written into the cache in %.1f ms between steps)",
                        len(spec.local_block_ids), sum(t.nbytes for t in layers.values()) >> 10,
                        spec.remote_request_id, spec.host, spec.port, fetch_s * 1e3,
                        (time.perf_counter() - start) * 1e3)
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._staged is not None:
            self._staged.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int,
                                   ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and params.get("remote_request_id"):
            count = len(request.prompt_token_ids or ()) - num_computed_tokens
            if count > 0:
                self._num_computed[request.request_id] = num_computed_tokens
                return count, True  # loaded asynchronously: running decodes go on
        return 0, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        if params.get("do_remote_decode") and self.is_producer:
            self._to_save[request.request_id] = request
        elif params.get("do_remote_prefill"):
            params["do_remote_prefill"] = False  # one transfer per request
            computed = self._num_computed.pop(request.request_id, 0)
            if num_external_tokens <= 0:
                return
            first = computed // self.block_size
            last = math.ceil(len(request.prompt_token_ids) / self.block_size)
            local = list(blocks.get_block_ids()[0][first:last])
            self._pending_recv.append(RecvSpec(
                request.request_id, local, params["remote_host"], int(params["remote_port"]),
                params["remote_request_id"], first))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = TpuTcpConnectorMetadata(recv=self._pending_recv)
        self._pending_recv = []
        scheduled = scheduler_output.num_scheduled_tokens
        for rid, request in list(self._to_save.items()):
            if rid not in scheduled:
                continue
            prompt = request.num_prompt_tokens
            if request.num_computed_tokens + scheduled[rid] >= prompt:  # the last prefill chunk
                blocks = self._kv_cache_manager.get_blocks(rid).get_block_ids()[0]
                meta.save.append(SaveSpec(rid, list(blocks[: math.ceil(prompt / self.block_size)])))
                del self._to_save[rid]
        return meta

    def request_finished(self, request: "Request", block_ids: list[int],
                         ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        self._to_save.pop(request.request_id, None)
        self._num_computed.pop(request.request_id, None)
        if not params or not params.get("do_remote_decode") or not self.is_producer:
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                  RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted: nothing staged for a decode instance
        # The KV is already on the host (staged in the step that finished the prefill): the
        # blocks can go back to the pool now.
        return False, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_block_ids": list(block_ids[0]) if block_ids and isinstance(block_ids[0], (list, tuple)) else list(block_ids),
            "remote_num_tokens": request.num_prompt_tokens,
            "tp_size": 1,
        }
