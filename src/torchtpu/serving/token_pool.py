"""Attention over a token-slot KV pool, as a few batched torch ops, with no engine.

SGLang's backend on ``tpu`` (:mod:`torchtpu.integrations.sglang`) is built on these; they import
no serving engine, so they are tested in the default suite.

A pool keeps each layer's keys and values by slot (``[slots, kv_heads, dim]``), a request's
slots listed in its ``req_to_token`` row. SGLang's torch-native backend loops over the requests
of a batch, reading each length back to the host; on an XLA device that is one small program
per request and per layer. Here the whole batch is one padded problem, planned once per forward
on the host from the lengths the scheduler already keeps there:

- queries ``[tokens, heads, dim]`` are gathered into ``[batch, q_len, heads, dim]``;
- each request's keys and values are gathered from the pool through its ``req_to_token`` row
  (``index_select`` on the paged buffers), ``[batch, kv_len, kv_heads, dim]``;
- one ``scaled_dot_product_attention`` with a mask saying which slot each query may see
  (causal within the request, none past its length), GQA through ``enable_gqa``;
- the padded output is gathered back to ``[tokens, heads * dim]``.

Prefill, decode (q_len 1), chunked prefill and prefix-cache hits (a prefix already in the
pool: queries start at ``prefix_len``) and mixed batches are the same computation with
different lengths. Batch, query and key lengths are rounded up to powers of two, so a server
sees a bounded set of shapes (programs), not one per length.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from torchtpu.serving.buckets import power_of_two_at_least

MIN_KV_BUCKET = 16  # smallest padded key length: short prompts share one program


@dataclass
class BatchPlan:
    """Where each query and key of a forward batch sits in the padded problem (tpu tensors)."""

    query_rows: torch.Tensor  # [B*Q] row of the flat query for each padded query (0 for padding)
    output_rows: torch.Tensor  # [tokens] padded row of each real query
    kv_slots: torch.Tensor  # [B*L] pool slot of each padded key
    mask: torch.Tensor  # [B, 1, Q, L] True where a query may attend to a key
    shape: tuple[int, int, int]  # (B, Q, L) after padding


def plan_batch(q_lens: list[int], seq_lens: list[int], req_rows: torch.Tensor,
               max_kv: int, device: torch.device) -> BatchPlan:
    """The gather indices and mask for requests with these query and total lengths.

    ``req_rows`` holds each request's ``req_to_token`` row (pool slots in order); the last
    ``q_len`` tokens of a request are its queries, the first ``seq_len - q_len`` its cached prefix.
    """
    n = len(q_lens)
    b, q, kv = power_of_two_at_least(n), power_of_two_at_least(max(q_lens)), min(power_of_two_at_least(max(seq_lens), MIN_KV_BUCKET), max_kv)
    q_lens_np, seq_np = np.asarray(q_lens), np.asarray(seq_lens)
    starts = np.concatenate([[0], np.cumsum(q_lens_np)[:-1]])
    offsets = np.arange(q)
    real = offsets[None, :] < q_lens_np[:, None]  # [n, q]
    query_rows = np.zeros((b, q), dtype=np.int64)
    query_rows[:n] = np.where(real, starts[:, None] + offsets[None, :], 0)
    output_rows = (np.arange(n)[:, None] * q + offsets[None, :])[real]
    # Position of each padded query in its sequence; padding rows see key 0 only (no NaN rows).
    q_pos = np.zeros((b, q), dtype=np.int64)
    q_pos[:n] = (seq_np - q_lens_np)[:, None] + offsets[None, :]
    kv_len = np.ones(b, dtype=np.int64)
    kv_len[:n] = seq_np
    key_pos = np.arange(kv)
    mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (key_pos[None, None, :] < kv_len[:, None, None])

    slots = torch.zeros((b, kv), dtype=req_rows.dtype, device=device)
    slots[:n] = req_rows[:, :kv]
    to_device = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    return BatchPlan(to_device(query_rows.reshape(-1)), to_device(output_rows),
                     slots.reshape(-1), to_device(mask[:, None]), (b, q, kv))


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: BatchPlan,
                    scale: float) -> torch.Tensor:
    """Attention of flat queries ``[tokens, heads, dim]`` over the pool; ``[tokens, heads * v_dim]``."""
    b, qn, kv = plan.shape
    heads, kv_heads = q.shape[1], k_pool.shape[1]
    query = q.index_select(0, plan.query_rows).view(b, qn, heads, -1).transpose(1, 2)
    key = k_pool.index_select(0, plan.kv_slots).view(b, kv, kv_heads, -1).transpose(1, 2)
    value = v_pool.index_select(0, plan.kv_slots).view(b, kv, kv_heads, -1).transpose(1, 2)
    if key.dtype != query.dtype:  # a pool kept in another dtype than the model's activations
        key, value = key.to(query.dtype), value.to(query.dtype)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=plan.mask, scale=scale,
                                         enable_gqa=heads != kv_heads)
    out = out.transpose(1, 2).reshape(b * qn, -1)
    return out.index_select(0, plan.output_rows)


PAD_SEQ_LEN = 1  # a padded request attends to one key (slot 0): no empty softmax rows


def pad_decode_batch(batch, size: int):
    """A shallow copy of a decode batch (SGLang's ``ForwardBatch``, or any object with its fields)
    with ``size`` requests, the extra ones padding: they point at the reserved request row 0 and KV
    slot 0 and see one key."""
    if size < batch.batch_size:
        raise ValueError(f"pad_decode_batch: size {size} is smaller than the batch ({batch.batch_size} requests)")
    extra = size - batch.batch_size
    padded = copy.copy(batch)
    padded.batch_size = size
    for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices"):
        setattr(padded, name, F.pad(getattr(batch, name), (0, extra)))
    padded.seq_lens = F.pad(batch.seq_lens, (0, extra), value=PAD_SEQ_LEN)
    padded.seq_lens_cpu = F.pad(batch.seq_lens_cpu, (0, extra), value=PAD_SEQ_LEN)
    padded.seq_lens_sum = batch.seq_lens_sum + extra * PAD_SEQ_LEN
    return padded
