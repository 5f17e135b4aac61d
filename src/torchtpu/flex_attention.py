"""``torch.nn.attention.flex_attention`` on tpu: past PyTorch's device check, into our kernels.

PyTorch's frontend rejects devices outside {cuda, cpu, xpu, hpu, mps} in ``_validate_device``
before any dispatch, and offers no plugin point. ``install`` replaces that module function with
one that lets ``tpu`` tensors through and calls the original for every other device, so CPU and
CUDA behave exactly as before (CPU still refuses a backward). The eager kernels of the two
higher-order ops are registered for PrivateUse1 (``tpu``); compiled graphs lower them in
``compile/flex_attention.py``.

This module is outside the packages dynamo skips (``compile/__init__.py``): dynamo traces
``flex_attention()`` with its device check, so the replacement must be traceable. It imports no
JAX; the kernels import their implementation when first called.
"""

from __future__ import annotations

from typing import Callable

_installed = False


def _allow_tpu(check: Callable) -> Callable:
    def _validate_device(query, key, value) -> None:
        """PyTorch's device check for every device but tpu, which flex_attention supports."""
        if query.device.type != "tpu":
            check(query, key, value)

    _validate_device.__wrapped__ = check
    return _validate_device


def _patch_frontend() -> None:
    import torch.nn.attention.flex_attention as frontend

    if not hasattr(frontend._validate_device, "__wrapped__"):
        frontend._validate_device = _allow_tpu(frontend._validate_device)


def _forward(*args, **kwargs):
    from torchtpu.compile import flex_attention

    return flex_attention.eager_forward(*args, **kwargs)


def _backward(*args, **kwargs):
    from torchtpu.compile import flex_attention

    return flex_attention.eager_backward(*args, **kwargs)


def install() -> None:
    """Register the tpu kernels of the flex_attention HOPs and patch the device check (idempotent)."""
    global _installed
    if _installed:
        return
    from torch._C import DispatchKey
    from torch._higher_order_ops.flex_attention import flex_attention, flex_attention_backward

    from torchtpu.compile.routing import after_import

    flex_attention.py_impl(DispatchKey.PrivateUse1)(_forward)
    flex_attention_backward.py_impl(DispatchKey.PrivateUse1)(_backward)
    after_import("torch.nn.attention.flex_attention", _patch_frontend)
    _installed = True
