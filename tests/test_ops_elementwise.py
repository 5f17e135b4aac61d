"""Elementwise ops on tpu against PyTorch's CPU results, with the CPU fallback off."""

import math

import pytest
import torch

pytestmark = pytest.mark.usefixtures("no_fallback")

S = torch.special


def make(shape, dtype, seed=0, low=-4.0, high=4.0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if not dtype.is_floating_point and not dtype.is_complex:
        return torch.randint(int(low), int(high), shape, generator=g).to(dtype)
    if dtype.is_complex:
        real, imag = make(shape, torch.float32, seed, low, high), make(shape, torch.float32, seed + 1, low, high)
        return torch.complex(real, imag)
    return (torch.rand(shape, generator=g, dtype=torch.float64) * (high - low) + low).to(dtype)


def tol(dtype):
    return {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=2e-3, rtol=2e-3)}.get(
        dtype, dict(atol=1e-5, rtol=2e-5) if dtype in (torch.float32, torch.complex64) else {})


def _on_tpu(inputs):
    return [x.to("tpu") if isinstance(x, torch.Tensor) else x for x in inputs]


def _upcast(x):
    return x.float() if isinstance(x, torch.Tensor) and x.dtype in (torch.bfloat16, torch.float16) else x


def check(fn, *inputs, dtype=torch.float32):
    """``fn`` on tpu equals ``fn`` on CPU. Where CPU has no kernel for a low-precision dtype
    ("... not implemented for 'BFloat16'"), the reference is the float32 result rounded to that
    dtype (tpu supports the op there, as CUDA does); where CPU raises anything else, tpu must raise
    the same exception type."""
    try:
        expected = fn(*inputs)
    except NotImplementedError as e:
        if "not implemented for" not in str(e) or not any(_upcast(x) is not x for x in inputs):
            with pytest.raises(NotImplementedError):
                fn(*_on_tpu(inputs))
            return
        expected = torch.utils._pytree.tree_map(
            lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t,
            fn(*[_upcast(x) for x in inputs]))
    except Exception as e:  # an argument error PyTorch makes: tpu must make it too, with the same type
        with pytest.raises(type(e)):
            fn(*_on_tpu(inputs))
        return
    got = fn(*_on_tpu(inputs))
    got = torch.utils._pytree.tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, got)
    torch.testing.assert_close(got, expected, equal_nan=True, **tol(dtype))


# ---------------------------------------------------------------- unary, by input domain

UNARY_ANY = {  # every real input is in the domain
    "erfcx": S.erfcx, "log_ndtr": S.log_ndtr, "ndtr": S.ndtr, "i0e": S.i0e, "i1": S.i1, "i1e": S.i1e,
    "modified_bessel_i0": S.modified_bessel_i0, "modified_bessel_i1": S.modified_bessel_i1,
    "spherical_bessel_j0": S.spherical_bessel_j0, "entr": S.entr, "sinc": torch.sinc,
    "nan_to_num": torch.nan_to_num, "isposinf": torch.isposinf, "isneginf": torch.isneginf,
    "sign": torch.sign, "sgn": torch.sgn, "angle": torch.angle, "frexp": torch.frexp,
    "digamma": torch.digamma, "trigamma": lambda x: torch.polygamma(1, x),
    "polygamma3": lambda x: torch.polygamma(3, x), "exp2": torch.exp2, "abs": torch.abs,
}
UNARY_POSITIVE = {
    "mvlgamma": lambda x: torch.mvlgamma(x + 2, 3), "zeta_q": lambda x: S.zeta(3.0, x), "log": torch.log,
    "polygamma2": lambda x: torch.polygamma(2, x),
}
UNARY_UNIT = {"ndtri": S.ndtri, "logit": torch.logit, "logit_eps": lambda x: torch.logit(x, 0.2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(UNARY_ANY) + list(UNARY_POSITIVE) + list(UNARY_UNIT))
def test_unary_floats(name, dtype):
    fn = {**UNARY_ANY, **UNARY_POSITIVE, **UNARY_UNIT}[name]
    low, high = (0.05, 0.95) if name in UNARY_UNIT else (0.1, 6.0) if name in UNARY_POSITIVE else (-6.0, 6.0)
    x = make((40,), dtype, low=low, high=high)
    if name in UNARY_ANY and dtype.is_floating_point:
        x[:4] = torch.tensor([0.0, float("inf"), float("-inf"), float("nan")])
    check(fn, x, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool], ids=str)
@pytest.mark.parametrize("name", ["sign", "sgn", "angle", "digamma", "erfcx", "i1", "abs", "exp2", "sinc"])
def test_unary_integers(name, dtype):
    check(UNARY_ANY[name], make((30,), dtype, low=-5, high=5), dtype=dtype)


def test_complex_unary():
    x = make((20,), torch.complex64)
    for fn in (torch.angle, torch.sgn, torch.abs, torch.exp, torch.conj_physical):
        check(fn, x, dtype=torch.complex64)


# ---------------------------------------------------------------- binary

BINARY_FLOAT = {
    "xlog1py": S.xlog1py, "xlogy": torch.xlogy, "zeta": lambda a, b: S.zeta(a.abs() + 1.5, b),
    "igamma": lambda a, b: torch.igamma(a.abs() + 0.1, b.abs()),
    "igammac": lambda a, b: torch.igammac(a.abs() + 0.1, b.abs()),
    "heaviside": torch.heaviside, "float_power": lambda a, b: torch.float_power(a.abs(), b),
    "floor_divide": torch.floor_divide, "div_floor": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "div_trunc": lambda a, b: torch.div(a, b, rounding_mode="trunc"), "remainder": torch.remainder,
    "fmod": torch.fmod, "copysign": torch.copysign, "nextafter": torch.nextafter,
    "clamp_min": torch.clamp_min, "clamp_max": torch.clamp_max,
    "ldexp": lambda a, b: torch.ldexp(a, b.round()),
    "logaddexp": torch.logaddexp, "logaddexp2": torch.logaddexp2, "hypot": torch.hypot,
    "isclose": lambda a, b: torch.isclose(a, a + b * 1e-6), "lerp": lambda a, b: torch.lerp(a, b, 0.7),
    "lerp_tensor": lambda a, b: torch.lerp(a, b, b.sigmoid()), "rsub": lambda a, b: torch.rsub(a, b, alpha=2),
    "addcmul": lambda a, b: torch.addcmul(a, a, b, value=0.5),
    "addcdiv": lambda a, b: torch.addcdiv(a, a, b, value=2),
    "pow": torch.pow, "pow_2": lambda a, b: a ** 2, "pow_half": lambda a, b: a.abs() ** 0.5,
    "pow_neg": lambda a, b: a ** -2, "pow_3_5": lambda a, b: a.abs() ** 3.5, "rpow": lambda a, b: 2.0 ** a,
    "complex": torch.complex, "polar": lambda a, b: torch.polar(a.abs(), b),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(BINARY_FLOAT))
def test_binary_floats(name, dtype):
    a, b = make((4, 5), dtype, 1), make((5,), dtype, 2)  # broadcasting
    b = torch.where(b.abs() < 0.2, torch.ones_like(b), b)  # keep divisors off zero
    check(BINARY_FLOAT[name], a, b, dtype=dtype)


BINARY_INT = {
    "floor_divide": torch.floor_divide, "div_floor": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "div_trunc": lambda a, b: torch.div(a, b, rounding_mode="trunc"), "remainder": torch.remainder,
    "fmod": torch.fmod, "gcd": torch.gcd, "lcm": torch.lcm, "pow": torch.pow, "rpow": lambda a, b: 3 ** b,
    "pow_scalar": lambda a, b: a ** 3, "shift_left": torch.bitwise_left_shift,
    "shift_right": torch.bitwise_right_shift, "and": torch.bitwise_and, "xor": torch.bitwise_xor,
    "true_divide": torch.true_divide, "heaviside": torch.heaviside, "clamp_min": torch.clamp_min,
}


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize("name", list(BINARY_INT))
def test_binary_integers(name, dtype):
    a = make((4, 6), dtype, 3, low=-9, high=9)
    b = make((6,), dtype, 4, low=-4, high=5)
    if name.startswith("shift"):
        b = b.abs()
    else:
        b = torch.where(b == 0, torch.ones_like(b), b)  # PyTorch raises on integer division by zero
    check(BINARY_INT[name], a, b, dtype=dtype)


def test_integer_pow_rules():
    base = torch.tensor([2, -1, 1, 0, 3, -2])
    check(torch.pow, base, torch.tensor([-1, -3, -2, -1, 4, 3]), dtype=torch.int64)
    with pytest.raises(RuntimeError, match="negative integer powers"):
        torch.pow(base.to("tpu"), -2)


def test_remainder_and_fmod_signs():
    a = torch.tensor([-7.0, 7.0, -7.0, 7.0, 0.0, -0.0, 5.5])
    b = torch.tensor([3.0, -3.0, -3.0, 3.0, -2.0, 2.0, float("inf")])
    for fn in (torch.remainder, torch.fmod, torch.floor_divide):
        check(fn, a, b)
        check(fn, torch.tensor([-7, 7, -7, 7, 0, 5]), torch.tensor([3, -3, -3, 3, -2, 4]), dtype=torch.int64)


def test_bitwise_on_bool():
    a, b = make((10,), torch.bool, 1), make((10,), torch.bool, 2)
    for fn in (torch.bitwise_and, torch.bitwise_or, torch.bitwise_xor, lambda x, y: torch.bitwise_not(x),
               torch.logical_xor, lambda x, y: x & True):
        check(fn, a, b, dtype=torch.bool)


def test_shifts_out_of_range():
    a = torch.tensor([1, -8, 5, -1], dtype=torch.int32)
    check(lambda x: x << 33, a, dtype=torch.int32)
    check(lambda x: x >> 33, a, dtype=torch.int32)


def test_half_division_rounds_in_the_dtype():
    # PyTorch divides half types in the dtype itself; a float32 detour differs near integers
    a, b = make((2000,), torch.bfloat16, 5, -30, 30), make((2000,), torch.bfloat16, 6, -3, 3)
    for mode in ("floor", "trunc"):
        check(lambda x, y: torch.div(x, y, rounding_mode=mode), a, b, dtype=torch.bfloat16)


# ---------------------------------------------------------------- special polynomials

POLYNOMIALS = ["chebyshev_polynomial_t", "chebyshev_polynomial_u", "chebyshev_polynomial_v",
               "chebyshev_polynomial_w", "shifted_chebyshev_polynomial_t", "shifted_chebyshev_polynomial_u",
               "shifted_chebyshev_polynomial_v", "shifted_chebyshev_polynomial_w", "hermite_polynomial_h",
               "hermite_polynomial_he", "laguerre_polynomial_l", "legendre_polynomial_p"]


@pytest.mark.parametrize("name", POLYNOMIALS)
def test_polynomials(name):
    x = make((60,), torch.float64, 7, -1.2, 1.2)
    x[:3] = torch.tensor([1.0, -1.0, float("nan")])
    if not getattr(S, name)(x[2], 3).isnan():  # torch < 2.14's CPU kernels return garbage for NaN
        x[2] = 0.5
    n = torch.arange(-2, 58).to(torch.float64) % 14 - 1  # degrees -1..12, both sides of the trig switch
    check(getattr(S, name), x, n, dtype=torch.float64)
    check(lambda t: getattr(S, name)(t, 3), x, dtype=torch.float64)  # Scalar n


# ---------------------------------------------------------------- 0-d, empty, views, autograd

@pytest.mark.parametrize("fn", [S.erfcx, torch.sinc, lambda t: torch.polygamma(1, t), lambda t: t ** 2,
                                lambda t: torch.floor_divide(t, 0.7), lambda t: torch.angle(t)])
@pytest.mark.parametrize("shape", [(), (0,), (0, 3)], ids=str)
def test_zero_dim_and_empty(fn, shape):
    check(fn, make(shape, torch.float32))


def test_non_contiguous_inputs():
    a = make((6, 4), torch.float32, 1).t()
    b = make((6, 4), torch.float32, 2)[::2]
    check(lambda x, y: torch.remainder(x[:, :3], y.t()), a, b)
    check(lambda x: S.i1e(x[::2]), a)


def test_in_place_and_out():
    x = make((5,), torch.float32)
    t = x.to("tpu")
    t.floor_divide_(0.7)
    torch.testing.assert_close(t.cpu(), x.floor_divide(0.7))
    out = torch.empty(5, device="tpu")
    torch.special.erfcx(x.to("tpu"), out=out)
    torch.testing.assert_close(out.cpu(), torch.special.erfcx(x))


GRAD = {
    "pow": lambda t: t.abs() ** 2.5, "xlogy": lambda t: torch.xlogy(t, t.abs() + 1), "erfcx": S.erfcx,
    "lerp": lambda t: torch.lerp(t, t * 2, 0.3), "remainder": lambda t: torch.remainder(t, 1.5),
    "logaddexp": lambda t: torch.logaddexp(t, t * 0.5), "i0e": S.i0e,
    "atan2": lambda t: torch.atan2(t, t + 3),
}


@pytest.mark.parametrize("name", list(GRAD))
def test_gradients(name):
    x = make((8,), torch.float32, 9)
    grads = []
    for device in ("cpu", "tpu"):
        leaf = x.detach().to(device).requires_grad_()
        GRAD[name](leaf).sum().backward()
        grads.append(leaf.grad.cpu())
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)


def test_pow_scalar_is_exact_for_small_integer_exponents():
    x = make((100,), torch.float32, 11)
    got = (x.to("tpu") ** 2).cpu()
    assert torch.equal(got, x ** 2)
    assert math.isclose(float((torch.tensor(3.0, device="tpu") ** 3).cpu()), 27.0)
