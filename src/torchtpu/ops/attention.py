"""Scaled-dot-product attention: a blockwise (flash-style) JAX attention and the aten ops it lowers.

``blockwise_attention`` / ``blockwise_attention_backward`` never hold the L×S score matrix: the
forward walks key blocks with an online softmax (per query block) and returns the output and the
row logsumexp; the backward recomputes each block's probabilities from that logsumexp
(FlashAttention-2), so both use O(L·block) memory. Causal attention skips the key blocks above
the diagonal; grouped-query attention reshapes the queries into groups instead of repeating K/V;
dropout draws its mask per block from a key folded with the block's indices, so the backward
draws the same mask. A fully masked query row gives zeros (and a logsumexp of 0).

Lowered here:

- ``_scaled_dot_product_fused_attention_overrideable`` (+ ``_backward``): PyTorch's hook for a
  PrivateUse1 backend's fused attention, what ``F.scaled_dot_product_attention`` on ``tpu`` runs
  unless ``sdpa_kernel`` asks for the math path (``eager/attention.py`` chooses). Its
  ``philox_seed`` output carries the dropout key to the backward.
- ``_scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``): the same attention, no dropout.
- ``_scaled_dot_product_flash_attention`` (+ ``_backward``): CUDA's flash op, which libraries call
  directly for its logsumexp (Diffusers' ``_native_flash`` backend, its ring attention). The same
  attention with CUDA's outputs (``rng_state``/``unused`` zeros shaped as PyTorch's meta function
  returns them, an empty debug mask), no dropout; grouped-query K/V as CUDA's kernel takes them,
  and float32 besides CUDA's fp16/bf16.

fp32 inputs' dots follow ``torch.set_float32_matmul_precision`` (``dots=True``; ``precision.py``);
bf16/fp16 inputs, computed in fp32, keep HIGHEST (the setting is about fp32).

Platform overrides (``platform="gpu"``: cuDNN through ``jax.nn.dot_product_attention``;
``platform="tpu"``: the Pallas flash kernel) are registered when their JAX modules import; they
fall back to the generic lowering for what they do not support. Neither has run on this project's
CPU-only test machines: only their registration is tested.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from torchtpu.ops.dtypes import to_opmath as _up
from torchtpu.ops.precision import matmul_precision
from torchtpu.ops.registry import aten, lowering

# Block sizes, measured (docs/design.md): up to SINGLE_BLOCK keys and queries the attention is one
# block (no loop); beyond, BLOCK_Q × BLOCK_K tiles. Causal fwd+bwd at 1k ran 373 ms in 256-blocks,
# 382 ms in 512-blocks, 551 ms as one block (the tiles skip the blocks above the diagonal); at 4k
# 256-blocks ran 4.5 s, 512-blocks 6.1 s, 1024-blocks 8.3 s.
SINGLE_BLOCK = 256
BLOCK_Q = 256
BLOCK_K = 256

ScoreMod = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def block_sizes(length: int, kv_length: int) -> tuple[int, int]:
    """The (query, key) block sizes the lowerings use for these sequence lengths."""
    if length <= SINGLE_BLOCK and kv_length <= SINGLE_BLOCK:
        return length, kv_length
    return min(BLOCK_Q, length), min(BLOCK_K, kv_length)


def _pad(x, axis: int, size: int, value=0):
    """``x`` padded along ``axis`` to ``size`` with ``value``."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _slice(x, axis: int, start, size: int):
    """``size`` elements of ``x`` along ``axis`` from ``start``, or all of a broadcast (size-1) axis."""
    return x if x.shape[axis] == 1 else lax.dynamic_slice_in_dim(x, start, size, axis)


def _loop(lo, hi, body, init):
    """``fori_loop``, or the body once when the range is statically a single step."""
    if isinstance(lo, int) and isinstance(hi, int) and hi - lo == 1:
        return body(lo, init)
    return lax.fori_loop(lo, hi, body, init)


class _Problem:
    """One attention's static layout: padded lengths, blocks, masks; reads one (i, j) block."""

    def __init__(self, q, k, bias, scale, causal, score_mod, dropout_p, key, block_q, block_k):
        self.length, self.kv_length = q.shape[3], k.shape[2]
        self.bq, self.bk = block_q, block_k
        self.nq, self.nk = -(-self.length // block_q), -(-self.kv_length // block_k)
        self.scale, self.causal, self.score_mod = scale, causal, score_mod
        self.dropout_p, self.key = dropout_p, key
        self.precision = matmul_precision(q.dtype)  # torch's fp32 matmul precision (ops/precision.py)
        self.bias = None if bias is None else _pad(_pad(bias, 3, self.nq * block_q if bias.shape[3] > 1 else 1),
                                                   4, self.nk * block_k if bias.shape[4] > 1 else 1)

    def kv_blocks_for(self, i):
        """How many key blocks query block ``i`` sees (all but those above the causal diagonal)."""
        if not self.causal:
            return self.nk
        seen = ((i + 1) * self.bq + self.bk - 1) // self.bk
        return min(self.nk, seen) if isinstance(i, int) else jnp.minimum(self.nk, seen)

    def first_q_block_for(self, j):
        """The first query block that sees key block ``j``."""
        return (j * self.bk) // self.bq if self.causal else 0

    def scores(self, qi, kj, i, j):
        """The (B, Hk, G, bq, bk) scores of block (i, j), masked with -inf; with the raw scores'
        vjp through ``score_mod`` (None without one)."""
        s = jnp.einsum("bhgqd,bhkd->bhgqk", qi, kj, precision=self.precision)
        q_idx = i * self.bq + lax.broadcasted_iota(jnp.int32, (self.bq, 1), 0)
        k_idx = j * self.bk + lax.broadcasted_iota(jnp.int32, (1, self.bk), 1)
        mod_vjp = None
        if self.score_mod is not None:
            s, mod_vjp = jax.vjp(lambda t: self.score_mod(t, q_idx, k_idx), s)
        if self.bias is not None:
            b = _slice(_slice(self.bias, 3, i * self.bq, self.bq), 4, j * self.bk, self.bk)
            s = jnp.where(b, s, -jnp.inf) if b.dtype == jnp.bool_ else s + _up(b)
        valid = k_idx < self.kv_length if self.nk * self.bk != self.kv_length else None
        if self.causal:
            valid = k_idx <= q_idx if valid is None else valid & (k_idx <= q_idx)
        if valid is not None:
            s = jnp.where(valid, s, -jnp.inf)
        return s, mod_vjp

    def dropout(self, p, i, j):
        """``p`` with block (i, j)'s dropout applied (scaled by 1/(1-p)); the mask is a function of
        the key and the block, so forward and backward draw the same one."""
        if not self.dropout_p:
            return p
        data = jax.random.key_data(jax.random.fold_in(self.key, i * self.nk + j))
        # XLA's own Philox generator: jax.random.bernoulli's threefry took 2.2 s to compile on
        # XLA:CPU, this 0.45 s, for every new shape an eager kernel meets
        _, bits = lax.rng_bit_generator(jnp.concatenate([data, ~data]), p.shape, jnp.uint32,
                                        algorithm=lax.RandomAlgorithm.RNG_PHILOX)
        keep = bits < np.uint32(min(int((1.0 - self.dropout_p) * 2.0 ** 32), 2 ** 32 - 1))
        return jnp.where(keep, p * (1.0 / (1.0 - self.dropout_p)), 0.0)


def _forward_q_block(prob: _Problem, q, k, v, i):
    """Output and logsumexp of query block ``i``: an online softmax over its key blocks."""
    qi = _slice(q, 3, i * prob.bq, prob.bq)
    b, h, g = qi.shape[:3]

    def step(j, carry):
        peak, total, acc = carry
        s, _ = prob.scores(qi, _slice(k, 2, j * prob.bk, prob.bk), i, j)
        new_peak = jnp.maximum(peak, jnp.max(s, axis=-1))
        safe = jnp.where(new_peak == -jnp.inf, 0.0, new_peak)  # an all-masked row so far: exp(-inf) = 0
        p = jnp.exp(s - safe[..., None])
        rescale = jnp.exp(peak - safe)
        total = rescale * total + jnp.sum(p, axis=-1)
        p = prob.dropout(p, i, j)
        vj = _slice(v, 2, j * prob.bk, prob.bk)
        acc = rescale[..., None] * acc + jnp.einsum("bhgqk,bhkd->bhgqd", p, vj, precision=prob.precision)
        return new_peak, total, acc

    init = (jnp.full((b, h, g, prob.bq), -jnp.inf, q.dtype), jnp.zeros((b, h, g, prob.bq), q.dtype),
            jnp.zeros((b, h, g, prob.bq, v.shape[-1]), q.dtype))
    peak, total, acc = _loop(0, prob.kv_blocks_for(i), step, init)
    empty = peak == -jnp.inf
    out = acc / jnp.where(empty, 1.0, total)[..., None]
    lse = jnp.where(empty, 0.0, peak + jnp.log(jnp.where(empty, 1.0, total)))
    return out, lse


def _grouped(q, k):
    """``q`` (B, Hq, L, D) as (B, Hk, G, L, D): each key/value head serves G query heads."""
    b, hq, length, d = q.shape
    hk = k.shape[1]
    if hq % hk:
        raise RuntimeError(f"scaled_dot_product_attention: number of heads in query ({hq}) must be divisible "
                           f"by the number of heads in key/value ({hk})")
    return q.reshape(b, hk, hq // hk, length, d)


def _grouped_bias(bias, q_heads: int, kv_heads: int):
    """An attention mask broadcastable to (B, Hq, L, S) as a 5-d (B, Hk, G, L, S)-broadcastable array."""
    if bias is None:
        return None
    bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    if bias.shape[1] == 1:
        return bias[:, :, None]
    return bias.reshape(bias.shape[0], kv_heads, q_heads // kv_heads, *bias.shape[2:])


def _problem(q, k, bias, scale, causal, score_mod, dropout_p, key, block_q, block_k):
    if q.shape[-1] != k.shape[-1]:
        raise RuntimeError(f"scaled_dot_product_attention: query and key must have the same head size, got "
                           f"{q.shape[-1]} and {k.shape[-1]}")
    bq, bk = block_sizes(q.shape[2], k.shape[2])
    bq, bk = block_q or bq, block_k or bk
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    grouped = _grouped(q, k)
    prob = _Problem(grouped, k, _grouped_bias(bias, q.shape[1], k.shape[1]), scale, causal, score_mod,
                    dropout_p, key, bq, bk)
    return prob, grouped


def blockwise_attention(q, k, v, bias=None, *, scale: float | None = None, causal: bool = False,
                        score_mod: ScoreMod | None = None, dropout_p: float = 0.0, key=None,
                        block_q: int | None = None, block_k: int | None = None):
    """Attention of q (B, Hq, L, D) over k (B, Hk, S, D), v (B, Hk, S, Dv) in blocks; returns
    (output in q's dtype, logsumexp (B, Hq, L) in opmath).

    ``bias``: a boolean mask (True attends) or an additive bias, broadcastable to (B, Hq, L, S).
    ``score_mod(scores, q_idx, k_idx)``: applied to each scaled score block ((B, Hk, G, bq, bk);
    indices (bq, 1) and (1, bk)); -inf masks. ``key``: the dropout key. Block sizes default to
    ``block_sizes``.
    """
    prob, grouped = _problem(q, k, bias, scale, causal, score_mod, dropout_p, key, block_q, block_k)
    qf = _pad(_up(grouped) * prob.scale, 3, prob.nq * prob.bq)
    kf = _pad(_up(k), 2, prob.nk * prob.bk)
    vf = _pad(_up(v), 2, prob.nk * prob.bk)
    if prob.nq == 1:
        out, lse = _forward_q_block(prob, qf, kf, vf, 0)
    else:
        out, lse = lax.map(lambda i: _forward_q_block(prob, qf, kf, vf, i), jnp.arange(prob.nq))
        out = jnp.moveaxis(out, 0, 3).reshape(*out.shape[1:4], -1, out.shape[-1])
        lse = jnp.moveaxis(lse, 0, 3).reshape(*lse.shape[1:4], -1)
    b, hq, length = q.shape[:3]
    out = out[..., :length, :].reshape(b, hq, length, v.shape[-1])
    return out.astype(q.dtype), lse[..., :length].reshape(b, hq, length)


def _reduce_to(x, shape):
    """``x`` summed over the axes where ``shape`` is 1 (the gradient of a broadcast)."""
    axes = tuple(a for a, n in enumerate(shape) if n == 1 and x.shape[a] != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def _backward_kv_block(prob: _Problem, tensors, j, carry):
    """Key block ``j``'s dK and dV; adds its share to the carried dQ (and d(bias))."""
    q, k, v, g, lse, delta = tensors
    kj, vj = _slice(k, 2, j * prob.bk, prob.bk), _slice(v, 2, j * prob.bk, prob.bk)

    def step(i, inner):
        dk, dv, dq, dbias = inner
        qi, gi = _slice(q, 3, i * prob.bq, prob.bq), _slice(g, 3, i * prob.bq, prob.bq)
        s, mod_vjp = prob.scores(qi, kj, i, j)
        p = jnp.exp(s - _slice(lse, 3, i * prob.bq, prob.bq)[..., None])
        dv = dv + jnp.einsum("bhgqk,bhgqd->bhkd", prob.dropout(p, i, j), gi, precision=prob.precision)
        dp = prob.dropout(jnp.einsum("bhgqd,bhkd->bhgqk", gi, vj, precision=prob.precision), i, j)
        ds = p * (dp - _slice(delta, 3, i * prob.bq, prob.bq)[..., None])
        if dbias is not None:
            at = [0, 0, 0, i * prob.bq if dbias.shape[3] > 1 else 0, j * prob.bk if dbias.shape[4] > 1 else 0]
            block = lax.dynamic_slice(dbias, at, [*dbias.shape[:3], min(dbias.shape[3], prob.bq),
                                                  min(dbias.shape[4], prob.bk)])
            dbias = lax.dynamic_update_slice(dbias, block + _reduce_to(ds, block.shape), at)
        if mod_vjp is not None:
            ds, = mod_vjp(ds)
        dk = dk + jnp.einsum("bhgqk,bhgqd->bhkd", ds, qi, precision=prob.precision)
        dqi = jnp.einsum("bhgqk,bhkd->bhgqd", ds, kj, precision=prob.precision) * prob.scale
        dq = lax.dynamic_update_slice_in_dim(dq, _slice(dq, 3, i * prob.bq, prob.bq) + dqi, i * prob.bq, 3)
        return dk, dv, dq, dbias

    dq, dbias = carry
    init = (jnp.zeros(kj.shape, kj.dtype), jnp.zeros(vj.shape, vj.dtype), dq, dbias)
    dk, dv, dq, dbias = _loop(prob.first_q_block_for(j), prob.nq, step, init)
    return (dq, dbias), (dk, dv)


def blockwise_attention_backward(g, q, k, v, out, lse, bias=None, *, scale: float | None = None,
                                 causal: bool = False, score_mod: ScoreMod | None = None, dropout_p: float = 0.0,
                                 key=None, bias_grad: bool = False, block_q: int | None = None,
                                 block_k: int | None = None):
    """Gradients (dq, dk, dv, d(bias) or None) of ``blockwise_attention`` at ``g``, from its output and
    logsumexp; the arguments must be those of the forward call."""
    prob, grouped = _problem(q, k, bias, scale, causal, score_mod, dropout_p, key, block_q, block_k)
    lq, lk = prob.nq * prob.bq, prob.nk * prob.bk
    gg = _up(g).reshape(*grouped.shape[:4], g.shape[-1])
    delta = jnp.sum(gg * _up(out).reshape(gg.shape), axis=-1)  # rowsum(dO ∘ O): softmax's backward term
    tensors = (_pad(_up(grouped) * prob.scale, 3, lq), _pad(_up(k), 2, lk), _pad(_up(v), 2, lk),
               _pad(gg, 3, lq), _pad(_up(lse).reshape(grouped.shape[:4]), 3, lq, jnp.inf), _pad(delta, 3, lq))
    dq = jnp.zeros(tensors[0].shape, tensors[0].dtype)
    dbias = None
    if bias_grad and bias is not None:
        dbias = jnp.zeros(prob.bias.shape, tensors[0].dtype)
    body = lambda j, carry: _backward_kv_block(prob, tensors, j, carry)  # noqa: E731
    if prob.nk == 1:
        (dq, dbias), (dk, dv) = body(0, (dq, dbias))
    else:
        (dq, dbias), (dk, dv) = lax.scan(lambda c, j: body(j, c), (dq, dbias), jnp.arange(prob.nk))
        dk = jnp.moveaxis(dk, 0, 2).reshape(*dk.shape[1:3], -1, dk.shape[-1])
        dv = jnp.moveaxis(dv, 0, 2).reshape(*dv.shape[1:3], -1, dv.shape[-1])
    length, kv_length = q.shape[2], k.shape[2]
    dq = dq[..., :length, :].reshape(q.shape).astype(q.dtype)
    dk, dv = dk[..., :kv_length, :].astype(k.dtype), dv[..., :kv_length, :].astype(v.dtype)
    if dbias is not None:
        dbias = dbias[..., :min(dbias.shape[3], length), :min(dbias.shape[4], kv_length)]
        dbias = dbias.reshape(bias.shape).astype(bias.dtype)
    return dq, dk, dv, dbias


def reference_attention(q, k, v, bias=None, *, scale: float | None = None, causal: bool = False):
    """The materialising attention (the whole L×S score matrix; the lowering before the blockwise
    one), kept as a reference for tests and ``benchmarks/attention.py``: (output, logsumexp)."""
    grouped = _grouped(q, k)
    prob = _Problem(grouped, k, _grouped_bias(bias, q.shape[1], k.shape[1]),
                    1.0 / math.sqrt(q.shape[-1]) if scale is None else scale, causal, None, 0.0, None,
                    q.shape[2], k.shape[2])
    out, lse = _forward_q_block(prob, _up(grouped) * prob.scale, _up(k), _up(v), 0)
    return out.reshape(*q.shape[:3], v.shape[-1]).astype(q.dtype), lse.reshape(q.shape[:3])


# ---------------------------------------------------------------- the aten ops

def _seed(rng_key, dropout_p):
    """The dropout key as the int64 ``philox_seed`` output the backward gets back (0 without dropout)."""
    if not dropout_p:
        return jnp.zeros((), jnp.int64)
    data = jax.random.key_data(rng_key).astype(jnp.uint64)
    return lax.bitcast_convert_type((data[0] << 32) | data[1], jnp.int64)


def _key(philox_seed):
    """The dropout key back from ``_seed``'s int64."""
    bits = lax.bitcast_convert_type(philox_seed, jnp.uint64)
    data = jnp.stack([bits >> 32, bits & 0xFFFFFFFF]).astype(jnp.uint32)
    return jax.random.wrap_key_data(data, impl="threefry2x32")


def _check(query, key, value, name: str):
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise RuntimeError(f"{name}: q, k, v must be 4 dimensional tensors, got {query.ndim}, {key.ndim}, "
                           f"{value.ndim}")


@lowering(aten._scaled_dot_product_fused_attention_overrideable.default, random=True, dots=True)
def fused_attention(rng_key, query, key, value, attn_bias=None, dropout_p=0.0, is_causal=False,
                    return_debug_mask=False, *, scale=None):
    _check(query, key, value, "_scaled_dot_product_fused_attention_overrideable")
    if return_debug_mask:
        raise NotImplementedError("tpu: _scaled_dot_product_fused_attention_overrideable cannot return the "
                                  "dropout mask (return_debug_mask=True)")
    out, lse = blockwise_attention(query, key, value, attn_bias, scale=scale, causal=is_causal,
                                   dropout_p=dropout_p, key=rng_key)
    return (out, lse.astype(jnp.float32), None, None, query.shape[2], key.shape[2], _seed(rng_key, dropout_p),
            jnp.zeros((), jnp.int64), None)


@lowering(aten._scaled_dot_product_fused_attention_overrideable_backward.default, dots=True)
def fused_attention_backward(grad_out, query, key, value, attn_bias, grad_input_mask, out, logsumexp, cum_seq_q,
                             cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *,
                             scale=None):
    return blockwise_attention_backward(grad_out, query, key, value, out, logsumexp, attn_bias, scale=scale,
                                        causal=is_causal, dropout_p=dropout_p,
                                        key=_key(philox_seed) if dropout_p else None,
                                        bias_grad=bool(grad_input_mask[3]))


def _check_flash(query, key, value, dropout_p):
    _check(query, key, value, "_scaled_dot_product_flash_attention_for_cpu")
    if dropout_p != 0:
        raise NotImplementedError("tpu: _scaled_dot_product_flash_attention_for_cpu with dropout_p > 0 is not "
                                  "supported; F.scaled_dot_product_attention runs dropout in its fused op")


@lowering(aten._scaled_dot_product_flash_attention_for_cpu.default, dots=True)
def flash_attention_for_cpu(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    _check_flash(query, key, value, dropout_p)
    out, lse = blockwise_attention(query, key, value, attn_mask, scale=scale, causal=is_causal)
    return out, lse


@lowering(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, dots=True)
def flash_attention_for_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                                     attn_mask=None, scale=None):
    _check_flash(query, key, value, dropout_p)
    return blockwise_attention_backward(grad_out, query, key, value, out, logsumexp, attn_mask, scale=scale,
                                        causal=is_causal)[:3]


def _check_cuda_flash(query, key, value, dropout_p, is_causal, return_debug_mask=False):
    name = "_scaled_dot_product_flash_attention"
    _check(query, key, value, name)
    if is_causal and query.shape[2] != key.shape[2]:
        # CUDA's kernel aligns a non-square causal mask to the bottom right, SDPA to the top left:
        # PyTorch's SDPA refuses this case for flash with the same words
        raise NotImplementedError(f"tpu: {name}: Flash attention does not support the is_causal flag when "
                                  f"seqlen_q != seqlen_k. Got seqlen_q: {query.shape[2]} seqlen_k: {key.shape[2]}")
    if dropout_p != 0:
        raise NotImplementedError(f"tpu: {name} with dropout_p > 0 is not supported; call "
                                  "F.scaled_dot_product_attention, whose fused op on tpu runs dropout")
    if return_debug_mask:
        raise NotImplementedError(f"tpu: {name} cannot return the attention mask (return_debug_mask=True)")


@lowering(aten._scaled_dot_product_flash_attention.default, dots=True)
def flash_attention(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    _check_cuda_flash(query, key, value, dropout_p, is_causal, return_debug_mask)
    out, lse = blockwise_attention(query, key, value, scale=scale, causal=is_causal)
    # rng_state (2,) and unused () as PyTorch's meta function makes them: no dropout, so no seed
    rng_state, unused = jnp.zeros((2,), jnp.uint64), jnp.zeros((), jnp.uint64)
    return (out, lse.astype(jnp.float32), None, None, query.shape[2], key.shape[2], rng_state, unused,
            jnp.zeros((0,), query.dtype))


@lowering(aten._scaled_dot_product_flash_attention_backward.default, dots=True)
def flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                             dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    _check_cuda_flash(query, key, value, dropout_p, is_causal)
    return blockwise_attention_backward(grad_out, query, key, value, out, logsumexp, scale=scale,
                                        causal=is_causal)[:3]


# ---------------------------------------------------------------- platform overrides (untested here)
# Each replaces the generic lowering on its platform for the inputs its kernel takes, and hands
# everything else (dropout, a bias gradient, other dtypes or layouts) to the generic lowering. The
# backwards differentiate the platform's forward (its own fused backward; the forward is recomputed).

def _cudnn_takes(query, key, value, attn_bias, dropout_p) -> bool:
    return (not dropout_p and query.dtype in (jnp.float16, jnp.bfloat16) and query.shape[-1] == value.shape[-1]
            and query.shape[-1] <= 128)


def _cudnn(query, key, value, attn_bias, scale, is_causal):
    """cuDNN's fused attention (JAX's BTNH layout): (output, logsumexp (B, N, T))."""
    bias = mask = None
    if attn_bias is not None:
        full = jnp.broadcast_to(attn_bias, (*query.shape[:3], key.shape[2]))
        bias, mask = (None, full) if attn_bias.dtype == jnp.bool_ else (full, None)
    out, lse = jax.nn.dot_product_attention(
        *(jnp.swapaxes(x, 1, 2) for x in (query, key, value)), bias, mask, scale=scale, is_causal=is_causal,
        implementation="cudnn", return_residual=True)
    return jnp.swapaxes(out, 1, 2), jnp.swapaxes(lse, 1, 2).astype(jnp.float32)


@lowering(aten._scaled_dot_product_fused_attention_overrideable.default, platform="gpu")
def fused_attention_gpu(rng_key, query, key, value, attn_bias=None, dropout_p=0.0, is_causal=False,
                        return_debug_mask=False, *, scale=None):
    if return_debug_mask or not _cudnn_takes(query, key, value, attn_bias, dropout_p):
        return fused_attention(rng_key, query, key, value, attn_bias, dropout_p, is_causal, return_debug_mask,
                               scale=scale)
    out, lse = _cudnn(query, key, value, attn_bias, scale, is_causal)
    zero = jnp.zeros((), jnp.int64)
    return out, lse, None, None, query.shape[2], key.shape[2], zero, zero, None


@lowering(aten._scaled_dot_product_fused_attention_overrideable_backward.default, platform="gpu")
def fused_attention_backward_gpu(grad_out, query, key, value, attn_bias, grad_input_mask, out, logsumexp,
                                 cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed,
                                 philox_offset, *, scale=None):
    if grad_input_mask[3] or not _cudnn_takes(query, key, value, attn_bias, dropout_p):
        return fused_attention_backward(grad_out, query, key, value, attn_bias, grad_input_mask, out, logsumexp,
                                        cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed,
                                        philox_offset, scale=scale)
    _, vjp = jax.vjp(lambda q, k, v: _cudnn(q, k, v, attn_bias, scale, is_causal)[0], query, key, value)
    return (*vjp(grad_out.astype(out.dtype)), None)


try:  # the Pallas TPU kernel ships with jax; a jax without it keeps the generic lowering on TPU
    from jax.experimental.pallas.ops.tpu import flash_attention as _pallas
except ImportError:  # pragma: no cover - depends on the jax build
    _pallas = None


def _pallas_takes(query, key, value, attn_bias, dropout_p) -> bool:
    # the kernel's dots run at the default precision (one bf16 pass on the MXU): fp32 inputs take
    # it only when torch's matmul precision asks for that ("medium")
    fp32_ok = query.dtype == jnp.float32 and matmul_precision(query.dtype) == lax.Precision.DEFAULT
    return (_pallas is not None and not dropout_p and query.shape[1] == key.shape[1]
            and (attn_bias is None or attn_bias.dtype != jnp.bool_) and (query.dtype == jnp.bfloat16 or fp32_ok))


def _pallas_bias(query, key, attn_bias):
    return None if attn_bias is None else jnp.broadcast_to(attn_bias, (*query.shape[:3], key.shape[2]))


if _pallas is not None:
    @lowering(aten._scaled_dot_product_fused_attention_overrideable.default, platform="tpu")
    def fused_attention_tpu(rng_key, query, key, value, attn_bias=None, dropout_p=0.0, is_causal=False,
                            return_debug_mask=False, *, scale=None):
        if return_debug_mask or not _pallas_takes(query, key, value, attn_bias, dropout_p):
            return fused_attention(rng_key, query, key, value, attn_bias, dropout_p, is_causal,
                                   return_debug_mask, scale=scale)
        from torchtpu.runtime.compat import pallas_flash_attention_forward

        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
        blocks = _pallas.BlockSizes.get_default()
        # the kernel's forward with residuals (row sum l and max m): logsumexp = m + log(l)
        out, total, peak = pallas_flash_attention_forward(query, key, value, _pallas_bias(query, key, attn_bias),
                                                          None, True, is_causal, scale, blocks, False)
        lse = (peak + jnp.log(total)).reshape(query.shape[:3]).astype(jnp.float32)
        zero = jnp.zeros((), jnp.int64)
        return out, lse, None, None, query.shape[2], key.shape[2], zero, zero, None

    @lowering(aten._scaled_dot_product_fused_attention_overrideable_backward.default, platform="tpu")
    def fused_attention_backward_tpu(grad_out, query, key, value, attn_bias, grad_input_mask, out, logsumexp,
                                     cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed,
                                     philox_offset, *, scale=None):
        if grad_input_mask[3] or not _pallas_takes(query, key, value, attn_bias, dropout_p):
            return fused_attention_backward(grad_out, query, key, value, attn_bias, grad_input_mask, out,
                                            logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                                            philox_seed, philox_offset, scale=scale)
        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
        bias = _pallas_bias(query, key, attn_bias)
        _, vjp = jax.vjp(lambda q, k, v: _pallas.flash_attention(q, k, v, bias, causal=is_causal, sm_scale=scale),
                         query, key, value)
        return (*vjp(grad_out.astype(out.dtype)), None)
