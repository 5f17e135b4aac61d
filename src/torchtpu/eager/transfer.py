"""Copies between ``tpu`` tensors and host tensors: ``copy_``, ``.to()``, ``.cpu()``, ``.item()``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchtpu import metrics
from torchtpu.device import bridge
from torchtpu.eager import modes, views
from torchtpu.ops import checks
from torchtpu.runtime.dtypes import TORCH_TO_JAX, convert, to_jax_dtype
from torchtpu.runtime import placement, state

aten = torch.ops.aten

# dtypes numpy cannot hold natively travel as same-width integers
_VIA = {torch.bfloat16: (torch.int16, jnp.bfloat16),
        **{t: (torch.uint8, TORCH_TO_JAX[t]) for t in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
                                                        torch.float8_e5m2fnuz)}}


def host_to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as a numpy array (bfloat16 as ml_dtypes.bfloat16)."""
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    via = _VIA.get(t.dtype)
    if via is not None:
        return t.view(via[0]).numpy().view(via[1])
    return t.numpy()


def numpy_to_host(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    array = np.array(array, copy=not array.flags.writeable, order="C")  # jax's host views are read-only
    via = _VIA.get(dtype)
    if via is not None:
        return torch.from_numpy(array.view(TORCH_TO_JAX[via[0]])).view(dtype)
    return torch.from_numpy(array)


def _private_copy(array: np.ndarray) -> np.ndarray:
    """A copy of ``array`` in PyTorch's host memory, which is 64-byte aligned: XLA:CPU adopts such
    a buffer as the device array without copying it again (numpy's own large allocations are not
    aligned, so XLA:CPU copied them: a checkpoint loaded straight to the device peaked at 2.4x its
    size, 2.0x with this, of which 1.0x is the device's buffers and 1.0x the checkpoint's mapped
    pages)."""
    memory = torch.empty(array.nbytes, dtype=torch.uint8).numpy()
    copy = memory.view(array.dtype).reshape(array.shape)
    np.copyto(copy, array, casting="no")
    return copy


def to_device(t: torch.Tensor, index: int) -> jax.Array:
    """Send a CPU tensor's values to ``tpu:index``."""
    to_jax_dtype(t.dtype)  # a clear error for dtypes XLA cannot hold
    array = host_to_numpy(t)
    metrics.count_transfer("to_device", array.nbytes)
    # A private host copy: the transfer may still be reading the buffer after device_put returns
    # (and XLA:CPU may keep using it), so a later in-place change of the CPU tensor would show
    # through the tpu tensor.
    return placement.put(_private_copy(array), index)


def read_for_host(t: torch.Tensor, reason: str) -> jax.Array:
    """``t``'s elements as a concrete array. In DEFER_AND_FUSE, the pending work ``t`` needs runs
    first and the caller waits only for that; the rest runs behind it. (A value another context
    recorded is computed by ``bridge.read``, by its own executor.)"""
    value = bridge.read(t)
    executor = modes.current().executor
    if executor is not None:
        executor.flush(reason, wanted=(value,))
    value = value.materialize() if isinstance(value, bridge.Lazy) else value
    checks.raise_pending()  # an op before this read indexed out of bounds: raise, as CUDA's assert does
    return value


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A ``tpu`` tensor's values as a new CPU tensor."""
    array = np.asarray(read_for_host(t, "transfer_to_host"))
    metrics.count_transfer("to_host", array.nbytes)
    return numpy_to_host(array, t.dtype).reshape(t.shape)


@functools.lru_cache(maxsize=4096)  # keyed by shapes: bounded
def _to_shape(shape, dtype):
    return jax.jit(lambda x: convert(jnp.broadcast_to(x, shape), dtype))


def copy_(self, src, non_blocking=False):
    if self.device.type != "tpu":  # tpu → host
        self.copy_(to_host(src))
        return self
    index = self.get_device()
    to_jax_dtype(self.dtype)
    if src.device.type == "tpu":
        value = bridge.read(src)
        if src.get_device() != index:
            value = placement.put(bridge.read_computed(src), index)
    else:
        value = to_device(src, index)
    target = TORCH_TO_JAX[self.dtype]
    if tuple(value.shape) != tuple(self.shape) or value.dtype != target:
        value = bridge.apply(_to_shape(tuple(self.shape), target), value)
    bridge.write(self, value)
    return self


def _copy_from(self, dst, non_blocking=False):
    return copy_(dst, self, non_blocking)


def _copy_from_and_resize(self, dst):
    if tuple(dst.shape) != tuple(self.shape):
        dst.resize_(self.shape)
    return copy_(dst, self)


def _to_copy(self, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
             memory_format=None):
    """``.to(device, dtype)`` to or from a tpu tensor: a cast on the device, a move, or a copy."""
    dtype = dtype or self.dtype
    device = torch.device(device) if device is not None else self.device
    if device.type == "tpu":
        to_jax_dtype(dtype)  # a clear error for dtypes XLA cannot hold (complex32, float8, ...)
    layout = _copy_layout(self, memory_format)
    if self.device.type != "tpu":  # host → tpu (PyTorch routes by the target device)
        index = device.index if device.index is not None else _current_device()
        return bridge.wrap(to_device(self.to(dtype), index), index, layout)
    if device.type == "cpu":
        host = to_host(self).to(dtype)
        return host if layout is None else torch.empty_strided(host.shape, layout, dtype=dtype).copy_(host)
    if device.type != "tpu":
        raise RuntimeError(f"tpu: cannot copy a tpu tensor to {device} directly; go through .cpu() first")
    index = device.index if device.index is not None else self.get_device()
    value = bridge.read(self)
    target = TORCH_TO_JAX[dtype]
    stored = bridge.array_of(self.untyped_storage())
    if value.dtype != target or value is stored or (isinstance(stored, bridge.Lazy) and value is stored.value):
        value = bridge.apply(bridge.cast(target), value)  # (a copy must not share the source's buffer)
    if index != self.get_device():
        value = placement.put(value.materialize() if isinstance(value, bridge.Lazy) else value, index)
    return bridge.wrap(value, index, layout)


def _copy_layout(t: torch.Tensor, memory_format) -> tuple | None:
    """The strides of ``t``'s copy where PyTorch does not make it contiguous: ``t``'s own where it
    is dense (preserve_format, the default), or the requested format's."""
    if memory_format in (None, torch.preserve_format):
        return bridge.dense_layout(t.shape, t.stride())
    if memory_format == torch.contiguous_format:
        return None
    return bridge.dense_layout(t.shape, views.format_strides(tuple(t.shape), memory_format))


_current_device = state.current_device


def _local_scalar_dense(self):
    """``.item()``: one element to the host, counted as a transfer like ``.cpu()``."""
    value = read_for_host(self, "item").item()
    metrics.count_transfer("to_host", self.element_size())
    return value


def equal(self, other) -> bool:
    """``torch.equal``: a Python bool, so the answer comes back to the host."""
    if tuple(self.shape) != tuple(other.shape):
        return False
    return bool(torch.ops.aten.eq.Tensor(self, other).all().item())


def _assert_async(self, assert_msg: str | None = None) -> None:
    """``torch._assert_async``: XLA has no device-side assert, so the condition is read to the
    host and checked now (as on the CPU), with PyTorch's messages."""
    if self.numel() != 1:
        amount = "no values" if self.numel() == 0 else "more than one value"
        raise RuntimeError(f"Boolean value of Tensor with {amount} is ambiguous")
    if not _local_scalar_dense(self):
        raise RuntimeError(assert_msg or "Expected Tensor with single nonzero value, but got zero")


def record_stream(self, stream) -> None:
    """``Tensor.record_stream``: nothing to do. It keeps a caching allocator from reusing a block
    while another stream may still use it; XLA keeps a buffer alive while any queued program
    reads it, and a device runs its work on one in-order stream."""


KERNELS = {
    aten.record_stream.default: record_stream,
    aten._assert_async.default: _assert_async,
    aten._assert_async.msg: _assert_async,
    aten.equal.default: equal,
    aten.copy_.default: copy_,
    aten._copy_from.default: _copy_from,
    aten._copy_from_and_resize.default: _copy_from_and_resize,
    aten._local_scalar_dense.default: _local_scalar_dense,
    aten._to_copy.default: _to_copy,
}
