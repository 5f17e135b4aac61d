"""torch.special Bessel and Airy functions, and logit, on tpu against PyTorch's CPU results."""

import math

import pytest
import torch

pytestmark = pytest.mark.usefixtures("no_fallback")

S = torch.special
FUNCTIONS = {
    "airy_ai": S.airy_ai,
    "bessel_j0": S.bessel_j0,
    "bessel_j1": S.bessel_j1,
    "bessel_y0": S.bessel_y0,
    "bessel_y1": S.bessel_y1,
    "modified_bessel_k0": S.modified_bessel_k0,
    "modified_bessel_k1": S.modified_bessel_k1,
    "scaled_modified_bessel_k0": S.scaled_modified_bessel_k0,
    "scaled_modified_bessel_k1": S.scaled_modified_bessel_k1,
}
EDGES = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-6, -1e-6, 2.0, -2.0, 2.09, -2.09, 5.0, -5.0,
         8.3203353, 103.892, 103.9, -103.9, 1e4, -1e4, 1e30, -1e30]


def wide(dtype: torch.dtype) -> torch.Tensor:
    """Every branch of the piecewise approximations: dense near 0, sparse out to ±1e3, edges."""
    dense = torch.linspace(-12, 12, 4801, dtype=torch.float64)
    far = torch.logspace(-20, 3, 400, dtype=torch.float64)
    return torch.cat([dense, far, -far, torch.tensor(EDGES, dtype=torch.float64)]).to(dtype)


def check(fn, x: torch.Tensor, **tol) -> torch.Tensor:
    """``fn`` on tpu matches ``fn`` on CPU (values, NaN positions, dtype, shape)."""
    expected = fn(x)
    got = fn(x.to("tpu"))
    assert got.device.type == "tpu"
    torch.testing.assert_close(got.cpu(), expected, equal_nan=True, **tol)
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name", FUNCTIONS)
def test_wide_range(name, dtype):
    check(FUNCTIONS[name], wide(dtype))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8, torch.bool], ids=str)
@pytest.mark.parametrize("name", FUNCTIONS)
def test_integers_promote_to_float(name, dtype):
    low = -20 if dtype.is_signed else 0
    x = torch.tensor([False, True]) if dtype == torch.bool else torch.arange(low, 30).to(dtype)
    got = check(FUNCTIONS[name], x)
    assert got.dtype == torch.float32


@pytest.mark.parametrize("name", FUNCTIONS)
def test_shapes(name):
    """0-d, empty and non-contiguous inputs, and the out= variant."""
    fn = FUNCTIONS[name]
    check(fn, torch.tensor(1.5))
    check(fn, torch.empty(0, 3))
    base = torch.linspace(-7, 7, 48).reshape(6, 8)
    check(fn, base.t())
    check(fn, base[:, ::3])
    out = torch.empty(6, 8, device="tpu")
    result = fn(base.to("tpu"), out=out)
    assert result is out
    torch.testing.assert_close(out.cpu(), fn(base), equal_nan=True)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_compiled(name):
    fn = FUNCTIONS[name]
    x = torch.linspace(-10, 10, 101)
    compiled = torch.compile(lambda t: fn(t) * 2, backend="tpu")
    torch.testing.assert_close(compiled(x.to("tpu")).cpu(), fn(x) * 2, equal_nan=True)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_fused_eager_mode(name):
    """Deferred and fused with the ops around it, the result is the same."""
    fn, x = FUNCTIONS[name], wide(torch.float32)
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        got = (fn(x.to("tpu") * 1.0) + 1.0).cpu()
    torch.testing.assert_close(got, fn(x) + 1.0, equal_nan=True)


def test_airy_asymptotic_phase_float32():
    """Large negative x: the phase 2/3 |x|^1.5 must be rounded as in C++ (no reciprocal-multiply)."""
    check(S.airy_ai, torch.linspace(-120, -2.1, 3001), rtol=1.3e-6, atol=1e-6)


# ---------------------------------------------------------------- logit

UNIT = torch.tensor([0.0, 1e-3, 0.05, 0.2, 0.3, 0.5, 0.7, 0.8, 0.95, 1.0, -0.1, 1.1, math.nan])


@pytest.mark.parametrize("eps", [None, -0.1, 0.0, 0.2, 0.5, 0.6, 1.0, math.nan], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_logit_eps(eps, dtype):
    """PyTorch clamps to [eps, 1 - eps] with bounds rounded in the input dtype; eps < 0 or NaN: none."""
    check(lambda t: torch.logit(t, eps), UNIT.to(dtype))


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.bool], ids=str)
def test_logit_integers(dtype):
    x = torch.tensor([0, 1, 1, 0]).to(dtype)
    assert check(lambda t: torch.logit(t, 0.25), x).dtype == torch.float32


def test_logit_shapes():
    check(torch.logit, torch.tensor(0.3))
    check(lambda t: torch.logit(t, 0.1), torch.empty(0))
    check(lambda t: torch.logit(t, 0.1), torch.rand(5, 6).t())


@pytest.mark.parametrize("eps", [None, -0.1, 0.0, 0.2, 0.6], ids=str)
def test_logit_backward(eps):
    """Gradient: NaN outside [0, 1] without eps, zero outside [eps, 1 - eps] with one."""
    x = torch.tensor([-0.5, 0.0, 0.05, 0.3, 0.5, 0.95, 1.0, 1.5, math.nan])
    g = torch.linspace(-2, 2, x.numel())
    expected = torch.ops.aten.logit_backward(g, x, eps)
    got = torch.ops.aten.logit_backward(g.to("tpu"), x.to("tpu"), eps)
    torch.testing.assert_close(got.cpu(), expected, equal_nan=True)


@pytest.mark.parametrize("eps", [None, 0.2], ids=str)
def test_logit_autograd(eps):
    x = torch.rand(4, 5, dtype=torch.float64) * 0.98 + 0.01
    xc, xt = x.clone().requires_grad_(), x.to("tpu").requires_grad_()
    torch.logit(xc, eps).sum().backward()
    torch.logit(xt, eps).sum().backward()
    torch.testing.assert_close(xt.grad.cpu(), xc.grad)


def test_complex32_is_refused_clearly():
    """XLA has no complex32: chalf names the dtype instead of failing with a KeyError."""
    with pytest.raises(TypeError, match="complex32 is not supported on the tpu device"):
        torch.ones(2, device="tpu").chalf()
