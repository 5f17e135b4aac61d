"""Elementwise ops: unary and binary tables, read by one registration function each."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import jax.scipy.special as jss
from jax import lax

from torchtpu.ops.dtypes import promote
from torchtpu.ops.registry import aten, lowering
from torchtpu.runtime.dtypes import scalar_type_name, to_jax_dtype


def _floating_or_complex(x, kernel: str) -> bool:
    """True for a floating or complex array; PyTorch's CPU error for the others (its kernel has none)."""
    if jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.complexfloating):
        return True
    raise NotImplementedError(f'"{kernel}" not implemented for \'{scalar_type_name(x.dtype)}\'')


def _not_bool(x, kernel: str) -> bool:
    """True unless ``x`` is boolean, where PyTorch's kernel has no case (``abs``): its error."""
    if x.dtype == jnp.bool_:
        raise NotImplementedError(f'"{kernel}" not implemented for \'Bool\'')
    return True


def _unary(kind: str, fn):
    def lower(x):
        compute, result = promote(x, kind=kind)
        return fn(x.astype(compute)).astype(result)

    return lower


def _sign(x):
    """-1, 0 or 1 (NaN gives 0, as in PyTorch); bools stay; complex: x / |x|."""
    if x.dtype == jnp.bool_:
        return x
    if jnp.iscomplexobj(x):
        return jnp.sign(x)
    return (x > 0).astype(x.dtype) - (x < 0).astype(x.dtype)


# aten op → (type promotion kind, jnp implementation)
UNARY = {
    aten.neg: ("DEFAULT", jnp.negative),
    aten.abs: ("COMPLEX_TO_FLOAT", lambda x: _not_bool(x, "abs_cpu") and jnp.abs(x)),
    aten.exp: ("INT_TO_FLOAT", jnp.exp),
    aten.exp2: ("INT_TO_FLOAT", jnp.exp2),
    aten.expm1: ("INT_TO_FLOAT", jnp.expm1),
    aten.log: ("INT_TO_FLOAT", jnp.log),
    aten.log2: ("INT_TO_FLOAT", jnp.log2),
    aten.log10: ("INT_TO_FLOAT", jnp.log10),
    aten.log1p: ("INT_TO_FLOAT", jnp.log1p),
    aten.sqrt: ("INT_TO_FLOAT", jnp.sqrt),
    aten.rsqrt: ("INT_TO_FLOAT", lax.rsqrt),
    aten.sin: ("INT_TO_FLOAT", jnp.sin),
    aten.cos: ("INT_TO_FLOAT", jnp.cos),
    aten.tan: ("INT_TO_FLOAT", jnp.tan),
    aten.asin: ("INT_TO_FLOAT", jnp.arcsin),
    aten.acos: ("INT_TO_FLOAT", jnp.arccos),
    aten.atan: ("INT_TO_FLOAT", jnp.arctan),
    aten.sinh: ("INT_TO_FLOAT", jnp.sinh),
    aten.cosh: ("INT_TO_FLOAT", jnp.cosh),
    aten.tanh: ("INT_TO_FLOAT", jnp.tanh),
    aten.asinh: ("INT_TO_FLOAT", jnp.arcsinh),
    aten.acosh: ("INT_TO_FLOAT", jnp.arccosh),
    aten.atanh: ("INT_TO_FLOAT", jnp.arctanh),
    aten.sigmoid: ("INT_TO_FLOAT", jax.nn.sigmoid),
    aten.erf: ("INT_TO_FLOAT", jax.scipy.special.erf),
    aten.erfc: ("INT_TO_FLOAT", jax.scipy.special.erfc),
    aten.erfinv: ("INT_TO_FLOAT", jax.scipy.special.erfinv),
    aten.reciprocal: ("INT_TO_FLOAT", jnp.reciprocal),
    aten.floor: ("DEFAULT", lambda x: x if jnp.issubdtype(x.dtype, jnp.integer) else jnp.floor(x)),
    aten.ceil: ("DEFAULT", lambda x: x if jnp.issubdtype(x.dtype, jnp.integer) else jnp.ceil(x)),
    aten.trunc: ("DEFAULT", lambda x: x if jnp.issubdtype(x.dtype, jnp.integer) else jnp.trunc(x)),
    aten.frac: ("DEFAULT", lambda x: x - jnp.trunc(x) if _floating_or_complex(x, "frac_cpu") else x),
    aten.sign: ("DEFAULT", _sign),
    aten.sgn: ("DEFAULT", _sign),
    aten.bitwise_not: ("DEFAULT", lambda x: jnp.logical_not(x) if x.dtype == jnp.bool_ else jnp.invert(x)),
    aten.logical_not: ("ALWAYS_BOOL", lambda x: jnp.logical_not(x)),
    aten.isnan: ("ALWAYS_BOOL", jnp.isnan),
    aten.isinf: ("ALWAYS_BOOL", jnp.isinf),
    aten.isfinite: ("ALWAYS_BOOL", jnp.isfinite),
    aten.signbit: ("ALWAYS_BOOL", jnp.signbit),
    aten.lgamma: ("INT_TO_FLOAT", jax.scipy.special.gammaln),
    # digamma(±0) is ∓inf in PyTorch (JAX says NaN)
    aten.digamma: ("INT_TO_FLOAT", lambda x: jnp.where(x == 0, jnp.copysign(jnp.inf, -x), jss.digamma(x))),
    aten.i0: ("INT_TO_FLOAT", jax.scipy.special.i0),
    aten._conj_physical: ("DEFAULT", jnp.conj),  # conj_physical itself is composite: keep its autograd
    aten.deg2rad: ("INT_TO_FLOAT", jnp.deg2rad),
    aten.rad2deg: ("INT_TO_FLOAT", jnp.rad2deg),
    aten.special_erfcx: ("INT_TO_FLOAT", jss.erfcx),
    aten.special_ndtri: ("INT_TO_FLOAT", jss.ndtri),
    aten.special_log_ndtr: ("INT_TO_FLOAT", jss.log_ndtr),
    aten.special_i0e: ("INT_TO_FLOAT", jss.i0e),
    aten.special_i1: ("INT_TO_FLOAT", jss.i1),
    aten.special_i1e: ("INT_TO_FLOAT", jss.i1e),
    aten.special_entr: ("INT_TO_FLOAT", jss.entr),
    aten.special_modified_bessel_i0: ("INT_TO_FLOAT", jss.i0),
    aten.special_modified_bessel_i1: ("INT_TO_FLOAT", jss.i1),
    aten.special_spherical_bessel_j0: ("INT_TO_FLOAT", lambda x: jnp.where(
        x == 0, 1, jnp.where(jnp.isinf(x), 0, jnp.sin(x) / x))),
}


@lowering(aten.angle.default)
def angle(x):
    """Complex: the argument as a real; real: pi below zero, else 0 (NaN stays); ints give floats."""
    if jnp.iscomplexobj(x):
        return jnp.angle(x)
    compute, result = promote(x, kind="INT_TO_FLOAT")
    x = x.astype(compute)
    return jnp.where(x < 0, jnp.pi, jnp.where(jnp.isnan(x), x, 0)).astype(result)


def _register_unary():
    for op, (kind, fn) in UNARY.items():
        overloads = [getattr(op, "default")]
        lowering(*overloads)(_unary(kind, fn))


_register_unary()


@lowering(aten.round.default)
def round_(x):
    return x if jnp.issubdtype(x.dtype, jnp.integer) else jnp.round(x)


@lowering(aten.round.decimals)
def round_decimals(x, *, decimals=0):
    scale = 10.0 ** decimals
    return (jnp.round(x * scale) / scale).astype(x.dtype)


# ---------------------------------------------------------------- binary

def _binary(kind: str, fn):
    """A lowering for ``op(self, other)``; either may be a Python number."""

    def lower(a, b):
        compute, result = promote(a, b, kind=kind)
        return fn(jnp.asarray(a).astype(compute), jnp.asarray(b).astype(compute)).astype(result)

    return lower


def logaddexp_complex(a, b):
    """log(exp(a) + exp(b)) for complex numbers, on the branch PyTorch picks (that of the larger)."""
    swap = a.real < b.real
    hi, lo = jnp.where(swap, b, a), jnp.where(swap, a, b)
    out = hi + jnp.log1p(jnp.exp(lo - hi))
    return jnp.where(jnp.isneginf(hi.real), hi, out)


def _true_divide(a, b):
    return jnp.true_divide(a, b)


def _remainder(a, b):
    if jnp.issubdtype(a.dtype, jnp.integer):
        return jnp.remainder(a, b)
    mod = jnp.fmod(a, b)  # exact; the sign fix-up is PyTorch's (Python's) rule
    return jnp.where((mod != 0) & ((b < 0) != (mod < 0)), mod + b, mod)


def _fmod(a, b):
    return jnp.fmod(a, b)


BINARY = {
    aten.mul: ("DEFAULT", jnp.multiply),
    aten.div: ("INT_TO_FLOAT", _true_divide),
    aten.true_divide: ("INT_TO_FLOAT", _true_divide),
    aten.remainder: ("DEFAULT", _remainder),
    aten.fmod: ("DEFAULT", _fmod),
    aten.atan2: ("INT_TO_FLOAT", jnp.arctan2),
    aten.maximum: ("DEFAULT", jnp.maximum),
    aten.minimum: ("DEFAULT", jnp.minimum),
    aten.fmax: ("DEFAULT", jnp.fmax),
    aten.fmin: ("DEFAULT", jnp.fmin),
    aten.hypot: ("DEFAULT", jnp.hypot),
    aten.copysign: ("INT_TO_FLOAT", jnp.copysign),
    aten.nextafter: ("DEFAULT", jnp.nextafter),
    aten.xlogy: ("INT_TO_FLOAT", jax.scipy.special.xlogy),
    aten.logaddexp: ("DEFAULT", lambda a, b: (logaddexp_complex if jnp.iscomplexobj(a) else jnp.logaddexp)(a, b)),
    aten.logaddexp2: ("DEFAULT", jnp.logaddexp2),
    aten.bitwise_and: ("DEFAULT", jnp.bitwise_and),
    aten.bitwise_or: ("DEFAULT", jnp.bitwise_or),
    aten.bitwise_xor: ("DEFAULT", jnp.bitwise_xor),
    aten.bitwise_left_shift: ("DEFAULT", jnp.left_shift),
    aten.bitwise_right_shift: ("DEFAULT", jnp.right_shift),
    aten.__lshift__: ("DEFAULT", jnp.left_shift),  # the operators `x << n`, `x >> n`
    aten.__rshift__: ("DEFAULT", jnp.right_shift),
    aten.logical_and: ("ALWAYS_BOOL", jnp.logical_and),
    aten.logical_or: ("ALWAYS_BOOL", jnp.logical_or),
    aten.logical_xor: ("ALWAYS_BOOL", jnp.logical_xor),
    aten.eq: ("ALWAYS_BOOL", jnp.equal),
    aten.ne: ("ALWAYS_BOOL", jnp.not_equal),
    aten.lt: ("ALWAYS_BOOL", jnp.less),
    aten.le: ("ALWAYS_BOOL", jnp.less_equal),
    aten.gt: ("ALWAYS_BOOL", jnp.greater),
    aten.ge: ("ALWAYS_BOOL", jnp.greater_equal),
    aten.igamma: ("DEFAULT", jss.gammainc),
    aten.igammac: ("DEFAULT", jss.gammaincc),
    aten.special_zeta: ("INT_TO_FLOAT", lambda x, q: _hurwitz_zeta(x, q)),
    aten.special_xlog1py: ("INT_TO_FLOAT", jss.xlog1py),
    aten.gcd: ("DEFAULT", jnp.gcd),
    aten.lcm: ("DEFAULT", jnp.lcm),
}

_BINARY_OVERLOADS = ("Tensor", "default", "Scalar", "Tensor_Tensor", "Tensor_Scalar", "Scalar_Tensor",
                     "other_scalar", "self_scalar", "Scalar_Other", "Scalar_Self", "x_scalar", "n_scalar")


# ---------------------------------------------------------------- orthogonal polynomials

def _polynomial(first, step, trig=None, trig_above: int = 0, shifted: bool = False):
    """``special_*_polynomial_*(x, n)``: degree trunc(n) by the three-term recurrence
    (``step(k, x, p_{k-1}, p_k) -> p_{k+1}``), 0 for n < 0, and PyTorch's closed trigonometric
    form for large n inside (-1, 1)."""

    def fn(x, n):
        x, n = jnp.broadcast_arrays(x, n)
        y = 2 * x - 1 if shifted else x
        n = jnp.trunc(n)

        def cond(state):
            return jnp.any(state[0] < n)

        def body(state):
            k, p, q = state
            active = k < n
            r = step(k, y, p, q)
            return k + 1, jnp.where(active, q, p), jnp.where(active, r, q)

        start = (jnp.ones((), x.dtype), jnp.ones_like(y), first(y))
        _, _, out = lax.while_loop(cond, body, start)
        if trig is not None:
            theta = jnp.arccos(jnp.clip(y, -1, 1))
            out = jnp.where((n > trig_above) & (jnp.abs(y) < 1), trig(theta, n), out)
        return jnp.where(n < 0, 0, jnp.where(n == 0, 1, out)).astype(x.dtype)

    return fn


def _chebyshev_step(k, y, p, q):
    return 2 * y * q - p


_CHEBYSHEV = {
    # kind: (p_1, closed form in theta = acos(y), degree above which it is used)
    "t": (lambda y: y, lambda t, n: jnp.cos(n * t), 6),
    "u": (lambda y: 2 * y, lambda t, n: jnp.sin((n + 1) * t) / jnp.sin(t), 8),
    "v": (lambda y: 2 * y - 1, lambda t, n: jnp.cos((n + 0.5) * t) / jnp.cos(t / 2), 8),
    "w": (lambda y: 2 * y + 1, lambda t, n: jnp.sin((n + 0.5) * t) / jnp.sin(t / 2), 8),
}
for _kind, (_first, _trig, _above) in _CHEBYSHEV.items():
    BINARY[getattr(aten, f"special_chebyshev_polynomial_{_kind}")] = (
        "INT_TO_FLOAT", _polynomial(_first, _chebyshev_step, _trig, _above))
    BINARY[getattr(aten, f"special_shifted_chebyshev_polynomial_{_kind}")] = (
        "INT_TO_FLOAT", _polynomial(_first, _chebyshev_step, _trig, _above, shifted=True))

BINARY.update({
    aten.special_hermite_polynomial_h: ("INT_TO_FLOAT", _polynomial(
        lambda x: 2 * x, lambda k, x, p, q: 2 * x * q - 2 * k * p)),
    aten.special_hermite_polynomial_he: ("INT_TO_FLOAT", _polynomial(
        lambda x: x, lambda k, x, p, q: x * q - k * p)),
    aten.special_laguerre_polynomial_l: ("INT_TO_FLOAT", _polynomial(
        lambda x: 1 - x, lambda k, x, p, q: ((2 * k + 1 - x) * q - k * p) / (k + 1))),
    aten.special_legendre_polynomial_p: ("INT_TO_FLOAT", _polynomial(
        lambda x: x, lambda k, x, p, q: ((2 * k + 1) * x * q - k * p) / (k + 1))),
})


def _register_binary():
    for packet, (kind, fn) in BINARY.items():
        for name in packet.overloads():
            if name in _BINARY_OVERLOADS:
                lowering(getattr(packet, name))(_binary(kind, fn))


_register_binary()


def _with_alpha(sign: int):
    def lower(a, b, *, alpha=1):
        if sign < 0 and (jnp.asarray(a).dtype == jnp.bool_ or jnp.asarray(b).dtype == jnp.bool_):
            raise NotImplementedError(
                "Subtraction, the `-` operator, with a bool tensor is not supported. If you are trying "
                "to invert a mask, use the `~` or `logical_not()` operator instead.")
        compute, result = promote(a, b)
        a, b = jnp.asarray(a).astype(compute), jnp.asarray(b).astype(compute)
        if not (isinstance(alpha, (int, float)) and alpha == 1):
            b = b * jnp.asarray(alpha).astype(compute)
        out = a + b if sign > 0 else a - b
        return out.astype(result)

    return lower


_add = _with_alpha(+1)
_sub = _with_alpha(-1)


def _rsub(a, b, *, alpha=1):
    """``other - alpha * self``."""
    return _sub(b, a, alpha=alpha)


@lowering(aten.add.Tensor)
def add(a, b, *, alpha=1):
    return _add(a, b, alpha=alpha)


@lowering(aten.add.Scalar)
def add_scalar(a, b, alpha=1):
    return _add(a, b, alpha=alpha)


@lowering(aten.sub.Tensor)
def sub(a, b, *, alpha=1):
    return _sub(a, b, alpha=alpha)


@lowering(aten.sub.Scalar)
def sub_scalar(a, b, alpha=1):
    return _sub(a, b, alpha=alpha)


@lowering(aten.rsub.Tensor)
def rsub(a, b, *, alpha=1):
    return _rsub(a, b, alpha=alpha)


@lowering(aten.rsub.Scalar)
def rsub_scalar(a, b, alpha=1):
    return _rsub(a, b, alpha=alpha)


@lowering(aten.div.Tensor_mode)
def div_mode(a, b, *, rounding_mode=None):
    return _div_mode(a, b, rounding_mode)


@lowering(aten.div.Scalar_mode)
def div_scalar_mode(a, b, *, rounding_mode=None):
    return _div_mode(a, b, rounding_mode)


def _div_mode(a, b, rounding_mode):
    if rounding_mode is None:
        compute, result = promote(a, b, kind="INT_TO_FLOAT")
        return jnp.true_divide(jnp.asarray(a).astype(compute), jnp.asarray(b).astype(compute)).astype(result)
    # PyTorch rounds in the result dtype itself (no float32 detour for half types): so do we
    _, result = promote(a, b)
    a, b = jnp.broadcast_arrays(jnp.asarray(a).astype(result), jnp.asarray(b).astype(result))
    if jnp.issubdtype(result, jnp.integer):
        return jnp.floor_divide(a, b) if rounding_mode == "floor" else lax.div(a, b)  # div: C truncation
    return _floor_divide_float(a, b) if rounding_mode == "floor" else jnp.trunc(a / b)


def _floor_divide_float(a, b):
    """Python's float floor division (exact quotient via fmod), as PyTorch computes it."""
    mod = jnp.fmod(a, b)
    div = (a - mod) / b
    div = jnp.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1, div)
    floor = jnp.floor(div)
    floor = jnp.where(div - floor > 0.5, floor + 1, floor)
    floor = jnp.where(div == 0, jnp.copysign(jnp.zeros_like(div), a / b), floor)
    return jnp.where(b == 0, a / b, floor)


@lowering(aten.floor_divide.default, aten.floor_divide.Scalar)
def floor_divide(a, b):
    return _div_mode(a, b, "floor")


@lowering(aten.where.self)
def where(cond, a, b):
    _, result = promote(a, b)
    return jnp.where(cond, jnp.asarray(a).astype(result), jnp.asarray(b).astype(result))


@lowering(aten.where.ScalarOther)
def where_scalar_other(cond, a, b):
    _, result = promote(a, b)
    return jnp.where(cond, a.astype(result), jnp.asarray(b).astype(result))


@lowering(aten.where.ScalarSelf)
def where_scalar_self(cond, a, b):
    _, result = promote(a, b)
    return jnp.where(cond, jnp.asarray(a).astype(result), b.astype(result))


@lowering(aten.clamp.default)
def clamp(x, min=None, max=None):
    _, result = promote(x, min, max)
    x = x.astype(result)
    if min is not None:
        x = jnp.maximum(x, jnp.asarray(min).astype(result))
    if max is not None:
        x = jnp.minimum(x, jnp.asarray(max).astype(result))
    return x


@lowering(aten.clamp.Tensor)
def clamp_tensor(x, min=None, max=None):
    _, result = promote(x, min, max)
    x = x.astype(result)
    if min is not None:
        x = jnp.maximum(x, min.astype(result))
    if max is not None:
        x = jnp.minimum(x, max.astype(result))
    return x


@lowering(aten.addcmul.default)
def addcmul(x, t1, t2, *, value=1):
    compute, result = promote(x, t1, t2)
    x, t1, t2 = x.astype(compute), t1.astype(compute), t2.astype(compute)
    return (x + jnp.asarray(value).astype(compute) * t1 * t2).astype(result)


@lowering(aten.addcdiv.default)
def addcdiv(x, t1, t2, *, value=1):
    if not (jnp.issubdtype(t1.dtype, jnp.inexact) or jnp.issubdtype(t2.dtype, jnp.inexact)):
        raise RuntimeError(
            "Integer division with addcdiv is no longer supported, and in a future release addcdiv will "
            "perform a true division of tensor1 and tensor2. The historic addcdiv behavior can be "
            "implemented as (input + value * torch.trunc(tensor1 / tensor2)).to(input.dtype) for integer "
            "inputs and as (input + value * tensor1 / tensor2) for float inputs. The future addcdiv behavior "
            "is just the latter implementation: (input + value * tensor1 / tensor2), for all dtypes.")
    compute, result = promote(x, t1, t2)
    x, t1, t2 = x.astype(compute), t1.astype(compute), t2.astype(compute)
    return (x + jnp.asarray(value).astype(compute) * (t1 / t2)).astype(result)


def _lerp(start, end, weight):
    """PyTorch's two-sided formula (exact at both ends), in opmath."""
    _floating_or_complex(start, "lerp_kernel_scalar" if jnp.ndim(weight) == 0 else "lerp_kernel_tensor")
    compute, result = promote(start, end, weight)
    start, end = start.astype(compute), end.astype(compute)
    weight = jnp.asarray(weight).astype(compute)
    diff = end - start
    out = jnp.where(jnp.abs(weight) < 0.5, start + weight * diff, end - diff * (1 - weight))
    return out.astype(result)


@lowering(aten.lerp.Scalar)
def lerp_scalar(start, end, weight):
    return _lerp(start, end, weight)


@lowering(aten.lerp.Tensor)
def lerp_tensor(start, end, weight):
    return _lerp(start, end, weight)


# ---------------------------------------------------------------- pow

def _pow_compute(a, b):
    compute, result = promote(a, b)
    return jnp.asarray(a).astype(compute), jnp.asarray(b).astype(compute), result


def _power(a, b):
    """jnp.power, with PyTorch's integer rule for negative exponents: 1 and -1 keep their
    powers, everything else gives 0."""
    if not jnp.issubdtype(a.dtype, jnp.integer):
        return jnp.power(a, b)
    a, b = jnp.broadcast_arrays(a, b)
    negative = jnp.where(a == 1, 1, jnp.where(a == -1, jnp.where(b % 2 == 0, 1, -1), 0)).astype(a.dtype)
    return jnp.where(b < 0, negative, jnp.power(a, jnp.maximum(b, 0)))


@lowering(aten.pow.Tensor_Tensor)
def pow_tensor(a, b):
    a, b, result = _pow_compute(a, b)
    return _power(a, b).astype(result)


@lowering(aten.pow.Scalar)
def pow_scalar_base(a, b):
    a, b, result = _pow_compute(a, b)
    return _power(a, b).astype(result)


# PyTorch's CPU kernel special-cases these exponents; the same formulas give the same roundings
_POW_BY_EXPONENT = {
    2: lambda x: x * x,
    3: lambda x: x * x * x,
    0.5: jnp.sqrt,
    -0.5: lax.rsqrt,
    -1: lambda x: 1 / x,
    -2: lambda x: 1 / (x * x),
}


@lowering(aten.pow.Tensor_Scalar, static_scalars=True)
def pow_tensor_scalar(x, exponent):
    """A static exponent: integer powers by multiplication, PyTorch's special cases, its errors."""
    compute, result = promote(x, exponent)
    x = x.astype(compute)
    if compute == jnp.bool_:
        return x if exponent else jnp.ones_like(x)
    if jnp.issubdtype(compute, jnp.integer):
        if exponent < 0:
            raise RuntimeError("Integers to negative integer powers are not allowed.")
        return lax.integer_pow(x, int(exponent)).astype(result)
    if not jnp.iscomplexobj(x) and not isinstance(exponent, complex) and exponent in _POW_BY_EXPONENT:
        return _POW_BY_EXPONENT[exponent](x).astype(result)
    return jnp.power(x, jnp.asarray(exponent, compute)).astype(result)


# ---------------------------------------------------------------- special functions, complex

def _hurwitz_zeta(s, q):
    """zeta(s, q) for any q: JAX's series needs q > 0, so shift negative q up one step at a time
    (zeta(s, q) = q^-s + zeta(s, q + 1)), as PyTorch's direct summation effectively does."""
    s, q = jnp.broadcast_arrays(s, q)
    # q below -2^20 would need that many steps; leave those to JAX's formula
    shiftable = jnp.isfinite(q) & (q > -(2.0 ** 20))

    def cond(state):
        return jnp.any(shiftable & (state[0] < 1))

    def body(state):
        q, acc = state
        step = shiftable & (q < 1)
        return jnp.where(step, q + 1, q), jnp.where(step, acc + q ** -s, acc)

    q, acc = lax.while_loop(cond, body, (q, jnp.zeros_like(q)))
    return acc + jss.zeta(s, q)


def _trigamma(x):
    """polygamma(1, x): reflection below 1/2, six recurrence steps, then the asymptotic series
    (the standard scheme PyTorch uses, so float32 results round alike)."""
    reflect = x < 0.5
    sin = jnp.sin(math.pi * x)
    result = jnp.where(reflect, -(math.pi ** 2) / (sin * sin), jnp.zeros_like(x))
    x = jnp.where(reflect, 1 - x, x)
    for _ in range(6):
        result = result + 1 / (x * x)
        x = x + 1
    ixx = 1 / (x * x)
    result = result + (1 + 1 / (2 * x) + ixx * (1 / 6 - ixx * (1 / 30 - ixx * (1 / 42)))) / x
    return jnp.where(reflect, -result, result)


@lowering(aten.polygamma.default)
def polygamma(n, x):
    compute, result = promote(x, kind="INT_TO_FLOAT")
    x = x.astype(compute)
    if n == 0:
        return jss.digamma(x).astype(result)
    if n == 1:
        return _trigamma(x).astype(result)
    # polygamma(n, x) = (-1)^(n+1) n! zeta(n+1, x)
    scale = (-1.0) ** (n + 1) * math.factorial(n)
    wide = jnp.float64  # the shifted sum loses float32 digits; PyTorch's float32 kernel does not
    return (scale * _hurwitz_zeta(jnp.asarray(n + 1, wide), x.astype(wide))).astype(result)


@lowering(aten.frexp.Tensor)
def frexp(x):
    mantissa, exponent = jnp.frexp(x)
    return mantissa.astype(x.dtype), exponent.astype(jnp.int32)


@lowering(aten.complex.default)
def complex_(real, imag):
    _, dtype = promote(real, imag)
    real, imag = jnp.broadcast_arrays(real.astype(dtype), imag.astype(dtype))
    return lax.complex(real, imag)


@lowering(aten.polar.default)
def polar(abs, angle):
    _, dtype = promote(abs, angle)
    abs, angle = jnp.broadcast_arrays(abs.astype(dtype), angle.astype(dtype))
    return lax.complex(abs * jnp.cos(angle), abs * jnp.sin(angle))



# Graph-only: eager resolves PyTorch's lazy conjugate and negation bits in the bridge; a graph
# computes them. The prims are what some decompositions produce (fma exists once Inductor is
# imported, so it is registered by name).
lowering(aten._conj.default, graph_only=True)(jnp.conj)
lowering(aten._neg_view.default, graph_only=True)(jnp.negative)


@lowering("prims::fma", graph_only=True)
def _fma(a, b, c):
    return a * b + c


@lowering("prims::convert_element_type", graph_only=True)
def _convert_element_type(x, dtype):
    return x.astype(to_jax_dtype(dtype))
