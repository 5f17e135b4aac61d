"""Makes ``tpu`` a PyTorch device: renames PrivateUse1, registers the hooks, the device guard,
``torch.tpu`` and a boxed fallback that starts the runtime at first use.

This runs during ``import torch`` (the autoload entry point), so it imports no JAX and starts
nothing. The first op on the ``tpu`` key has no kernel yet and reaches the fallback, which
starts the runtime (``runtime.state.start``: the eager layer registers its kernels then) and
calls the op again. From then on the fallback serves only ops that have no kernel, through the
handler the eager layer installs (``set_fallback``).
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch

from torchtpu.config import config
from torchtpu.device import autocast, serialization
from torchtpu.runtime import state
from torchtpu.runtime.compat import DeviceGuard, DeviceType, PrivateUse1Hooks, privateuse1_backend_name
from torchtpu.runtime.compat import register_device_module, register_privateuse1_device_guard, register_privateuse1_hooks

_done = False
_libs: list[torch.library.Library] = []
_handler: Callable | None = None


class _Hooks(PrivateUse1Hooks):
    """The Python hooks, used only where the C++ hooks (``runtime/native.py``) cannot be built."""

    def is_available(self) -> bool:
        return state.is_available()

    def has_primary_context(self, dev_id) -> bool:
        return state.started()

    def is_built(self) -> bool:
        return True


class _Guard(DeviceGuard):
    def type_(self):
        return DeviceType.PrivateUse1


def set_fallback(handler: Callable | None) -> None:
    """What the fallback does once the runtime has started (None: start it again on next use)."""
    global _handler
    _handler = handler


def _fallback(op, *args, **kwargs):
    handler = _handler
    if handler is not None:
        return handler(op, *args, **kwargs)
    state.start()  # the process's first tpu op: start the runtime, which registers the kernels
    if _handler is None:
        raise RuntimeError(f"tpu: the runtime started but registered no kernels; cannot run {op}")
    return op(*args, **kwargs)  # now its kernel runs, or this fallback's handler


def _has_compatible_shallow_copy_type(self, other) -> bool:
    """Whether ``other``'s TensorImpl can replace ``self``'s (``param.data = other``).

    PyTorch answers True between dense tensors of its built-in backends only, so ``Module.to``
    would build new Parameters for ``tpu`` instead of moving each in place: tied weights would
    untie and an optimizer built before ``.to()`` would step stale copies. A dense ``tpu``
    tensor is as compatible with a dense CPU/CUDA tensor as those are with each other.
    """
    if self.layout != torch.strided or other.layout != torch.strided:
        return self.layout == other.layout and self.device.type == other.device.type
    return self.device.type in _DENSE and other.device.type in _DENSE


_DENSE = frozenset({"cpu", "cuda", "mps", "hip", "xpu", "hpu", "mtia", "tpu"})


def _register_hooks() -> bool:
    """The C++ hooks, allocator and guard; else the Python hooks (True if the C++ ones)."""
    from torchtpu.device import hooks
    from torchtpu.runtime import native

    if native.register_hooks(hooks):
        state.sync_guard()
        return True
    if config.require_native:
        raise RuntimeError(f"torchtpu: the C++ device hooks are unavailable ({native.unavailable_reason()}) and "
                           f"TORCHTPU_REQUIRE_NATIVE=1 asks for them; install a C++ compiler and PyTorch's headers, "
                           f"or unset TORCHTPU_REQUIRE_NATIVE to run with the Python hooks")
    warnings.warn(f"torchtpu: the C++ device hooks are unavailable ({native.unavailable_reason()}); "
                  "pin_memory(), pinned DataLoaders, torch.Generator('tpu'), UntypedStorage.resize_ "
                  "(FSDP2) and torch.accelerator's memory statistics and synchronize() will not work on "
                  "tpu", RuntimeWarning, stacklevel=2)
    register_privateuse1_hooks(_Hooks())
    return False


def register(module) -> None:
    """Register the ``tpu`` device with PyTorch, ``module`` as ``torch.tpu`` (idempotent)."""
    global _done
    if _done:
        return
    name = privateuse1_backend_name()
    if name not in ("privateuseone", "tpu"):
        raise RuntimeError(f"PrivateUse1 is already taken by '{name}'; torchtpu cannot also register the "
                           "'tpu' device in this process")
    if name == "privateuseone":
        # torch.utils.backend_registration._setup_privateuseone_for_python_backend, with our hooks
        torch.utils.rename_privateuse1_backend("tpu")
        torch.utils.generate_methods_for_privateuse1_backend()
        register_device_module("tpu", module)
        if not _register_hooks():  # the C++ hooks bring their own guard
            register_privateuse1_device_guard(_Guard())
    autocast.install()  # torch.autocast("tpu"): PyTorch's CUDA policy (C++), bfloat16 by default
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_has_compatible_shallow_copy_type", _has_compatible_shallow_copy_type, "PrivateUse1")
    fallback_lib = torch.library.Library("_", "IMPL")
    fallback_lib.fallback(_fallback, "PrivateUse1")
    _libs.extend([lib, fallback_lib])
    serialization.install()
    _done = True
