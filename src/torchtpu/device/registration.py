"""Makes ``tpu`` a PyTorch device: renames PrivateUse1, registers hooks, guard, ``torch.tpu``."""

from __future__ import annotations

import torch
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

from torchtpu.device import module as tpu_module
from torchtpu.device import serialization
from torchtpu.runtime import platform

_done = False


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return tpu_module.is_available()

    def has_primary_context(self, dev_id) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _Guard(torch._C._acc.DeviceGuard):
    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


def register() -> None:
    """Register the ``tpu`` device and its kernels with PyTorch (idempotent)."""
    global _done
    if _done:
        return
    from torchtpu.eager import register as eager_register

    if torch._C._get_privateuse1_backend_name() not in ("privateuseone", "tpu"):
        raise RuntimeError(
            f"PrivateUse1 is already taken by '{torch._C._get_privateuse1_backend_name()}'; "
            "torchtpu cannot also register the 'tpu' device in this process")
    if torch._C._get_privateuse1_backend_name() == "privateuseone":
        module = tpu_module.build()
        _setup_privateuseone_for_python_backend("tpu", backend_module=module, hook=_Hooks(),
                                                device_guard=_Guard())
    eager_register.install()
    serialization.install()
    platform.devices()
    _done = True
