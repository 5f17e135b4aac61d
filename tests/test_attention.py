"""Fused scaled-dot-product attention: the blockwise kernel against PyTorch's CPU SDPA (forward and
gradients, many blocks), SDPA on tpu in eager and compiled code, dropout, and backend selection;
CUDA's flash op (``aten._scaled_dot_product_flash_attention``, called directly by libraries for its
logsumexp) against the float64 formula."""

from __future__ import annotations

import contextlib
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from torchtpu import metrics
from torchtpu.ops import attention, registry

aten = torch.ops.aten
FUSED = aten._scaled_dot_product_fused_attention_overrideable.default
FUSED_BACKWARD = aten._scaled_dot_product_fused_attention_overrideable_backward.default


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _mask(kind, length, kv_length, heads, seed=5):
    """An attention mask of ``kind`` for (2, heads, length, kv_length) attention."""
    if kind == "bool":  # per batch and head, with fully masked rows
        mask = torch.rand(2, heads, length, kv_length, generator=torch.Generator().manual_seed(seed)) > 0.4
        mask[:, :, 3] = False
        return mask
    if kind == "additive":  # broadcast over heads; its gradient is reduced to this shape
        return _randn(2, 1, length, kv_length, seed=seed)
    if kind == "additive_rows":  # broadcast over batch and query rows
        return _randn(heads, 1, kv_length, seed=seed)
    return None


SLOW = pytest.mark.slow  # the blockwise kernel compiles a loop per case: CI keeps two cases
CASES = {  # name: (q heads, kv heads, L, S, causal, mask kind, scale, block q, block k)
    "one_block": (2, 2, 8, 8, False, None, None, None, None),
    "blocks_padded": (2, 2, 37, 29, False, None, None, 8, 8),
    "causal_wide": (4, 2, 37, 53, True, None, None, 16, 8),
    "causal_tall": (4, 2, 37, 29, True, None, None, 8, 16),
    "gqa_mqa_bool_mask": (4, 1, 37, 29, False, "bool", None, 8, 8),
    "bool_mask_empty_rows": (4, 4, 37, 29, False, "bool", None, 16, 16),
    "additive_mask_scale": (4, 2, 37, 29, False, "additive", 0.3, 8, 8),
    "additive_rows": (4, 2, 37, 29, False, "additive_rows", None, 8, 8),
}


@pytest.mark.parametrize("case", [c if c in ("causal_wide", "additive_mask_scale") else pytest.param(c, marks=SLOW)
                                  for c in CASES])
def test_blockwise_matches_torch_sdpa(case):
    hq, hk, length, kv_length, causal, kind, scale, bq, bk = CASES[case]
    q, k, v = _randn(2, hq, length, 8, seed=1), _randn(2, hk, kv_length, 8, seed=2), _randn(2, hk, kv_length, 8,
                                                                                             seed=3)
    g, mask = _randn(2, hq, length, 8, seed=4), _mask(kind, length, kv_length, hq)
    learnable = mask is not None and mask.dtype != torch.bool
    ref_in = [t.double().requires_grad_() for t in (q, k, v)] + ([mask.double().requires_grad_()] if learnable else [])
    ref_mask = ref_in[3] if learnable else mask
    ref = F.scaled_dot_product_attention(*ref_in[:3], attn_mask=ref_mask, is_causal=causal, scale=scale,
                                         enable_gqa=hq != hk)
    ref.backward(g.double())
    arrays = [jnp.asarray(t.numpy()) for t in (q, k, v)]
    bias = None if mask is None else jnp.asarray(mask.numpy())
    kw = dict(scale=scale, causal=causal, block_q=bq, block_k=bk)
    out, lse = attention.blockwise_attention(*arrays, bias, **kw)
    grads = attention.blockwise_attention_backward(jnp.asarray(g.numpy()), *arrays, out, lse, bias,
                                                   bias_grad=learnable, **kw)
    np.testing.assert_allclose(np.asarray(out), ref.detach().numpy(), atol=2e-6, rtol=1e-5)
    for got, want in zip(grads, ref_in):
        np.testing.assert_allclose(np.asarray(got), want.grad.numpy(), atol=1e-5, rtol=1e-4)
    assert grads[3] is None or grads[3].shape == mask.shape


@SLOW
def test_blockwise_dropout_backward_is_the_gradient_of_its_forward():
    q, k, v, g = (jnp.asarray(_randn(1, 2, 19, 8, seed=s).numpy()) for s in range(4))
    key = jax.random.key(7)
    kw = dict(dropout_p=0.3, key=key, block_q=8, block_k=8)
    out, vjp = jax.vjp(lambda a, b, c: attention.blockwise_attention(a, b, c, **kw)[0], q, k, v)
    _, lse = attention.blockwise_attention(q, k, v, **kw)
    got = attention.blockwise_attention_backward(g, q, k, v, out, lse, **kw)[:3]
    for a, b in zip(got, vjp(g)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)


@SLOW
def test_blockwise_score_mod_and_its_gradient():
    q, k, v, g = (jnp.asarray(_randn(1, 2, 21, 8, seed=s).numpy()) for s in range(4))

    def alibi(s, q_idx, k_idx):  # a score_mod with a gradient of its own (tanh soft-capping)
        return 5.0 * jnp.tanh(s / 5.0) - 0.1 * jnp.abs(q_idx - k_idx)

    def reference(a, b, c):
        s = alibi(jnp.einsum("bhqd,bhkd->bhqk", a, b) / np.sqrt(8), jnp.arange(21)[:, None], jnp.arange(21)[None])
        return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), c)

    kw = dict(score_mod=alibi, block_q=8, block_k=8)
    out, lse = attention.blockwise_attention(q, k, v, **kw)
    want, vjp = jax.vjp(reference, q, k, v)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5, rtol=1e-5)
    for a, b in zip(attention.blockwise_attention_backward(g, q, k, v, out, lse, **kw)[:3], vjp(g)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)


def _sdpa_grads(device, fn, *tensors):
    inputs = [t.detach().to(device).requires_grad_(t.is_floating_point()) for t in tensors]
    out = fn(*inputs)
    out.backward(_randn(*out.shape, seed=9).to(device))
    return [out.detach().cpu()] + [t.grad.cpu() for t in inputs if t.requires_grad]


@pytest.mark.usefixtures("each_eager_mode", "no_fallback")
@pytest.mark.parametrize("kind", ["causal", "bool", "additive", "gqa_scale"])
def test_sdpa_on_tpu_matches_cpu(kind):
    hk = 2 if kind == "gqa_scale" else 4
    q, k, v = _randn(2, 4, 37, 16, seed=1), _randn(2, hk, 29, 16, seed=2), _randn(2, hk, 29, 16, seed=3)
    mask = _mask(kind, 37, 29, 4)
    tensors = (q, k, v) if mask is None else (q, k, v, mask)

    def fn(q, k, v, m=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=kind == "causal",
                                              scale=0.2 if kind == "gqa_scale" else None,
                                              enable_gqa=kind == "gqa_scale")

    for got, want in zip(_sdpa_grads("tpu", fn, *tensors), _sdpa_grads("cpu", fn, *tensors)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.usefixtures("no_fallback")
def test_sdpa_beyond_one_block_on_tpu():
    # 600 > SINGLE_BLOCK: the lowering's own blocks (3 of 256), padded, with the causal skip
    assert attention.block_sizes(600, 600) == (attention.BLOCK_Q, attention.BLOCK_K) == (256, 256)
    q, k, v = (_randn(1, 2, 600, 8, seed=s) for s in range(3))
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    for got, want in zip(_sdpa_grads("tpu", fn, q, k, v), _sdpa_grads("cpu", fn, q, k, v)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.usefixtures("no_fallback")
def test_sdpa_bfloat16():
    q, k, v = (_randn(1, 2, 24, 16, seed=s).bfloat16() for s in range(3))
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    got, want = _sdpa_grads("tpu", fn, q, k, v), _sdpa_grads("cpu", fn, q, k, v)
    assert got[0].dtype == torch.bfloat16
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


@pytest.mark.usefixtures("no_fallback")
def test_sdpa_dropout_is_reproducible_and_unbiased():
    q, k = torch.zeros(1, 2, 64, 8, device="tpu"), torch.zeros(1, 2, 64, 8, device="tpu")
    v = torch.ones(1, 2, 64, 8, device="tpu", requires_grad=True)

    def run(seed):
        torch.manual_seed(seed)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.25)
        out.sum().backward()
        grad, v.grad = v.grad.cpu(), None
        return out.detach().cpu(), grad

    first, again, other = run(0), run(0), run(1)
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    assert not torch.equal(first[0], other[0])
    kept = (first[0][..., 0] != 0).float().mean()  # uniform weights 1/64: each kept one adds 1/(64*0.75)
    assert 0.5 < float(first[0].mean()) < 1.5 and float(kept) > 0.9
    # each weight is dropped or scaled by 1/(1-p): dV's columns are the kept weights summed over rows
    assert abs(float(first[1].mean()) - 1.0) < 0.05
    assert set(torch.unique((first[0] * 64 * 0.75).round()).tolist()) <= set(range(0, 65))


def _backend_of(out) -> str:
    return type(out.grad_fn).__name__


@pytest.mark.usefixtures("no_fallback")
def test_sdpa_kernel_selects_the_backend():
    q, k, v = (_randn(1, 2, 8, 4, seed=s).to("tpu").requires_grad_() for s in range(3))
    assert "FusedAttentionOverrideable" in _backend_of(F.scaled_dot_product_attention(q, k, v))
    for fused in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.OVERRIDEABLE):
        with sdpa_kernel([fused]):
            assert "FusedAttentionOverrideable" in _backend_of(F.scaled_dot_product_attention(q, k, v))
            assert torch._fused_sdp_choice(q, k, v) == SDPBackend.OVERRIDEABLE.value
    with sdpa_kernel([SDPBackend.MATH]):
        math = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert "FusedAttention" not in _backend_of(math)
        assert torch._fused_sdp_choice(q, k, v) == SDPBackend.MATH.value
    torch.testing.assert_close(math, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    # float64 and 3-d inputs take the math path; with it disabled, PyTorch's error
    assert "FusedAttention" not in _backend_of(F.scaled_dot_product_attention(q.double(), k.double(), v.double()))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), pytest.raises(RuntimeError, match="No viable backend"):
        F.scaled_dot_product_attention(q[0], k[0], v[0])


@pytest.mark.usefixtures("each_eager_mode", "no_fallback")
@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
def test_sdpa_without_autograd_takes_the_fused_op(grad_mode):
    """Serving engines run models under ``torch.inference_mode`` (vLLM) or ``no_grad`` (HF): SDPA
    still chooses its backend there (inference mode skips the autograd keys; the math path it fell
    to cost a vLLM decode step 20x its attention) and matches PyTorch's CPU. With no backward to
    feed, the fused op's lowering runs for its output alone (``attention._OutputOnly``: no dropout
    key drawn, no logsumexp kept), each call after the first too."""
    q, k, v = _randn(8, 4, 1, 16, seed=1), _randn(8, 2, 40, 16, seed=2), _randn(8, 2, 40, 16, seed=3)
    mask = torch.rand(8, 1, 1, 40, generator=torch.Generator().manual_seed(4)) > 0.3
    context = getattr(torch, grad_mode)
    fused = "aten._scaled_dot_product_fused_attention_overrideable.default"

    def run(device, backends=None):
        chosen = sdpa_kernel(backends) if backends else contextlib.nullcontext()
        before = metrics.ops[fused]
        with context(), torch.profiler.profile() as prof, chosen:
            out = F.scaled_dot_product_attention(*(t.to(device) for t in (q, k, v)), attn_mask=mask.to(device),
                                                 scale=0.3, enable_gqa=True).cpu()
        return out, {e.name for e in prof.events()}, metrics.ops[fused] - before

    for call in range(2):
        out, ops, runs = run("tpu")
        assert runs == 1 and "aten::_scaled_dot_product_attention_math" not in ops
        assert "aten::_scaled_dot_product_fused_attention_overrideable" not in ops or call == 0  # (its meta: the first)
        torch.testing.assert_close(out, run("cpu")[0], atol=1e-5, rtol=1e-4)
    math, ops, runs = run("tpu", [SDPBackend.MATH])  # and the choice still follows sdpa_kernel
    assert runs == 0 and "aten::_scaled_dot_product_attention_math" in ops
    torch.testing.assert_close(math, out, atol=1e-5, rtol=1e-4)


@pytest.mark.usefixtures("no_fallback")
def test_sdpa_that_needs_a_backward_keeps_the_fused_op():
    """Where a gradient can flow (an input requires one, grad mode on) or dropout draws a key, SDPA
    dispatches the fused op, which autograd records; its gradients match PyTorch's CPU."""
    q, k, v = _randn(2, 4, 3, 16, seed=1), _randn(2, 2, 9, 16, seed=2), _randn(2, 2, 9, 16, seed=3)

    def run(device):
        inputs = [t.to(device).requires_grad_() for t in (q, k, v)]
        with torch.profiler.profile() as prof:
            out = F.scaled_dot_product_attention(*inputs, enable_gqa=True)
        out.sum().backward()
        return [out.detach().cpu(), *(t.grad.cpu() for t in inputs)], {e.name for e in prof.events()}

    got, ops = run("tpu")
    assert "aten::_scaled_dot_product_fused_attention_overrideable" in ops
    for a, b in zip(got, run("cpu")[0]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    with torch.no_grad(), torch.profiler.profile() as prof:
        dropped = F.scaled_dot_product_attention(*(t.to("tpu") for t in (q, k, v)), dropout_p=0.5, enable_gqa=True)
    assert "aten::_scaled_dot_product_fused_attention_overrideable" in {e.name for e in prof.events()}
    assert dropped.shape == q.shape


@pytest.mark.usefixtures("no_fallback")
@pytest.mark.parametrize("backend", [SDPBackend.FLASH_ATTENTION, pytest.param(SDPBackend.MATH, marks=SLOW)])
def test_sdpa_compiled(backend):
    q, k, v = _randn(2, 4, 20, 8, seed=1), _randn(2, 2, 20, 8, seed=2), _randn(2, 2, 20, 8, seed=3)
    mask = _randn(20, 20, seed=4)

    def fn(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)

    torch._dynamo.reset()
    with sdpa_kernel([backend]):
        got = _sdpa_grads("tpu", torch.compile(fn, backend="tpu"), q, k, v, mask)
    for a, b in zip(got, _sdpa_grads("cpu", fn, q, k, v, mask)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.usefixtures("no_fallback")
def test_sdpa_compiled_inside_opinfos_reseeding():
    """OpInfo's wrapper_set_seed (freeze_rng_state, then torch.manual_seed) in a compiled region:
    torch.tpu's rng-state functions graph-break and run eagerly, as torch.cuda's do (dynamo traced
    into set_rng_state under freeze_rng_state's no_dispatch, and failed)."""
    from torch.testing._utils import wrapper_set_seed

    q = _randn(1, 2, 6, 4, seed=6)
    fn = torch.compile(lambda q: wrapper_set_seed(F.scaled_dot_product_attention, q, q, q), backend="tpu")
    torch.tpu.manual_seed(7)
    before = torch.tpu.get_rng_state()
    got = fn(q.to("tpu")).cpu()
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, q, q), atol=1e-5, rtol=1e-4)
    assert torch.equal(torch.tpu.get_rng_state(), before)  # freeze_rng_state restored the seed 42 set inside


def test_platform_overrides_are_registered_and_fall_back():
    low = registry.LOWERINGS[FUSED]
    assert low.impl("gpu") is attention.fused_attention_gpu
    assert registry.LOWERINGS[FUSED_BACKWARD].impl("gpu") is attention.fused_attention_backward_gpu
    assert low.impl("cpu") is attention.fused_attention
    if attention._pallas is not None:
        assert low.impl("tpu") is attention.fused_attention_tpu
    # float32 and dropout are not cuDNN's: the override hands them to the generic lowering
    q, k, v = (jnp.asarray(_randn(1, 2, 6, 8, seed=s).numpy()) for s in range(3))
    registry.check_override(FUSED, "gpu", q, k, v, None, 0.0, True, key=jax.random.key(0))


@pytest.mark.parametrize("backends", [[SDPBackend.MATH], [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION]])
def test_sdpa_boolean_mask_matches_cpu_on_every_backend(backends):
    """A boolean mask (True attends) masks on the math path too, fully masked rows (left padding) included."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 4, 7, 8) for _ in range(3))
    mask = torch.tril(torch.ones(7, 7, dtype=torch.bool)).expand(3, 1, 7, 7).clone()
    mask[-1, :, :, :2] = False  # the last row's first two keys are padding: its first two queries see nothing
    with sdpa_kernel(backends):
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        got = F.scaled_dot_product_attention(q.to("tpu"), k.to("tpu"), v.to("tpu"), attn_mask=mask.to("tpu"))
    torch.testing.assert_close(got.cpu(), expected)


# ---------------------------------------------------------------- CUDA's flash op, called directly
FLASH = aten._scaled_dot_product_flash_attention.default
FLASH_CASES = {  # name: (dtype, q heads, kv heads, causal, scale)
    "float32": (torch.float32, 4, 4, False, None),
    "float32_causal_gqa": (torch.float32, 4, 2, True, 0.3),
    "bfloat16_causal": (torch.bfloat16, 4, 4, True, None),
    "bfloat16_gqa": (torch.bfloat16, 4, 1, False, None),
}


def _math_attention(q, k, v, causal, scale):
    """(output, logsumexp) by the softmax formula in float64 on CPU (CPU has no kernel for CUDA's op)."""
    q, k, v = (t.double() for t in (q, k, v))
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


@pytest.mark.usefixtures("no_fallback")
@pytest.mark.parametrize("case", FLASH_CASES)
def test_cuda_flash_op_matches_the_math(case):
    """Output, logsumexp and gradients of ``_scaled_dot_product_flash_attention`` on tpu against the
    float64 formula (gradients by CPU autograd through it) on the same (rounded) inputs."""
    dtype, hq, hk, causal, scale = FLASH_CASES[case]
    q, k, v = (_randn(2, h, 11, 8, seed=s).to(dtype) for s, h in ((1, hq), (2, hk), (3, hk)))
    g = _randn(2, hq, 11, 8, seed=4).to(dtype)
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    want_out, want_lse = _math_attention(*ref_in, causal, scale)
    want_out.backward(g.double())
    tpu_in = [t.to("tpu").requires_grad_() for t in (q, k, v)]
    out, lse, cum_q, cum_k, max_q, max_k, rng_state, unused, debug = FLASH(*tpu_in, 0.0, causal, scale=scale)
    out.backward(g.to("tpu"))
    assert "FlashAttentionBackward" in type(out.grad_fn).__name__
    assert (out.dtype, lse.dtype, lse.shape, cum_q, cum_k, max_q, max_k) == (dtype, torch.float32, (2, hq, 11),
                                                                            None, None, 11, 11)
    assert (rng_state.shape, unused.shape, debug.shape, debug.dtype) == ((2,), (), (0,), dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse.cpu().double(), want_lse, atol=1e-5, rtol=1e-5)
    for got, want in zip([out] + [t.grad for t in tpu_in], [want_out] + [t.grad for t in ref_in]):
        assert got.dtype == dtype
        torch.testing.assert_close(got.cpu().double(), want.detach(), **tol)


@pytest.mark.usefixtures("no_fallback")
def test_cuda_flash_op_compiled():
    """Under ``torch.compile(backend="tpu")`` the op traces through PyTorch's meta function and runs
    (forward and backward) to the eager results."""
    q, k, v = (_randn(1, 2, 9, 8, seed=s).bfloat16() for s in range(3))

    def fn(q, k, v):
        out, lse = FLASH(q, k, v, 0.0, True)[:2]
        return out.float() * lse.exp()[..., None]

    torch._dynamo.reset()
    got = _sdpa_grads("tpu", torch.compile(fn, backend="tpu", fullgraph=True), q, k, v)
    for a, b in zip(got, _sdpa_grads("tpu", fn, q, k, v)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kwargs, match", [
    (dict(dropout_p=0.1), "dropout_p > 0"), (dict(return_debug_mask=True), "return_debug_mask=True"),
    (dict(is_causal=True, kv_length=5), "is_causal flag when seqlen_q != seqlen_k")])
def test_cuda_flash_op_refuses_what_it_does_not_lower(kwargs, match):
    kv_length = kwargs.pop("kv_length", 6)
    q, k = torch.zeros(1, 2, 6, 4, device="tpu"), torch.zeros(1, 2, kv_length, 4, device="tpu")
    with pytest.raises(NotImplementedError, match=match):
        aten._scaled_dot_product_flash_attention(q, k, k, **kwargs)
