"""The precision of fp32 matrix products and convolutions: ``torch.set_float32_matmul_precision``.

PyTorch's setting, as XLA's ``lax.Precision`` (one table, ``PRECISIONS``):

=========== ============ ===================================== ==============================
setting     precision    TPU (MXU)                             GPU
=========== ============ ===================================== ==============================
"highest"   HIGHEST      fp32: 6 bf16 passes                   fp32
"high"      HIGH         bf16x3: 3 bf16 passes                 TF32 (JAX: HIGH is TF32 there)
"medium"    DEFAULT      bf16: 1 pass                          TF32 (as CUDA's "medium" is)
=========== ============ ===================================== ==============================

XLA:CPU computes fp32 whichever. The default is PyTorch's ("highest"). Non-fp32 operands (bf16
under autocast, fp64) are unaffected in practice: the setting is about fp32 only.

**Which ops follow it.** Lowerings registered with ``@lowering(..., dots=True)`` — the matrix
products (``mm``, ``bmm``, ``addmm``, ``baddbmm``, ...), the convolutions and ``cdist``'s
matmul form — pass ``precision=matmul_precision()``; so do the attention lowerings (SDPA's fused
op, flex_attention's HOPs) and the chunked ``linear_cross_entropy``, as
``matmul_precision(input_dtype)``: they compute bf16/fp16 inputs in fp32, and those stay at
HIGHEST, as a bf16 ``mm`` is unaffected. Dots that implement something other than a user's
product keep ``Precision.HIGHEST``: ``ctc_loss``'s one-hot gather,
interpolation weights, linear-algebra reconstructions (PyTorch computes those in full precision
and without a matmul on every device).

**Where it is read.** ``setting()`` is the current context's setting: a ``torch.tpu.matmul_precision``
block's (``scope``), else, in an autograd thread running a backward pass, its caller's block's,
else torch's global ``torch.get_float32_matmul_precision()``. Executors read it when a program that
has dots runs (an eager op with ``dots=True``, a compiled graph containing one) and put it in that
program's cache key, so a change of setting recompiles those programs only. While such a program
is traced, ``tracing(setting)`` pins the setting its lowerings see through ``matmul_precision()``:
a program never bakes in a setting its key does not carry. A lowering traced under a pin without
a setting (its op is not registered with ``dots=True``) that asks for the precision raises.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Iterator

import numpy as np
from jax import lax

from torchtpu.runtime.compat import AUTOGRAD_CALLER_KEY as _CALLER, float32_matmul_precision as _torch_setting
from torchtpu.runtime.compat import get_obj_in_tls as _get_obj_in_tls, is_key_in_tls as _is_key_in_tls

PRECISIONS: dict[str, lax.Precision] = {
    "highest": lax.Precision.HIGHEST,
    "high": lax.Precision.HIGH,
    "medium": lax.Precision.DEFAULT,
}

_block: contextvars.ContextVar[str] = contextvars.ContextVar("torchtpu_matmul_precision")
_blocks = 0  # live ``scope`` blocks in any thread: with none, setting() is torch's at once
_blocks_lock = threading.Lock()
_traced = threading.local()  # .pin: what the program being traced in this thread asks for, if any


def setting() -> str:
    """The current context's fp32 matmul precision setting: "highest", "high" or "medium"."""
    if not _blocks:  # the common case: one read of torch's setting
        return _torch_setting()
    value = _block.get(None)
    if value is not None:
        return value
    if _is_key_in_tls(_CALLER):  # an autograd thread: the block of the thread that called backward()
        caller = _get_obj_in_tls(_CALLER)
        value = caller.get(_block) if caller is not None else None
        if value is not None:
            return value
    return _torch_setting()


def _check(value: str) -> str:
    if value not in PRECISIONS:
        raise RuntimeError(f"Invalid precision {value!r}: expected one of {', '.join(map(repr, PRECISIONS))} "
                           f"(as torch.set_float32_matmul_precision)")
    return value


@contextlib.contextmanager
def scope(value: str) -> Iterator[None]:
    """``torch.tpu.matmul_precision(value)``: fp32 dots and convolutions on tpu use ``value``
    ("highest", "high" or "medium") inside the block, in this thread or asyncio task only (and
    in the backward passes it runs); torch's global setting is left as it is."""
    global _blocks
    token = _block.set(_check(value))
    with _blocks_lock:
        _blocks += 1
    try:
        yield
    finally:
        _block.reset(token)
        with _blocks_lock:
            _blocks -= 1


class _Unmarked:
    """The pin of a program whose ops are not registered with ``dots=True``."""

    __slots__ = ("what",)

    def __init__(self, what: str):
        self.what = what


class tracing:
    """Pin what ``matmul_precision()`` returns while a program is traced in this thread: the
    ``setting`` in the program's key, or, for a program without ops registered with
    ``dots=True``, nothing (``setting=None``; ``what`` names the lowering for the error): a
    lowering that asks then raises."""

    __slots__ = ("pin", "previous")

    def __init__(self, setting: str | None, what: str = "a lowering"):
        self.pin = setting if setting is not None else _Unmarked(what)

    def __enter__(self) -> None:
        self.previous = getattr(_traced, "pin", None)
        _traced.pin = self.pin

    def __exit__(self, *exc) -> None:
        _traced.pin = self.previous


def matmul_precision(dtype=None) -> lax.Precision:
    """The ``precision=`` of an fp32 dot or convolution in a lowering registered with ``dots=True``;
    given the op's input ``dtype``, HIGHEST unless it is float32."""
    pin = getattr(_traced, "pin", None)
    if pin is None:  # called outside an executor (a test, check_override): the current setting
        pin = setting()
    elif pin.__class__ is _Unmarked:
        raise RuntimeError(f"tpu: {pin.what} asks for the matmul precision, but its op is not registered with "
                           f"@lowering(..., dots=True), so its programs would not follow "
                           f"torch.set_float32_matmul_precision; register it with dots=True")
    # the setting is about fp32: a lowering that computes bf16/fp16 inputs in fp32 (attention) keeps HIGHEST
    if dtype is not None and dtype != np.float32:
        return lax.Precision.HIGHEST
    return PRECISIONS[pin]
