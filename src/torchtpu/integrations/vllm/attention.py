"""Paged attention for vLLM on ``tpu``, written with plain torch ops (they run through torchtpu's op registry).

Each layer's KV cache is one tensor of slots ``[(num_blocks + 1) * block_size, num_kv_heads,
2 * head_size]`` (keys then values in the last axis; slot ``s`` is offset ``s % block_size`` of
page ``s // block_size``); the extra page is a scratch page that padded tokens (slot -1) are
written to, so a write never needs a host-side filter. A step writes its new keys and values
with one ``index_copy_`` over the slots of the whole tensor (so the eager in-place write donates
the cache and XLA updates it in place), then each request reads its pages with one
``index_select`` over its block-table row. Queries are regrouped per request
(``[requests, longest query, heads, head_size]``; decodes and the other requests in separate
grids) and masked by position, so one computation serves prefill, decode, chunked prefill and
prefix-cache hits alike: a query at position ``p`` sees every cached key at positions ``<= p``
of its own request. The mask is built on the host once per step, and attention is one
``scaled_dot_product_attention`` per grid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import KVCacheLayout


@dataclass
class RequestGroup:
    """Some of a step's requests as one padded grid of query rows (see ``plan_step``)."""

    block_table: torch.Tensor  # [requests, pages read] page ids
    query_rows: torch.Tensor  # [requests * longest query] the token each padded query row holds
    query_positions: torch.Tensor  # [requests, longest query] position of each padded query row
    mask: torch.Tensor  # [requests, 1, longest query, keys read] whether a query row sees a key


@dataclass
class TpuPagedAttentionMetadata:
    """What every layer of one step needs to find its queries' keys (shared across layers)."""

    num_actual_tokens: int
    block_size: int  # tokens per page of the cache
    groups: list[RequestGroup]  # decodes, then the rest (prefills, chunks): each its own grid
    token_rows: torch.Tensor  # [padded tokens] row of the groups' stacked grids holding each token (0: padding)


def power_of_two_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def plan_step(query_start_loc: np.ndarray, seq_lens: np.ndarray, block_table: torch.Tensor,
              block_size: int, max_seq_len: int, tokens: int, device) -> TpuPagedAttentionMetadata:
    """The padded attention problem of one step, planned on the host.

    ``query_start_loc`` and ``seq_lens`` are the host's per-request figures, ``block_table`` the
    requests' rows of page ids (on the device), ``tokens`` the step's padded token count.

    Decodes (one query each) and the other requests (prefills, chunks) form two grids, so a
    long prompt in the step does not widen every decode to its length (32 decodes next to a
    256-token chunk would be a [32, 256] grid of queries, 256 times the work). Each grid's
    requests, query width and pages read are rounded up to powers of two, and the tokens are
    the step's padded count, which bounds the eager programs a server builds. Padded requests
    read the page ids of row 0 and see one key; padded rows are discarded.
    """
    del max_seq_len  # each grid reads as many pages as its own longest request needs
    query_lens = np.diff(query_start_loc)
    to_device = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    token_rows = np.zeros(tokens, dtype=np.int64)
    groups, base = [], 0
    for members in (np.flatnonzero(query_lens == 1), np.flatnonzero(query_lens != 1)):
        if not len(members):
            continue
        lens, seqs, starts = query_lens[members], seq_lens[members], query_start_loc[members]
        requests, width = power_of_two_at_least(len(members)), power_of_two_at_least(int(lens.max()))
        pages = min(power_of_two_at_least(-(-int(seqs.max()) // block_size)), block_table.shape[1])
        offsets = np.arange(width)
        # Rows past a request's length repeat its first token: valid data, discarded afterwards.
        rows = np.zeros((requests, width), dtype=np.int64)
        rows[: len(members)] = starts[:, None] + np.where(offsets[None, :] < lens[:, None], offsets[None, :], 0)
        for j, (start, n) in enumerate(zip(starts, lens)):
            token_rows[start: start + n] = base + j * width + np.arange(n)
        positions = np.zeros((requests, width), dtype=np.int64)
        positions[: len(members)] = (seqs - lens)[:, None] + offsets[None, :]
        visible_len = np.pad(seqs, (0, requests - len(members)), constant_values=1)
        # Causal within the request, nothing past its length; a padded request sees key 0 only.
        key_pos = np.arange(pages * block_size)
        mask = (key_pos[None, None, :] <= positions[:, :, None]) & (key_pos[None, None, :] < visible_len[:, None, None])
        table_rows = to_device(np.pad(members, (0, requests - len(members))).astype(np.int64))
        groups.append(RequestGroup(block_table=block_table[:, :pages].index_select(0, table_rows),
                                   query_rows=to_device(rows.reshape(-1)), query_positions=to_device(positions),
                                   mask=to_device(mask[:, None])))
        base += requests * width
    return TpuPagedAttentionMetadata(num_actual_tokens=int(query_start_loc[-1]), block_size=block_size,
                                     groups=groups, token_rows=to_device(token_rows))


class TpuPagedAttentionMetadataBuilder(AttentionMetadataBuilder[TpuPagedAttentionMetadata]):
    """Builds :class:`TpuPagedAttentionMetadata` once per step from vLLM's common metadata."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        self.speculative = vllm_config.speculative_config is not None

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TpuPagedAttentionMetadata:
        m = common_attn_metadata
        # The host's sequence lengths are exact unless drafts are speculated (then read the device's).
        exact_on_host = m.seq_lens_cpu_upper_bound is not None and not self.speculative
        seq_lens = (m.seq_lens_cpu_upper_bound if exact_on_host else m.seq_lens.cpu())[: m.num_reqs]
        return plan_step(m.query_start_loc_cpu.numpy()[: m.num_reqs + 1], seq_lens.numpy().astype(np.int64),
                         m.block_table_tensor, self.block_size, m.max_seq_len,
                         max(m.slot_mapping.shape[0], m.num_actual_tokens), self.device)


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store each token's key and value at its slot; padded tokens (slot < 0) go to the scratch page."""
    n = min(key.shape[0], slot_mapping.shape[0])
    slots = slot_mapping[:n].long()
    slots = torch.where(slots < 0, torch.full_like(slots, kv_cache.shape[0] - 1), slots)
    # index_copy_ on the whole cache: the eager in-place op donates the cache's buffer, so a write
    # costs its tokens (index_put_ over (page, offset) copied the whole cache: 45 ms per 64 MiB
    # layer on XLA:CPU, benchmarks/vllm_kv_write.py).
    kv_cache.index_copy_(0, slots, torch.cat([key[:n], value[:n]], dim=-1).to(kv_cache.dtype))


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: TpuPagedAttentionMetadata,
                    scale: float, head_size: int, sliding_window: int | None,
                    soft_cap: float | None) -> torch.Tensor:
    """Causal attention of packed queries [tokens, heads, d] over their requests' cached keys."""
    outs = [_attend_group(query, kv_cache, group, meta.block_size, scale, head_size, sliding_window, soft_cap)
            for group in meta.groups]
    return (torch.cat(outs) if len(outs) > 1 else outs[0]).index_select(0, meta.token_rows)


def _attend_group(query, kv_cache, group: RequestGroup, block_size: int, scale: float, head_size: int,
                  sliding_window: int | None, soft_cap: float | None) -> torch.Tensor:
    """One grid's attention, [requests * width, heads, d_v]."""
    requests, pages = group.block_table.shape
    kv_heads = kv_cache.shape[1]
    heads, width = query.shape[1], group.query_positions.shape[1]
    q = query.index_select(0, group.query_rows).view(requests, width, heads, head_size)
    paged = kv_cache.view(-1, block_size, kv_heads, kv_cache.shape[-1])
    kv = paged.index_select(0, group.block_table.reshape(-1).long())
    kv = kv.view(requests, pages * block_size, kv_heads, -1)
    k, v = kv[..., :head_size], kv[..., head_size:]
    visible = group.mask  # [requests, 1, width, keys], built on the host once per step
    if sliding_window is not None:
        key_pos = torch.arange(pages * block_size, device=query.device)
        visible = visible & (key_pos[None, None, :] > group.query_positions[:, :, None] - sliding_window)[:, None]
    if not soft_cap:  # one fused attention op: no transposed copies, no score tensor in between
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=visible, scale=scale, enable_gqa=heads != kv_heads)
    else:
        if heads != kv_heads:  # grouped-query attention: each kv head serves heads // kv_heads queries
            k = k.repeat_interleave(heads // kv_heads, dim=2)
            v = v.repeat_interleave(heads // kv_heads, dim=2)
        scores = torch.matmul(q.transpose(1, 2), k.permute(0, 2, 3, 1)).float() * scale
        scores = soft_cap * torch.tanh(scores / soft_cap)
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out = torch.matmul(probs, v.transpose(1, 2))  # [requests, heads, width, d_v]
    return out.transpose(1, 2).reshape(requests * width, heads, -1)


class TpuPagedAttentionImpl(AttentionImpl[TpuPagedAttentionMetadata]):
    """Decoder self-attention over the paged cache (multi-head and grouped-query)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks=None, **kwargs) -> None:
        if alibi_slopes is not None or sinks is not None:
            raise NotImplementedError("tpu: ALiBi and attention sinks are not supported by "
                                      "torchtpu's vLLM attention backend yet.")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"tpu: attention type {attn_type} is not supported by "
                                      "torchtpu's vLLM attention backend (decoder only).")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.kv_sharing_target_layer_name is None:
            write_kv(kv_cache, key, value, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("tpu: fused output quantization is not supported by "
                                      "torchtpu's vLLM attention backend.")
        if attn_metadata is None:  # profiling run: no cache bound yet
            return output.fill_(0)
        rows = attn_metadata.token_rows.shape[0]
        if rows == query.shape[0] == output.shape[0]:  # the step's padded tokens: whole tensors
            out = paged_attention(query, kv_cache, attn_metadata, self.scale, self.head_size,
                                  self.sliding_window, self.logits_soft_cap)
            output.copy_(out.reshape(output.shape))
            return output
        out = paged_attention(query[:rows], kv_cache, attn_metadata, self.scale, self.head_size,
                              self.sliding_window, self.logits_soft_cap)
        output[:rows].copy_(out.reshape(output[:rows].shape))
        return output


class TpuPagedAttentionBackend(AttentionBackend):
    """vLLM attention backend: paged KV cache in tpu memory, read and written with torch ops."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16"]
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[TpuPagedAttentionImpl]:
        return TpuPagedAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TpuPagedAttentionMetadataBuilder]:
        return TpuPagedAttentionMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBNHC,)  # each layer's tensor is [blocks x tokens, heads, k|v]
