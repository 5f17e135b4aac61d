"""``torch._grouped_mm`` (mixture-of-experts products) on tpu vs PyTorch CPU, forward and gradients.

The gradients go through PyTorch's own ``GroupedMmBackward0``, which calls ``_grouped_mm`` in its
other forms (ragged K for the weights' gradient), so the backward checks cover those too.
"""

import pytest
import torch

from test_ops_nn import check, randn

pytestmark = pytest.mark.usefixtures("no_fallback")

# PyTorch's CPU kernel wants 16-byte aligned strides: inner sizes that are multiples of 8.
M, K, N, G = 24, 16, 8, 3
OFFS = [5, 5, 17]  # an empty group, and rows past the last offset (which belong to no group)


def _offs(values=OFFS):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_rows_of_a(dtype):
    """(M, K) @ (G, K, N): each expert's run of tokens times that expert's weight, as TorchTitan's
    GroupedExperts calls it (the weight passed transposed)."""
    a, w = randn(M, K, dtype=dtype), randn(G, N, K, dtype=dtype, seed=1)
    check(lambda a, w, offs: torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)[:OFFS[-1]], a, w, _offs(),
          grad=False)  # PyTorch's gradient of the rows past the last offset is unwritten memory
    rows = OFFS[-1]
    padded = lambda a, w, offs: torch._grouped_mm(  # only rows in a group carry a gradient
        torch.cat([a, torch.zeros(M - rows, K, dtype=a.dtype, device=a.device)]), w.transpose(-2, -1), offs=offs)[:rows]
    check(padded, a[:rows], w, _offs())
    full = _offs([5, 9, M])  # every row in a group
    check(lambda a, w, offs: torch._grouped_mm(a, w.transpose(-2, -1), offs=offs), a, w, full)
    check(lambda a, w, offs: torch._grouped_mm(a, w.transpose(-2, -1).contiguous(), offs=offs), a, w, full)


def test_rows_past_the_last_offset_are_zero():
    a, b = randn(M, K).to("tpu"), randn(G, K, N, seed=1).to("tpu")
    out = torch._grouped_mm(a, b, offs=_offs().to("tpu")).cpu()
    assert out.shape == (M, N)
    assert torch.equal(out[OFFS[-1]:], torch.zeros(M - OFFS[-1], N))


def test_ragged_k():
    """(M, K) @ (K, N) with offsets over K: one product per slice, (G, M, N) (the weights' gradient)."""
    offs = _offs([5, 9, M])
    check(lambda a, b, offs: torch._grouped_mm(a, b, offs=offs), randn(N, M), randn(M, K, seed=1), offs)
    check(lambda a, b, offs: torch._grouped_mm(a, b.t(), offs=offs), randn(N, M), randn(K, M, seed=1), offs)


def test_ragged_columns_of_b():
    """(G, M, K) @ (K, N) with offsets over N."""
    offs = _offs([5, 9, M])
    check(lambda a, b, offs: torch._grouped_mm(a, b, offs=offs), randn(G, N, K), randn(K, M, seed=1), offs)
    check(lambda a, b, offs: torch._grouped_mm(a, b.t(), offs=offs), randn(G, N, K), randn(M, K, seed=1), offs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched(dtype):
    check(lambda a, b: torch._grouped_mm(a, b), randn(G, M, K, dtype=dtype), randn(G, K, N, dtype=dtype, seed=1))


def test_moe_expert_layer_matches_cpu():
    """The expert computation of a mixture-of-experts layer, end to end: route, sort by expert,
    SwiGLU through three grouped products in bf16, weight by the router's scores, scatter back."""
    tokens, dim, hidden, experts, top_k = 32, 16, 24, 4, 2

    def layer(x, gate, w1, w2, w3):
        scores = torch.softmax(x @ gate, dim=-1)
        top_scores, top_ids = scores.topk(top_k, dim=-1)
        order = torch.argsort(top_ids.view(-1), stable=True)
        counts = torch.bincount(top_ids.view(-1), minlength=experts)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        routed = x[order // top_k].bfloat16()
        h = torch.nn.functional.silu(torch._grouped_mm(routed, w1.bfloat16().mT, offs=offs))
        h = h * torch._grouped_mm(routed, w3.bfloat16().mT, offs=offs)
        out = torch._grouped_mm(h, w2.bfloat16().mT, offs=offs).float() * top_scores.view(-1)[order, None]
        return torch.zeros_like(x).index_add(0, order // top_k, out)

    check(layer, randn(tokens, dim), randn(dim, experts, seed=1), randn(experts, hidden, dim, seed=2) / 4,
          randn(experts, dim, hidden, seed=3) / 4, randn(experts, hidden, dim, seed=4) / 4, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("case", ["no offsets", "offsets with 3-d", "dtypes", "contraction", "bias", "int"])
def test_errors_are_pytorchs(case):
    """A call PyTorch refuses on the CPU is refused on tpu with the same message."""
    a, offs = randn(M, K), _offs()
    args = {"no offsets": (a, randn(K, N)), "offsets with 3-d": (randn(G, M, K), randn(G, K, N), offs),
            "dtypes": (a, randn(G, K, N, dtype=torch.bfloat16), offs), "contraction": (a, randn(G, N, K), offs),
            "bias": (a, randn(G, K, N), offs, randn(G, N)), "int": (a.int(), randn(G, K, N).int(), offs)}[case]
    with pytest.raises(RuntimeError) as cpu:
        torch._grouped_mm(*args)
    with pytest.raises(RuntimeError) as tpu:
        torch._grouped_mm(*[t.to("tpu") for t in args])
    assert str(tpu.value) == str(cpu.value)
