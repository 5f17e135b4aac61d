"""Elementwise ops: unary and binary tables, read by one registration function each."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from torchtpu.ops.dtypes import promote
from torchtpu.ops.registry import aten, lowering


def _unary(kind: str, fn):
    def lower(x):
        compute, result = promote(x, kind=kind)
        return fn(x.astype(compute)).astype(result)

    return lower


# aten op → (type promotion kind, jnp implementation)
UNARY = {
    aten.neg: ("DEFAULT", jnp.negative),
    aten.abs: ("COMPLEX_TO_FLOAT", jnp.abs),
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
    aten.frac: ("DEFAULT", lambda x: x - jnp.trunc(x)),
    aten.sign: ("DEFAULT", jnp.sign),
    aten.sgn: ("DEFAULT", jnp.sign),
    aten.bitwise_not: ("DEFAULT", lambda x: jnp.logical_not(x) if x.dtype == jnp.bool_ else jnp.invert(x)),
    aten.logical_not: ("ALWAYS_BOOL", lambda x: jnp.logical_not(x)),
    aten.isnan: ("ALWAYS_BOOL", jnp.isnan),
    aten.isinf: ("ALWAYS_BOOL", jnp.isinf),
    aten.isfinite: ("ALWAYS_BOOL", jnp.isfinite),
    aten.signbit: ("ALWAYS_BOOL", jnp.signbit),
    aten.lgamma: ("INT_TO_FLOAT", jax.scipy.special.gammaln),
    aten.digamma: ("INT_TO_FLOAT", jax.scipy.special.digamma),
    aten.i0: ("INT_TO_FLOAT", jax.scipy.special.i0),
    aten.angle: ("COMPLEX_TO_FLOAT", jnp.angle),
    aten.conj_physical: ("DEFAULT", jnp.conj),
    aten.deg2rad: ("INT_TO_FLOAT", jnp.deg2rad),
    aten.rad2deg: ("INT_TO_FLOAT", jnp.rad2deg),
}


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


def _true_divide(a, b):
    return jnp.true_divide(a, b)


def _remainder(a, b):
    if jnp.issubdtype(a.dtype, jnp.integer):
        return jnp.remainder(a, b)
    return a - jnp.floor(a / b) * b


def _fmod(a, b):
    return jnp.fmod(a, b)


def _pow(a, b):
    return jnp.power(a, b)


BINARY = {
    aten.mul: ("DEFAULT", jnp.multiply),
    aten.div: ("INT_TO_FLOAT", _true_divide),
    aten.true_divide: ("INT_TO_FLOAT", _true_divide),
    aten.remainder: ("DEFAULT", _remainder),
    aten.fmod: ("DEFAULT", _fmod),
    aten.pow: ("DEFAULT", _pow),
    aten.atan2: ("INT_TO_FLOAT", jnp.arctan2),
    aten.maximum: ("DEFAULT", jnp.maximum),
    aten.minimum: ("DEFAULT", jnp.minimum),
    aten.fmax: ("DEFAULT", jnp.fmax),
    aten.fmin: ("DEFAULT", jnp.fmin),
    aten.hypot: ("DEFAULT", jnp.hypot),
    aten.copysign: ("INT_TO_FLOAT", jnp.copysign),
    aten.nextafter: ("DEFAULT", jnp.nextafter),
    aten.xlogy: ("INT_TO_FLOAT", jax.scipy.special.xlogy),
    aten.logaddexp: ("DEFAULT", jnp.logaddexp),
    aten.logaddexp2: ("DEFAULT", jnp.logaddexp2),
    aten.bitwise_and: ("DEFAULT", jnp.bitwise_and),
    aten.bitwise_or: ("DEFAULT", jnp.bitwise_or),
    aten.bitwise_xor: ("DEFAULT", jnp.bitwise_xor),
    aten.bitwise_left_shift: ("DEFAULT", jnp.left_shift),
    aten.bitwise_right_shift: ("DEFAULT", jnp.right_shift),
    aten.logical_and: ("ALWAYS_BOOL", jnp.logical_and),
    aten.logical_or: ("ALWAYS_BOOL", jnp.logical_or),
    aten.logical_xor: ("ALWAYS_BOOL", jnp.logical_xor),
    aten.eq: ("ALWAYS_BOOL", jnp.equal),
    aten.ne: ("ALWAYS_BOOL", jnp.not_equal),
    aten.lt: ("ALWAYS_BOOL", jnp.less),
    aten.le: ("ALWAYS_BOOL", jnp.less_equal),
    aten.gt: ("ALWAYS_BOOL", jnp.greater),
    aten.ge: ("ALWAYS_BOOL", jnp.greater_equal),
}

_BINARY_OVERLOADS = ("Tensor", "default", "Scalar", "Tensor_Tensor", "Tensor_Scalar", "Scalar_Tensor")


def _register_binary():
    for packet, (kind, fn) in BINARY.items():
        for name in packet.overloads():
            if name in _BINARY_OVERLOADS:
                lowering(getattr(packet, name))(_binary(kind, fn))


_register_binary()


def _with_alpha(sign: int, reverse: bool = False):
    def lower(a, b, *, alpha=1):
        compute, result = promote(a, b)
        a, b = jnp.asarray(a).astype(compute), jnp.asarray(b).astype(compute)
        if not (isinstance(alpha, (int, float)) and alpha == 1):
            b = b * jnp.asarray(alpha).astype(compute)
        out = (b - a) if reverse else (a + sign * b if sign > 0 else a - b)
        return out.astype(result)

    return lower


_add = _with_alpha(+1)
_sub = _with_alpha(-1)
_rsub = _with_alpha(-1, reverse=True)


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
    compute, result = promote(a, b)
    a, b = jnp.asarray(a).astype(compute), jnp.asarray(b).astype(compute)
    if jnp.issubdtype(compute, jnp.integer):
        if rounding_mode == "floor":
            return jnp.floor_divide(a, b).astype(result)
        q = lax.div(a, b)  # C-style truncation
        return q.astype(result)
    q = a / b
    return (jnp.floor(q) if rounding_mode == "floor" else jnp.trunc(q)).astype(result)


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
    _, result = promote(x, t1, t2)
    return (x + jnp.asarray(value).astype(result) * t1 * t2).astype(result)


@lowering(aten.addcdiv.default)
def addcdiv(x, t1, t2, *, value=1):
    _, result = promote(x, t1, t2)
    return (x + jnp.asarray(value).astype(result) * (t1 / t2)).astype(result)


@lowering(aten.lerp.Scalar)
def lerp_scalar(start, end, weight):
    _, result = promote(start, end)
    return (start + jnp.asarray(weight).astype(result) * (end - start)).astype(result)


@lowering(aten.lerp.Tensor)
def lerp_tensor(start, end, weight):
    _, result = promote(start, end, weight)
    return (start + weight * (end - start)).astype(result)
