"""Which attention ``F.scaled_dot_product_attention`` runs on ``tpu``, and the fused op's eager kernel.

PyTorch chooses SDPA's backend with a C++ stub (``_fused_sdp_choice_stub``) that only a C++
extension can fill for PrivateUse1; without it a ``tpu`` tensor always takes the math path, which
materialises the L×S scores. So SDPA gets its own kernel that chooses as PyTorch does, by the
``sdpa_kernel`` settings in their priority order, on AutogradPrivateUse1 and on PrivateUse1 (under
``torch.inference_mode`` the autograd keys are skipped: with only the first, inference took the
math path, 20x slower for a decode step's attention over 1,024 keys):

- the math backend: ``_scaled_dot_product_attention_math`` (PyTorch's decomposition);
- the flash, efficient, cuDNN and overrideable backends: the one fused op PyTorch provides for
  PrivateUse1 backends, ``_scaled_dot_product_fused_attention_overrideable`` (blockwise,
  ``ops/attention.py``), for 4-d float16/bfloat16/float32 inputs; other inputs (float64,
  other ranks, broadcast batches, head counts without ``enable_gqa``) take the math path.

Autograd records the fused op (PyTorch's formula calls its ``_backward``), so eager, fused and
compiled execution (aot_autograd traces through this kernel) all run the same two lowerings.
``torch._fused_sdp_choice`` on ``tpu`` answers with the same choice. A call without dropout that
no gradient can flow through (no_grad, inference mode: serving) runs the fused op's lowering for
its output alone (``_OutputOnly``).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import torch
from torch.autograd import forward_ad
from torch.nn.attention import SDPBackend

from torchtpu.eager import dispatch
from torchtpu.ops import registry
from torchtpu.ops.registry import Lowering
from torchtpu.runtime import rng
from torchtpu.runtime.compat import overrideable_sdp_enabled, sdp_priority_order

aten = torch.ops.aten
_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_ENABLED = {
    SDPBackend.MATH: torch.backends.cuda.math_sdp_enabled,  # (these four serve every device)
    SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled,
    SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled,
    SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.cudnn_sdp_enabled,
    SDPBackend.OVERRIDEABLE: overrideable_sdp_enabled,
}
_BY_VALUE = {b.value: b for b in _ENABLED}


def _fused_fits(query, key, value, attn_mask, enable_gqa: bool) -> bool:
    """Whether the fused op takes these inputs (else the math path, which also raises PyTorch's errors)."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or query.is_nested:
        return False
    if query.dtype not in _FUSED_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return False
    (b, hq, length, d), (bk, hk, s, dk), (bv, hv, sv, _) = query.shape, key.shape, value.shape
    if not (b == bk == bv and hk == hv and s == sv and d == dk):
        return False
    if hq != hk and not (enable_gqa and hq % hk == 0):
        return False
    if attn_mask is not None:
        if attn_mask.dtype not in (torch.bool, query.dtype) or attn_mask.dim() > 4:
            return False
        try:
            torch.broadcast_shapes(attn_mask.shape, (b, hq, length, s))
        except RuntimeError:
            return False
    return True


def choice(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
           enable_gqa=False) -> SDPBackend:
    """The backend SDPA runs on these inputs: MATH or OVERRIDEABLE (what FLASH/EFFICIENT/CUDNN map to)."""
    fits = _fused_fits(query, key, value, attn_mask, enable_gqa)
    for value_ in sdp_priority_order():
        backend = _BY_VALUE.get(value_)
        if backend is None or not _ENABLED[backend]():
            continue
        if backend == SDPBackend.MATH:
            return backend
        if fits:
            return SDPBackend.OVERRIDEABLE
    raise RuntimeError("No viable backend for scaled_dot_product_attention was found. This is likely due to "
                       "turning off both the math kernel and the fused kernels.")


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                                 scale=None, enable_gqa=False):
    """SDPA on ``tpu``: the chosen backend's op (autograd records it)."""
    if attn_mask is not None and is_causal:  # PyTorch's own check, before any backend
        raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set when "
                           "is_causal=True")
    if choice(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) == SDPBackend.MATH:
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            # PyTorch's SDPA makes a boolean mask additive (True: 0, False: -inf) before its math backend,
            # which adds whatever mask it gets to the scores.
            attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(attn_mask.logical_not(),
                                                                                   float("-inf"))
        return aten._scaled_dot_product_attention_math(query, key, value, attn_mask, dropout_p, is_causal, None,
                                                       scale=scale, enable_gqa=enable_gqa)[0]
    if dropout_p == 0.0 and _INFERENCE is not None and _no_gradient(query, key, value, attn_mask):
        return _INFERENCE(query, key, value, attn_mask, 0.0, is_causal, False, scale=scale)[0]
    return aten._scaled_dot_product_fused_attention_overrideable(query, key, value, attn_mask, dropout_p,
                                                                 is_causal, False, scale=scale)[0]


def _no_gradient(*tensors) -> bool:
    """Whether no gradient can flow from SDPA's output to these inputs (no_grad, inference mode, or
    no input that requires one; no forward-mode AD), and they are plain ``tpu`` tensors (not a
    tracer's: ``torch.compile`` traces the fused op, which autograd records)."""
    grad = torch.is_grad_enabled()
    return all(t is None or type(t) is torch.Tensor and not (grad and t.requires_grad)
               and forward_ad.unpack_dual(t).tangent is None for t in tensors)


def _fused_sdp_choice(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                      enable_gqa=False) -> int:
    return choice(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa).value


@dataclasses.dataclass(frozen=True)
class _OutputOnly(Lowering):
    """The fused op's lowering (or its platform override) for a call without dropout that no
    gradient flows through: its attention output alone. One program that draws no random key and
    returns one array, where the op's kernel draws a key and wraps four outputs (logsumexp and the
    dropout seeds, for the backward): a decode step's attention (40 keys) took 165 us a call through
    the op alone, 126 so (``benchmarks/attention.py --decode-only``)."""

    def impl(self, platform: str | None = None):
        full = registry.LOWERINGS[self.op].impl(platform)

        def output(*args, **kwargs):
            unused = rng.make_key(jnp.uint32(0), jnp.uint32(0), 0)  # (dropout_p is 0: never drawn from)
            return (full(unused, *args, **kwargs)[0],)

        return output


_INFERENCE = None  # the fused op's kernel for calls that need no backward (``_OutputOnly``)


@dataclasses.dataclass(frozen=True)
class _ArrayOutputs(Lowering):
    """An op's lowering (or its platform override) with only its array outputs: an eager program
    returns arrays; the kernel puts back the undefined tensors (None) and ints the schema returns."""

    def impl(self, platform: str | None = None):
        full = registry.LOWERINGS[self.op].impl(platform)

        def arrays(*args, **kwargs):
            return tuple(o for o in full(*args, **kwargs) if o is not None and not isinstance(o, int))

        return arrays


def _array_kernel(op) -> dispatch.Kernel:
    low = registry.LOWERINGS[op]
    # dots: its programs follow (and key on) torch's matmul precision, as any dots=True kernel's
    return dispatch.Kernel(_ArrayOutputs(op, low.fn, random=low.random, dots=low.dots))


def _fused_kernel():
    """The fused op's eager kernel: its arrays from one program, its ints from the shapes."""
    functional = _array_kernel(aten._scaled_dot_product_fused_attention_overrideable.default)

    def fused(query, key, value, attn_bias=None, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
              scale=None):
        out, lse, seed, offset = functional(query, key, value, attn_bias, dropout_p, is_causal, return_debug_mask,
                                            scale=scale)
        return out, lse, None, None, query.shape[2], key.shape[2], seed, offset, None

    global _INFERENCE
    op = aten._scaled_dot_product_fused_attention_overrideable.default
    low = registry.LOWERINGS[op]
    _INFERENCE = dispatch.Kernel(_OutputOnly(op, low.fn, dots=low.dots))
    fused.functional = functional  # register.py drops its programs when the op's override changes
    fused.inference = _INFERENCE  # (and these)
    return fused


def _flash_kernel():
    """CUDA's flash op's eager kernel (``ops/attention.py`` lowers it): as the fused op's."""
    functional = _array_kernel(aten._scaled_dot_product_flash_attention.default)

    def flash(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        out, lse, rng_state, unused, debug_mask = functional(query, key, value, dropout_p, is_causal,
                                                             return_debug_mask, scale=scale)
        return out, lse, None, None, query.shape[2], key.shape[2], rng_state, unused, debug_mask

    flash.functional = functional
    return flash


def _fused_backward_kernel():
    """The fused backward's eager kernel: no bias gradient (None) unless asked for one."""
    functional = _array_kernel(aten._scaled_dot_product_fused_attention_overrideable_backward.default)

    def fused_backward(*args, **kwargs):
        grads = functional(*args, **kwargs)
        return grads if len(grads) == 4 else (*grads, None)

    fused_backward.functional = functional
    return fused_backward


def kernels() -> dict:
    """This module's PrivateUse1 kernels."""
    return {aten._scaled_dot_product_fused_attention_overrideable.default: _fused_kernel(),
            aten._scaled_dot_product_fused_attention_overrideable_backward.default: _fused_backward_kernel(),
            aten._scaled_dot_product_flash_attention.default: _flash_kernel(),
            aten._fused_sdp_choice.default: _fused_sdp_choice}


def install_autograd() -> torch.library.Library:
    """Register SDPA's kernel on AutogradPrivateUse1 and PrivateUse1 (what ``torch.inference_mode``
    dispatches to); returns its library (destroying it unregisters)."""
    lib = torch.library.Library("aten", "IMPL")
    for key in ("AutogradPrivateUse1", "PrivateUse1"):
        lib.impl("scaled_dot_product_attention", scaled_dot_product_attention, key)
    return lib
