"""Fused linear cross-entropy: torch 2.14's chunked ``F.linear_cross_entropy`` ops, lowered.

``F.linear_cross_entropy(..., options=LinearCrossEntropyOptions())`` calls one of two custom ops
(``torch.nn.modules.linear_cross_entropy``): ``torch_nn::_linear_cross_entropy_batch_chunked``
(mean/sum: the loss and the gradients, computed together in the forward; the backward scales the
gradients by the upstream one) and ``..._no_reduction`` (per-row losses; its backward is
PyTorch's Python loop over chunks, made of aten ops we lower). PyTorch's own implementation of
both is a Python loop of in-place ops over row chunks; here each is one ``lax.scan`` over row
chunks, so the (tokens × vocab) logits exist one chunk at a time in eager and compiled programs
alike (``benchmarks/linear_cross_entropy.py`` measures the peak). Each chunk's gradients come from
``jax.vjp`` of the chunk's loss, so forward and backward share one formula.

Logits and sums are computed in float32 at least (``opmath`` of the op's ``acc_dtype``): on
``tpu`` PyTorch's options resolve ``acc_dtype`` to the input's dtype, which for bfloat16 would
sum 32k logits in bfloat16; PyTorch's CPU path accumulates those in float32 too. The logits'
product of fp32 inputs follows ``torch.set_float32_matmul_precision`` (``dots=True``), as
``F.linear``'s does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from torchtpu.ops.dtypes import opmath, to_jax_dtype
from torchtpu.ops.precision import matmul_precision
from torchtpu.ops.registry import lowering

try:  # torch >= 2.14 defines the chunked ops when this module is imported
    from torch.nn.modules import linear_cross_entropy as _torch_lce
except ImportError:  # pragma: no cover - an older torch: nothing to lower
    _torch_lce = None


def _row_coefficients(target, weight, n: int, reduction: str, ignore_index: int, acc):
    """Each row's factor in the reduced loss: its class weight (0 where ignored), divided by the
    total weight for "mean" (NaN when every row is ignored, as in PyTorch)."""
    if jnp.issubdtype(target.dtype, jnp.floating):  # probabilities: "mean" divides by the row count
        return jnp.full((n,), 1.0 / n if reduction == "mean" else 1.0, acc)
    keep = target != ignore_index
    coef = keep.astype(acc)
    if weight is not None:
        coef = jnp.where(keep, weight.astype(acc)[jnp.where(keep, target, 0)], 0)
    if reduction == "mean":
        total = coef.sum()
        # (not coef / where(total == 0, nan, total): XLA:CPU folds that to 0 under jit)
        coef = jnp.where(total == 0, jnp.nan, coef / total)
    return coef


def _row_losses(x, w, bias, target, weight, ignore_index: int, acc):
    """Unweighted-by-reduction cross-entropy of each row of one chunk (its logits live only here)."""
    logits = lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=matmul_precision(x.dtype),
                             preferred_element_type=acc)
    if bias is not None:
        logits = logits + bias.astype(acc)
    lse = jax.nn.logsumexp(logits, axis=1)
    if jnp.issubdtype(target.dtype, jnp.floating):
        p = target.astype(acc) if weight is None else target.astype(acc) * weight.astype(acc)
        return lse * p.sum(1) - (p * logits).sum(1)
    picked = jnp.take_along_axis(logits, jnp.where(target == ignore_index, 0, target)[:, None], axis=1)[:, 0]
    return lse - picked


def _pad_rows(a, rows: int):
    return a if a.shape[0] == rows else jnp.pad(a, [(0, rows - a.shape[0])] + [(0, 0)] * (a.ndim - 1))


def _split(a, chunk: int):
    """(N, ...) → (chunks, chunk, ...), zero rows padding the last chunk."""
    count = -(-a.shape[0] // chunk)
    return _pad_rows(a, count * chunk).reshape(count, chunk, *a.shape[1:])


def _check(x, target, reduction: str, label_smoothing: float) -> None:
    if reduction not in ("mean", "sum", "none"):
        raise NotImplementedError(f"linear_cross_entropy does not support reduction={reduction!r}")
    if label_smoothing != 0.0:
        raise NotImplementedError("linear_cross_entropy's chunked path needs label_smoothing == 0")
    if x.ndim != 2:
        raise RuntimeError(f"expected input with dimensionality 2, got {x.ndim}")


# Fewest rows per chunk: each chunk adds a (vocab x hidden) update to the weight's gradient, which
# costs as much memory traffic as the chunk's matmuls when chunks are small (PyTorch's default
# options pick 16 rows for 1024 tokens at vocab 32k: twice the unfused loss's time on XLA:CPU, 64+
# rows: 0.7x). 128 rows (an MXU tile) keeps a chunk's logits at 16 MiB at vocab 32k.
MIN_CHUNK_ROWS = 128


def rows_per_chunk(n: int, batch_chunk_size: int) -> int:
    """The chunk the lowerings use for ``n`` rows when PyTorch asks for ``batch_chunk_size``."""
    return max(1, min(max(int(batch_chunk_size), MIN_CHUNK_ROWS), n))


def chunked_loss_and_grads(x, w, target, bias, weight, reduction: str, ignore_index: int,
                           chunk: int, acc_dtype, grads: tuple[bool, bool, bool]):
    """Reduced loss and (d input, d linear_weight, d linear_bias) by a scan over chunks of ``chunk`` rows."""
    n, acc = x.shape[0], opmath(to_jax_dtype(acc_dtype))
    coef = _split(_row_coefficients(target, weight, n, reduction, ignore_index, acc), chunk)

    def chunk_loss(xc, wc, bc, tc, cc):
        return (cc * _row_losses(xc, wc, bc, tc, weight, ignore_index, acc)).sum()

    def step(carry, part):
        loss, dw, db = carry
        xc, tc, cc = part
        value, pullback = jax.vjp(lambda a, b, c: chunk_loss(a, b, c, tc, cc), xc, w, bias)
        dxc, dwc, dbc = pullback(jnp.ones((), value.dtype))
        dw = dw + dwc.astype(acc) if grads[1] else dw
        db = db + dbc.astype(acc) if grads[2] else db
        return (loss + value, dw, db), (dxc if grads[0] else None)

    zeros_w = jnp.zeros(w.shape if grads[1] else (0,), acc)
    zeros_b = jnp.zeros(w.shape[:1] if grads[2] else (0,), acc)
    (loss, dw, db), dx = lax.scan(step, (jnp.zeros((), acc), zeros_w, zeros_b),
                                  (_split(x, chunk), _split(target, chunk), coef))
    dtype = x.dtype
    dx = dx.reshape(-1, x.shape[1])[:n].astype(dtype) if grads[0] else jnp.zeros((0, 0), dtype)
    dw = dw.astype(dtype) if grads[1] else jnp.zeros((0, 0), dtype)
    db = db.astype(dtype) if grads[2] else jnp.zeros((0,), dtype)
    return loss.astype(dtype), dx, dw, db


def chunked_row_losses(x, w, target, bias, weight, ignore_index: int, chunk: int, acc_dtype):
    """Per-row losses (``reduction="none"``) by a map over chunks of ``chunk`` rows."""
    n, acc = x.shape[0], opmath(to_jax_dtype(acc_dtype))
    coef = _split(_row_coefficients(target, weight, n, "none", ignore_index, acc), chunk)

    def one(part):
        xc, tc, cc = part
        return cc * _row_losses(xc, w, bias, tc, weight, ignore_index, acc)

    losses = lax.map(one, (_split(x, chunk), _split(target, chunk), coef))
    return losses.reshape(-1)[:n].astype(x.dtype)


if _torch_lce is not None:
    import torch

    _chunked_op = torch.ops.torch_nn._linear_cross_entropy_batch_chunked.default
    _no_reduction_op = torch.ops.torch_nn._linear_cross_entropy_batch_chunked_no_reduction.default

    @lowering(_chunked_op, dots=True)
    def linear_cross_entropy_chunked(x, w, target, bias, weight, reduction, ignore_index, label_smoothing,
                                     batch_chunk_size, acc_policy, acc_dtype, allow_retain_graph,
                                     compute_input_grad, compute_linear_weight_grad, compute_linear_bias_grad):
        _check(x, target, reduction, label_smoothing)
        if reduction == "none":
            raise NotImplementedError("linear_cross_entropy does not support reduction='none' in this op")
        grads = (bool(compute_input_grad), bool(compute_linear_weight_grad),
                 bool(compute_linear_bias_grad) and bias is not None)
        return chunked_loss_and_grads(x, w, target, bias, weight, reduction, ignore_index,
                                      rows_per_chunk(x.shape[0], batch_chunk_size), acc_dtype, grads)

    @lowering(_no_reduction_op, dots=True)
    def linear_cross_entropy_chunked_no_reduction(x, w, target, bias, weight, ignore_index, batch_chunk_size,
                                                  acc_policy, acc_dtype):
        _check(x, target, "none", 0.0)
        return chunked_row_losses(x, w, target, bias, weight, ignore_index,
                                  rows_per_chunk(x.shape[0], batch_chunk_size), acc_dtype)

