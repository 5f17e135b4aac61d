"""DLPack export of ``tpu`` tensors: a host copy of the values.

A tpu tensor's bytes live in its storage's ``jax.Array``; its ``data_ptr()`` is a fake address
that nothing may dereference (``device/bridge.py``). PyTorch's own exporter
(``torch._C._to_dlpack``) would hand that address out as a ``kDLExtDev`` capsule, which
``torch.from_dlpack`` and ``torch.asarray`` turn into a tensor of zeros, and which any other
consumer would read garbage from. So ``Tensor.__dlpack__``, ``Tensor.__dlpack_device__``,
``torch.to_dlpack`` and ``torch.utils.dlpack.to_dlpack`` export a tpu tensor as a CPU capsule
of a copy of its values (``kDLCPU``): a round trip gives the right values, as a CPU tensor, and
JAX and NumPy (``np.from_dlpack``) can read it. Being a copy, writes to the imported tensor do
not reach the tpu tensor: ``copy=False`` raises ``BufferError``, as the array API asks of a
producer that cannot share memory. Tensors on other devices take PyTorch's own path.
"""

from __future__ import annotations

import torch
from torch.utils.dlpack import DLDeviceType

from torchtpu.eager import transfer

_installed: dict[str, object] = {}


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a new CPU tensor (its lazy conjugate/negation bits resolved)."""
    return transfer.to_host(t.detach())


def to_dlpack(tensor: torch.Tensor):
    """``torch.utils.dlpack.to_dlpack``: a tpu tensor as a CPU capsule of a copy of its values."""
    if isinstance(tensor, torch.Tensor) and tensor.device.type == "tpu":
        return _installed["to_dlpack"](_host_copy(tensor))
    return _installed["to_dlpack"](tensor)


def __dlpack__(self, *, stream=-1, max_version=None, dl_device=None, copy=None, read_only=False):
    original = _installed["__dlpack__"]
    if self.device.type != "tpu" or torch.overrides.has_torch_function_unary(self):
        return original(self, stream=stream, max_version=max_version, dl_device=dl_device, copy=copy,
                        read_only=read_only)
    if self.requires_grad:  # PyTorch's checks, with its wording
        raise BufferError("Can't export tensors that require gradient, use tensor.detach()")
    if self.is_conj():
        raise BufferError("Can't export tensors with the conjugate bit set")
    if copy is False:
        raise BufferError("tpu: a tpu tensor cannot be exported through DLPack without a copy: its data is "
                          "in an XLA buffer, not at its data_ptr(); it exports a host copy (copy=None or "
                          "copy=True)")
    if dl_device is not None and tuple(dl_device) != (DLDeviceType.kDLCPU, 0):
        raise BufferError(f"tpu: a tpu tensor exports through DLPack to the CPU only (kDLCPU, 0), not to "
                          f"{tuple(dl_device)}")
    if stream is not None and stream != -1:
        raise BufferError("tpu: a tpu tensor's DLPack export is a host copy and takes no stream")
    return original(_host_copy(self), max_version=max_version, read_only=read_only)


def __dlpack_device__(self):
    if self.device.type == "tpu" and not torch.overrides.has_torch_function_unary(self):
        return (DLDeviceType.kDLCPU, 0)  # where its export lives: see __dlpack__
    return _installed["__dlpack_device__"](self)


def install() -> None:
    """Route DLPack exports of tpu tensors here (idempotent); run when the runtime starts."""
    if _installed:
        return
    _installed.update(to_dlpack=torch.utils.dlpack.to_dlpack, __dlpack__=torch.Tensor.__dlpack__,
                      __dlpack_device__=torch.Tensor.__dlpack_device__)
    torch.utils.dlpack.to_dlpack = to_dlpack
    torch.to_dlpack = to_dlpack
    torch.Tensor.__dlpack__ = __dlpack__
    torch.Tensor.__dlpack_device__ = __dlpack_device__
