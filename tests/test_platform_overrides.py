"""Platform overrides: a kernel written for one platform replaces the generic lowering there, in
eager and compiled code alike, and the generic lowering stays the reference it is checked against."""

from __future__ import annotations

import contextlib

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from torchtpu.ops import registry

aten = torch.ops.aten


@contextlib.contextmanager
def override(op, platform, fn):
    registry.add_override(op, platform, fn)
    try:
        yield
    finally:
        registry.add_override(op, platform, None)


def _gelu_tanh_form(x, approximate="none"):
    # the same function written another way, as a platform's own kernel would be
    from jax.scipy.special import erf

    return (0.5 * x * (1.0 + erf(x * (1.0 / np.sqrt(2.0))))).astype(x.dtype)


def _wrong_gelu(x, approximate="none"):
    return x * 0.5


def test_override_replaces_the_lowering_on_its_platform():
    calls = []

    def traced(x, approximate="none"):
        calls.append(x.shape)
        return _gelu_tanh_form(x, approximate)

    x = torch.randn(5, 7)
    with override(aten.gelu.default, "cpu", traced):
        got = F.gelu(x.to("tpu")).cpu()
        assert calls, "the eager kernel did not use the cpu override"
        calls.clear()
        compiled = torch.compile(lambda t: F.gelu(t) * 2, backend="tpu")(x.to("tpu")).cpu()
        assert calls, "the compiled graph did not use the cpu override"
    torch.testing.assert_close(got, F.gelu(x))
    torch.testing.assert_close(compiled, F.gelu(x) * 2)
    # removed: the generic lowering is back (the eager kernel's cached program was dropped)
    calls.clear()
    F.gelu(x.to("tpu")).cpu()
    assert not calls


def test_override_on_another_platform_is_not_used():
    x = torch.randn(4)
    with override(aten.gelu.default, "tpu", _wrong_gelu):  # the tests run on XLA:CPU
        torch.testing.assert_close(F.gelu(x.to("tpu")).cpu(), F.gelu(x))


def test_reference_comparison_accepts_a_correct_override():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 3)), jnp.float32)
    with override(aten.gelu.default, "gpu", _gelu_tanh_form):
        registry.check_override(aten.gelu.default, "gpu", x)


def test_reference_comparison_catches_a_wrong_override():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 3)), jnp.float32)
    with override(aten.gelu.default, "cpu", _wrong_gelu):
        with pytest.raises(AssertionError, match="gelu.*differs from the reference"):
            registry.check_override(aten.gelu.default, "cpu", x)
    with override(aten.gelu.default, "cpu", lambda x, approximate="none": x.astype(jnp.float64)):
        with pytest.raises(AssertionError, match="float64"):
            registry.check_override(aten.gelu.default, "cpu", x)


def test_override_registration_errors():
    with pytest.raises(ValueError, match="unknown platform"):
        registry.lowering(aten.gelu.default, platform="npu")
    with override(aten.gelu.default, "cpu", _wrong_gelu):
        with pytest.raises(ValueError, match="already has a cpu override"):
            registry.add_override(aten.gelu.default, "cpu", _wrong_gelu)


def test_decorator_registers_an_override():
    @registry.lowering(aten.gelu.default, platform="gpu")
    def gelu_gpu(x, approximate="none"):
        return _gelu_tanh_form(x, approximate)

    try:
        assert registry.OVERRIDES[(aten.gelu.default, "gpu")] is gelu_gpu
        assert registry.LOWERINGS[aten.gelu.default].impl("gpu") is gelu_gpu
        assert registry.LOWERINGS[aten.gelu.default].impl("cpu") is registry.LOWERINGS[aten.gelu.default].fn
    finally:
        registry.add_override(aten.gelu.default, "gpu", None)
