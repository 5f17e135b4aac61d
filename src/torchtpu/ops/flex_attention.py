"""flex_attention as blockwise JAX: an online softmax over the key/value blocks a BlockMask lists.

``score_mod(score, b, h, q_idx, kv_idx, *buffers)`` and ``mask_mod(b, h, q_idx, kv_idx, *buffers)``
are JAX functions of one element; they are vectorised with ``jax.vmap`` over (b, h, q, kv), as
PyTorch's math implementation vectorises them with ``torch.vmap``.

For each block of ``q_block`` query rows only the key/value blocks listed for it are computed: the
BlockMask's partial blocks (``kv_num_blocks``/``kv_indices``, ``mask_mod`` applied) then its full
blocks (``full_kv_num_blocks``/``full_kv_indices``, no mask). Masked-out blocks cost nothing, and
memory is O(L * block) rather than O(L²): the (q_block x kv_block) scores of one block are the
largest temporary. The backward recomputes each block's probabilities from the forward's
log-sum-exp (flash-attention style); the gradient through ``score_mod`` (to the scores and to
floating captured buffers) is ``jax.vjp`` of it, block by block.

Scores, softmax and accumulation run in float32 (float64 for float64 inputs), PyTorch's working
precision; ``lse`` and ``max_scores`` are natural-log values (PyTorch's HOP works in log2: the
caller converts). fp32 inputs' dots follow ``torch.set_float32_matmul_precision``
(``precision.matmul_precision``: callers pin the setting while they trace); others keep HIGHEST.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from torchtpu.ops.precision import matmul_precision

DENSE_TILE = 128  # tile of a call without a BlockMask (PyTorch's default block size)


class Blocks(NamedTuple):
    """A BlockMask's sparsity: block sizes (static) and its block lists (arrays or None)."""

    q_block: int
    kv_block: int
    kv_num_blocks: jax.Array | None  # (Bm, Hm, NQ): partial blocks per query block
    kv_indices: jax.Array | None  # (Bm, Hm, NQ, NK): their key/value block numbers
    full_kv_num_blocks: jax.Array | None = None
    full_kv_indices: jax.Array | None = None


def dense_blocks(q_len: int, kv_len: int) -> Blocks:
    """Every key/value block for every query block (a call without a BlockMask)."""
    qb, kb = min(DENSE_TILE, q_len), min(DENSE_TILE, kv_len)
    nq, nk = -(-q_len // qb), -(-kv_len // kb)
    counts = jnp.full((1, 1, nq), nk, jnp.int32)
    indices = jnp.broadcast_to(jnp.arange(nk, dtype=jnp.int32), (1, 1, nq, nk))
    return Blocks(qb, kb, counts, indices)


def _vmap_elements(fn: Callable, with_score: bool, n_buffers: int) -> Callable:
    """``fn`` of one element → of (B, H, QB, KB): b (B,), h (H,), q_idx (QB,), kv_idx (B, H, KB)."""
    lead, rest = (0,) * with_score, (None,) * n_buffers
    fn = jax.vmap(fn, in_axes=(*lead, None, None, None, 0, *rest))  # kv
    fn = jax.vmap(fn, in_axes=(*lead, None, None, 0, None, *rest))  # q
    fn = jax.vmap(fn, in_axes=(*lead, None, 0, None, 0, *rest))  # h
    return jax.vmap(fn, in_axes=(*lead, 0, None, None, 0, *rest))  # b


class _Problem:
    """One call's padded, blocked operands and the vectorised modifiers (shared by both passes)."""

    def __init__(self, q, k, v, score_mod, mask_mod, blocks: Blocks, scale, score_buffers, mask_buffers):
        self.B, self.H, self.Lq, _ = q.shape
        self.Bk, self.Hk, self.Lk, _ = k.shape
        if self.H % self.Hk or self.Bk not in (1, self.B):
            raise ValueError(f"flex_attention: key/value heads {self.Hk} (batch {self.Bk}) do not "
                             f"broadcast to query heads {self.H} (batch {self.B})")
        self.work = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
        self.precision = matmul_precision(q.dtype)  # torch's fp32 matmul precision (ops/precision.py)
        self.QB, self.KB, self.scale = blocks.q_block, blocks.kv_block, scale
        self.NQ = -(-self.Lq // self.QB)
        nk = max(-(-self.Lk // self.KB), blocks.kv_indices.shape[-1])
        self.NK = nk
        self.q = _pad(q.astype(self.work), 2, self.NQ * self.QB)
        self.k_blocks = _blocked(k.astype(self.work), nk, self.KB)
        self.v_blocks = _blocked(v.astype(self.work), nk, self.KB)
        self.b = jnp.arange(self.B, dtype=jnp.int32)
        self.h = jnp.arange(self.H, dtype=jnp.int32)
        # which key/value (batch, head) each query (batch, head) reads: GQA groups and Bkv == 1
        self.kb_sel = (self.b if self.Bk == self.B else jnp.zeros_like(self.b))[:, None]
        self.kh_sel = (self.h // (self.H // self.Hk))[None, :]
        self.score = _vmap_elements(score_mod, True, len(score_buffers))
        self.mask = _vmap_elements(mask_mod, False, len(mask_buffers))
        self.score_buffers, self.mask_buffers = tuple(score_buffers), tuple(mask_buffers)
        self.lists = [(self._per_query_block(blocks.kv_num_blocks, blocks.kv_indices), True)]
        if blocks.full_kv_num_blocks is not None:
            self.lists.append((self._per_query_block(blocks.full_kv_num_blocks, blocks.full_kv_indices), False))

    def _per_query_block(self, counts, indices):
        """(counts (NQ, B, H), indices (NQ, B, H, NK)) broadcast over the BlockMask's batch/heads."""
        counts = jnp.broadcast_to(counts[:, :, :self.NQ], (self.B, self.H, self.NQ)).astype(jnp.int32)
        indices = indices[:, :, :self.NQ]
        indices = jnp.broadcast_to(indices, (self.B, self.H, self.NQ, indices.shape[-1])).astype(jnp.int32)
        return jnp.moveaxis(counts, 2, 0), jnp.moveaxis(indices, 2, 0)

    def query_rows(self, x, i):
        """Rows ``[i*QB, (i+1)*QB)`` of a padded (B, H, NQ*QB, ...) array."""
        return lax.dynamic_slice_in_dim(x, i * self.QB, self.QB, axis=2)

    def block(self, qb, i, kv_block, valid, masked: bool, score_buffers):
        """One block's modified scores, keep-mask and key/value rows; ``kv_block``: (B, H)."""
        kv_block = jnp.clip(kv_block, 0, self.NK - 1)
        k = self.k_blocks[self.kb_sel, self.kh_sel, kv_block]
        v = self.v_blocks[self.kb_sel, self.kh_sel, kv_block]
        q_idx = i * self.QB + jnp.arange(self.QB, dtype=jnp.int32)
        kv_idx = kv_block[..., None] * self.KB + jnp.arange(self.KB, dtype=jnp.int32)
        keep = valid[:, :, None, None] & (kv_idx < self.Lk)[:, :, None, :] & (q_idx < self.Lq)[:, None]
        if masked:
            keep = keep & self.mask(self.b, self.h, q_idx, kv_idx, *self.mask_buffers).astype(bool)

        def modified(raw, *buffers):
            return self.score(raw, self.b, self.h, q_idx, kv_idx, *buffers).astype(self.work)

        raw = jnp.einsum("bhqe,bhke->bhqk", qb, k, precision=self.precision) * self.scale
        return raw, modified, keep, k, v, kv_block


def _pad(x, axis: int, size: int):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def _blocked(x, n_blocks: int, block: int):
    """(B, H, L, E) → (B, H, n_blocks, block, E), zero-padded."""
    b, h, _, e = x.shape
    return _pad(x, 2, n_blocks * block).reshape(b, h, n_blocks, block, e)


def _each_block(p: _Problem, i, step, carry):
    """Run ``step(carry, kv_block (B, H), valid (B, H), masked)`` over query block ``i``'s lists."""
    for (counts, indices), masked in p.lists:
        count, index = counts[i], indices[i]

        def body(j, c, count=count, index=index, masked=masked):
            return step(c, index[:, :, j], j < count, masked)

        carry = lax.fori_loop(0, jnp.max(count), body, carry)
    return carry


def forward(q, k, v, score_mod, mask_mod, blocks: Blocks, scale: float, score_buffers=(), mask_buffers=()):
    """Attention output (q's dtype), log-sum-exp and row maximum (float32, natural log)."""
    p = _Problem(q, k, v, score_mod, mask_mod, blocks, scale, score_buffers, mask_buffers)
    ev = v.shape[-1]

    def query_block(i):
        qb = p.query_rows(p.q, i)

        def step(carry, kv_block, valid, masked):
            m, l, acc = carry
            raw, modified, keep, _, vb, _ = p.block(qb, i, kv_block, valid, masked, p.score_buffers)
            s = jnp.where(keep, modified(raw, *p.score_buffers), -jnp.inf)
            m_new = jnp.maximum(m, s.max(-1))
            m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # a row with nothing kept yet
            e = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            acc = acc * alpha[..., None] + jnp.einsum("bhqk,bhke->bhqe", e, vb, precision=p.precision)
            return m_new, l * alpha + e.sum(-1), acc

        shape = (p.B, p.H, p.QB)
        init = (jnp.full(shape, -jnp.inf, p.work), jnp.zeros(shape, p.work), jnp.zeros((*shape, ev), p.work))
        m, l, acc = _each_block(p, i, step, init)
        out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)  # no key kept: 0
        lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
        return out, lse, m

    out, lse, m = lax.map(query_block, jnp.arange(p.NQ))
    rows = lambda x: jnp.moveaxis(x, 0, 2).reshape(p.B, p.H, p.NQ * p.QB, *x.shape[4:])[:, :, :p.Lq]  # noqa: E731
    return rows(out).astype(q.dtype), rows(lse).astype(jnp.float32), rows(m).astype(jnp.float32)


def backward(q, k, v, out, lse, grad_out, grad_lse, score_mod, mask_mod, blocks: Blocks, scale: float,
             score_buffers=(), mask_buffers=(), buffer_grads: tuple[bool, ...] = ()):
    """Gradients (dq, dk, dv, grads of the score buffers marked in ``buffer_grads``, else None) of
    ``forward``'s output and natural-log ``lse`` given their cotangents (``grad_lse`` may be None)."""
    p = _Problem(q, k, v, score_mod, mask_mod, blocks, scale, score_buffers, mask_buffers)
    rows = p.NQ * p.QB
    do = _pad(grad_out.astype(p.work), 2, rows)
    delta = _pad(jnp.sum(out.astype(p.work) * grad_out.astype(p.work), -1), 2, rows)
    lse = _pad(lse.astype(p.work), 2, rows)
    dlse = jnp.zeros_like(lse) if grad_lse is None else _pad(grad_lse.astype(p.work), 2, rows)
    wanted = [i for i, (b, want) in enumerate(zip(score_buffers, buffer_grads))
              if want and jnp.issubdtype(b.dtype, jnp.inexact)]

    def with_grads(grads):
        buffers = list(p.score_buffers)
        for i, g in zip(wanted, grads):
            buffers[i] = g
        return buffers

    def query_block(carry, i):
        qb, dob = p.query_rows(p.q, i), p.query_rows(do, i)
        lse_b, delta_b, dlse_b = (p.query_rows(x[..., None], i)[..., 0] for x in (lse, delta, dlse))

        def step(c, kv_block, valid, masked):
            dq, dk, dv, dbuf = c
            raw, modified, keep, kb, vb, kv_block = p.block(qb, i, kv_block, valid, masked, p.score_buffers)
            s, vjp = jax.vjp(lambda r, *g: modified(r, *with_grads(g)), raw, *[p.score_buffers[j] for j in wanted])
            prob = jnp.where(keep, jnp.exp(s - lse_b[..., None]), 0.0)
            dp = jnp.einsum("bhqe,bhke->bhqk", dob, vb, precision=p.precision)
            ds = prob * (dp - delta_b[..., None] + dlse_b[..., None])
            draw, *dg = vjp(ds)
            draw = jnp.where(keep, draw, 0.0) * p.scale
            dq = dq + jnp.einsum("bhqk,bhke->bhqe", draw, kb, precision=p.precision)
            at = (p.b[:, None], p.h[None, :], kv_block)
            dk = dk.at[at].add(jnp.einsum("bhqk,bhqe->bhke", draw, qb, precision=p.precision))
            dv = dv.at[at].add(jnp.einsum("bhqk,bhqe->bhke", prob, dob, precision=p.precision))
            return dq, dk, dv, tuple(a + g.astype(a.dtype) for a, g in zip(dbuf, dg))

        dk, dv, dbuf = carry
        dq, dk, dv, dbuf = _each_block(p, i, step, (jnp.zeros_like(qb), dk, dv, dbuf))
        return (dk, dv, dbuf), dq

    blocks_shape = (p.B, p.H, p.NK, p.KB)
    init = (jnp.zeros((*blocks_shape, k.shape[-1]), p.work), jnp.zeros((*blocks_shape, v.shape[-1]), p.work),
            tuple(jnp.zeros(p.score_buffers[j].shape, p.work) for j in wanted))
    (dk, dv, dbuf), dq = lax.scan(query_block, init, jnp.arange(p.NQ))
    dq = jnp.moveaxis(dq, 0, 2).reshape(p.B, p.H, rows, -1)[:, :, :p.Lq]
    dk, dv = (_to_kv_heads(x, p, like) for x, like in ((dk, k), (dv, v)))
    grads: list = [None] * len(score_buffers)
    for j, g in zip(wanted, dbuf):
        grads[j] = g.astype(score_buffers[j].dtype)
    return dq.astype(q.dtype), dk, dv, tuple(grads)


def _to_kv_heads(x, p: _Problem, like):
    """Per-query-head block gradients (B, H, NK, KB, E) → ``like``'s (Bkv, Hkv, Lk, E)."""
    x = x.reshape(p.B, p.Hk, p.H // p.Hk, p.NK * p.KB, -1)[:, :, :, :p.Lk].sum(2)
    if p.Bk != p.B:
        x = x.sum(0, keepdims=True)
    return x.astype(like.dtype)
