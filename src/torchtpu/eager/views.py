"""View kernels: metadata only. A view is a new tensor sharing its base's storage with its own
sizes, strides and offset, exactly as in PyTorch; the bridge reads and writes through that
geometry. Every view op is declared once, in the op registry (``view=True``, ``ops/shape.py``);
its eager kernel here takes the view's geometry from PyTorch itself, by running the op on a meta
tensor of the base's geometry (cached), so PyTorch's own shape rules and errors apply. The other
kernels here are the storage-level ops: ``empty`` (a lazy shell), ``set_`` and ``resize_``."""

from __future__ import annotations

import functools
import math

import torch

from torchtpu.device import bridge
from torchtpu.runtime import native, state
from torchtpu.runtime.compat import set_conj, set_neg

aten = torch.ops.aten


def make_view(base: torch.Tensor, size, stride, offset: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor sharing ``base``'s storage with the given geometry (and dtype)."""
    if torch.is_inference_mode_enabled() and not base.is_inference():
        # a view of a normal tensor is a normal tensor, also inside inference_mode (PyTorch gives
        # it the base's version counter, which an inference tensor cannot take)
        with torch.inference_mode(False):
            view = bridge._shell(dtype or base.dtype, base.get_device())
    else:
        view = bridge._shell(dtype or base.dtype, base.get_device())
    bridge.restride(view, base.untyped_storage(), offset, size, stride)
    if base.is_conj():  # a view keeps its base's lazy conjugate/negation bits, as in PyTorch
        set_conj(view, True)
    if base.is_neg():
        set_neg(view, True)
    return view


@functools.lru_cache(maxsize=16384)
def _geometry(op, shape, stride, offset, dtype, numel, bits, args, kwargs):
    """The (size, stride, offset, dtype) of each view ``op`` makes of a base of this geometry on a
    storage of ``numel`` elements."""
    base = torch.empty(numel, dtype=dtype, device="meta").as_strided(shape, stride, offset)
    if bits[0]:
        set_conj(base, True)
    if bits[1]:
        set_neg(base, True)
    out = op(base, *args, **dict(kwargs))
    outs = out if isinstance(out, (list, tuple)) else (out,)
    return tuple((tuple(o.shape), tuple(o.stride()), o.storage_offset(), o.dtype) for o in outs), \
        isinstance(out, (list, tuple))


def _hashable(value):
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value


def view_kernel(op):
    """The eager kernel of view ``op``: new tensors on the base's storage, in the op's geometry."""

    def kernel(self, *args, **kwargs):
        geometries, many = _geometry(op, tuple(self.shape), tuple(self.stride()), self.storage_offset(),
                                     self.dtype, max(self.untyped_storage().nbytes() // self.element_size(),
                                                     bridge._extent(self)),
                                     (self.is_conj(), self.is_neg()), _hashable(list(args)),
                                     tuple((k, _hashable(v)) for k, v in kwargs.items()))
        views = [make_view(self, size, stride, offset, dtype) for size, stride, offset, dtype in geometries]
        return views if many else views[0]

    kernel.__name__ = str(op).replace(".", "_")
    kernel.is_view = True  # (eager/native_kernels.py: the native path has its own view kernels)
    return kernel


def set_storage(self, source, storage_offset=0, size=(), stride=()):
    bridge.restride(self, source, storage_offset, size, stride or bridge._contiguous_strides(size))
    return self


def set_tensor(self, source):
    bridge.restride(self, source.untyped_storage(), source.storage_offset(), source.shape, source.stride())
    return self


def resize(t: torch.Tensor, shape) -> None:
    """``t.resize_(shape)`` for a tpu tensor: new contiguous geometry, a grown storage if needed
    (the old elements kept, as PyTorch's resize_ keeps them)."""
    shape = tuple(int(s) for s in shape)
    nbytes = (t.storage_offset() + math.prod(shape)) * t.element_size()
    storage = t.untyped_storage()
    if storage.nbytes() < nbytes:
        if native.registered():  # in place (the C++ hook), as PyTorch: every tensor on it sees it
            storage.resize_(nbytes)
        else:  # a new storage for t alone
            grown = bridge.new_storage(nbytes, t.get_device())
            array = bridge.array_of(storage)
            if array is not None:
                bridge.set_array(grown, bridge.resized(array, nbytes))
            storage = grown
    bridge.restride(t, storage, t.storage_offset(), shape, bridge._contiguous_strides(shape))


def resize_(self, size, memory_format=None):
    resize(self, size)
    if memory_format not in (None, torch.contiguous_format, torch.preserve_format):
        bridge.restride(self, self.untyped_storage(), self.storage_offset(), self.shape,
                        format_strides(tuple(self.shape), memory_format))
    return self


@functools.lru_cache(maxsize=1024)
def format_strides(size: tuple, memory_format) -> tuple:
    """The strides PyTorch gives a new tensor of ``size`` in ``memory_format`` (channels_last, ...)."""
    if memory_format in (None, torch.contiguous_format, torch.preserve_format):
        return bridge._strides_of(size)
    return torch.empty(size, memory_format=memory_format, device="meta").stride()




def empty(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """A new tensor; its array is made (as zeros) when first read: XLA has no uninitialised memory."""
    _check_size(size)
    # explicit strides make the storage's byte count right, which views of it rely on
    return bridge.empty_shell(tuple(size), dtype or torch.get_default_dtype(), state.device_index(device),
                              format_strides(tuple(size), memory_format))


def empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    _check_size(size)
    return bridge.empty_shell(tuple(size), dtype or torch.get_default_dtype(), state.device_index(device), stride)


def _check_size(size) -> None:
    for s in size:
        if s < 0:
            raise RuntimeError(f"Trying to create tensor with negative dimension {s}: {list(size)}")


KERNELS = {
    aten.empty.memory_format: empty,
    aten.empty_strided.default: empty_strided,
    aten.set_.source_Storage_storage_offset: set_storage,
    aten.set_.source_Storage: lambda self, source: set_storage(self, source, 0, (source.nbytes() // self.element_size(),)),
    aten.set_.source_Tensor: set_tensor,
    aten.resize_.default: resize_,
}
