"""Collectives as XLA programs over a mesh of the group's devices.

A process group of ranks ``r0, r1, ...`` is a 1-D mesh of those processes' devices (one device
per process, see ``runtime.multiprocess``). A collective is a ``shard_map`` program over that
mesh: each process hands in its local ``jax.Array`` as its shard of a global array (global
shape: the local one with dimension 0 multiplied by the group size), every process of the group
runs the same program, and each reads its own shard of the result. XLA runs the communication
(ICI on TPU, NCCL on GPU, gloo over TCP on CPU); the data never visits the host.

Programs are compiled once per (collective, shapes, dtype, reduce op, group) and kept.
Only processes of the group call a group's program, so subgroups (``new_group``, a DeviceMesh
dimension) run independently.
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from torchtpu.runtime.compat import ArrayImpl
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXIS = "ranks"
_SPEC = PartitionSpec(AXIS)

_lock = threading.Lock()
_programs: dict[tuple, tuple] = {}


def device_of_rank(rank: int) -> jax.Device:
    """The device of the process with global rank ``rank`` (JAX's ``process_index``)."""
    devices = _devices_by_process()
    try:
        return devices[rank]
    except KeyError:
        raise RuntimeError(f"tpu: no process of rank {rank} joined the runtime "
                           f"({len(devices)} process(es) did)") from None


@functools.cache
def _devices_by_process() -> dict[int, jax.Device]:
    """Each process's device: the first of its local devices (the one it drives, see
    ``runtime.platform.devices``)."""
    by_process: dict[int, jax.Device] = {}
    for device in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
        by_process.setdefault(device.process_index, device)
    return by_process


@functools.cache
def mesh(ranks: tuple[int, ...]) -> Mesh:
    """The 1-D mesh (axis ``"ranks"``) of the devices of ``ranks``, in group order."""
    return Mesh(np.array([device_of_rank(r) for r in ranks]), (AXIS,))


def run(key: tuple, ranks: tuple[int, ...], make_body, arrays: list[jax.Array], n_out: int = 1) -> list[jax.Array]:
    """Run the program ``key`` on this process's ``arrays`` (each at least 1-D), building it with
    ``make_body(group_size)`` the first time; returns this process's shards of the outputs."""
    full_key = (key, ranks, tuple((a.shape, a.dtype) for a in arrays))
    entry = _programs.get(full_key)
    if entry is None:
        with _lock:
            entry = _programs.get(full_key)
            if entry is None:
                the_mesh = mesh(ranks)
                fn = jax.jit(jax.shard_map(make_body(len(ranks)), mesh=the_mesh, in_specs=(_SPEC,) * len(arrays),
                                           out_specs=(_SPEC,) * n_out, check_vma=False))
                entry = _programs[full_key] = (fn, NamedSharding(the_mesh, _SPEC), len(ranks))
    fn, sharding, n = entry
    inputs = [jax.make_array_from_single_device_arrays((a.shape[0] * n, *a.shape[1:]), sharding, [a])
              for a in arrays]
    return [out.addressable_shards[0].data for out in fn(*inputs)]


# ---------------------------------------------------------------- whole programs over a group's mesh
# A compiled graph with collectives is one program over the mesh (compile/collectives.py); these
# say how each process's arrays are its shards of that program's global arrays.

def spec(ndim: int) -> PartitionSpec:
    """How an ``ndim``-dimensional per-process array is its shard of a group-wide array: along
    dimension 0, as in ``run``; a 0-d array has no dimension to split, so it is declared
    replicated (``P()``) and each device keeps its own value (the programs run with
    ``check_vma=False``, so nothing assumes the ranks' values equal)."""
    return _SPEC if ndim else PartitionSpec()


def sharding(ranks: tuple[int, ...], ndim: int) -> NamedSharding:
    """The sharding of a group-wide array made of ``ndim``-dimensional per-process shards."""
    return _sharding(ranks, ndim > 0)


@functools.cache
def _sharding(ranks: tuple[int, ...], split: bool) -> NamedSharding:
    return NamedSharding(mesh(ranks), _SPEC if split else PartitionSpec())


def global_shape(shape: tuple[int, ...], n: int) -> tuple[int, ...]:
    """The group-wide shape of per-process shards of ``shape`` over ``n`` ranks (see ``spec``)."""
    return (shape[0] * n, *shape[1:]) if shape else ()


def assembler(shape: tuple[int, ...], dtype, ranks: tuple[int, ...]):
    """A function that takes this process's array of ``shape`` and ``dtype`` (on its device of
    ``mesh(ranks)``) and returns it as its shard of the group-wide array, without a copy. Built
    once per program input, it is called per run, so it builds the array directly: about 4 us,
    against 10 for ``make_array_from_single_device_arrays``, whose checks the caller makes once."""
    aval = jax.core.ShapedArray(global_shape(shape, len(ranks)), dtype)
    the_sharding = sharding(ranks, len(shape))
    return lambda array: ArrayImpl(aval, the_sharding, [array], committed=True, _skip_checks=True)


def local_shard(array: jax.Array) -> jax.Array:
    """This process's shard of a group-wide array (its only addressable one)."""
    return array.addressable_data(0)


@functools.cache
def _cpu_across_processes() -> bool:
    return jax.process_count() > 1 and jax.devices()[0].platform == "cpu"


def cached_count() -> int:
    """How many collective programs are compiled and kept."""
    return len(_programs)


# ---------------------------------------------------------------- the bodies
# Each maker takes the group size and returns the per-shard function (tuple in, tuple out).

def _bits_dtype(dtype):
    """The unsigned integer type of ``dtype``'s width, for exact bitwise transport."""
    return {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[jnp.dtype(dtype).itemsize]


def _reduce_stacked(stacked, op: str):
    """Reduce ``stacked`` (one slice per rank along axis 0) with a reduce op."""
    if op == "product":
        return jnp.prod(stacked, axis=0, dtype=stacked.dtype)
    if op == "band":
        return functools.reduce(jnp.bitwise_and, list(stacked))
    if op == "bor":
        return functools.reduce(jnp.bitwise_or, list(stacked))
    if op == "bxor":
        return functools.reduce(jnp.bitwise_xor, list(stacked))
    if op == "max":
        return jnp.max(stacked, axis=0)
    if op == "min":
        return jnp.min(stacked, axis=0)
    if op in ("sum", "avg"):
        total = jnp.sum(stacked, axis=0, dtype=stacked.dtype)
        return _average(total, stacked.shape[0]) if op == "avg" else total
    raise ValueError(op)


def _average(total, n: int):
    if jnp.issubdtype(total.dtype, jnp.inexact):
        return (total / n).astype(total.dtype)
    return lax.div(total, jnp.asarray(n, total.dtype))  # integer AVG truncates, as NCCL's does


def all_reduce(op: str):
    def make(n):
        def body(x):
            boolean = x.dtype == jnp.bool_
            if boolean:
                x = x.astype(jnp.uint8)
            if op in ("sum", "avg"):
                out = lax.psum(x, AXIS)
                out = _average(out, n) if op == "avg" else out
            elif op == "max":
                out = lax.pmax(x, AXIS)
            elif op == "min":
                out = lax.pmin(x, AXIS)
            else:  # product and bitwise ops have no XLA all-reduce of their own on every platform
                out = _reduce_stacked(lax.all_gather(x, AXIS, axis=0), op)
            if boolean:
                out = out != 0 if op not in ("bxor",) else (out % 2) != 0
            return (out,)
        return body
    return make


def broadcast(root: int):
    """``root``'s block to every rank, bit-exact: an integer psum of the bits masked to the root."""
    def make(n):
        def body(x):
            mine = lax.axis_index(AXIS) == root
            if jnp.issubdtype(x.dtype, jnp.complexfloating):
                return (lax.all_gather(x, AXIS, axis=0)[root],)
            if x.dtype == jnp.bool_:
                return (lax.psum(jnp.where(mine, x.astype(jnp.uint8), 0), AXIS) != 0,)
            bits_type = _bits_dtype(x.dtype)
            bits = lax.bitcast_convert_type(x, bits_type) if x.dtype != bits_type else x
            total = lax.psum(jnp.where(mine, bits, jnp.zeros_like(bits)), AXIS)
            return (lax.bitcast_convert_type(total, x.dtype) if x.dtype != bits_type else total,)
        return body
    return make


def all_gather():
    def make(n):
        return lambda x: (lax.all_gather(x, AXIS, axis=0, tiled=True),)
    return make


def reduce_scatter(op: str):
    """Input: n equal blocks along dimension 0; output: this rank's block, reduced over ranks."""
    def make(n):
        def body(x):
            if op in ("sum", "avg") and x.dtype != jnp.bool_:
                if _cpu_across_processes():
                    # XLA:CPU's cross-process reduce-scatter (gloo's halving-doubling) pins its TCP
                    # send buffers to the message size, which slows every later collective on those
                    # connections by up to 200x (docs/design.md, "the reduce-scatter stall"):
                    # a psum and this rank's block of it instead.
                    block = x.shape[0] // n
                    out = lax.dynamic_slice_in_dim(lax.psum(x, AXIS), lax.axis_index(AXIS) * block, block, axis=0)
                else:
                    out = lax.psum_scatter(x, AXIS, scatter_dimension=0, tiled=True)
                return (_average(out, n) if op == "avg" else out,)
            chunks = lax.all_to_all(x.reshape(n, x.shape[0] // n, *x.shape[1:]), AXIS, 0, 0, tiled=False)
            boolean = x.dtype == jnp.bool_
            stacked = chunks.astype(jnp.uint8) if boolean else chunks
            out = _reduce_stacked(stacked, op)
            return ((out % 2 != 0 if op == "bxor" else out != 0) if boolean else out,)
        return body
    return make


def all_to_all():
    """Input: n equal blocks along dimension 0, block j for rank j; output: block i from rank i."""
    def make(n):
        return lambda x: (lax.all_to_all(x, AXIS, 0, 0, tiled=True),)
    return make


def all_to_all_uneven(in_splits: tuple[int, ...], out_splits: tuple[int, ...], block: int):
    """``all_to_all_single`` with uneven splits: rows ``in_splits[j]`` of the input go to rank j and
    ``out_splits[i]`` rows arrive from rank i. Every block is padded to ``block`` rows (which
    must be the same on every rank: at least the largest split of any rank), exchanged evenly,
    and the received blocks' real rows kept."""
    starts = [sum(in_splits[:j]) for j in range(len(in_splits))]

    def make(n):
        def body(x):
            pad = [(0, 0)] * (x.ndim - 1)
            padded = jnp.concatenate([jnp.pad(x[s:s + k], [(0, block - k)] + pad) for s, k in zip(starts, in_splits)])
            received = lax.all_to_all(padded, AXIS, 0, 0, tiled=True)
            return (jnp.concatenate([received[i * block:i * block + k] for i, k in enumerate(out_splits)]),)
        return body
    return make


def scatter(root: int):
    """Input (n blocks; only the root's matter); output: the root's block for this rank."""
    def make(n):
        def body(x):
            received = lax.all_to_all(x, AXIS, 0, 0, tiled=True)
            block = x.shape[0] // n
            return (lax.dynamic_slice_in_dim(received, root * block, block, axis=0),)
        return body
    return make


def send_recv(source: int, dest: int):
    """Positions in a 2-rank mesh: ``source``'s block arrives at ``dest`` (zeros elsewhere)."""
    def make(n):
        return lambda x: (lax.ppermute(x, AXIS, perm=[(source, dest)]),)
    return make


def barrier():
    def make(n):
        return lambda x: (lax.psum(x, AXIS),)
    return make
