"""A paged KV cache laid out by slot, and the attention that reads it: plain torch ops, no engine.

vLLM's backend on ``tpu`` (:mod:`torchtpu.integrations.vllm`) is built on these; they import no
serving engine, so they are tested in the default suite.

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

import numpy as np
import torch
import torch.nn.functional as F

from torchtpu.serving.buckets import power_of_two_at_least


def kv_cache_shape(block_size: int, num_kv_heads: int, head_size: int, num_blocks: int,
                   head_size_v: int | None = None) -> tuple[int, int, int]:
    """[(num_blocks + 1) * block_size, num_kv_heads, key size + value size] of one layer's cache.

    Slots, not pages, lead: a step's write is one ``index_copy_`` on the whole tensor (see
    :func:`write_kv`). The extra block is the scratch page that padded tokens are written to.
    """
    return ((num_blocks + 1) * block_size, num_kv_heads, head_size + (head_size_v or head_size))


def block_slots(block_ids: list[int], block_size: int) -> torch.Tensor:
    """The cache slots of ``block_ids`` (host int64), in order: what zeroing fresh blocks writes."""
    return (torch.tensor(block_ids, dtype=torch.long)[:, None] * block_size + torch.arange(block_size)).reshape(-1)


def _whole_buffer(t: torch.Tensor) -> torch.Tensor:
    """The 1-D buffer ``t`` was sliced from, from ``t``'s first element to the storage's end."""
    return t.as_strided((t.untyped_storage().nbytes() // t.element_size() - t.storage_offset(),), (1,))


def compute_slot_mapping(num_tokens: int, max_num_tokens: int, query_start_loc: torch.Tensor,
                         positions: torch.Tensor, block_table: torch.Tensor,
                         block_table_stride: int, slot_mapping: torch.Tensor,
                         KV_CACHE_BLOCK_SIZE: int, TOTAL_CP_WORLD_SIZE: int = 1,  # noqa: N803
                         TOTAL_CP_RANK: int = 0, CP_KV_CACHE_INTERLEAVE_SIZE: int = 1,  # noqa: N803
                         PAD_ID: int = -1, BLOCK_SIZE: int = 1024) -> None:  # noqa: N803
    """slot_mapping[t] = block_table[request of t, pos // block] * block + pos % block; PAD_ID after.

    Every step runs the same program: like the Triton kernel, which reads the runner's buffers
    through pointers, this reads them whole (``positions`` and ``query_start_loc`` are slices of
    the runner's persistent buffers) and writes ``slot_mapping`` up to ``max_num_tokens``. The runner pads
    ``query_start_loc`` past the last request with the token count, so it gives both which
    request a token belongs to and where the real tokens end; slicing to ``num_tokens`` instead
    made one program per token count.
    """
    if TOTAL_CP_WORLD_SIZE != 1:
        raise NotImplementedError("tpu: context parallelism is not supported by torchtpu's vLLM "
                                  "slot mapping (TOTAL_CP_WORLD_SIZE must be 1).")
    ends = _whole_buffer(query_start_loc)[1:].long()
    n = min(max_num_tokens, slot_mapping.shape[0])
    pos = _whole_buffer(positions)[:n].long()
    pos = F.pad(pos, (0, n - pos.shape[0]))  # (the runner's buffer is never shorter; a caller's may be)
    tokens = torch.arange(n, device=positions.device)
    # A token belongs to the request whose [start, end) range holds it: count the ends it passed.
    request = (tokens[:, None] >= ends[None, :]).sum(dim=1)
    real = tokens < ends[-1:]
    flat_index = torch.where(real, request * block_table_stride + torch.div(pos, KV_CACHE_BLOCK_SIZE,
                                                                             rounding_mode="floor"), 0)
    blocks = _whole_buffer(block_table).index_select(0, flat_index).long()
    slot_mapping[:n].copy_(torch.where(real, blocks * KV_CACHE_BLOCK_SIZE + pos % KV_CACHE_BLOCK_SIZE, PAD_ID))


@dataclass
class RequestGroup:
    """Some of a step's requests as one padded grid of query rows (see ``plan_step``)."""

    block_table: torch.Tensor  # [requests, pages read] page ids
    query_rows: torch.Tensor  # [requests * longest query] the token each padded query row holds
    query_positions: torch.Tensor  # [requests, longest query] position of each padded query row
    mask: torch.Tensor  # [requests, 1, longest query, keys read] whether a query row sees a key


@dataclass
class PagedStepPlan:
    """What every layer of one step needs to find its queries' keys (shared across layers)."""

    num_actual_tokens: int
    block_size: int  # tokens per page of the cache
    groups: list[RequestGroup]  # decodes, then the rest (prefills, chunks): each its own grid
    token_rows: torch.Tensor  # [padded tokens] row of the groups' stacked grids holding each token (0: padding)


def plan_step(query_start_loc: np.ndarray, seq_lens: np.ndarray, block_table: torch.Tensor,
              block_size: int, max_seq_len: int, tokens: int, device) -> PagedStepPlan:
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
    return PagedStepPlan(num_actual_tokens=int(query_start_loc[-1]), block_size=block_size,
                                     groups=groups, token_rows=to_device(token_rows))


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


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: PagedStepPlan,
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
