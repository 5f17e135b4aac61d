"""``TpuAttnBackend``: SGLang attention over the paged KV pool, as a few batched torch ops.

SGLang's torch-native backend loops over the requests of a batch, reading each length back to
the host; on an XLA device that is one small program per request and per layer. Here the
whole batch is one padded problem, planned once per forward on the host from the lengths
SGLang already keeps there:

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

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

MIN_KV_BUCKET = 16  # smallest padded key length: short prompts share one program


def bucket(n: int, minimum: int = 1) -> int:
    """The power of two at or above ``n`` (at least ``minimum``): the padded size for ``n``."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


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
    b, q, kv = bucket(n), bucket(max(q_lens)), min(bucket(max(seq_lens), MIN_KV_BUCKET), max_kv)
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


class TpuAttnBackend(AttentionBackend):
    """SGLang attention backend for ``tpu``: batched, padded, made of torch ops."""

    def __init__(self, model_runner):
        super().__init__()
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.forward_metadata: BatchPlan | None = None

    def init_forward_metadata(self, forward_batch):
        """Plan the padded problem of this batch once; every layer reuses it."""
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.forward_metadata = None
            return
        seq_lens = [int(n) for n in forward_batch.seq_lens_cpu.tolist()]
        if mode.is_decode():
            q_lens = [1] * len(seq_lens)
        elif mode.is_extend() or mode.is_mixed():
            q_lens = [int(n) for n in forward_batch.extend_seq_lens_cpu]
        else:
            raise NotImplementedError(f"The tpu attention backend does not support forward mode {mode.name}.")
        req_to_token = self.req_to_token_pool.req_to_token
        rows = req_to_token.index_select(0, forward_batch.req_pool_indices)
        self.forward_metadata = plan_batch(q_lens, seq_lens, rows, req_to_token.shape[1], self.device)

    def _check_layer(self, layer) -> None:
        if layer.is_cross_attention or layer.attn_type == AttentionType.ENCODER_ONLY:
            raise NotImplementedError("The tpu attention backend supports decoder self-attention only.")
        if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
            raise NotImplementedError("The tpu attention backend does not support sliding-window attention yet.")
        if getattr(layer, "logit_cap", 0) and layer.logit_cap > 0:
            raise NotImplementedError("The tpu attention backend does not support attention logit capping yet.")

    def _attend(self, q, k, v, layer, forward_batch, save_kv_cache):
        self._check_layer(layer)
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v)
        query = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        return paged_attention(query, self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                               self.token_to_kv_pool.get_value_buffer(layer.layer_id),
                               self.forward_metadata, layer.scaling)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache)

    def support_triton(self):
        return False
