"""VeRL's checkpoint engine for ``tpu``: the trainer's new weights to the rollout replicas after
each step, when the trainer and the rollout hold separate devices (``hybrid_engine=False``).

VeRL's engines for CUDA (``nccl``, ``nixl``, ``mooncake``) broadcast between GPUs; a ``tpu``
trainer and a ``tpu`` rollout engine share no device memory and no communicator (each is its own
``jax.distributed`` job), so this engine moves the weights through the hosts: actor rank 0 reads
each full tensor to host memory (``get_per_tensor_param``: FSDP2's all-gather runs on the
trainer's devices, every actor rank takes part) and streams buckets of them over ZeroMQ (TCP) to
every rollout worker, which hands them to its engine as VeRL does for every backend (vLLM:
shared memory into the worker process, ``load_weights`` onto its ``tpu``). Each bucket is
acknowledged by every receiver before the next is sent, so at most one bucket per receiver is in
flight.

Selected with ``actor_rollout_ref.rollout.checkpoint_engine.backend=tpu`` and
``...checkpoint_engine.custom_backend_module=torchtpu.integrations.verl.checkpoint_engine``
(VeRL imports that module in the actor and rollout processes, which registers the backend).
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import time
from collections.abc import AsyncGenerator, Generator
from dataclasses import dataclass

import ray
import torch
import zmq
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
from verl.utils.net_utils import get_free_port, is_valid_ipv6_address

logger = logging.getLogger(__name__)

BACKEND = "tpu"
READY, ACK = b"ready", b"ack"
RECEIVE_TIMEOUT_MS = 600_000  # a receiver waits this long for the next bucket


@dataclass
class Endpoint:
    """Where actor rank 0 listens, handed to every rollout worker."""

    address: str


def _address(ip: str, port: int) -> str:
    return f"tcp://[{ip}]:{port}" if is_valid_ipv6_address(ip) else f"tcp://{ip}:{port}"


def _to_host(weight: torch.Tensor) -> torch.Tensor:
    """The full tensor, contiguous in host memory (a DTensor's full value, a tpu tensor's copy)."""
    if hasattr(weight, "full_tensor"):
        weight = weight.full_tensor()
    return weight.detach().to("cpu").contiguous()


def _pack(bucket: list[tuple[str, torch.Tensor]]) -> tuple[bytes, bytes]:
    """(metadata, payload) of a bucket: names, dtypes, shapes and offsets; the bytes end to end."""
    meta, parts, offset = [], [], 0
    for name, tensor in bucket:
        raw = tensor.view(-1).view(torch.uint8).numpy().tobytes()
        meta.append((name, tensor.dtype, tuple(tensor.shape), offset, len(raw)))
        parts.append(raw)
        offset += len(raw)
    return pickle.dumps(meta), b"".join(parts)


def _unpack(meta: bytes, payload: bytes) -> list[tuple[str, torch.Tensor]]:
    buffer = bytearray(payload)  # writable: the tensors own it after the message is dropped
    out = []
    for name, dtype, shape, offset, size in pickle.loads(meta):
        flat = torch.frombuffer(buffer, dtype=torch.uint8, count=size, offset=offset) if size else \
            torch.empty(0, dtype=torch.uint8)
        out.append((name, flat.view(dtype).view(shape)))
    return out


@CheckpointEngineRegistry.register(BACKEND)
class HostCheckpointEngine(CheckpointEngine):
    """Weights from actor rank 0 to every rollout worker through host memory and ZeroMQ."""

    def __init__(self, bucket_size: int, is_master: bool = False, **unused) -> None:
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.rank = None
        self.receivers = 0
        self.context = zmq.Context.instance()
        self.socket = None
        self.endpoint = None
        if is_master:  # one listening socket for the whole run; receivers reconnect each sync
            self.socket = self.context.socket(zmq.ROUTER)
            ip = ray.util.get_node_ip_address().strip("[]")
            if is_valid_ipv6_address(ip):
                self.socket.setsockopt(zmq.IPV6, 1)
            port, _ = get_free_port(ip)
            self.socket.bind(_address(ip, port))
            self.endpoint = Endpoint(_address(ip, port))

    def prepare(self) -> Endpoint | None:
        return self.endpoint

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list):
        endpoint = metadata[0]
        assert isinstance(endpoint, Endpoint), "actor rank 0 must be the checkpoint engine's master"
        actor = {"rank": list(range(actor_wg_world_size)), "endpoint": [endpoint] * actor_wg_world_size,
                 "receivers": [rollout_world_size] * actor_wg_world_size}
        rollout = {"rank": [-1 - i for i in range(rollout_world_size)], "endpoint": [endpoint] * rollout_world_size,
                   "receivers": [rollout_world_size] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, rank: int, endpoint: Endpoint, receivers: int):
        """Actor ranks: >= 0 (rank 0 sends); rollout workers: < 0, each connects to rank 0's socket."""
        self.rank, self.receivers = rank, receivers
        if rank < 0:
            self.socket = self.context.socket(zmq.DEALER)
            self.socket.setsockopt(zmq.RCVTIMEO, RECEIVE_TIMEOUT_MS)
            if endpoint.address.startswith("tcp://["):
                self.socket.setsockopt(zmq.IPV6, 1)
            self.socket.connect(endpoint.address)
            self.socket.send(READY)

    def finalize(self):
        if self.rank is not None and self.rank < 0 and self.socket is not None:
            self.socket.close(linger=0)
            self.socket = None
        self.rank = None

    def _wait_for_receivers(self) -> list[bytes]:
        identities = []
        while len(identities) < self.receivers:
            if not self.socket.poll(RECEIVE_TIMEOUT_MS):
                raise TimeoutError(f"tpu checkpoint engine: {len(identities)} of {self.receivers} rollout "
                                   f"workers connected to actor rank 0 within {RECEIVE_TIMEOUT_MS // 1000} s")
            identity, message = self.socket.recv_multipart()
            assert message == READY, message
            identities.append(identity)
        return identities

    def _broadcast(self, identities: list[bytes], bucket: list[tuple[str, torch.Tensor]], last: bool) -> None:
        meta, payload = _pack(bucket)
        flag = b"1" if last else b"0"
        for identity in identities:
            self.socket.send_multipart([identity, flag, meta, payload], copy=False)
        for _ in identities:  # every receiver has the bucket before the next one is read
            if not self.socket.poll(RECEIVE_TIMEOUT_MS):
                raise TimeoutError("tpu checkpoint engine: a rollout worker did not acknowledge a bucket")
            _, message = self.socket.recv_multipart()
            assert message == ACK, message

    @torch.no_grad()
    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                           global_steps: int | None = None):
        """Rank 0 streams the weights; the other actor ranks take part in gathering them only."""
        start = time.perf_counter()
        if self.rank != 0:
            for _name, weight in weights:  # the generator's all-gathers need every rank
                if hasattr(weight, "full_tensor"):
                    weight.full_tensor()
            return {}
        identities = await asyncio.to_thread(self._wait_for_receivers)
        bucket, size, total = [], 0, 0
        for name, weight in weights:
            host = _to_host(weight)
            if bucket and size + host.nbytes > self.bucket_size:
                await asyncio.to_thread(self._broadcast, identities, bucket, False)
                bucket, size = [], 0
            bucket.append((name, host))
            size += host.nbytes
            total += host.nbytes
        await asyncio.to_thread(self._broadcast, identities, bucket, True)
        seconds = time.perf_counter() - start
        logger.info("tpu checkpoint engine: %.1f MB to %d rollout workers in %.2f s", total / 2**20,
                    len(identities), seconds)
        return {"timing_s/weight_send": seconds, "perf/weight_sync_mb": total / 2**20}

    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """The weights as host tensors, bucket by bucket, in the trainer's order."""
        while True:
            flag, meta, payload = await asyncio.to_thread(self.socket.recv_multipart)
            self.socket.send(ACK)
            for item in _unpack(meta, payload):
                yield item
            if flag == b"1":
                return
