"""The ``tpu`` c10d backend: ``torch.distributed`` collectives on ``tpu`` tensors as XLA programs.

One instance serves one process group (the world, a ``new_group``, a DeviceMesh dimension). Each
method reads its tensors' ``jax.Array``s, runs the collective's program over the group's devices
(``programs.py``) and writes the results back into the output tensors, all without the host.
JAX dispatches asynchronously, so a method returns as soon as the program is queued: the
returned ``Work`` is complete from the caller's point of view, and a later op that reads an
output waits for the data as it would for any other device op (as NCCL's work orders streams).

Guards (see ``docs/design.md``, "Distributed"):

* the first time a group runs a program, its ranks check through the group's store that they
  all called the same collective with the same shapes; a mismatch or an absent rank raises a
  ``RuntimeError`` that names the op, the group and the ranks, within the group's timeout;
* a watchdog ends the process with the same kind of message when a queued collective has not
  completed within the timeout (a rank died or diverged later), as NCCL's watchdog does.
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import os
import sys
import threading
import time
from collections import Counter

import jax
import jax.numpy as jnp
import torch
from torchtpu.runtime.compat import C10dBackend as Backend, create_work_from_future as _create_work_from_future

from torchtpu import metrics
from torchtpu.device import bridge
from torchtpu.distributed import programs
from torchtpu.runtime import placement, platform
from torchtpu.runtime.dtypes import to_jax_dtype

_OPS = {"SUM": "sum", "AVG": "avg", "PRODUCT": "product", "MIN": "min", "MAX": "max", "BAND": "band",
        "BOR": "bor", "BXOR": "bxor"}
_BITWISE = ("band", "bor", "bxor")
_group_ids = itertools.count()
_counts: Counter = Counter()  # collectives run, by op (in metrics.snapshot()["collectives"])
metrics.register_source("collectives", lambda: dict(_counts))


def _op_name(reduce_op) -> str:
    name = getattr(reduce_op, "op", reduce_op).name
    try:
        return _OPS[name]
    except KeyError:
        raise ValueError(f"tpu backend: ReduceOp.{name} is not supported (SUM, AVG, PRODUCT, MIN, MAX, "
                         f"BAND, BOR, BXOR, PREMUL_SUM are)") from None


def _reduction(opts, x: jax.Array) -> tuple[str, jax.Array]:
    """The reduce op of ``opts`` (sum when none) and the local input it applies to.

    ``PREMUL_SUM(factor)`` (FSDP2 asks for it when a gradient divide factor is set) is a sum of
    the inputs each multiplied by the factor first, as NCCL defines it.
    """
    reduce_op = opts.reduceOp if opts is not None else None
    if reduce_op is None or getattr(reduce_op, "op", reduce_op).name != "PREMUL_SUM":
        return (_op_name(reduce_op) if reduce_op is not None else "sum"), x
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        raise ValueError(f"tpu backend: ReduceOp.PREMUL_SUM needs a floating-point tensor, got {x.dtype}")
    factor = reduce_op.__getstate__()[1]  # a float or a 0-d tensor
    factor = factor.item() if isinstance(factor, torch.Tensor) else factor
    return "sum", (x * factor).astype(x.dtype)


def _check_tensor(t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.device.type != "tpu" or t.layout != torch.strided:
        device = t.device if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"Tensors must be tpu and dense (got a tensor on {device}); the tpu backend serves "
                         f"tpu tensors: init_process_group('cpu:gloo,tpu:tpu') routes CPU tensors to gloo")


def _local(t: torch.Tensor) -> jax.Array:
    """``t``'s elements as a (at least 1-D) array for a collective."""
    _check_tensor(t)
    array = bridge.read_computed(t)
    return array.reshape(1) if array.ndim == 0 else array


def _store(t: torch.Tensor, value: jax.Array) -> None:
    bridge.write(t, value.reshape(t.shape) if tuple(value.shape) != tuple(t.shape) else value)


def _done(result) -> "torch.distributed.Work":
    future = torch.futures.Future()
    future.set_result(result)
    return _create_work_from_future(future)


class _Watchdog:
    """Ends the process when a queued collective outlives its group's timeout (see module doc).

    Its thread runs only while collectives are pending, and is stopped before the interpreter
    shuts down (a daemon thread inside a JAX call at exit aborts the process)."""

    def __init__(self) -> None:
        self._pending: list[tuple[float, list, str]] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        atexit.register(self.stop)

    def track(self, timeout_s: float, arrays: list, what: str) -> None:
        with self._lock:
            self._pending.append((time.monotonic() + timeout_s, arrays, what))
            if self._thread is None and not self._stopping:
                self._thread = threading.Thread(target=self._run, name="torchtpu-collective-watchdog", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            thread = self._thread
        if thread is not None:
            thread.join(timeout=1.0)

    def _run(self) -> None:
        while True:
            time.sleep(0.1)
            now = time.monotonic()
            with self._lock:
                pending, self._pending = self._pending, []
                if self._stopping:
                    self._thread = None
                    return
            keep, expired = [], None
            for entry in pending:
                deadline, arrays, what = entry
                try:
                    ready = all(a.is_ready() for a in arrays)
                except Exception:  # a failed computation: its reader raises the error
                    ready = True
                if not ready:
                    if now > deadline and expired is None:
                        expired = what
                    keep.append(entry)
            if expired is not None:
                sys.stderr.write(f"[rank {os.environ.get('RANK', '?')}] torchtpu watchdog: {expired} did not "
                                 f"complete within the group's timeout: a rank died, or the ranks called "
                                 f"different collectives. Ending this process, as NCCL's watchdog does.\n")
                sys.stderr.flush()
                os._exit(1)
            with self._lock:
                self._pending = keep + self._pending
                if not self._pending:  # nothing in flight: the next collective starts a new thread
                    self._thread = None
                    return


_watchdog = _Watchdog()


class ProcessGroupTPU(Backend):
    """The ``tpu`` backend of one process group."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta, ranks=()) -> None:
        super().__init__(rank, size)
        self._store = store
        self._ranks = tuple(ranks) if ranks else tuple(range(size))
        self._timeout = timeout
        self._id = next(_group_ids)
        self._checked: set[tuple] = set()
        self._checks = 0
        self._batch: list | None = None  # point-to-point ops of a batch_isend_irecv, run at its end
        if self._ranks and self._ranks[rank] != jax.process_index():
            raise RuntimeError(f"tpu backend: group rank {rank} is global rank {self._ranks[rank]}, but this is "
                               f"process {jax.process_index()} of jax.distributed")

    # ------------------------------------------------------------ identity
    def getBackendName(self) -> str:
        return "tpu"

    def __repr__(self) -> str:
        return f"ProcessGroupTPU(group {self._id}, ranks {list(self._ranks)})"

    def _describe(self, op: str, arrays=()) -> str:
        shapes = ", ".join(f"{a.dtype}{list(a.shape)}" for a in arrays)
        return f"tpu collective {op}({shapes}) on group {self._id} (global ranks {list(self._ranks)})"

    @property
    def _timeout_s(self) -> float:
        seconds = self._timeout.total_seconds() if self._timeout else 0
        return seconds if seconds > 0 else 1800.0

    # ------------------------------------------------------------ running a program
    def _agree(self, key: tuple, describe: str) -> None:
        """On a group's first use of a program: check that every rank runs the same one."""
        if len(self._ranks) == 1 or key in self._checked:
            return
        index, self._checks = self._checks, self._checks + 1
        signature = repr(key)
        me = self.rank()
        # the keys name torchrun's restart: a restarted group may get the same store (the agent's),
        # where the previous attempt's signatures for the same index are still set
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._store.set(f"torchtpu/check/{attempt}/{index}/{me}", signature)
        keys = [f"torchtpu/check/{attempt}/{index}/{r}" for r in range(self.size())]
        try:
            self._store.wait(keys, datetime.timedelta(seconds=self._timeout_s))
        except Exception as exc:
            missing = [r for r, k in enumerate(keys) if not self._store.check([k])]
            raise RuntimeError(
                f"{describe}: group ranks {missing} (global {[self._ranks[r] for r in missing]}) did not call a "
                f"matching collective within the timeout ({self._timeout}): a rank is dead, or the ranks "
                f"called different collectives ({type(exc).__name__}: {exc})") from None
        others = {r: self._store.get(k).decode() for r, k in enumerate(keys) if r != me}
        different = {r: s for r, s in others.items() if s != signature}
        if different:
            rank, theirs = next(iter(different.items()))
            raise RuntimeError(f"{describe}: the ranks called different collectives; this rank (group rank {me}) "
                               f"ran {signature}, group rank {rank} ran {theirs}")
        self._checked.add(key)

    def _run(self, op: str, key: tuple, make_body, arrays: list, n_out: int = 1) -> list:
        describe = self._describe(op, arrays)
        full = (key, tuple((tuple(a.shape), str(a.dtype)) for a in arrays))
        self._agree(full, describe)
        outs = programs.run(key, self._ranks, make_body, arrays, n_out)
        _counts[op] += 1
        _watchdog.track(self._timeout_s, outs, describe)
        return outs

    # ------------------------------------------------------------ collectives
    def allreduce(self, tensors, opts=None):
        for t in tensors:
            op, x = _reduction(opts, _local(t))
            if op in _BITWISE and jnp.issubdtype(x.dtype, jnp.inexact):
                raise ValueError(f"tpu backend: ReduceOp.{op.upper()} needs an integer or bool tensor, got {t.dtype}")
            (out,) = self._run("all_reduce", ("all_reduce", op), programs.all_reduce(op), [x])
            _store(t, out)
        return _done(list(tensors))

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts):
        root = opts.rootRank
        for t in tensors:
            (out,) = self._run("broadcast", ("broadcast", root), programs.broadcast(root), [_local(t)])
            if self.rank() != root:
                _store(t, out)
        return _done(list(tensors))

    def reduce(self, tensors, opts):
        root = opts.rootRank
        for t in tensors:
            op, x = _reduction(opts, _local(t))
            (out,) = self._run("reduce", ("all_reduce", op), programs.all_reduce(op), [x])
            if self.rank() == root:
                _store(t, out)
        return _done(list(tensors))

    def _gather_flat(self, op: str, x: jax.Array) -> jax.Array:
        (out,) = self._run(op, ("all_gather",), programs.all_gather(), [x])
        return out

    def all_gather_single(self, output, input, opts=None):
        n = self.size()
        if output.numel() != input.numel() * n:
            raise ValueError(f"tpu backend: all_gather_into_tensor: output has {output.numel()} elements, expected "
                             f"{n} x {input.numel()}")
        _check_tensor(output)
        x = _local(input).reshape(-1) if input.dim() != 1 else _local(input)
        _store(output, self._gather_flat("all_gather_into_tensor", x))
        return _done([output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        for output, input in zip(outputs, inputs):
            self.all_gather_single(output, input, opts)
        return _done(list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather(self, output_lists, inputs, opts=None):
        for outputs, input in zip(output_lists, inputs):
            if len(outputs) != self.size():
                raise ValueError(f"tpu backend: all_gather needs {self.size()} output tensors, got {len(outputs)}")
            for o in outputs:
                _check_tensor(o)
            gathered = self._gather_flat("all_gather", _local(input).reshape(-1))
            blocks = gathered.reshape(self.size(), -1)
            for i, o in enumerate(outputs):
                _store(o, blocks[i])
        return _done(output_lists)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        return self.allgather(output_lists, inputs, opts)

    def reduce_scatter_single(self, output, input, opts=None):
        n = self.size()
        if input.numel() != output.numel() * n:
            raise ValueError(f"tpu backend: reduce_scatter_tensor: input has {input.numel()} elements, expected "
                             f"{n} x {output.numel()}")
        _check_tensor(output)
        op, x = _reduction(opts, _local(input).reshape(-1))
        (out,) = self._run("reduce_scatter_tensor", ("reduce_scatter", op), programs.reduce_scatter(op), [x])
        _store(output, out)
        return _done([output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        for output, input in zip(outputs, inputs):
            self.reduce_scatter_single(output, input, opts)
        return _done(list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        for output, inputs in zip(outputs, input_lists):
            if len(inputs) != self.size():
                raise ValueError(f"tpu backend: reduce_scatter needs {self.size()} input tensors, got {len(inputs)}")
            _check_tensor(output)
            op, x = _reduction(opts, jnp.concatenate([_local(i).reshape(-1) for i in inputs]))
            (out,) = self._run("reduce_scatter", ("reduce_scatter", op), programs.reduce_scatter(op), [x])
            _store(output, out)
        return _done(list(outputs))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        n = self.size()
        _check_tensor(output)
        x = _local(input)
        if not output_split_sizes and not input_split_sizes:
            if x.shape[0] % n:
                raise ValueError(f"tpu backend: all_to_all_single: dimension 0 ({x.shape[0]}) is not divisible by "
                                 f"the group size {n}")
            (out,) = self._run("all_to_all_single", ("all_to_all",), programs.all_to_all(), [x])
            _store(output, out)
            return _done([output])
        return self._all_to_all_uneven(output, x, list(output_split_sizes), list(input_split_sizes))

    alltoall_base = all_to_all_single

    def _all_to_all_uneven(self, output, x, out_splits, in_splits):
        """Uneven splits: agree on the largest block (one small all-gather of the split sizes), pad
        every block to it, exchange, and keep the received blocks' real rows."""
        n = self.size()
        rows = x.shape[0]
        in_splits = in_splits or [rows // n] * n
        out_splits = out_splits or [output.shape[0] // n] * n
        sizes = jnp.asarray(in_splits, jnp.int64)
        (all_sizes,) = self._run("all_to_all_single(split sizes)", ("all_gather",), programs.all_gather(),
                                 [placement.put(sizes, platform.first_index())])
        block = max(1, int(jax.device_get(all_sizes).max()))
        starts = [sum(in_splits[:j]) for j in range(n)]
        padded = jnp.concatenate([
            jnp.pad(x[starts[j]:starts[j] + in_splits[j]], [(0, block - in_splits[j])] + [(0, 0)] * (x.ndim - 1))
            for j in range(n)])
        (received,) = self._run("all_to_all_single", ("all_to_all",), programs.all_to_all(), [padded])
        out = jnp.concatenate([received[i * block:i * block + out_splits[i]] for i in range(n)])
        _store(output, out)
        return _done([output])

    def alltoall(self, outputs, inputs, opts=None):
        n = self.size()
        if len(inputs) != n or len(outputs) != n:
            raise ValueError(f"tpu backend: all_to_all needs {n} input and {n} output tensors")
        for o in outputs:
            _check_tensor(o)
        locals_ = [_local(i).reshape(-1) for i in inputs]
        if len({a.shape for a in locals_}) == 1 and all(o.numel() == locals_[0].size for o in outputs):
            (out,) = self._run("all_to_all", ("all_to_all",), programs.all_to_all(), [jnp.concatenate(locals_)])
            blocks = out.reshape(n, -1)
            for i, o in enumerate(outputs):
                _store(o, blocks[i])
            return _done(list(outputs))
        # Blocks of different sizes: the uneven path on the flattened blocks.
        flat_out = torch.empty(sum(o.numel() for o in outputs), dtype=outputs[0].dtype, device=outputs[0].device)
        self._all_to_all_uneven(flat_out, jnp.concatenate(locals_), [o.numel() for o in outputs],
                                [a.size for a in locals_])
        offset = 0
        for o in outputs:
            o.copy_(flat_out[offset:offset + o.numel()].view(o.shape))
            offset += o.numel()
        return _done(list(outputs))

    def scatter(self, outputs, input_lists, opts):
        root = opts.rootRank
        n = self.size()
        for i, output in enumerate(outputs):
            _check_tensor(output)
            if self.rank() == root:
                blocks = [_local(t).reshape(-1) for t in input_lists[i]]
                if len(blocks) != n:
                    raise ValueError(f"tpu backend: scatter needs {n} input tensors on the root, got {len(blocks)}")
                x = jnp.concatenate(blocks)
            else:
                x = jnp.zeros((output.numel() * n,), to_jax_dtype(output.dtype))
                x = placement.put(x, output.get_device())
            (out,) = self._run("scatter", ("scatter", root), programs.scatter(root), [x])
            _store(output, out)
        return _done(list(outputs))

    def gather(self, output_lists, inputs, opts):
        root = opts.rootRank
        for i, input in enumerate(inputs):
            gathered = self._gather_flat("gather", _local(input).reshape(-1))
            if self.rank() == root:
                outputs = output_lists[i]
                if len(outputs) != self.size():
                    raise ValueError(f"tpu backend: gather needs {self.size()} output tensors on the root")
                blocks = gathered.reshape(self.size(), -1)
                for j, o in enumerate(outputs):
                    _check_tensor(o)
                    _store(o, blocks[j])
        return _done(output_lists)

    # ------------------------------------------------------------ point to point
    def _pair(self, peer: int, tensor: torch.Tensor, sending: bool):
        """Send or receive ``tensor`` between this rank and ``peer`` (group ranks): a 2-device
        program both of them run, ordered by (lower rank, higher rank)."""
        me = self.rank()
        low, high = sorted((me, peer))
        source, dest = (me, peer) if sending else (peer, me)
        ranks = (self._ranks[low], self._ranks[high])
        x = _local(tensor)
        key = ("send_recv", ranks.index(self._ranks[source]), ranks.index(self._ranks[dest]))
        describe = self._describe("send" if sending else "recv", [x])
        outs = programs.run(key, ranks, programs.send_recv(key[1], key[2]), [x])
        _counts["send" if sending else "recv"] += 1
        _watchdog.track(self._timeout_s, outs, describe)
        if not sending:
            _store(tensor, outs[0])

    def send(self, tensors, dst: int, tag: int = 0):
        for t in tensors:
            self._point_to_point(dst, t, sending=True)
        return _done(list(tensors))

    def recv(self, tensors, src: int, tag: int = 0):
        for t in tensors:
            self._point_to_point(src, t, sending=False)
        return _done(list(tensors))

    def _point_to_point(self, peer: int, tensor, sending: bool) -> None:
        _check_tensor(tensor)
        if self._batch is not None:
            self._batch.append((peer, tensor, sending))
        else:
            self._pair(peer, tensor, sending)

    # batch_isend_irecv: its sends and receives may come in any order on each rank ("[recv_from_1,
    # send_to_1] is equivalent to [send_to_1, recv_from_1]"), but each transfer here is a program
    # both ends run. Running every rank's transfers sorted by (lower rank, higher rank, sender)
    # puts them in one global order, so the first transfer not yet run always has both ends
    # ready: no deadlock, whatever the pattern (rings, pairs, all-to-some).
    supports_coalescing = True

    def start_coalescing(self) -> None:
        self._batch = []

    def end_coalescing(self):
        batch, self._batch = self._batch or [], None
        me = self.rank()
        batch.sort(key=lambda op: (min(me, op[0]), max(me, op[0]), me if op[2] else op[0]))
        for peer, tensor, sending in batch:
            self._pair(peer, tensor, sending)
        return _done([tensor for _, tensor, _ in batch])

    def recv_anysource(self, tensors, tag: int = 0):
        raise RuntimeError("tpu backend: recv from any source is not supported (XLA needs both ends of a "
                           "transfer to be known); pass src")

    def barrier(self, opts=None):
        x = placement.put(jnp.ones((1,), jnp.int32), platform.first_index())
        (out,) = self._run("barrier", ("barrier",), programs.barrier(), [x])
        out.block_until_ready()
        return _done([])


def create(dist_backend_opts, backend_options=None) -> ProcessGroupTPU:
    """The factory ``torch.distributed`` calls (``extended_api``) for each group using ``tpu``."""
    from torchtpu.runtime import multiprocess, state

    state.start()
    size = dist_backend_opts.group_size
    if size > 1 and not multiprocess.active():
        raise RuntimeError(
            "tpu backend: a process group of size > 1 needs one process per device joined through "
            "jax.distributed, which torchtpu starts under a launcher that sets WORLD_SIZE, RANK and "
            "LOCAL_RANK (torchrun). Launch with torchrun, or set those variables before the first tpu op.")
    return ProcessGroupTPU(dist_backend_opts.store, dist_backend_opts.group_rank, size,
                           dist_backend_opts.timeout, list(dist_backend_opts.global_ranks_in_group))
