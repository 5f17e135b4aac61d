"""View kernels: metadata only. A view is a new tensor sharing its base's storage with its own
sizes, strides and offset, exactly as in PyTorch; the bridge reads and writes through that
geometry. PyTorch's own composite view ops (transpose, permute, slice, select, expand, unsqueeze,
squeeze, diagonal, unfold, ...) reach us as ``as_strided``, so these few kernels cover them all."""

from __future__ import annotations

import functools

import torch

from torchtpu.device import bridge
from torchtpu.eager import dispatch
from torchtpu.runtime import state

aten = torch.ops.aten


def make_view(base: torch.Tensor, size, stride, offset: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor sharing ``base``'s storage with the given geometry (and dtype)."""
    view = bridge._shell(dtype or base.dtype, base.device.index or 0)
    bridge.restride(view, base.untyped_storage(), offset, size, stride)
    if base.is_conj():  # a view keeps its base's lazy conjugate/negation bits, as in PyTorch
        torch._C._set_conj(view, True)
    if base.is_neg():
        torch._C._set_neg(view, True)
    return view


def as_strided(self, size, stride, storage_offset=None):
    offset = self.storage_offset() if storage_offset is None else storage_offset
    return make_view(self, size, stride, offset)


@functools.lru_cache(maxsize=16384)
def _view_strides(shape, stride, size):
    meta = torch.empty_strided(shape, stride, device="meta").view(size)
    return tuple(meta.shape), tuple(meta.stride())


def view(self, size):
    shape, stride = _view_strides(tuple(self.shape), tuple(self.stride()), tuple(size))
    return make_view(self, shape, stride, self.storage_offset())


def _reshape_alias(self, size, stride):
    return make_view(self, size, stride, self.storage_offset())


def view_dtype(self, dtype):
    if dtype == self.dtype:
        return make_view(self, self.shape, self.stride(), self.storage_offset())
    meta = torch.empty_strided(tuple(self.shape), tuple(self.stride()), dtype=self.dtype,
                               device="meta").view(dtype)
    offset = self.storage_offset() * self.element_size() // dtype.itemsize
    return make_view(self, meta.shape, meta.stride(), offset, dtype)


def view_as_real(self):
    if not self.is_complex():
        raise RuntimeError("view_as_real is only supported for complex tensors")
    real = torch.float32 if self.dtype == torch.complex64 else torch.float64
    return make_view(self, (*self.shape, 2), (*(2 * s for s in self.stride()), 1), 2 * self.storage_offset(), real)


def view_as_complex(self):
    if self.dtype not in (torch.float32, torch.float64):
        raise RuntimeError(f"view_as_complex is only supported for float and double tensors, but got a tensor of "
                           f"scalar type: {self.dtype}")
    if self.dim() == 0 or self.shape[-1] != 2 or self.stride(-1) != 1:
        raise RuntimeError("Tensor must have a last dimension of size 2 with stride 1")
    if self.storage_offset() % 2 or any(s % 2 for s in self.stride()[:-1]):
        raise RuntimeError("Tensor must have a stride divisible by 2 for all but last dimension")
    complex_dtype = torch.complex64 if self.dtype == torch.float32 else torch.complex128
    return make_view(self, self.shape[:-1], tuple(s // 2 for s in self.stride()[:-1]), self.storage_offset() // 2,
                     complex_dtype)


def set_storage(self, source, storage_offset=0, size=(), stride=()):
    bridge.restride(self, source, storage_offset, size, stride or bridge._contiguous_strides(size))
    return self


def set_tensor(self, source):
    bridge.restride(self, source.untyped_storage(), source.storage_offset(), source.shape, source.stride())
    return self


def resize_(self, size, memory_format=None):
    dispatch.resize(self, size)
    return self




def empty(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """A new tensor; its array is made (as zeros) when first read: XLA has no uninitialised memory."""
    _check_size(size)
    # explicit strides make the storage's byte count right, which views of it rely on
    return bridge.empty_shell(tuple(size), dtype or torch.get_default_dtype(), state.device_index(device),
                              bridge._contiguous_strides(size))


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
    aten.as_strided.default: as_strided,
    aten.view.default: view,
    aten._unsafe_view.default: view,
    aten._reshape_alias.default: _reshape_alias,
    aten.view.dtype: view_dtype,
    aten.view_as_real.default: view_as_real,
    aten.view_as_complex.default: view_as_complex,
    aten.set_.source_Storage_storage_offset: set_storage,
    aten.set_.source_Storage: lambda self, source: set_storage(self, source, 0, (source.nbytes() // self.element_size(),)),
    aten.set_.source_Tensor: set_tensor,
    aten.resize_.default: resize_,
}
