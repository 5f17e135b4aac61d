"""``torch.nn.attention.flex_attention`` on tpu: past PyTorch's device check, into our kernels.

PyTorch's frontend rejects devices outside {cuda, cpu, xpu, hpu, mps} in ``_validate_device``
before any dispatch, and offers no plugin point. ``install`` replaces that module function with
one that lets ``tpu`` tensors through and calls the original for every other device, so CPU and
CUDA behave exactly as before (CPU still refuses a backward). The eager kernels of the two
higher-order ops are registered for PrivateUse1 (``tpu``); compiled graphs lower them in
``compile/flex_attention.py``. Both are made when the runtime starts (the first tpu use), through
``torchtpu.patches``: a program that never uses tpu keeps PyTorch's own.

This module is outside the packages dynamo skips (``compile/__init__.py``): dynamo traces
``flex_attention()`` with its device check, so the replacement must be traceable. It imports no
JAX; the kernels import their implementation when first called.
"""

from __future__ import annotations

import sys
from typing import Callable

from torchtpu import patches

_installed = False


def _allow_tpu(check: Callable) -> Callable:
    def _validate_device(query, key, value) -> None:
        """PyTorch's device check for every device but tpu, which flex_attention supports."""
        if query.device.type != "tpu":
            check(query, key, value)

    _validate_device.__wrapped__ = check
    return _validate_device


_FRONTEND = "torch.nn.attention.flex_attention"


def _patch_frontend() -> None:
    frontend = sys.modules[_FRONTEND]
    if not hasattr(frontend._validate_device, "__wrapped__"):
        frontend._validate_device = _allow_tpu(frontend._validate_device)


def allow_tpu() -> bool:
    """Patch ``flex_attention.validate_device`` (``torchtpu.patches``): now, or when the frontend
    is imported."""
    from torchtpu.compile.routing import after_import

    after_import(_FRONTEND, _patch_frontend)
    return True


def disallow_tpu() -> None:
    from torchtpu.compile.routing import cancel_after_import

    cancel_after_import(_FRONTEND)
    frontend = sys.modules.get(_FRONTEND)
    if frontend is not None and hasattr(frontend._validate_device, "__wrapped__"):
        frontend._validate_device = frontend._validate_device.__wrapped__


def _forward(*args, **kwargs):
    from torchtpu.compile import flex_attention

    return flex_attention.eager_forward(*args, **kwargs)


def _backward(*args, **kwargs):
    from torchtpu.compile import flex_attention

    return flex_attention.eager_backward(*args, **kwargs)


def _ops():
    from torchtpu.runtime import compat

    return ((compat.flex_attention_hop, _forward), (compat.flex_attention_backward_hop, _backward))


def register_kernels() -> bool:
    """Patch ``flex_attention.kernels``: the tpu (PrivateUse1) kernels of the two HOPs."""
    from torchtpu.runtime.compat import DispatchKey

    for op, kernel in _ops():
        if op.py_kernels.get(DispatchKey.PrivateUse1) is not kernel:
            op.py_impl(DispatchKey.PrivateUse1)(kernel)
    return True


def unregister_kernels() -> None:
    from torchtpu.runtime.compat import DispatchKey

    for op, kernel in _ops():
        if op.py_kernels.get(DispatchKey.PrivateUse1) is kernel:
            del op.py_kernels[DispatchKey.PrivateUse1]
            op._dispatch_cache.clear()


def _on_first_use() -> None:
    patches.apply("flex_attention.kernels")
    patches.apply("flex_attention.validate_device")


def install() -> None:
    """At ``import torch``: arrange for the kernels and the device check at the first tpu use (idempotent)."""
    global _installed
    if _installed:
        return
    from torchtpu.runtime import state

    state.on_start(_on_first_use)
    _installed = True
