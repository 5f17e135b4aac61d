"""F.linear_cross_entropy's chunked path on tpu (ops/losses.py): eager (both modes) and compiled,
forward and backward, against the unfused PyTorch CPU loss; and its memory stays chunked."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F
from torch.nn import LinearCrossEntropyOptions

from torchtpu.ops import losses

N, D, V = 300, 16, 50  # chunks of losses.MIN_CHUNK_ROWS (128) rows: the last one partial


def _inputs(bias: bool, class_weight: bool):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g)
    target = torch.randint(0, V, (N,), generator=g)
    target[3] = -100  # ignored
    extra = {}
    if bias:
        extra["linear_bias"] = torch.randn(V, generator=g)
    if class_weight:
        extra["weight"] = torch.rand(V, generator=g)
    return x, w, target, extra


def _run(fn, x, w, target, extra, device):
    """The loss and the gradients of input, linear_weight (and linear_bias) on ``device``."""
    leaves = [t.detach().to(device).requires_grad_() for t in (x, w)]
    kwargs = {k: v.detach().to(device).requires_grad_() if k == "linear_bias" else v.to(device)
              for k, v in extra.items()}
    out = fn(*leaves, target.to(device), **kwargs)
    (out * torch.linspace(0.5, 1.5, out.numel(), device=device).reshape(out.shape)).sum().backward()  # uneven upstream
    grads = [t.grad for t in leaves] + ([kwargs["linear_bias"].grad] if "linear_bias" in kwargs else [])
    return [out.detach().cpu()] + [g.cpu() for g in grads]


def _chunked(reduction):
    # 64: our lowerings raise it to 128 rows; reduction="none"'s backward (PyTorch's loop) uses 64
    options = LinearCrossEntropyOptions(batch_chunk_size=64, allow_retain_graph=True)
    return lambda x, w, t, **kw: F.linear_cross_entropy(x, w, t, reduction=reduction, options=options, **kw)


def _reference(reduction):
    def loss(x, w, t, linear_bias=None, weight=None):
        return F.cross_entropy(F.linear(x, w, linear_bias), t, weight=weight, reduction=reduction)
    return loss


def _compare(got, expected):
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


@pytest.mark.usefixtures("no_fallback")
@pytest.mark.parametrize("reduction,bias,class_weight", [("mean", True, False), ("sum", False, True),
                                                         ("none", True, True)])
def test_eager_matches_unfused_cpu_loss(each_eager_mode, reduction, bias, class_weight):
    x, w, target, extra = _inputs(bias, class_weight)
    _compare(_run(_chunked(reduction), x, w, target, extra, "tpu"),
             _run(_reference(reduction), x, w, target, extra, "cpu"))


@pytest.mark.usefixtures("no_fallback")
@pytest.mark.parametrize("reduction", ["mean", pytest.param("none", marks=pytest.mark.slow)])
def test_compiled_matches_unfused_cpu_loss(reduction):
    torch._dynamo.reset()
    x, w, target, extra = _inputs(bias=True, class_weight=False)
    compiled = torch.compile(_chunked(reduction), backend="tpu", fullgraph=True)
    _compare(_run(compiled, x, w, target, extra, "tpu"), _run(_reference(reduction), x, w, target, extra, "cpu"))


def test_probability_targets_and_all_ignored_rows():
    x, w, _, _ = _inputs(False, False)
    probs = torch.softmax(torch.randn(N, V), 1)
    options = LinearCrossEntropyOptions(batch_chunk_size=64)
    got = F.linear_cross_entropy(x.to("tpu"), w.to("tpu"), probs.to("tpu"), options=options)
    torch.testing.assert_close(got.cpu(), F.cross_entropy(x @ w.T, probs), rtol=1e-4, atol=1e-5)
    ignored = torch.full((N,), -100)  # mean over no rows: NaN, as PyTorch
    assert torch.isnan(F.linear_cross_entropy(x.to("tpu"), w.to("tpu"), ignored.to("tpu"), options=options).cpu())


def test_memory_stays_chunked():
    """XLA's own accounting of the compiled loss-and-gradients program: its temporaries stay well
    under one (tokens x vocab) logits matrix, which the unfused loss needs several of."""
    n, d, v, chunk = 1024, 64, 4096, 64
    x, w = jnp.ones((n, d), jnp.float32), jnp.ones((v, d), jnp.float32)
    target = jnp.zeros((n,), jnp.int64)

    def fused(x, w, target):
        return losses.chunked_loss_and_grads(x, w, target, None, None, "mean", -100, chunk, torch.float32,
                                             (True, True, False))[:3]

    def unfused(x, w, target):
        def loss(x, w):
            logits = x @ w.T
            return (jax.nn.logsumexp(logits, 1) - jnp.take_along_axis(logits, target[:, None], 1)[:, 0]).mean()
        return (loss(x, w), *jax.grad(loss, argnums=(0, 1))(x, w))

    def temp_bytes(fn):
        return jax.jit(fn).lower(x, w, target).compile().memory_analysis().temp_size_in_bytes

    logits_bytes = n * v * 4
    assert temp_bytes(fused) < logits_bytes / 4
    assert temp_bytes(unfused) >= logits_bytes
