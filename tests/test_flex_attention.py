"""flex_attention on tpu, eager and compiled, forward and backward, against PyTorch on the CPU.

Outputs are compared with CPU ``flex_attention``; gradients (CPU flex_attention has no backward)
with the same attention written densely in torch on the CPU, differentiated by autograd.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

B, H, L, E = 1, 2, 128, 16
BLOCK = 32  # four query blocks: partial and full key/value blocks, and skipped ones
SCALE = E ** -0.5


def _causal(b, h, q, kv):
    return q >= kv


def _window(b, h, q, kv):
    return (q >= kv) & (q - kv <= 40)


def _case(name: str, device: str):
    """(score_mod, mask_mod, the tensors they close over that take gradients) on ``device``."""
    if name == "causal":
        return None, _causal, []
    if name == "sliding_window":
        return None, _window, []
    if name == "document":
        doc = torch.tensor([0] * 50 + [1] * 30 + [2] * 48, device=device)
        return None, lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv), []
    if name == "alibi":
        slopes = torch.tensor([0.5, 0.125], device=device, requires_grad=True)
        return (lambda s, b, h, q, kv: s + slopes[h] * (kv - q)), _causal, [slopes]
    raise ValueError(name)


def _dense_reference(q, k, v, score_mod, mask_mod):
    """The attention flex_attention defines, in plain torch: every index tensor broadcasts."""
    b, h, q_idx, kv_idx = (torch.arange(n).view([-1 if d == i else 1 for d in range(4)])
                           for i, n in enumerate((q.shape[0], q.shape[1], q.shape[2], k.shape[2])))
    scores = q @ k.transpose(-2, -1) * SCALE
    if score_mod is not None:
        scores = score_mod(scores, b, h, q_idx, kv_idx)
    scores = scores.masked_fill(~mask_mod(b, h, q_idx, kv_idx), float("-inf"))
    return scores.softmax(-1) @ v


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, E, generator=gen) for _ in range(3)]


def _run_tpu(fn, qkv, score_mod, mask_mod, captured):
    block_mask = create_block_mask(mask_mod, B, H, L, L, device="tpu", BLOCK_SIZE=BLOCK)
    leaves = [x.to("tpu").requires_grad_() for x in qkv]
    out = fn(*leaves, score_mod=score_mod, block_mask=block_mask)
    out.backward(torch.ones_like(out) * 0.1 + out.detach())
    return out.cpu(), [x.grad.cpu() for x in leaves + captured]


_FAST = {("document", False), ("alibi", True)}  # captured mask and score buffers; the rest: -m slow
_CASES = [pytest.param(case, compiled, id=f"{case}-{'compiled' if compiled else 'eager'}",
                       marks=() if (case, compiled) in _FAST else pytest.mark.slow)
          for case in ("causal", "sliding_window", "document", "alibi") for compiled in (False, True)]


@pytest.mark.parametrize("case,compiled", _CASES)
def test_matches_cpu(case, compiled):
    qkv = _inputs()
    score_cpu, mask_cpu, captured_cpu = _case(case, "cpu")
    block_mask = create_block_mask(mask_cpu, B, H, L, L, device="cpu", BLOCK_SIZE=BLOCK)
    with torch.no_grad():  # CPU flex_attention has no backward
        expected = flex_attention(*qkv, score_mod=score_cpu, block_mask=block_mask)
    leaves = [x.clone().requires_grad_() for x in qkv]
    dense = _dense_reference(*leaves, score_cpu, mask_cpu)
    dense.backward(torch.ones_like(dense) * 0.1 + dense.detach())

    score_tpu, mask_tpu, captured_tpu = _case(case, "tpu")
    fn = torch.compile(flex_attention, backend="tpu", fullgraph=True) if compiled else flex_attention
    out, grads = _run_tpu(fn, qkv, score_tpu, mask_tpu, captured_tpu)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    assert len(grads) == len(leaves + captured_cpu)
    for got, leaf in zip(grads, leaves + captured_cpu):
        torch.testing.assert_close(got, leaf.grad, atol=2e-5, rtol=1e-5)


def test_block_mask_built_on_tpu_matches_cpu():
    mask = _case("document", "cpu")[1]
    cpu = create_block_mask(mask, B, H, L, L, device="cpu", BLOCK_SIZE=BLOCK)
    tpu = create_block_mask(_case("document", "tpu")[1], B, H, L, L, device="tpu", BLOCK_SIZE=BLOCK)
    assert tpu.kv_num_blocks.device.type == "tpu"
    for a, b in zip(tpu.as_tuple()[2:10], cpu.as_tuple()[2:10]):
        torch.testing.assert_close(a.cpu(), b)


def test_no_block_mask_gqa_score_mod_only(each_eager_mode):
    """No BlockMask (every block, with padding: 160 rows in tiles of 128) and two query heads per
    key/value head."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 2, 160, E, generator=gen)
    k, v = (torch.randn(2, 1, 160, E, generator=gen) for _ in range(2))

    def score_mod(s, b, h, q_idx, kv_idx):
        return s * (1.0 + 0.5 * h) - 0.01 * b

    expected = flex_attention(q, k, v, score_mod=score_mod, enable_gqa=True)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    full = [leaves[0]] + [x.repeat_interleave(2, dim=1) for x in leaves[1:]]
    dense = _dense_reference(*full, score_mod, lambda b, h, q_idx, kv_idx: q_idx >= 0)
    dense.sum().backward()

    tpu = [x.to("tpu").requires_grad_() for x in (q, k, v)]
    out = flex_attention(*tpu, score_mod=score_mod, enable_gqa=True)
    out.sum().backward()
    torch.testing.assert_close(out.cpu(), expected, atol=2e-5, rtol=1e-5)
    for got, leaf in zip(tpu, leaves):
        torch.testing.assert_close(got.grad.cpu(), leaf.grad, atol=2e-5, rtol=1e-5)


def test_cpu_behaviour_unchanged():
    """The device check lets tpu through only: CPU still refuses a backward and other devices are
    still refused, as in PyTorch."""
    q = torch.randn(1, 1, 16, 8, requires_grad=True)
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        flex_attention(q, q, q)
    meta = torch.empty(1, 1, 16, 8, device="meta")
    with pytest.raises(ValueError, match="only supported on CUDA, CPU"):
        flex_attention(meta, meta, meta)


def _hop_opinfos():
    from torch.testing._internal.hop_db import hop_db

    return [op for op in hop_db if op.name.startswith("flex_attention")]


def _to_tpu(value):
    if isinstance(value, (torch.Tensor, BlockMask)):
        return value.to("tpu")
    if isinstance(value, (tuple, list)):
        return type(value)(_to_tpu(v) for v in value)
    return value


@pytest.mark.parametrize("op", _hop_opinfos(), ids=lambda op: f"{op.name}.{op.variant_test_name}")
def test_hop_db_opinfo(op):
    """PyTorch's OpInfo entries of the flex_attention HOPs (torch.testing._internal.hop_db)."""
    for sample in op.sample_inputs("cpu", torch.float32, requires_grad=False):
        args = (sample.input, *sample.args)
        expected = op.op(*args, **sample.kwargs)
        got = op.op(*_to_tpu(args), **sample.kwargs)
        flat_expected, flat_got = torch.utils._pytree.tree_leaves(expected), torch.utils._pytree.tree_leaves(got)
        assert len(flat_got) == len(flat_expected)
        for a, b in zip(flat_got, flat_expected):
            torch.testing.assert_close(a.cpu(), b, atol=2e-5, rtol=1e-5)


def test_unlisted_blocks_are_skipped():
    """Only the blocks a BlockMask lists are computed (as on CUDA): with only the diagonal blocks
    listed and no mask_mod, the result is block-diagonal attention."""
    n = L // BLOCK
    indices = torch.zeros(1, 1, n, n, dtype=torch.int32)
    indices[..., 0] = torch.arange(n)
    block_mask = BlockMask.from_kv_blocks(torch.ones(1, 1, n, dtype=torch.int32), indices, BLOCK_SIZE=BLOCK)
    block_mask = block_mask.to("tpu")
    qkv = _inputs(2)
    out = flex_attention(*[x.to("tpu") for x in qkv], block_mask=block_mask)
    expected = _dense_reference(*qkv, None, lambda b, h, q, kv: q // BLOCK == kv // BLOCK)
    torch.testing.assert_close(out.cpu(), expected, atol=2e-5, rtol=1e-5)


def test_memory_is_blockwise():
    """XLA's temporary memory for forward+backward at L=1024 stays under a quarter of one head's
    L x L score matrix (the materialising formulation needs several of them per head)."""
    import jax
    import jax.numpy as jnp

    from torchtpu.ops import flex_attention as flex

    length, blocks = 1024, flex.dense_blocks(1024, 1024)
    x = jnp.ones((1, 2, length, E), jnp.float32)

    def step(q):
        out, lse, _ = flex.forward(q, q, q, lambda s, b, h, i, j: s, lambda b, h, i, j: i >= j, blocks, SCALE)
        return flex.backward(q, q, q, out, lse, out, None, lambda s, b, h, i, j: s,
                             lambda b, h, i, j: i >= j, blocks, SCALE)[:3]

    temp = jax.jit(step).lower(x).compile().memory_analysis().temp_size_in_bytes
    assert 0 < temp < length * length * 4 / 4


def test_captured_tensor_on_another_device_raises():
    slopes = torch.tensor([0.5, 0.125])  # left on the CPU
    q = torch.randn(1, 2, 32, 8, device="tpu")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        flex_attention(q, q, q, score_mod=lambda s, b, h, i, j: s + slopes[h])
