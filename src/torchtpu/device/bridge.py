"""The tensor ⇄ ``jax.Array`` bridge.

A ``tpu`` tensor is a plain ``torch.Tensor`` whose storage (a PyTorch ``UntypedStorage`` with no
host bytes) carries the data as a ``jax.Array`` in the attribute ``_jax``. The array holds the
storage's elements in order (any shape; its C-order flattening is the storage). A tensor reads
its elements through its own sizes, strides and storage offset, exactly as PyTorch reads memory,
so views, ``detach``, ``alias`` and in-place updates through any of them share one array.

Reading the common case (a tensor that owns its whole storage) returns the array itself; other
geometries go through a cached, jitted gather; writes through a cached, jitted scatter.
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys
import threading

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import torch

from torchtpu.runtime import compat, errors, placement
from torchtpu.runtime.execution import current
from torchtpu.runtime.dtypes import JAX_TO_TORCH, TORCH_TO_JAX, convert, to_jax_dtype

_create_empty = compat.create_empty_tensor
_META = compat.DispatchKeySet(compat.DispatchKey.Meta)
_CPU = compat.DispatchKeySet(compat.DispatchKey.CPU)
_set_storage = compat.set_storage_below_backend

ATTR = "_jax"


class Lazy:
    """Base of the deferred values a storage may hold instead of a ``jax.Array`` (the fused eager
    mode's ``Deferred``). One has ``shape``, ``dtype``, ``size``, ``value`` (the array once
    computed, else None), ``executor`` (what records it and will compute it) and ``materialize()``,
    which returns the array, running what it needs.

    ``read`` and ``write`` use one as is in DEFER_AND_FUSE (the executor takes a computed one's
    array as an input) unless it is another context's pending value; that one, and any lazy value
    read where nothing records, is materialised (by its own executor, from any thread)."""

    __slots__ = ()


LAZY_TYPES: tuple[type, ...] = (Lazy,)

# How many contexts are capturing a graph (``eager/capture.py``). While any is, every storage a
# read, write or new tensor touches is reported to the current context's recorder (``_touched``),
# which makes a storage that existed before the capture an input of the captured program.
capturing = 0


def _touched(storage, tensor=None, made: bool = False) -> None:
    executor = current().executor
    if executor is not None and executor.captures:
        executor.touch(storage, tensor, made)


def apply(fn, *args):
    """``fn(*args)`` for a jitted ``fn``, in the current context's mode: run now, or recorded by
    its DEFER_AND_FUSE executor (returning deferred values)."""
    executor = current().executor
    if executor is not None:
        return executor.call(fn, *args)
    try:
        return fn(*args)
    except TypeError:
        if not any(isinstance(a, Lazy) for a in args):
            raise
        # a deferred argument read before this context's mode changed (the process default left
        # DEFER_AND_FUSE while an op was under way): compute it
        return fn(*[a.materialize() if isinstance(a, Lazy) else a for a in args])


# ---------------------------------------------------------------- tensor shells on tpu:N
# torch._C._acc.create_empty_tensor only makes tensors on tpu:0. For tpu:N (N > 0) we build a
# 0-element tensor through DLPack (kDLExtDev maps to PrivateUse1 with the device index) once per
# device and alias it: alias keeps the device and gives a fresh TensorImpl.

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                             ("deleter", ctypes.c_void_p)]  # NULL: the template owns no memory
_KEEP_ALIVE: list = []
_KDL_EXT_DEV = 12


_DL_CODES = {torch.bool: (6, 8), torch.bfloat16: (4, 16), torch.complex64: (5, 64), torch.complex128: (5, 128)}


def _dl_dtype(dtype: torch.dtype) -> _DLDataType:
    code, bits = _DL_CODES.get(dtype, (None, dtype.itemsize * 8))
    if code is None:
        code = 2 if dtype.is_floating_point else (1 if dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64) else 0)
    return _DLDataType(code, bits, 1)


@functools.cache
def _device_template(index: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    shape = (ctypes.c_int64 * 1)(0)
    managed = _DLManagedTensor()
    managed.dl_tensor.device = _DLDevice(_KDL_EXT_DEV, index)
    managed.dl_tensor.ndim = 1
    managed.dl_tensor.dtype = _dl_dtype(dtype)
    managed.dl_tensor.shape = shape
    _KEEP_ALIVE.append((managed, shape))
    capsule = compat.new_capsule(ctypes.addressof(managed), b"dltensor", None)
    return torch.from_dlpack(capsule)


def _contiguous_strides(shape) -> list[int]:
    return list(_strides_of(tuple(shape)))


@functools.lru_cache(maxsize=4096)
def _strides_of(shape: tuple) -> tuple:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(strides[::-1])


# Every storage gets a unique, never reused, fake device address and its real byte count, so
# data_ptr(), storage sizes, torch.save and sharing checks behave as on any device. Nothing
# dereferences these addresses: the bytes live in the storage's jax.Array.
_address_lock = threading.Lock()
_next_address = 1 << 40
_DEVICES: dict[int, torch.device] = {}


_native_reserve = None  # the C++ counter, once the native eager kernel makes storages too


def use_native_addresses(reserve, set_next) -> None:
    """Take every later address from the C++ counter ``reserve`` (moved past those given out here)."""
    global _native_reserve
    with _address_lock:
        set_next(_next_address)
        _native_reserve = reserve


# Buffer donation hands an array's memory to XLA, so only an array that nothing but its storage
# holds may be donated (eager in-place ops, compiled graphs' mutated inputs, captured steps). The
# test is ``sys.getrefcount(array) <= SOLE_OWNER_REFS`` taken at the call site: the storage's
# attribute dict, the caller's local and getrefcount's own argument. It is counted there, not in a
# helper: while dynamo's frame hook (PEP 523) is installed, a Python call keeps one more reference
# to its arguments on the caller's stack, which made every buffer of a fullgraph step look shared.
SOLE_OWNER_REFS = 3


def sole_owner_refs_hold() -> bool:
    """Whether this interpreter counts ``SOLE_OWNER_REFS`` references to an object held only by an
    instance's attribute and one local (what the donation sites assume)."""

    class Holder:
        pass

    holder = Holder()
    holder.value = object()
    local = holder.value
    return sys.getrefcount(local) == SOLE_OWNER_REFS


def reserve_address(nbytes: int) -> int:
    """A fresh fake device address for ``nbytes`` bytes, never reused."""
    global _next_address
    if _native_reserve is not None:
        return _native_reserve(nbytes)
    with _address_lock:
        address = _next_address
        _next_address += (nbytes // 64 + 2) * 64
    return address


def new_storage(nbytes: int, index: int):
    """A fresh, fixed-size ``tpu:index`` storage of ``nbytes`` bytes (no data attached)."""
    device = _DEVICES.get(index)
    if device is None:
        device = _DEVICES[index] = torch.device("tpu", index)
    storage = _new_storage(reserve_address(nbytes), device, nbytes)
    if capturing:
        _touched(storage, made=True)
    return storage


def resize_storage(storage, nbytes: int) -> int:
    """The data side of ``storage.resize_(nbytes)`` (the C++ hook then sets the byte count): the
    array keeps its first ``nbytes`` bytes and grows with zeros; at 0 bytes it is dropped, which
    frees its device memory. Returns the storage's new fake address (0 for no bytes)."""
    array = getattr(storage, ATTR, None)
    if array is not None:
        if nbytes:
            storage._jax = resized(array, nbytes)
        else:
            del storage._jax
    return reserve_address(nbytes) if nbytes else 0


def resized(array, nbytes: int):
    """``array``'s bytes cut or zero-padded to ``nbytes``, flat (as bytes if its elements do not fit)."""
    if isinstance(array, Lazy):
        array = array.materialize()
    return apply(_resize_flat(array.shape, array.dtype, nbytes), array)


@functools.lru_cache(maxsize=1024)  # keyed by sizes: bounded
def _resize_flat(shape, dtype, nbytes: int):
    dtype = np.dtype(dtype)
    keep = dtype if nbytes % dtype.itemsize == 0 else np.dtype(np.uint8)
    numel = nbytes // keep.itemsize

    def resize(array):
        flat = _bitcast(array.reshape(-1), keep)
        if flat.size >= numel:
            return flat[:numel]
        return jnp.concatenate([flat, jnp.zeros((numel - flat.size,), keep)])

    return jax.jit(resize)


_new_storage = compat.construct_storage_from_data_pointer


def _shell(dtype: torch.dtype, index: int) -> torch.Tensor:
    """A new 0-element tensor on ``tpu:index`` (its storage is replaced by ``restride``)."""
    if index == 0:
        return _create_empty(_EMPTY, dtype)
    return torch.ops.aten.alias.default(_device_template(index, dtype))


_EMPTY = [0]


def empty_shell(shape, dtype: torch.dtype, index: int = 0, strides=None) -> torch.Tensor:
    """A new ``tpu:index`` tensor with a fresh storage and no data attached yet."""
    strides = list(strides) if strides is not None else _contiguous_strides(shape)
    extent = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    t = _shell(dtype, index)
    _set_storage(_CPU, t, new_storage(extent * dtype.itemsize, index), 0, list(shape), strides)
    return t


def restride(t: torch.Tensor, storage, offset: int, size, stride) -> None:
    """Point ``t`` at ``storage`` with the given geometry (no data moves).

    Our storages are fixed-size, so this takes the CPU ``set_`` kernel, which only resizes a
    storage the geometry does not fit (never the case for views); a resizable storage (made by
    PyTorch itself) takes the Meta kernel, which only grows its byte count.
    """
    _set_storage(_CPU if not storage.resizable() else _META, t, storage, offset, list(size), list(stride))


# ---------------------------------------------------------------- reading and writing

def wrap(array: jax.Array, index: int = 0, strides: tuple | None = None) -> torch.Tensor:
    """A new ``tpu:index`` tensor holding ``array`` (which must already be on that device);
    ``strides``: its memory layout where not contiguous (a ``dense_layout``: the storage then holds
    the array's dims in the layout's order, as PyTorch's memory would)."""
    if strides is None:
        return _wrap_stored(array, index, array.shape, _strides_of(array.shape))
    return _wrap_stored(apply(_permute(memory_order(strides)), array), index, array.shape, strides)


def _wrap_stored(stored: jax.Array, index: int, shape: tuple, strides) -> torch.Tensor:
    """A new ``tpu:index`` tensor of ``shape`` and ``strides`` whose storage holds ``stored`` (the
    elements in memory order)."""
    dtype = JAX_TO_TORCH[stored.dtype]
    storage = new_storage(math.prod(shape) * dtype.itemsize, index)
    t = _shell(dtype, index)
    _set_storage(_CPU, t, storage, 0, shape, list(strides))
    storage._jax = stored
    if capturing:
        _touched(storage)
    return t


def wrap_in_memory_order(array: jax.Array, index: int, order: tuple | None) -> torch.Tensor:
    """``wrap`` for an array already transposed into the memory ``order`` of its tensor (dims from
    the outermost; None: ``array`` is the tensor's, contiguous): the tensor's shape is ``array``'s
    put back in dim order. Where that shape makes ``order``'s strides contiguous after all, or
    orders its size-1 dims otherwise than ``memory_order`` does, the array is reshaped (the same
    elements in the same order)."""
    if order is None or len(order) != len(array.shape):  # (not transposed: see dispatch._in_memory_order)
        return wrap(array, index)
    shape, strides, stored = _geometry_in_order(array.shape, order)
    if strides is None:  # contiguous: the storage holds the tensor's own shape
        return wrap(apply(_reshape(shape), array), index)
    if stored != array.shape:
        array = apply(_reshape(stored), array)
    return _wrap_stored(array, index, shape, strides)


@functools.lru_cache(maxsize=4096)
def _geometry_in_order(array_shape: tuple, order: tuple) -> tuple:
    """(tensor shape, its strides or None if contiguous, the stored array's shape) of an array
    transposed into memory ``order`` (``wrap_in_memory_order``)."""
    shape = [0] * len(order)
    for position, dim in enumerate(order):
        shape[dim] = array_shape[position]
    shape = tuple(shape)
    strides = dense_layout(shape, strides_in_order(shape, order))
    return shape, strides, None if strides is None else tuple(shape[d] for d in memory_order(strides))


def dense_layout(shape, strides) -> tuple | None:
    """``strides`` if they lay ``shape`` out densely in another order than the contiguous one
    (channels_last, a transposed result), else None (contiguous, or not a permutation)."""
    shape, strides = tuple(shape), tuple(strides)
    if strides == _strides_of(shape) or 0 in shape:
        return None
    return strides if strides_in_order(shape, memory_order(strides)) == strides else None


def memory_order(strides) -> tuple:
    """The dims from the outermost in memory to the innermost (ties: in dim order)."""
    return tuple(sorted(range(len(strides)), key=lambda d: -strides[d]))


def strides_in_order(shape, order) -> tuple:
    """The strides of a dense layout of ``shape`` whose dims lie in memory in ``order``."""
    strides, step = [0] * len(shape), 1
    for d in reversed(order):
        strides[d] = step
        step *= max(shape[d], 1)
    return tuple(strides)


@functools.lru_cache(maxsize=256)
def _permute(order: tuple):
    return jax.jit(lambda x: jnp.transpose(x, order))


@functools.lru_cache(maxsize=256)
def _reshape(shape: tuple):
    return jax.jit(lambda x: jnp.reshape(x, shape))


def array_of(storage):
    """The ``jax.Array`` (or deferred value) a ``tpu`` storage holds, None if it has none yet. (The
    eager and compiled hot paths inline this read: ``getattr(storage, ATTR, None)``.)"""
    return getattr(storage, ATTR, None)


def set_array(storage, value) -> None:
    """Make ``value`` (a ``jax.Array`` or a deferred value) the bytes of ``storage``."""
    setattr(storage, ATTR, value)


def _covers_storage(t: torch.Tensor, array) -> bool:
    """Whether ``t`` spans its storage's ``array`` in order (its dtype may still differ)."""
    return array.shape == t.shape and t.storage_offset() == 0 and t.is_contiguous()


def holds_whole_storage(t: torch.Tensor, array) -> bool:
    """Whether ``t``'s elements are its storage's ``array`` as it is (no gather or cast)."""
    return _covers_storage(t, array) and array.dtype == TORCH_TO_JAX.get(t.dtype)


def read(t: torch.Tensor) -> jax.Array:
    """The elements of ``t`` as a ``jax.Array`` of ``t``'s shape and dtype; in DEFER_AND_FUSE a
    pending value stays a deferred one (``read_computed`` runs it)."""
    storage = t.untyped_storage()
    if capturing:
        _touched(storage, t)
    array = getattr(storage, ATTR, None)
    if array is None:
        array = _allocate(t, storage)
    elif isinstance(array, Lazy):  # see Lazy (inline: the fused mode's hot path)
        executor = current().executor
        if executor is None or (array.value is None and array.executor is not executor):
            array = array.materialize()
    if array.shape == t.shape and t.storage_offset() == 0 and t.is_contiguous() \
            and array.dtype == TORCH_TO_JAX.get(t.dtype):  # holds_whole_storage, inline: the hot path
        value = array
    else:
        value = apply(_gather(array.shape, array.dtype, tuple(t.shape), tuple(t.stride()), to_jax_dtype(t.dtype)),
                      array, t.storage_offset())
        if t.storage_offset() == 0 and t.is_contiguous() and value.size * value.dtype.itemsize == array.size * \
                array.dtype.itemsize:
            storage._jax = value  # same bytes, now in the shape and dtype readers use (e.g. after torch.load)
    if t.is_conj() or t.is_neg():  # PyTorch's lazy conjugate/negation bits: the data is not changed yet
        value = apply(_resolve_bits(t.is_conj(), t.is_neg()), value)
    return value


@functools.cache
def _resolve_bits(conj: bool, neg: bool):
    """Logical value from stored data (and back: both maps are their own inverse)."""
    def resolve(x):
        x = jnp.conj(x) if conj else x
        return -x if neg else x

    return jax.jit(resolve)


def read_computed(t: torch.Tensor) -> jax.Array:
    """Like ``read``, but always a real ``jax.Array`` (runs pending deferred work if needed)."""
    array = read(t)
    return array.materialize() if isinstance(array, Lazy) else array


def _allocate(t: torch.Tensor, storage) -> jax.Array:
    # `empty` tensors get their array on first use: XLA has no uninitialised memory, so zeros.
    numel = max(storage.nbytes() // t.element_size(), _extent(t))
    index = t.get_device()
    try:
        array = apply(_zeros(numel, to_jax_dtype(t.dtype), index))
    except jax.errors.JaxRuntimeError as exc:
        raise errors.device_error(exc, index, "allocating a tensor") from exc
    storage._jax = array
    return array


def zeros_for(t: torch.Tensor, storage) -> jax.Array:
    """The zeros an array-less storage of ``t`` gets, computed now (never recorded)."""
    numel = max(storage.nbytes() // t.element_size(), _extent(t))
    return _zeros(numel, to_jax_dtype(t.dtype), t.get_device())()


@functools.lru_cache(maxsize=1024)
def _zeros(numel: int, dtype, index: int):
    # A jitted constant: 20x cheaper than jnp.zeros per call, and recordable by the fused mode.
    return jax.jit(lambda: jnp.zeros((numel,), dtype), out_shardings=placement.sharding(index))


def _extent(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return t.storage_offset()
    return t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1


def write(t: torch.Tensor, value: jax.Array) -> None:
    """Store ``value`` (``t``'s shape; cast to ``t``'s dtype) into ``t``'s elements, in place."""
    dtype = to_jax_dtype(t.dtype)
    if value.dtype != dtype:
        value = apply(cast(dtype), value)
    if t.is_conj() or t.is_neg():
        value = apply(_resolve_bits(t.is_conj(), t.is_neg()), value)
    if tuple(value.shape) != tuple(t.shape):
        value = apply(_broadcast(tuple(t.shape)), value)
    storage = t.untyped_storage()
    if capturing:
        _touched(storage, t)
    array = getattr(storage, ATTR, None)
    if array is None:
        if t.storage_offset() == 0 and t.is_contiguous() and t.numel() * t.element_size() >= storage.nbytes():
            storage._jax = value  # t covers its whole (empty) storage
            return
        array = _allocate(t, storage)
    if (_covers_storage(t, array) and array.dtype == dtype) or \
            (t.storage_offset() == 0 and t.is_contiguous() and array.size == t.numel() and array.dtype == dtype):
        if array.shape != value.shape:
            value = apply(_reshape(tuple(array.shape)), value)
        storage._jax = value  # (a lazy old value is not needed: shape and dtype are enough)
        return
    if isinstance(array, Lazy):  # the old value is the scatter's input: as in ``read``
        executor = current().executor
        if executor is None or (array.value is None and array.executor is not executor):
            array = array.materialize()
    storage._jax = apply(_scatter(array.shape, array.dtype, tuple(t.shape), tuple(t.stride()), dtype),
                         array, value, t.storage_offset())


@functools.cache
def cast(dtype):
    return jax.jit(lambda x: convert(x, dtype))


@functools.lru_cache(maxsize=4096)  # keyed by shapes: bounded
def _reshape(shape):
    return jax.jit(lambda x: x.reshape(shape))


@functools.lru_cache(maxsize=4096)  # keyed by shapes: bounded
def _broadcast(shape):
    return jax.jit(lambda x: jnp.broadcast_to(x, shape))


def _indices(shape, strides, offset) -> np.ndarray:
    idx = np.full(shape, offset, dtype=np.int64)
    for dim, (n, s) in enumerate(zip(shape, strides)):
        view = [1] * len(shape)
        view[dim] = n
        idx = idx + (np.arange(n, dtype=np.int64) * s).reshape(view)
    return idx


def _bitcast(flat, dtype):
    """Reinterpret a 1-D array's bytes as ``dtype`` (little-endian, as the storage's bytes)."""
    src, dst = np.dtype(flat.dtype), np.dtype(dtype)
    if src == dst:
        return flat
    if src.kind == "c" or dst.kind == "c":  # XLA cannot bitcast complex: go through (re, im) pairs
        if src.kind == "c":
            pairs = jnp.stack([flat.real, flat.imag], -1).reshape(-1)
            return _bitcast(pairs, dst)
        part = np.dtype(np.float32 if dst == np.complex64 else np.float64)
        pairs = _bitcast(flat, part).reshape(-1, 2)
        return jax.lax.complex(pairs[:, 0], pairs[:, 1])
    if src == np.bool_:
        flat, src = flat.astype(np.uint8), np.dtype(np.uint8)
    target = np.dtype(np.uint8) if dst == np.bool_ else dst
    if src.itemsize > target.itemsize:
        out = jax.lax.bitcast_convert_type(flat, target).reshape(-1)
    elif src.itemsize < target.itemsize:
        ratio = target.itemsize // src.itemsize
        out = jax.lax.bitcast_convert_type(flat[: flat.size // ratio * ratio].reshape(-1, ratio), target)
    else:
        out = jax.lax.bitcast_convert_type(flat, target)
    return out.astype(np.bool_) if dst == np.bool_ else out


@functools.lru_cache(maxsize=4096)  # keyed by shapes: bounded
def _gather(array_shape, array_dtype, shape, strides, dtype):
    """A jitted ``(array, offset) -> view``. The offset is a runtime argument, so views that differ
    only in where they start (slices of a KV cache, rows of a batch) share one program."""
    numel = math.prod(shape)
    contiguous = tuple(_contiguous_strides(shape)) == strides or numel <= 1
    plan = None if contiguous else _strided_plan(shape, strides)

    def gather(array, offset):
        flat = _bitcast(array.reshape(-1), dtype)
        if contiguous:
            return lax.dynamic_slice(flat, (offset,), (numel,)).reshape(shape)
        if plan is not None:
            return _strided_read(flat, offset, shape, strides, plan)
        return flat[_indices(shape, strides, 0) + offset]

    return jax.jit(gather)


def _strided_plan(shape, strides):
    """Dims (by decreasing stride) if the view is a nest of strided slices, else None.

    Transposes, permutes, slices with steps and expands all are: ordered by stride, each kept
    dim's stride spans the next one's extent without overlap. Such a view is read with slices and
    reshapes instead of a gather with a constant index table (diagonals and overlapping windows
    still gather).
    """
    dims = sorted((d for d, n in enumerate(shape) if n > 1 and strides[d] > 0), key=lambda d: -strides[d])
    for outer, inner in zip(dims, dims[1:]):
        if strides[outer] < shape[inner] * strides[inner]:
            return None
    return tuple(dims)


def _strided_read(flat, offset, shape, strides, dims):
    """The view as slices and reshapes of the flat storage (see ``_strided_plan``)."""
    if not dims:  # every dim has size 1 or stride 0: one element, broadcast
        return jnp.broadcast_to(lax.dynamic_index_in_dim(flat, offset, keepdims=False), shape)
    outer = dims[0]
    length = shape[outer] * strides[outer]
    # The last row's tail may lie past the storage (it is never read): pad by the most it can
    # overhang, which the view's own extent bounds (a full transpose needs none).
    overhang = length - 1 - sum((n - 1) * s for n, s in zip(shape, strides))
    if overhang > 0:
        flat = jnp.pad(flat, (0, overhang))
    block = lax.dynamic_slice(flat, (offset,), (length,))
    block = block.reshape(shape[outer], strides[outer])
    for d in dims[1:]:  # within each row of the previous dim, rows of this one
        block = block[..., : shape[d] * strides[d]].reshape(*block.shape[:-1], shape[d], strides[d])
    block = block[..., 0]
    order = sorted(range(len(dims)), key=lambda i: dims[i])
    block = jnp.transpose(block, order)
    kept = set(dims)
    block = block.reshape([shape[d] if d in kept else 1 for d in range(len(shape))])
    return jnp.broadcast_to(block, shape)


@functools.lru_cache(maxsize=4096)  # keyed by shapes: bounded
def _scatter(array_shape, array_dtype, shape, strides, dtype):
    """A jitted ``(array, value, offset) -> array`` writing a view (offset dynamic, as in _gather)."""
    numel = math.prod(shape)
    contiguous = tuple(_contiguous_strides(shape)) == strides or numel <= 1

    def scatter(array, value, offset):
        flat = _bitcast(array.reshape(-1), dtype)
        if contiguous:
            flat = lax.dynamic_update_slice(flat, value.reshape(-1), (offset,))
        else:
            flat = flat.at[_indices(shape, strides, 0).reshape(-1) + offset].set(value.reshape(-1))
        return _bitcast(flat, array_dtype).reshape(array_shape)

    return jax.jit(scatter)
