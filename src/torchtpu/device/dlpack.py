"""DLPack on ``tpu``: PyTorch's own capsules, imported as true aliases; host copies for others.

A tpu tensor's bytes live in its storage's ``jax.Array``; its ``data_ptr()`` is a fake, never
dereferenced address (``device/bridge.py``). PyTorch's exporter (``torch._C._to_dlpack``) hands
that address out in a ``kDLExtDev`` capsule, and PyTorch's importer (``torch.from_dlpack``,
``torch.asarray``) makes of it a tpu tensor over a *new* storage at the same address: a storage
with no array, which reads as zeros. So:

* **Capsules** (``torch.utils.dlpack.to_dlpack``, ``torch.to_dlpack``): PyTorch's own
  ``kDLExtDev`` capsule, as for any device; the exported tensor's storage is remembered
  (weakly). ``torch.from_dlpack(capsule)``, ``torch.utils.dlpack.from_dlpack`` and
  ``torch.asarray(capsule, ...)`` re-point the imported tensor at that storage, at the offset its
  address says: it aliases the exported tensor (``data_ptr()`` equal, writes visible both ways),
  exactly PyTorch's semantics, and ``copy=True`` / another dtype copy the real values. A tpu
  capsule this module did not export (``torch._C._to_dlpack`` bound before torchtpu was
  imported) raises ``BufferError``: never a tensor of zeros. No other library can read a
  ``kDLExtDev`` capsule (NumPy and JAX refuse its device).
* **``torch.from_dlpack(tpu_tensor)``**: an alias on the same device (as PyTorch gives for a
  CUDA tensor), with PyTorch's checks; ``copy=True`` copies, ``device=`` moves.
* **``Tensor.__dlpack__`` / ``__dlpack_device__``** (what NumPy, JAX and other libraries call):
  ``kDLCPU`` and a capsule of a host copy of the values, which they can read. Being a copy,
  ``copy=False`` raises ``BufferError``; ``dl_device=(kDLExtDev, index)`` asks for PyTorch's own
  aliasing capsule (only PyTorch can import it).

Installed when torchtpu is imported (during ``import torch``, through the backend autoload), so
names bound later (``from torch.utils.dlpack import to_dlpack``) are these; hence this module
lives in ``device``, below ``eager``, and imports no JAX (the runtime is running whenever a tpu
tensor exists). Tensors on other devices take PyTorch's own path.
"""

from __future__ import annotations

import datetime
import sys
import threading
import weakref

import torch
from torch.utils.dlpack import DLDeviceType

from torchtpu.runtime.compat import from_dlpack_capsule

_installed: dict[str, object] = {}
_CAPSULE = type(datetime.datetime_CAPI)  # types.CapsuleType (Python >= 3.13)

# Storages exported in a PyTorch capsule, by id, weakly: the capsule holds a reference to the
# exported tensor, so the storage lives while the capsule (and then the imported tensor) does.
_exported: dict[int, weakref.ref] = {}
_lock = threading.Lock()


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a new CPU tensor (its lazy conjugate/negation bits resolved)."""
    return t.detach().resolve_conj().resolve_neg().cpu()


def _remember(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    key = id(storage)

    def forget(ref, key=key):
        with _lock:
            if _exported.get(key) is ref:
                del _exported[key]

    with _lock:
        ref = _exported.get(key)
        if ref is None or ref() is not storage:
            _exported[key] = weakref.ref(storage, forget)


def _exporter_of(address: int, nbytes: int):
    """The live exported tpu storage holding ``[address, address + nbytes)``, or None."""
    with _lock:
        refs = list(_exported.values())
    for ref in refs:
        storage = ref()
        if storage is None or storage.device.type != "tpu":
            continue
        base = storage.data_ptr()
        if base and base <= address and address + nbytes <= base + storage.nbytes():
            return storage
    return None


def _resolve(t):
    """An imported tensor (``torch._C._from_dlpack``'s result) as the alias it stands for: a tpu
    one is re-pointed at the exported storage its address lies in (geometry unchanged)."""
    if not isinstance(t, torch.Tensor) or t.device.type != "tpu" or t.numel() == 0:
        return t  # (no values to get wrong: bridge's 0-element tpu:N templates come this way)
    itemsize = t.element_size()
    extent = t.storage_offset() + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    address = t.data_ptr()
    storage = _exporter_of(address, (extent - t.storage_offset()) * itemsize)
    if storage is None or (address - storage.data_ptr()) % itemsize:
        raise BufferError(
            "tpu: this DLPack capsule points at tpu memory that torchtpu did not export (a capsule "
            "from torch._C._to_dlpack, or a reference to torch.utils.dlpack.to_dlpack taken before "
            "torchtpu was imported): a tpu tensor's data_ptr() is not its memory, so the import "
            "cannot find the values. Export with torch.utils.dlpack.to_dlpack, or use "
            "torch.from_dlpack(tensor) / torch.asarray(tensor)")
    from torchtpu.device import bridge

    offset = (address - storage.data_ptr()) // itemsize
    bridge.restride(t, storage, offset, tuple(t.shape), tuple(t.stride()))
    return t


def _pytorch_capsule(t: torch.Tensor, **kwargs):
    """PyTorch's own (``kDLExtDev``, aliasing) capsule of a tpu tensor, importable by ``_resolve``."""
    _remember(t)
    return _installed["to_dlpack"](t, **kwargs)


# ---------------------------------------------------------------- export

def to_dlpack(tensor, **kwargs):
    """``torch.utils.dlpack.to_dlpack``: PyTorch's capsule; a tpu tensor's storage is remembered
    so that importing the capsule aliases it."""
    if isinstance(tensor, torch.Tensor) and tensor.device.type == "tpu":
        dl_device = kwargs.get("dl_device")
        if dl_device is not None and tuple(dl_device) == (DLDeviceType.kDLCPU, 0):
            if kwargs.get("copy") is False:
                raise BufferError("tpu: a tpu tensor cannot be exported to the CPU without a copy")
            return _installed["to_dlpack"](_host_copy(tensor))
        return _pytorch_capsule(tensor, **kwargs)
    return _installed["to_dlpack"](tensor, **kwargs)


def __dlpack__(self, *, stream=-1, max_version=None, dl_device=None, copy=None, read_only=False):
    original = _installed["__dlpack__"]
    if self.device.type != "tpu" or torch.overrides.has_torch_function_unary(self):
        return original(self, stream=stream, max_version=max_version, dl_device=dl_device, copy=copy,
                        read_only=read_only)
    if self.requires_grad:  # PyTorch's checks, with its wording
        raise BufferError("Can't export tensors that require gradient, use tensor.detach()")
    if self.is_conj():
        raise BufferError("Can't export tensors with the conjugate bit set")
    if stream is not None and stream != -1:
        raise BufferError("tpu: a tpu tensor's DLPack export takes no stream")
    own = (DLDeviceType.kDLExtDev, self.device.index or 0)
    if dl_device is not None and tuple(dl_device) == own:  # PyTorch's aliasing capsule, for PyTorch
        _remember(self)
        return original(self, max_version=max_version, copy=copy, read_only=read_only)
    if copy is False:
        raise BufferError("tpu: a tpu tensor cannot be exported through DLPack without a copy: its data is "
                          "in an XLA buffer, not at its data_ptr(); it exports a host copy (copy=None or "
                          "copy=True), or PyTorch's own capsule with dl_device=(kDLExtDev, index)")
    if dl_device is not None and tuple(dl_device) != (DLDeviceType.kDLCPU, 0):
        raise BufferError(f"tpu: a tpu tensor exports through DLPack to the CPU (kDLCPU, 0) or, for "
                          f"PyTorch only, as {own}; not to {tuple(dl_device)}")
    return original(_host_copy(self), max_version=max_version, read_only=read_only)


def __dlpack_device__(self):
    if self.device.type == "tpu" and not torch.overrides.has_torch_function_unary(self):
        return (DLDeviceType.kDLCPU, 0)  # where its export for other libraries lives: see __dlpack__
    return _installed["__dlpack_device__"](self)


# ---------------------------------------------------------------- import

def _from_tpu_tensor(t: torch.Tensor, device, copy) -> torch.Tensor:
    """``torch.from_dlpack(t)`` of a tpu tensor, as PyTorch does it for a CUDA tensor: an alias
    through PyTorch's own capsule (its checks; a new tensor and version counter), ``copy=True``
    a copy, another ``device`` a move."""
    if t.requires_grad:
        raise BufferError("Can't export tensors that require gradient, use tensor.detach()")
    if t.is_conj():
        raise BufferError("Can't export tensors with the conjugate bit set")
    target = t.device if device is None else torch.device(device)
    if target.type == "tpu" and target.index is None:
        target = torch.device("tpu", torch.tpu.current_device())
    if target != t.device and copy is False:
        raise ValueError(f"cannot move DLPack tensor from device {t.device} to {target} without copying. "
                         "Set copy=None or copy=True.")
    alias = _resolve(from_dlpack_capsule(_pytorch_capsule(t)))
    if target != t.device:
        return alias.to(target)
    return alias.clone() if copy else alias


def from_dlpack(ext_tensor, *, device=None, copy=None) -> torch.Tensor:
    """``torch.from_dlpack``: PyTorch's, with tpu capsules imported as aliases (``_resolve``)."""
    if isinstance(ext_tensor, torch.Tensor) and ext_tensor.device.type == "tpu" \
            and not torch.overrides.has_torch_function_unary(ext_tensor):
        return _from_tpu_tensor(ext_tensor, device, copy)
    if type(ext_tensor) is _CAPSULE:
        if device is not None or copy is not None:  # PyTorch's own check
            return _installed["from_dlpack"](ext_tensor, device=device, copy=copy)
        return _resolve(from_dlpack_capsule(ext_tensor))
    return _resolve(_installed["from_dlpack"](ext_tensor, device=device, copy=copy))


def asarray(obj, *args, **kwargs):
    """``torch.asarray``: a DLPack capsule is imported as ``from_dlpack`` does (a tpu one as an
    alias), then handled as PyTorch handles the tensor it stands for (alias, or copy for
    ``copy=True``, another dtype or device); ``device="tpu"`` is the current tpu device, as
    ``device="cuda"`` is on CUDA (so a tpu tensor aliases). Torch-function modes (``with torch.device(...)``)
    and subclasses see this function, as they saw PyTorch's."""
    if torch.overrides.has_torch_function((obj,)):
        return torch.overrides.handle_torch_function(asarray, (obj,), obj, *args, **kwargs)
    device = kwargs.get("device")
    if device is not None:  # "tpu" means the current tpu device, as "cuda" does here on CUDA
        device = torch.device(device) if isinstance(device, str) else device
        if isinstance(device, torch.device) and device.type == "tpu" and device.index is None:
            kwargs["device"] = torch.device("tpu", torch.tpu.current_device())
    if type(obj) is _CAPSULE:
        try:
            imported = from_dlpack_capsule(obj)
        except Exception:  # not a live DLPack capsule: PyTorch's own handling and error
            imported = None
        if imported is not None:
            obj = _resolve(imported)
    return _installed["asarray"](obj, *args, **kwargs)


def install() -> None:
    """Route DLPack exports and imports of tpu tensors here (idempotent); run at import."""
    if _installed:
        return
    _installed.update(to_dlpack=torch.utils.dlpack.to_dlpack, __dlpack__=torch.Tensor.__dlpack__,
                      __dlpack_device__=torch.Tensor.__dlpack_device__,
                      from_dlpack=torch.utils.dlpack.from_dlpack, asarray=torch.asarray)
    to_dlpack.__doc__ = torch.utils.dlpack.to_dlpack.__doc__
    from_dlpack.__doc__ = torch.utils.dlpack.from_dlpack.__doc__
    asarray.__doc__ = torch.asarray.__doc__
    torch.utils.dlpack.to_dlpack = to_dlpack
    torch.to_dlpack = to_dlpack
    torch.utils.dlpack.from_dlpack = from_dlpack
    torch.from_dlpack = from_dlpack
    torch.asarray = asarray
    device_module = sys.modules.get("torch.utils._device")
    if device_module is not None:  # its cached list of factories names torch.asarray: now this one
        device_module._device_constructors.cache_clear()
    torch.Tensor.__dlpack__ = __dlpack__
    torch.Tensor.__dlpack_device__ = __dlpack_device__
