"""What the serving engines compute on ``tpu``, without an engine (:mod:`torchtpu.serving`):
padded sizes, vLLM's slot-major paged KV cache (slot mapping, writes, the step plan, attention)
and SGLang's token-slot pool attention and decode padding, each against plain per-request
attention on the CPU. The engines' own tests (``test_vllm.py``, ``test_sglang.py``) need their
environments; these run in the default suite."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from torchtpu.serving import paged_kv, token_pool
from torchtpu.serving.buckets import padded_size, power_of_two_at_least, token_buckets

# ---------------------------------------------------------------- padded sizes


def test_token_buckets_are_bounded_and_cover_every_count():
    buckets = token_buckets(8192)
    assert buckets[:5] == [1, 2, 4, 8, 16] and buckets[-1] == 8192
    assert len(buckets) < 100  # programs per piece of the forward, whatever the traffic
    assert all(b - a <= 256 for a, b in zip(buckets, buckets[1:]))
    assert token_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert [power_of_two_at_least(n) for n in (1, 2, 3, 16, 17)] == [1, 2, 4, 16, 32]  # attention's


def test_padded_size_picks_the_smallest_bucket_that_holds_the_count():
    sizes = token_buckets(100)
    assert [padded_size(sizes, n) for n in (1, 3, 8, 9, 99, 100)] == [1, 4, 8, 16, 100, 100]
    with pytest.raises(ValueError, match="larger than the largest padded size 100"):
        padded_size(sizes, 101)
    with pytest.raises(ValueError, match="at least 1"):
        token_buckets(0)
    assert power_of_two_at_least(3, minimum=16) == 16


# ---------------------------------------------------------------- vLLM's paged cache

def test_slot_mapping_matches_python_reference():
    gen = torch.Generator().manual_seed(0)
    block, stride = 4, 6
    table = torch.randperm(40, generator=gen)[:3 * stride].view(3, stride).int()
    q_lens, ctx = [5, 1, 7], [0, 9, 3]  # a prefill, a decode, a chunk after a cached context
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    positions = torch.cat([torch.arange(c, c + q) for c, q in zip(ctx, q_lens)])
    n, padded = int(qsl[-1]), int(qsl[-1]) + 3
    out = torch.full((padded + 2,), 7, dtype=torch.int64)
    expect = [int(table[r, p // block]) * block + p % block
              for r, (c, q) in enumerate(zip(ctx, q_lens)) for p in range(c, c + q)]
    slots = out.to("tpu")
    paged_kv.compute_slot_mapping(n, padded, qsl.to("tpu"), positions.to("tpu"), table.to("tpu"), stride,
                         slots, block)
    assert slots.cpu().tolist() == expect + [-1] * 3 + [7, 7]


def test_slot_mapping_is_one_program_for_every_token_count():
    """The runner passes slices of its persistent buffers; every step reuses one program."""
    from torchtpu import metrics

    def programs_built():
        built = metrics.snapshot()["eager_compiles"]
        return built["compilations"] + built["persistent_hits"]

    block, stride, max_tokens = 4, 8, 32
    table = torch.arange(4 * stride, dtype=torch.int32).view(4, stride).to("tpu")
    qsl_buffer, pos_buffer = torch.zeros(5, dtype=torch.int32), torch.zeros(max_tokens, dtype=torch.int64)
    slots = torch.zeros(max_tokens, dtype=torch.int64, device="tpu")
    built = []
    for q_lens in ([3], [5, 1], [2, 2, 9], [1, 1, 1, 1], [7, 4]):
        n = sum(q_lens)
        qsl_buffer[: len(q_lens) + 1] = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]))
        qsl_buffer[len(q_lens) + 1:] = n  # as vLLM's runner pads it
        pos_buffer[:n] = torch.cat([torch.arange(q) for q in q_lens])
        qsl, pos = qsl_buffer.to("tpu"), pos_buffer.to("tpu")
        paged_kv.compute_slot_mapping(n, max_tokens, qsl[: len(q_lens) + 1], pos[:n], table, stride, slots, block)
        expect = [int(table[r, p // block]) * block + p % block for r, q in enumerate(q_lens) for p in range(q)]
        assert slots.cpu().tolist() == expect + [-1] * (max_tokens - n)
        built.append(programs_built())
    assert built[1:] == built[:1] * 4, built  # the first step built every program the others ran


def reference_attention(q, keys, values, q_lens, seq_lens, scale):
    """Per-request causal SDPA on CPU; a request's queries are the last q_len of its seq_len tokens."""
    outs, start = [], 0
    for r, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        query = q[start:start + q_len].transpose(0, 1)
        k, v = keys[r][:seq_len].transpose(0, 1), values[r][:seq_len].transpose(0, 1)
        rows = torch.arange(seq_len - q_len, seq_len)[:, None]
        mask = torch.arange(seq_len)[None, :] <= rows
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            query, k, v, attn_mask=mask, scale=scale, enable_gqa=True).transpose(0, 1))
        start += q_len
    return torch.cat(outs)


def test_paged_attention_matches_sdpa():
    """Prefill, decode and a chunk after a cached prefix in one batch, grouped-query heads."""
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, block, num_blocks = 4, 2, 8, 4, 12
    q_lens, seq_lens = [6, 1, 3], [6, 9, 10]
    table = torch.tensor([[3, 7, 0], [1, 5, 9], [10, 2, 4]], dtype=torch.int32)
    keys = [torch.randn(s, kv_heads, dim, generator=gen) for s in seq_lens]
    values = [torch.randn(s, kv_heads, dim, generator=gen) for s in seq_lens]
    cache = torch.zeros((num_blocks + 1) * block, kv_heads, 2 * dim).to("tpu")

    def slots(r, positions):
        return [int(table[r, p // block]) * block + p % block for p in positions]

    # The cached context first (one write), then this step's tokens plus one padded token.
    ctx = [(r, range(s - q)) for r, (q, s) in enumerate(zip(q_lens, seq_lens)) if s > q]
    paged_kv.write_kv(cache, torch.cat([keys[r][p] for r, p in ctx]).to("tpu"),
             torch.cat([values[r][p] for r, p in ctx]).to("tpu"),
             torch.tensor(sum((slots(r, p) for r, p in ctx), [])).to("tpu"))
    new = [range(s - q, s) for q, s in zip(q_lens, seq_lens)]
    step_slots = sum((slots(r, p) for r, p in enumerate(new)), []) + [-1]
    k_new = torch.cat([keys[r][p] for r, p in enumerate(new)] + [torch.full((1, kv_heads, dim), 9.0)])
    v_new = torch.cat([values[r][p] for r, p in enumerate(new)] + [torch.full((1, kv_heads, dim), 9.0)])
    paged_kv.write_kv(cache, k_new.to("tpu"), v_new.to("tpu"), torch.tensor(step_slots).to("tpu"))

    q = torch.randn(sum(q_lens), heads, dim, generator=gen)
    # Planned as the builder plans a step, with one padded token: the decode in a grid of its
    # own, the prefill and the chunk in another (2 requests, queries padded to 8).
    meta = paged_kv.plan_step(np.concatenate([[0], np.cumsum(q_lens)]), np.array(seq_lens), table.to("tpu"), block,
                     max(seq_lens), sum(q_lens) + 1, torch.device("tpu"))
    assert [tuple(g.mask.shape) for g in meta.groups] == [(1, 1, 1, 12), (2, 1, 8, 12)]
    padded_q = torch.cat([q, torch.full((1, heads, dim), 5.0)])
    got = paged_kv.paged_attention(padded_q.to("tpu"), cache, meta, dim ** -0.5, dim, None, None).cpu()
    assert got.shape[0] == sum(q_lens) + 1
    got = got[: sum(q_lens)]
    want = reference_attention(q, keys, values, q_lens, seq_lens, dim ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)



def explicit_attention(q, keys, values, q_lens, seq_lens, scale, window=None, soft_cap=None):
    """Per-request attention written out in float64 on CPU: scores, soft cap, a causal mask
    (and a sliding window: a query at position p sees keys at p - window < position <= p),
    softmax, grouped-query heads by repetition."""
    outs, start = [], 0
    for r, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        query = q[start:start + q_len].double().transpose(0, 1)  # [heads, q, d]
        group = q.shape[1] // keys[r].shape[1]
        k = keys[r][:seq_len].double().repeat_interleave(group, dim=1).transpose(0, 1)
        v = values[r][:seq_len].double().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = query @ k.transpose(1, 2) * scale
        if soft_cap:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        visible = k_pos <= q_pos
        if window is not None:
            visible &= k_pos > q_pos - window
        outs.append((scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v).transpose(0, 1))
        start += q_len
    return torch.cat(outs).float()


@pytest.mark.parametrize("window,soft_cap", [(None, None), (5, None), (None, 30.0), (7, 2.0)],
                         ids=["plain", "sliding_window", "soft_cap", "both"])
def test_paged_attention_of_a_random_mixed_step(window, soft_cap):
    """Eight requests (decodes, prefills, chunks after cached prefixes) whose pages are scattered
    over the cache, written in two steps as a server writes them, then attended in one step."""
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, dim, block, num_blocks = 6, 2, 8, 4, 70
    q_lens = [1, 1, 9, 1, 3, 1, 14, 2]
    seq_lens = [5, 17, 9, 1, 20, 30, 14, 11]
    pages = -(-max(seq_lens) // block)
    table = torch.randperm(num_blocks, generator=gen)[: len(q_lens) * pages].view(len(q_lens), pages).int()
    keys = [torch.randn(s, kv_heads, dim, generator=gen) for s in seq_lens]
    values = [torch.randn(s, kv_heads, dim, generator=gen) for s in seq_lens]
    cache = torch.zeros(paged_kv.kv_cache_shape(block, kv_heads, dim, num_blocks)).to("tpu")

    def write(positions_of):
        rows = [(r, p) for r in range(len(q_lens)) for p in positions_of(r)]
        slots = [int(table[r, p // block]) * block + p % block for r, p in rows]
        paged_kv.write_kv(cache, torch.stack([keys[r][p] for r, p in rows]).to("tpu"),
                          torch.stack([values[r][p] for r, p in rows]).to("tpu"), torch.tensor(slots).to("tpu"))

    write(lambda r: range(seq_lens[r] - q_lens[r]))  # the cached prefixes
    write(lambda r: range(seq_lens[r] - q_lens[r], seq_lens[r]))  # this step's tokens
    q = torch.randn(sum(q_lens), heads, dim, generator=gen)
    tokens = padded_size(token_buckets(64), sum(q_lens))
    meta = paged_kv.plan_step(np.concatenate([[0], np.cumsum(q_lens)]), np.array(seq_lens), table.to("tpu"),
                              block, max(seq_lens), tokens, torch.device("tpu"))
    padded_q = torch.cat([q, torch.zeros(tokens - sum(q_lens), heads, dim)])
    got = paged_kv.paged_attention(padded_q.to("tpu"), cache, meta, dim ** -0.5, dim, window, soft_cap).cpu()
    want = explicit_attention(q, keys, values, q_lens, seq_lens, dim ** -0.5, window, soft_cap)
    torch.testing.assert_close(got[: sum(q_lens)], want, rtol=2e-5, atol=2e-5)


def test_write_kv_sends_padded_tokens_to_the_scratch_page():
    block, kv_heads, dim, num_blocks = 4, 1, 2, 3
    shape = paged_kv.kv_cache_shape(block, kv_heads, dim, num_blocks)
    assert shape == ((num_blocks + 1) * block, kv_heads, 2 * dim)
    assert paged_kv.kv_cache_shape(block, kv_heads, dim, num_blocks, head_size_v=3)[-1] == dim + 3
    cache = torch.zeros(shape).to("tpu")
    key = torch.arange(8.0).view(4, 1, 2)
    paged_kv.write_kv(cache, key.to("tpu"), (-key).to("tpu"), torch.tensor([5, -1, 0, -1]).to("tpu"))
    got = cache.cpu()
    torch.testing.assert_close(got[5, 0], torch.tensor([0.0, 1.0, -0.0, -1.0]))
    torch.testing.assert_close(got[0, 0], torch.tensor([4.0, 5.0, -4.0, -5.0]))
    assert got[1:5].abs().sum() == 0 and got[6: num_blocks * block].abs().sum() == 0  # nothing else written
    assert got[-1].abs().sum() > 0  # the padded tokens' writes: the scratch page's last slot
    assert paged_kv.block_slots([2, 0], block).tolist() == [8, 9, 10, 11, 0, 1, 2, 3]


def test_step_plans_bound_the_shapes_a_server_compiles():
    """Whatever the mix of lengths, a step's grids have power-of-two requests, query widths and
    pages, and its token count is a bucket: the shapes a server compiles are bounded by those
    sizes, not by the traffic."""
    rng = np.random.default_rng(0)
    block, pages_max, buckets = 4, 8, token_buckets(64)
    table = torch.zeros(16, pages_max, dtype=torch.int32)
    pow2 = {1 << i for i in range(8)}
    for _ in range(200):
        n = int(rng.integers(1, 17))
        q_lens = rng.integers(1, 5, n) * (rng.random(n) < 0.3) + 1
        seq_lens = q_lens + rng.integers(0, 20, n)
        tokens = padded_size(buckets, int(q_lens.sum()))
        meta = paged_kv.plan_step(np.concatenate([[0], np.cumsum(q_lens)]), seq_lens, table, block, 32, tokens, "cpu")
        assert tokens in buckets and meta.token_rows.shape == (tokens,)
        for g in meta.groups:
            requests, _, width, keys = g.mask.shape
            assert {requests, width, keys // block} <= pow2 and keys // block <= pages_max and keys % block == 0
            assert g.block_table.shape == (requests, keys // block)


# ---------------------------------------------------------------- SGLang's token-slot pool

def pool_reference_attention(q, k_pool, v_pool, rows, q_lens, seq_lens, scale):
    """Per-request causal SDPA on CPU, queries being the last q_len tokens of each request."""
    outs, start = [], 0
    for row, q_len, seq_len in zip(rows, q_lens, seq_lens):
        query = q[start:start + q_len].transpose(0, 1)  # [heads, q, dim]
        key = k_pool[row[:seq_len]].transpose(0, 1)
        value = v_pool[row[:seq_len]].transpose(0, 1)
        pos_q = torch.arange(seq_len - q_len, seq_len)[:, None]
        mask = torch.arange(seq_len)[None, :] <= pos_q
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scale, enable_gqa=True)
        outs.append(out.transpose(0, 1).reshape(q_len, -1))
        start += q_len
    return torch.cat(outs)


def test_paged_attention_matches_per_request_sdpa():
    """Prefill, a prefix-cache hit (prefill after a cached prefix), a chunk and decodes in one batch."""
    torch.manual_seed(0)
    heads, kv_heads, dim, slots = 4, 2, 16, 200
    q_lens, seq_lens = [7, 5, 1, 1, 9], [7, 20, 33, 1, 40]
    k_pool, v_pool = torch.randn(slots, kv_heads, dim), torch.randn(slots, kv_heads, dim)
    rows = torch.stack([torch.randperm(slots - 1)[:64] + 1 for _ in q_lens])  # paged: slots scattered
    q = torch.randn(sum(q_lens), heads, dim)
    want = pool_reference_attention(q, k_pool, v_pool, rows, q_lens, seq_lens, 0.25)
    plan = token_pool.plan_batch(q_lens, seq_lens, rows.to("tpu"), rows.shape[1], torch.device("tpu"))
    got = token_pool.paged_attention(q.to("tpu"), k_pool.to("tpu"), v_pool.to("tpu"), plan, 0.25)
    assert plan.shape == (8, 16, 64)  # padded to buckets
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def test_padded_decode_batch_attends_like_the_unpadded_one():
    """The compiled decode pads a batch to a capture size; the real requests' attention is unchanged."""
    torch.manual_seed(0)
    heads, kv_heads, dim, slots = 4, 2, 16, 100
    seq_lens = torch.tensor([5, 17, 9])
    req_to_token = torch.zeros(4, 32, dtype=torch.int64)  # row 0: SGLang's reserved padding row
    req_to_token[1:] = torch.stack([torch.randperm(slots - 1)[:32] + 1 for _ in range(3)])
    batch = SimpleNamespace(batch_size=3, input_ids=torch.tensor([7, 8, 9]), positions=seq_lens - 1,
                            out_cache_loc=torch.tensor([11, 12, 13]), req_pool_indices=torch.tensor([1, 2, 3]),
                            seq_lens=seq_lens, seq_lens_cpu=seq_lens, seq_lens_sum=int(seq_lens.sum()))
    padded = token_pool.pad_decode_batch(batch, 8)
    assert padded.batch_size == 8 and batch.batch_size == 3  # a copy: SGLang's batch is untouched
    assert padded.seq_lens_cpu.tolist() == [5, 17, 9] + [1] * 5 and padded.req_pool_indices[3:].eq(0).all()
    assert padded.seq_lens_sum == int(padded.seq_lens.sum())
    k_pool, v_pool = torch.randn(slots, kv_heads, dim).to("tpu"), torch.randn(slots, kv_heads, dim).to("tpu")
    q = torch.randn(8, heads, dim).to("tpu")
    rows = req_to_token.to("tpu")

    def attend(b, n):
        plan = token_pool.plan_batch([1] * n, b.seq_lens_cpu.tolist(), rows.index_select(0, b.req_pool_indices.to("tpu")),
                          32, torch.device("tpu"))
        return token_pool.paged_attention(q[:n], k_pool, v_pool, plan, 0.25).cpu()

    torch.testing.assert_close(attend(padded, 8)[:3], attend(batch, 3))
    with pytest.raises(ValueError, match="smaller than the batch"):
        token_pool.pad_decode_batch(batch, 2)


