"""Neural-network ops, forward and the backward ops autograd calls: activations, softmax,
normalisation, dropout, embedding, losses, distances, convolution, pooling and upsampling
(grid sampling and fractional pooling: ``sampling.py``).

Low-precision inputs compute in PyTorch's opmath dtype (fp32) and return in their own dtype.
Backward ops whose PyTorch formula is just "the derivative of the forward" are written as
``jax.vjp`` of the forward lowering, so the two can never disagree.

Ops that also write into arguments other than ``self`` (the batch norms' running statistics,
``rrelu_with_noise``'s noise) are lowered with ``mutates=``: they return the new values, which
eager writes back; compiled graphs use their functional forms
(``_native_batch_norm_legit_functional``, ``rrelu_with_noise_functional``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from torchtpu.ops import checks
from torchtpu.ops.dtypes import opmath, promote, to_jax_dtype, to_torch_dtype
from torchtpu.ops.dtypes import to_opmath as _up
from torchtpu.ops.precision import matmul_precision
from torchtpu.ops.registry import aten, lowering

# Dots that are not a user's product (a one-hot gather, interpolation weights) stay exact; matrix
# products and convolutions take torch's matmul precision (``precision.matmul_precision``).
HIGHEST = lax.Precision.HIGHEST


def _dim(dim: int, ndim: int) -> int:
    """Wrap a possibly negative ``dim``; a 0-d tensor accepts 0 and -1, as in PyTorch."""
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], but got {dim})")
    return dim % n


def _defined(grads, likes):
    """Zeros for the gradients autograd did not ask for: eager cannot return undefined tensors yet."""
    return tuple(jnp.zeros(shape, dtype) if g is None else g for g, (shape, dtype) in zip(grads, likes))


def _reduce(loss, reduction: int):
    """PyTorch's loss reductions: 0 none, 1 mean, 2 sum."""
    if reduction == 1:
        return jnp.mean(loss)
    if reduction == 2:
        return jnp.sum(loss)
    return loss


def _reduce_grad(grad, shape, reduction: int, n: int):
    """The gradient of ``_reduce`` at a loss of ``shape``."""
    grad = jnp.broadcast_to(grad, shape)
    return grad / n if reduction == 1 else grad


# ---------------------------------------------------------------- activations
# op → f(x, *scalars) computed in opmath; the output keeps x's dtype.

def _gelu(x, approximate="none"):
    if approximate == "tanh":
        inner = math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)
        return 0.5 * x * (1 + jnp.tanh(inner))
    return 0.5 * x * (1 + lax.erf(x * (1 / math.sqrt(2))))


def _gelu_grad(x, approximate="none"):
    if approximate == "tanh":
        k = math.sqrt(2 / math.pi)
        inner = k * (x + 0.044715 * x ** 3)
        t = jnp.tanh(inner)
        return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x)
    cdf = 0.5 * (1 + lax.erf(x * (1 / math.sqrt(2))))
    pdf = jnp.exp(-0.5 * x * x) * (1 / math.sqrt(2 * math.pi))
    return cdf + x * pdf


def _softplus(x, beta=1, threshold=20):
    return jnp.where(x * beta > threshold, x, jnp.log1p(jnp.exp(x * beta)) / beta)


def _elu(x, alpha=1, scale=1, input_scale=1):
    return jnp.where(x > 0, x * scale, jnp.expm1(x * input_scale) * (alpha * scale))


ACTIVATIONS = {
    aten.relu.default: lambda x: jnp.maximum(x, jnp.zeros((), x.dtype)),
    aten.threshold.default: lambda x, th, value: jnp.where(x <= th, jnp.asarray(value).astype(x.dtype), x),
    aten.gelu.default: _gelu,
    aten.silu.default: lambda x: x * jax.nn.sigmoid(x),
    aten.mish.default: lambda x: x * jnp.tanh(_softplus(x)),
    aten.elu.default: _elu,
    aten.celu.default: lambda x, alpha=1.0: _elu(x, alpha, 1, 1 / alpha),
    aten.leaky_relu.default: lambda x, slope=0.01: jnp.where(x > 0, x, x * slope),
    aten.hardtanh.default: lambda x, lo=-1, hi=1: jnp.minimum(jnp.maximum(x, lo), hi),
    aten.softplus.default: _softplus,
    aten.hardswish.default: lambda x: x * jnp.clip(x + 3, 0, 6) / 6,
    aten.hardsigmoid.default: lambda x: jnp.clip(x / 6 + 0.5, 0, 1),
    aten.softshrink.default: lambda x, lambd=0.5: jnp.where(x > lambd, x - lambd,
                                                            jnp.where(x < -lambd, x + lambd, 0)),
    aten.hardshrink.default: lambda x, lambd=0.5: jnp.where((x >= -lambd) & (x <= lambd), 0, x),
}


@lowering(aten.logit.default)
def logit(x, eps=None):
    compute, result = promote(x, kind="INT_TO_FLOAT")
    x = x.astype(opmath(compute))
    if eps is not None and eps >= 0:  # a negative or NaN eps means no clamping, as in PyTorch
        # bounds rounded in the input's dtype as PyTorch's kernel does, then its
        # x < lo ? lo : (x > hi ? hi : x), which differs from clip when eps > 0.5
        lo = np.asarray(eps, result)
        hi = np.asarray(1, result) - lo
        x = jnp.where(x < lo, lo, jnp.where(x > hi, hi, x)).astype(x.dtype)
    return jnp.log(x / (1 - x)).astype(result)


def _hardswish_grad(g, x):
    return jnp.where(x < -3, 0, jnp.where(x < 3, g * (x / 3 + 0.5), g))  # x == 3 takes g, as on CPU


def _mish_grad(g, x):
    sig = jax.nn.sigmoid(x)
    t = jnp.tanh(_softplus(x))
    return g * (t + x * sig * (1 - t * t))


def _softplus_grad(g, x, beta, threshold):
    z = jnp.exp(x * beta)
    return jnp.where(x * beta > threshold, g, g * z / (z + 1))


def _elu_grad(g, alpha, scale, input_scale, is_result, y):
    if is_result:
        neg = g * input_scale * (y + alpha * scale)
    else:
        neg = g * input_scale * alpha * scale * jnp.exp(y * input_scale)
    return jnp.where(y <= 0, neg, g * scale)


def _logit_grad(g, x, eps=None):
    grad = g / (x * (1 - x))
    if eps is None or not eps >= 0:  # unclamped: NaN outside [0, 1], as PyTorch's kernel
        return jnp.where((x < 0) | (x > 1), jnp.nan, grad)
    lo = np.asarray(eps, x.dtype)
    return jnp.where((x < lo) | (x > np.asarray(1, x.dtype) - lo), 0, grad)


# backward op → f(grad, *args) in opmath; the output takes grad's dtype
ACTIVATION_GRADS = {
    aten.threshold_backward.default: lambda g, x, th: jnp.where(x <= th, 0, g),
    aten.gelu_backward.default: lambda g, x, approximate="none": g * _gelu_grad(x, approximate),
    aten.silu_backward.default: lambda g, x: g * jax.nn.sigmoid(x) * (1 + x * (1 - jax.nn.sigmoid(x))),
    aten.mish_backward.default: _mish_grad,
    aten.sigmoid_backward.default: lambda g, y: g * (1 - y) * y,
    aten.tanh_backward.default: lambda g, y: g * (1 - y * y),
    aten.elu_backward.default: _elu_grad,
    aten.leaky_relu_backward.default: lambda g, x, slope, is_result: jnp.where(x > 0, g, g * slope),
    aten.hardtanh_backward.default: lambda g, x, lo, hi: jnp.where((x <= lo) | (x >= hi), 0, g),
    aten.softplus_backward.default: _softplus_grad,
    aten.hardswish_backward.default: _hardswish_grad,
    aten.hardsigmoid_backward.default: lambda g, x: jnp.where((x > -3) & (x < 3), g / 6, 0),
    aten.softshrink_backward.default: lambda g, x, lambd: jnp.where((x >= -lambd) & (x <= lambd), 0, g),
    aten.hardshrink_backward.default: lambda g, x, lambd: jnp.where((x >= -lambd) & (x <= lambd), 0, g),
    aten.logit_backward.default: _logit_grad,
}


# activations PyTorch also defines on integer tensors
_INTEGER_ACTIVATIONS = {aten.relu.default, aten.threshold.default, aten.hardtanh.default}


def _activation(op, fn):
    def lower(x, *args, **kwargs):
        if jnp.issubdtype(x.dtype, jnp.floating):
            return fn(_up(x), *args, **kwargs).astype(x.dtype)
        if op not in _INTEGER_ACTIVATIONS or x.dtype == jnp.bool_:
            raise RuntimeError(f'"{op._schema.name}" not implemented for {to_torch_dtype(x.dtype)} tensors')
        return fn(x, *args, **kwargs).astype(x.dtype)

    return lower


def _activation_grad(fn):
    def lower(g, *args, **kwargs):
        args = [_up(a) if isinstance(a, jax.Array) and not getattr(a, "weak_type", False) else a for a in args]
        return fn(_up(g), *args, **kwargs).astype(g.dtype)

    return lower


for _op, _fn in ACTIVATIONS.items():
    lowering(_op)(_activation(_op, _fn))
for _op, _fn in ACTIVATION_GRADS.items():
    lowering(_op)(_activation_grad(_fn))


@lowering(aten.log_sigmoid_forward.default)
def log_sigmoid_forward(x):
    y = jax.nn.log_sigmoid(_up(x)).astype(x.dtype)
    return y, jnp.zeros((0,), x.dtype)  # the buffer PyTorch's CPU kernel fills is not needed


@lowering(aten.log_sigmoid_backward.default)
def log_sigmoid_backward(g, x, buffer):
    return (_up(g) * jax.nn.sigmoid(-_up(x))).astype(g.dtype)


@lowering(aten.glu.default)
def glu(x, dim=-1):
    a, b = jnp.split(_up(x), 2, axis=_dim(dim, x.ndim))
    return (a * jax.nn.sigmoid(b)).astype(x.dtype)


@lowering(aten.glu_backward.default)
def glu_backward(g, x, dim):
    _, vjp = jax.vjp(lambda t: glu(t, dim), _up(x))
    return vjp(_up(g))[0].astype(x.dtype)


@lowering(aten._prelu_kernel.default)
def prelu(x, weight):
    w = _prelu_weight(weight, x.ndim)
    return jnp.where(x > 0, x, x * w).astype(x.dtype)


def _prelu_weight(weight, ndim):
    if weight.size == 1 or ndim < 2:
        return weight.reshape(())
    return weight.reshape((1, -1) + (1,) * (ndim - 2))


@lowering(aten._prelu_kernel_backward.default)
def prelu_backward(g, x, weight):
    gf, xf = _up(g), _up(x)
    w = _prelu_weight(_up(weight), x.ndim)
    gx = jnp.where(xf > 0, gf, gf * w)
    per_element = jnp.where(xf > 0, 0, gf * xf)
    shared = weight.size == 1 or x.ndim < 2
    axes = None if shared else tuple(i for i in range(x.ndim) if i != 1)
    gw = jnp.sum(per_element, axis=axes).reshape(weight.shape)
    return gx.astype(x.dtype), gw.astype(weight.dtype)


# ---------------------------------------------------------------- softmax

def _softmax_io(x, dim, half_to_float):
    if half_to_float and x.dtype not in (jnp.float16, jnp.bfloat16):
        raise RuntimeError("conversion is supported for Half type only")
    out = jnp.float32 if half_to_float else x.dtype
    return _up(x), _dim(dim, x.ndim), out


@lowering(aten._softmax.default)
def _softmax(x, dim, half_to_float):
    x, dim, out = _softmax_io(x, dim, half_to_float)
    if x.ndim == 0:
        return jnp.ones_like(x, dtype=out)
    return jax.nn.softmax(x, axis=dim).astype(out)


@lowering(aten._log_softmax.default)
def _log_softmax(x, dim, half_to_float):
    x, dim, out = _softmax_io(x, dim, half_to_float)
    if x.ndim == 0:
        return jnp.zeros_like(x, dtype=out)
    return jax.nn.log_softmax(x, axis=dim).astype(out)


@lowering(aten._safe_softmax.default)
def _safe_softmax(x, dim, dtype=None):
    """Softmax whose fully masked (all -inf) rows give zeros instead of NaN."""
    out = to_jax_dtype(dtype) if dtype is not None else x.dtype
    x = x.astype(out) if dtype is not None else x
    d = _dim(dim, x.ndim)
    if x.ndim == 0:
        return jnp.ones_like(x, dtype=out)
    y = jax.nn.softmax(_up(x), axis=d)
    masked = jnp.all(x == -jnp.inf, axis=d, keepdims=True)
    return jnp.where(masked, 0, y).astype(out)


@lowering(aten._softmax_backward_data.default)
def _softmax_backward_data(g, y, dim, input_dtype):
    d = _dim(dim, g.ndim)
    g32, y32 = _up(g), _up(y)
    if g.ndim == 0:
        return jnp.zeros_like(g32).astype(to_jax_dtype(input_dtype))
    gi = y32 * (g32 - jnp.sum(g32 * y32, axis=d, keepdims=True))
    return gi.astype(to_jax_dtype(input_dtype))


@lowering(aten._log_softmax_backward_data.default)
def _log_softmax_backward_data(g, y, dim, input_dtype):
    d = _dim(dim, g.ndim)
    g32, y32 = _up(g), _up(y)
    if g.ndim == 0:
        return jnp.zeros_like(g32).astype(to_jax_dtype(input_dtype))
    gi = g32 - jnp.exp(y32) * jnp.sum(g32, axis=d, keepdims=True)
    return gi.astype(to_jax_dtype(input_dtype))


# ---------------------------------------------------------------- normalisation

def _stat_dtype(dtype):
    """Saved mean/rstd dtype of layer and batch norm: fp32 for fp16/bf16 (PyTorch's meta kernels)."""
    return opmath(dtype)


@lowering(aten.native_layer_norm.default)
def native_layer_norm(x, normalized_shape, weight, bias, eps):
    axis = x.ndim - len(normalized_shape)
    if tuple(x.shape[axis:]) != tuple(normalized_shape):
        raise RuntimeError(f"Given normalized_shape={list(normalized_shape)}, expected input with shape "
                           f"[*, {', '.join(map(str, normalized_shape))}], but got input of size{list(x.shape)}")
    dims = tuple(range(axis, x.ndim))
    xf = _up(x)
    mean = jnp.mean(xf, axis=dims, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=dims, keepdims=True)
    rstd = lax.rsqrt(var + eps)
    y = (xf - mean) * rstd
    if weight is not None:
        y = y * _up(weight)
    if bias is not None:
        y = y + _up(bias)
    stat = _stat_dtype(x.dtype)
    return y.astype(x.dtype), mean.astype(stat), rstd.astype(stat)


@lowering(aten.native_layer_norm_backward.default)
def native_layer_norm_backward(g, x, normalized_shape, mean, rstd, weight, bias, output_mask):
    axis = x.ndim - len(normalized_shape)
    dims = tuple(range(axis, x.ndim))
    outer = tuple(range(axis))
    n = math.prod(normalized_shape)
    gf, xf = _up(g), _up(x)
    mean, rstd = _up(mean), _up(rstd)
    xhat = (xf - mean) * rstd
    gxhat = gf * _up(weight) if weight is not None else gf
    gx = gw = gb = None
    if output_mask[0]:
        if n == 0:
            gx = jnp.zeros_like(x)
        else:
            a = jnp.sum(gxhat, axis=dims, keepdims=True)
            b = jnp.sum(gxhat * xhat, axis=dims, keepdims=True)
            gx = (rstd * (gxhat - a / n - xhat * b / n)).astype(x.dtype)
    if output_mask[1] and weight is not None:
        gw = jnp.sum(gf * xhat, axis=outer).astype(weight.dtype)
    if output_mask[2] and bias is not None:
        gb = jnp.sum(gf, axis=outer).astype(bias.dtype)
    param = (tuple(normalized_shape), x.dtype)
    return _defined((gx, gw, gb), [(x.shape, x.dtype), param, param])


def _channel_shape(x):
    return (1, -1) + (1,) * (x.ndim - 2)


def _bn_apply(x, mean, invstd, weight, bias):
    shape = _channel_shape(x)
    y = (_up(x) - mean.reshape(shape)) * invstd.reshape(shape)
    if weight is not None:
        y = y * _up(weight).reshape(shape)
    if bias is not None:
        y = y + _up(bias).reshape(shape)
    return y.astype(x.dtype)


def _bn_stats(x, eps):
    dims = tuple(i for i in range(x.ndim) if i != 1)
    xf = _up(x)
    mean = jnp.mean(xf, axis=dims)
    var = jnp.mean(jnp.square(xf - mean.reshape(_channel_shape(x))), axis=dims)
    return mean, var, lax.rsqrt(var + eps)


def _bn_train(x, weight, bias, eps):
    mean, var, invstd = _bn_stats(x, eps)
    stat = _stat_dtype(x.dtype)
    return _bn_apply(x, mean, invstd, weight, bias), mean.astype(stat), invstd.astype(stat), var


def _bn_eval(x, weight, bias, running_mean, running_var, eps):
    invstd = lax.rsqrt(_up(running_var) + eps)
    y = _bn_apply(x, _up(running_mean), invstd, weight, bias)
    empty = jnp.zeros((0,), _stat_dtype(x.dtype))
    return y, empty, empty


@lowering(aten._native_batch_norm_legit_functional.default)
def batch_norm_functional(x, weight, bias, running_mean, running_var, training, momentum, eps):
    """Batch norm returning the updated running statistics instead of writing them."""
    if not training:
        y, m, s = _bn_eval(x, weight, bias, running_mean, running_var, eps)
        return y, m, s, running_mean, running_var
    y, mean, invstd, var = _bn_train(x, weight, bias, eps)
    n = x.size // x.shape[1]
    unbiased = var * (n / max(n - 1, 1))
    new_mean = (1 - momentum) * _up(running_mean) + momentum * mean
    new_var = (1 - momentum) * _up(running_var) + momentum * unbiased
    return y, mean, invstd, new_mean.astype(running_mean.dtype), new_var.astype(running_var.dtype)


_RUNNING_STATS = ("running_mean", "running_var")


@lowering(aten._native_batch_norm_legit.default, mutates=_RUNNING_STATS)
def batch_norm_legit(x, weight, bias, running_mean, running_var, training, momentum, eps):
    return batch_norm_functional(x, weight, bias, running_mean, running_var, training, momentum, eps)


@lowering(aten.native_batch_norm.default, mutates=_RUNNING_STATS)
def native_batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps):
    if running_mean is None:
        return (*batch_norm_no_stats(x, weight, bias, training, momentum, eps), None, None)
    return batch_norm_functional(x, weight, bias, running_mean, running_var, training, momentum, eps)


@lowering(aten._batch_norm_with_update.default, mutates=_RUNNING_STATS)
def batch_norm_with_update(x, weight, bias, running_mean, running_var, momentum, eps):
    y, mean, invstd, new_mean, new_var = batch_norm_functional(x, weight, bias, running_mean, running_var,
                                                               True, momentum, eps)
    return y, mean, invstd, jnp.zeros((0,), jnp.uint8), new_mean, new_var


@lowering(aten._native_batch_norm_legit.no_stats)
def batch_norm_no_stats(x, weight, bias, training, momentum, eps):
    if not training:
        raise RuntimeError("batch_norm without running statistics needs training=True")
    y, mean, invstd, _ = _bn_train(x, weight, bias, eps)
    return y, mean, invstd


@lowering(aten._native_batch_norm_legit_no_training.default)
def batch_norm_no_training(x, weight, bias, running_mean, running_var, momentum, eps):
    return _bn_eval(x, weight, bias, running_mean, running_var, eps)


@lowering(aten._batch_norm_no_update.default)
def batch_norm_no_update(x, weight, bias, running_mean, running_var, momentum, eps):
    if running_mean is None:
        out = _bn_train(x, weight, bias, eps)[:3]
    else:
        out = _bn_eval(x, weight, bias, running_mean, running_var, eps)
    return (*out, jnp.zeros((0,), jnp.uint8))  # no cuDNN reserve space here


@lowering(aten.native_batch_norm_backward.default)
def native_batch_norm_backward(g, x, weight, running_mean, running_var, save_mean, save_invstd,
                               train, eps, output_mask):
    shape = _channel_shape(x)
    dims = tuple(i for i in range(x.ndim) if i != 1)
    if train:
        mean, invstd = _up(save_mean), _up(save_invstd)
    else:
        mean, invstd = _up(running_mean), lax.rsqrt(_up(running_var) + eps)
    gf, xf = _up(g), _up(x)
    xhat = (xf - mean.reshape(shape)) * invstd.reshape(shape)
    w = _up(weight) if weight is not None else jnp.ones((x.shape[1],), gf.dtype)
    gsum = jnp.sum(gf, axis=dims)
    gdot = jnp.sum(gf * xhat, axis=dims)
    gx = gw = gb = None
    if output_mask[0]:
        scale = (w * invstd).reshape(shape)
        if train:
            n = x.size // x.shape[1]
            gx = scale * (gf - (gsum / n).reshape(shape) - xhat * (gdot / n).reshape(shape))
        else:
            gx = gf * scale
        gx = gx.astype(x.dtype)
    if output_mask[1]:
        gw = gdot.astype(weight.dtype if weight is not None else x.dtype)
    if output_mask[2]:
        gb = gsum.astype(weight.dtype if weight is not None else x.dtype)
    param = ((x.shape[1],), weight.dtype if weight is not None else x.dtype)
    return _defined((gx, gw, gb), [(x.shape, x.dtype), param, param])


def _group_norm(x, weight, bias, N, C, HxW, group, eps):
    xf = _up(x).reshape(N, group, C // group * HxW)  # explicit: -1 cannot be inferred when N == 0
    mean = jnp.mean(xf, axis=-1)
    var = jnp.mean(jnp.square(xf - mean[..., None]), axis=-1)
    rstd = lax.rsqrt(var + eps)
    y = ((xf - mean[..., None]) * rstd[..., None]).reshape(N, C, HxW)
    if weight is not None:
        y = y * _up(weight)[None, :, None]
    if bias is not None:
        y = y + _up(bias)[None, :, None]
    return y.reshape(x.shape).astype(x.dtype), mean.astype(x.dtype), rstd.astype(x.dtype)


@lowering(aten.native_group_norm.default)
def native_group_norm(x, weight, bias, N, C, HxW, group, eps):
    if C % group:
        raise RuntimeError(f"Expected number of channels in input to be divisible by num_groups, but got "
                           f"input of shape {list(x.shape)} and num_groups={group}")
    return _group_norm(x, weight, bias, N, C, HxW, group, eps)


@lowering(aten.native_group_norm_backward.default)
def native_group_norm_backward(g, x, mean, rstd, weight, N, C, HxW, group, output_mask):
    gf, xf = _up(g).reshape(N, C, HxW), _up(x).reshape(N, group, C // group * HxW)
    xhat = ((xf - _up(mean)[..., None]) * _up(rstd)[..., None]).reshape(N, C, HxW)
    gx = gw = gb = None
    if output_mask[0]:
        gxhat = gf * _up(weight)[None, :, None] if weight is not None else gf
        gxhat, xh = gxhat.reshape(N, group, C // group * HxW), xhat.reshape(N, group, C // group * HxW)
        n = xh.shape[-1]
        a = jnp.mean(gxhat, axis=-1, keepdims=True)
        b = jnp.mean(gxhat * xh, axis=-1, keepdims=True)
        gx = (_up(rstd)[..., None] * (gxhat - a - xh * b)).reshape(x.shape).astype(x.dtype) if n else \
            jnp.zeros_like(x)
    if output_mask[1] and weight is not None:
        gw = jnp.sum(gf * xhat, axis=(0, 2)).astype(weight.dtype)
    if output_mask[2]:
        gb = jnp.sum(gf, axis=(0, 2)).astype(weight.dtype if weight is not None else x.dtype)
    param = ((C,), weight.dtype if weight is not None else x.dtype)
    return _defined((gx, gw, gb), [(x.shape, x.dtype), param, param])


def _weight_norm(v, g, dim):
    axes = tuple(i for i in range(v.ndim) if i != dim) if dim != -1 else ()
    vf = _up(v)
    norms = jnp.sqrt(jnp.sum(vf * vf, axis=axes, keepdims=True))
    return vf * (_up(g) / norms), norms


@lowering(aten._weight_norm_interface.default)
def weight_norm(v, g, dim=0):
    w, norms = _weight_norm(v, g, dim)
    return w.astype(v.dtype), norms.astype(g.dtype).reshape(g.shape)


@lowering(aten._weight_norm_interface_backward.default)
def weight_norm_backward(grad_w, saved_v, saved_g, saved_norms, dim):
    _, vjp = jax.vjp(lambda v, g: _weight_norm(v, g, dim)[0], _up(saved_v), _up(saved_g))
    gv, gg = vjp(_up(grad_w))
    return gv.astype(saved_v.dtype), gg.astype(saved_g.dtype)


# ---------------------------------------------------------------- dropout and embedding

@lowering(aten.native_dropout.default, random=True)
def native_dropout(key, x, p, train):
    if train is False or (train and p == 0):
        return x, jnp.ones(x.shape, jnp.bool_)
    if p == 1:
        return jnp.zeros_like(x), jnp.zeros(x.shape, jnp.bool_)
    keep = jax.random.bernoulli(key, 1 - p, x.shape)
    return (_up(x) * keep * (1 / (1 - p))).astype(x.dtype), keep


@lowering(aten.native_dropout_backward.default)
def native_dropout_backward(g, mask, scale):
    _, out = promote(g, scale)  # an integer or bool gradient times the float scale is float, as on CPU
    return (_up(g) * mask * scale).astype(out)


@lowering(aten.rrelu_with_noise.default, random=True, mutates=("noise",))
@lowering(aten.rrelu_with_noise_functional.default, random=True)
def rrelu_with_noise_functional(key, x, noise, lower=0.125, upper=1 / 3, training=False, generator=None):
    """(output, new noise): training draws a slope in [lower, upper) for each negative element."""
    if generator is not None:
        raise NotImplementedError("tpu: rrelu does not take a torch.Generator; seed the device with "
                                  "torch.manual_seed instead")
    xf = _up(x)
    if not training:
        return jnp.where(xf >= 0, xf, xf * ((lower + upper) / 2)).astype(x.dtype), noise
    slopes = jax.random.uniform(key, x.shape, xf.dtype, lower, upper)
    new_noise = jnp.where(xf <= 0, slopes, 1)
    return (xf * new_noise).astype(x.dtype), new_noise.astype(noise.dtype)


@lowering(aten.embedding.default, checked=True)
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    checks.in_bounds(indices, weight.shape[0], negative=False)
    return jnp.take(weight, indices, axis=0, mode="clip")


@lowering(aten.embedding_dense_backward.default)
def embedding_dense_backward(g, indices, num_weights, padding_idx, scale_grad_by_freq):
    flat = indices.reshape(-1)
    grads = _up(g).reshape(flat.shape[0], -1)
    if padding_idx >= 0:
        grads = jnp.where((flat == padding_idx)[:, None], 0, grads)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), grads.dtype).at[flat].add(1)
        grads = grads / counts[flat][:, None]
    out = jnp.zeros((num_weights, grads.shape[1]), grads.dtype).at[flat].add(grads)
    return out.astype(g.dtype)


@lowering(aten.embedding_renorm.default)
def embedding_renorm(weight, indices, max_norm, norm_type):
    """Rows that ``indices`` reference with a norm above ``max_norm`` rescaled to it."""
    rows = jnp.zeros((weight.shape[0],), jnp.bool_).at[indices.reshape(-1)].set(True)
    wf = _up(weight)
    if norm_type == math.inf:
        norms = jnp.max(jnp.abs(wf), axis=1)
    else:
        norms = jnp.sum(jnp.abs(wf) ** norm_type, axis=1) ** (1 / norm_type)
    scale = jnp.where(rows & (norms > max_norm), max_norm / (norms + 1e-7), 1)
    return (wf * scale[:, None]).astype(weight.dtype)


# ---------------------------------------------------------------- losses

def _nll(x, target, weight, reduction, ignore_index):
    """nll loss with the class dim of ``x`` at 1 (or 0 for an unbatched input)."""
    unbatched = x.ndim == 1
    if unbatched:
        x, target = x[None], target[None]
    logp = jnp.moveaxis(_up(x), 1, -1)
    valid = target != ignore_index
    safe = jnp.where(valid, target, 0)
    picked = jnp.take_along_axis(logp, safe[..., None].astype(jnp.int32), axis=-1)[..., 0]
    w = _up(weight)[safe] if weight is not None else jnp.ones_like(picked)
    w = jnp.where(valid, w, 0)
    loss = -picked * w
    if reduction == 0:  # an unbatched input's per-sample loss is 0-d, as in PyTorch
        return (loss[0] if unbatched else loss).astype(x.dtype), jnp.zeros((), x.dtype)
    total = jnp.sum(w)
    out = jnp.sum(loss) / total if reduction == 1 else jnp.sum(loss)
    return out.astype(x.dtype), total.astype(x.dtype)


def _nll_grad(g, x, target, weight, reduction, ignore_index, total_weight):
    unbatched = x.ndim == 1
    xb, tb = (x[None], target[None]) if unbatched else (x, target)
    valid = tb != ignore_index
    safe = jnp.where(valid, tb, 0)
    w = _up(weight)[safe] if weight is not None else jnp.ones(safe.shape, opmath(x.dtype))
    w = jnp.where(valid, w, 0)
    gf = _up(g)
    if reduction == 0:
        coef = -w * (gf[None] if unbatched else gf)
    elif reduction == 1:
        coef = -w * gf / _up(total_weight)
    else:
        coef = -w * gf
    onehot = jax.nn.one_hot(safe, xb.shape[1], dtype=coef.dtype, axis=1)
    grad = onehot * jnp.expand_dims(coef, 1)
    return (grad[0] if unbatched else grad).astype(x.dtype)


def _check_nll(x, target, spatial: bool):
    if not spatial and x.ndim > 2:
        raise ValueError(f"Expected 1D or 2D input to nll_loss, got {x.ndim}D")
    if x.ndim >= 2 and target.shape[0] != x.shape[0]:
        raise ValueError(f"Expected input batch_size ({x.shape[0]}) to match target batch_size "
                         f"({target.shape[0]}).")


@lowering(aten.nll_loss_forward.default)
def nll_loss_forward(x, target, weight, reduction, ignore_index):
    _check_nll(x, target, False)
    return _nll(x, target, weight, reduction, ignore_index)


@lowering(aten.nll_loss2d_forward.default)
def nll_loss2d_forward(x, target, weight, reduction, ignore_index):
    _check_nll(x, target, True)
    return _nll(x, target, weight, reduction, ignore_index)


@lowering(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward(g, x, target, weight, reduction, ignore_index, total_weight):
    return _nll_grad(g, x, target, weight, reduction, ignore_index, total_weight)


def _pointwise_loss(fn):
    """A lowering ``loss(x, target, reduction, *params)`` from its elementwise loss ``fn``."""

    def lower(x, target, reduction=1, *params):
        return _reduce(fn(_up(x), _up(target), *params), reduction).astype(x.dtype)

    return lower


def _pointwise_loss_grad(fn):
    """The backward of ``_pointwise_loss(fn)`` by ``jax.vjp``: the formula is fn's derivative."""

    def lower(g, x, target, reduction, *params):
        xf, tf = _up(x), _up(target)
        _, vjp = jax.vjp(lambda a: fn(a, tf, *params), xf)
        seed = _reduce_grad(_up(g), jnp.broadcast_shapes(x.shape, target.shape), reduction, max(xf.size, 1))
        return vjp(seed)[0].astype(x.dtype)

    return lower


def _smooth_l1(x, t, beta=1.0):
    d = jnp.abs(x - t)
    if beta == 0:
        return d
    return jnp.where(d < beta, 0.5 * d * d / beta, d - 0.5 * beta)


def _huber(x, t, delta=1.0):
    d = jnp.abs(x - t)
    return jnp.where(d < delta, 0.5 * d * d, delta * (d - 0.5 * delta))


def _mse(x, t):
    return jnp.square(x - t)


LOSSES = {  # (forward op, backward op) → elementwise loss
    (aten.mse_loss.default, aten.mse_loss_backward.default): _mse,
    (aten.smooth_l1_loss.default, aten.smooth_l1_loss_backward.default): _smooth_l1,
    (aten.huber_loss.default, aten.huber_loss_backward.default): _huber,
    (aten.soft_margin_loss.default, aten.soft_margin_loss_backward.default): lambda x, t: jnp.log1p(jnp.exp(-x * t)),
}

for (_fwd, _bwd), _fn in LOSSES.items():
    lowering(_fwd)(_pointwise_loss(_fn))
    if _bwd is not None:
        lowering(_bwd)(_pointwise_loss_grad(_fn))


def _multi_margin(x, target, p, margin, weight, reduction):
    if p not in (1, 2):
        raise ValueError("only p == 1 and p == 2 supported")
    classes = x.shape[-1] if x.ndim else 1  # a 0-d input is one sample of one class
    x2 = _up(x).reshape(-1, classes)
    if target.size != x2.shape[0]:
        raise RuntimeError(f"inconsistent target size: {list(target.shape)} for input of size: {list(x.shape)}")
    t = target.reshape(-1)
    picked = jnp.take_along_axis(x2, t[:, None], axis=1)
    z = jnp.maximum(margin - picked + x2, 0)
    z = z if p == 1 else z * z
    if weight is not None:
        z = z * _up(weight)[t][:, None]
    z = jnp.where(jax.nn.one_hot(t, x2.shape[1], dtype=jnp.bool_), 0, z)
    loss = jnp.sum(z, axis=1) / classes
    return _reduce(loss.reshape(target.shape), reduction)  # per-sample losses take the target's shape


# static Scalars: p picks the formula (and margins are constants of a model)
@lowering(aten.multi_margin_loss.default, static_scalars=True)
def multi_margin_loss(x, target, p=1, margin=1, weight=None, reduction=1):
    return _multi_margin(x, target, p, margin, weight, reduction).astype(x.dtype)


@lowering(aten.multi_margin_loss_backward.default, static_scalars=True)
def multi_margin_loss_backward(g, x, target, p, margin, weight=None, reduction=1):
    _, vjp = jax.vjp(lambda a: _multi_margin(a, target, p, margin, weight, reduction), _up(x))
    return vjp(_up(g))[0].astype(x.dtype)


def _multilabel_rows(x, target):
    """``x`` (in opmath) and ``target`` as (samples, classes), and which label slots are used:
    each row's labels end at its first -1."""
    classes = x.shape[-1] if x.ndim else 1
    t2 = target.reshape(-1, classes)
    return _up(x).reshape(-1, classes), t2, jnp.cumprod(t2 >= 0, axis=-1).astype(jnp.bool_)


def _multilabel_margin(x, target, is_target, reduction):
    """Per-sample sum over labels j and non-labels i of max(0, 1 - x[j] + x[i]), over classes."""
    x2, t2, used = _multilabel_rows(x, target)
    picked = jnp.take_along_axis(x2, jnp.where(used, t2, 0), axis=1)  # x[j] per label slot
    z = 1 - picked[:, :, None] + x2[:, None, :]  # (sample, label slot, class i)
    keep = used[:, :, None] & (is_target.reshape(x2.shape) == 0)[:, None, :]
    loss = jnp.sum(jnp.where(keep & (z > 0), z, 0), axis=(1, 2)) / x2.shape[1]
    return _reduce(loss if x.ndim > 1 else loss.reshape(()), reduction)


@lowering(aten.multilabel_margin_loss_forward.default)
def multilabel_margin_loss_forward(x, target, reduction):
    if target.shape != x.shape:
        raise RuntimeError(f"inconsistent target size: {list(target.shape)} for input of size: {list(x.shape)}")
    x2, t2, used = _multilabel_rows(x, target)
    labels = jax.nn.one_hot(jnp.where(used, t2, 0), x2.shape[1], dtype=jnp.bool_) & used[..., None]
    is_target = jnp.any(labels, axis=1).reshape(x.shape).astype(x.dtype)
    return _multilabel_margin(x, target, is_target, reduction).astype(x.dtype), is_target


@lowering(aten.multilabel_margin_loss_backward.default)
def multilabel_margin_loss_backward(g, x, target, reduction, is_target):
    _, vjp = jax.vjp(lambda a: _multilabel_margin(a, target, is_target, reduction), _up(x))
    return vjp(_up(g))[0].astype(x.dtype)


# CTC (Graves et al. 2006), in log space as PyTorch's CPU kernel: alpha runs forward over time with
# lax.scan, beta (for the gradient) backward. States are the extended label sequence
# l' = (blank, y1, blank, y2, ..., blank) padded to the longest target; unused states stay -inf.

def _lse3(a, b, c):
    """log(exp(a) + exp(b) + exp(c)) that is -inf, never NaN, when all three are -inf."""
    peak = jnp.maximum(jnp.maximum(a, b), c)
    peak = jnp.where(peak == -jnp.inf, 0, peak)
    return jnp.log(jnp.exp(a - peak) + jnp.exp(b - peak) + jnp.exp(c - peak)) + peak


def _shift(a, k: int, fill=-jnp.inf):
    """``a`` moved k states right (k > 0) or left (k < 0) along the last axis, filled with ``fill``."""
    n = a.shape[-1]
    pad = [(0, 0)] * (a.ndim - 1) + [(k, 0) if k > 0 else (0, -k)]
    padded = jnp.pad(a, pad, constant_values=fill)
    return padded[..., :n] if k > 0 else padded[..., -k:]


def _ctc_setup(log_probs, targets, input_lengths, target_lengths, blank):
    """Extended labels (N, L), emission log-probs (T, N, L), used states (N, L), lengths as arrays."""
    if log_probs.ndim != 3:
        raise RuntimeError(f"Expected 3-dimensional tensor, but got {log_probs.ndim}-dimensional tensor for "
                           f"argument #1 'log_probs' (while checking arguments for ctc_loss)")
    T, N, _ = log_probs.shape
    if len(input_lengths) != N or len(target_lengths) != N:
        raise RuntimeError(f"input_lengths and target_lengths must have {N} entries (the batch size)")
    if any(not 0 <= n <= T for n in input_lengths):
        raise RuntimeError(f"Expected input_lengths to have value at most {T}, but got {max(input_lengths)}")
    longest = max(target_lengths, default=0)
    if targets.ndim == 1:  # the targets of the batch concatenated
        starts = np.cumsum([0, *target_lengths[:-1]], dtype=np.int64)
        index = np.minimum(starts[:, None] + np.arange(longest), max(targets.shape[0] - 1, 0))
        padded = targets[jnp.asarray(index)] if longest else jnp.zeros((N, 0), targets.dtype)
    else:
        if longest > targets.shape[1]:
            raise RuntimeError(f"Expected tensor to have size at least {longest} at dimension 1, but got size "
                               f"{targets.shape[1]} for argument #2 'targets' (while checking arguments for ctc_loss)")
        padded = targets[:, :longest]
    L = 2 * longest + 1
    labels = jnp.full((N, L), blank, padded.dtype).at[:, 1::2].set(padded).astype(jnp.int32)
    tl = jnp.asarray(target_lengths, jnp.int32)
    used = jnp.arange(L)[None] < 2 * tl[:, None] + 1
    emit = jnp.take_along_axis(_up(log_probs), jnp.broadcast_to(labels[None], (T, N, L)), axis=2)
    skip = (labels != blank) & (labels != jnp.roll(labels, 2, axis=1)) & (jnp.arange(L) >= 2)[None]
    return labels, emit, used, skip, jnp.asarray(input_lengths, jnp.int32), tl


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _ctc_forward(log_probs, targets, input_lengths, target_lengths, blank):
    _, emit, used, skip, il, tl = _ctc_setup(log_probs, targets, input_lengths, target_lengths, blank)
    states = jnp.arange(emit.shape[2])[None]
    first = jnp.where((states == 0) | ((states == 1) & (tl[:, None] > 0)), emit[0], -jnp.inf)
    first = jnp.where(used & (il[:, None] > 0), first, -jnp.inf)

    def step(prev, t):
        alpha = _lse3(prev, _shift(prev, 1), jnp.where(skip, _shift(prev, 2), -jnp.inf)) + emit[t]
        alpha = jnp.where(used & (t < il[:, None]), alpha, -jnp.inf)
        return alpha, alpha

    _, rest = lax.scan(step, first, jnp.arange(1, emit.shape[0]))
    log_alpha = jnp.concatenate([first[None], rest], axis=0)  # (T, N, L)
    last = jnp.take_along_axis(log_alpha, jnp.maximum(il - 1, 0)[None, :, None], axis=0)[0]
    end = jnp.take_along_axis(last, (2 * tl)[:, None], axis=1)[:, 0]
    before = jnp.take_along_axis(last, jnp.maximum(2 * tl - 1, 0)[:, None], axis=1)[:, 0]
    likelihood = jnp.where(tl > 0, _lse3(end, before, -jnp.inf), end)
    likelihood = jnp.where(il > 0, likelihood, jnp.where(tl > 0, -jnp.inf, 0))
    dtype = log_probs.dtype
    return (-likelihood).astype(dtype), jnp.transpose(log_alpha, (1, 0, 2)).astype(dtype)


@functools.partial(jax.jit, static_argnums=(3, 4, 7, 8))
def _ctc_backward(grad, log_probs, targets, input_lengths, target_lengths, nll, log_alpha, blank, zero_infinity):
    labels, emit, used, skip, il, tl = _ctc_setup(log_probs, targets, input_lengths, target_lengths, blank)
    states = jnp.arange(emit.shape[2])[None]
    skip_back = _shift(skip, -2, False)  # state s + 2 may come from s

    def step(nxt, t):
        start = jnp.where((states == 2 * tl[:, None]) | (states == 2 * tl[:, None] - 1), emit[t], -jnp.inf)
        beta = _lse3(nxt, _shift(nxt, -1), jnp.where(skip_back, _shift(nxt, -2), -jnp.inf)) + emit[t]
        last = il[:, None] - 1
        beta = jnp.where(t == last, start, jnp.where(t < last, beta, -jnp.inf))
        beta = jnp.where(used, beta, -jnp.inf)
        return beta, beta

    T, N, C = log_probs.shape
    init = jnp.full(emit.shape[1:], -jnp.inf, emit.dtype)
    _, log_beta = lax.scan(step, init, jnp.arange(T), reverse=True)  # (T, N, L)
    ab = jnp.transpose(_up(log_alpha), (1, 0, 2)) + log_beta
    peak = jnp.max(ab, axis=2, keepdims=True)
    peak = jnp.where(peak == -jnp.inf, 0, peak)
    onehot = jax.nn.one_hot(labels, C, dtype=ab.dtype)  # (N, L, C): sums the states of each class
    lcab = jnp.log(jnp.einsum("tns,nsc->tnc", jnp.exp(ab - peak), onehot, precision=HIGHEST)) + peak
    lp, nllf = _up(log_probs), _up(nll)[None, :, None]
    # PyTorch's gradient: exp(lp) minus the occupation probabilities (it folds log_softmax's Jacobian in)
    result = (jnp.exp(lp) - jnp.exp(lcab + nllf - lp)) * _up(grad)[None, :, None]
    keep = jnp.arange(T)[:, None, None] < il[None, :, None]
    if zero_infinity:
        keep = keep & (nllf != jnp.inf)
    return jnp.where(keep, result, 0).astype(log_probs.dtype)


def _lengths(a) -> list[int]:
    return [int(v) for v in np.asarray(a).reshape(-1)]


@lowering(aten._ctc_loss.default)
def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    return _ctc_forward(log_probs, targets, tuple(input_lengths), tuple(target_lengths), blank)


# lengths given as tensors decide the shape of log_alpha: read them first
@lowering(aten._ctc_loss.Tensor, jit=False)
def ctc_loss_tensor(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    return _ctc_forward(log_probs, targets, tuple(_lengths(input_lengths)), tuple(_lengths(target_lengths)), blank)


@lowering(aten._ctc_loss_backward.default)
def ctc_loss_backward(grad, log_probs, targets, input_lengths, target_lengths, nll, log_alpha, blank,
                      zero_infinity=False):
    return _ctc_backward(grad, log_probs, targets, tuple(input_lengths), tuple(target_lengths), nll, log_alpha,
                         blank, zero_infinity)


@lowering(aten._ctc_loss_backward.Tensor, jit=False)
def ctc_loss_backward_tensor(grad, log_probs, targets, input_lengths, target_lengths, nll, log_alpha, blank,
                             zero_infinity=False):
    return _ctc_backward(grad, log_probs, targets, tuple(_lengths(input_lengths)), tuple(_lengths(target_lengths)),
                         nll, log_alpha, blank, zero_infinity)


def _bce(x, t, weight):
    # PyTorch clamps the log terms at -100 so a saturated probability gives a finite loss
    loss = -(t * jnp.maximum(jnp.log(x), -100) + (1 - t) * jnp.maximum(jnp.log1p(-x), -100))
    return loss * _up(weight) if weight is not None else loss


@lowering(aten.binary_cross_entropy.default)
def binary_cross_entropy(x, target, weight=None, reduction=1):
    return _reduce(_bce(_up(x), _up(target), weight), reduction).astype(x.dtype)


@lowering(aten.binary_cross_entropy_backward.default)
def binary_cross_entropy_backward(g, x, target, weight=None, reduction=1):
    xf, tf = _up(x), _up(target)
    eps = 1e-12  # PyTorch's EPSILON in the CPU kernel
    grad = (xf - tf) / jnp.maximum((1 - xf) * xf, eps)
    if weight is not None:
        grad = grad * _up(weight)
    seed = _reduce_grad(_up(g), x.shape, reduction, max(x.size, 1))
    return (grad * seed).astype(x.dtype)


# ---------------------------------------------------------------- distances

def _uses_mm(p, r1, r2, compute_mode) -> bool:
    """PyTorch's choice of the matmul form of the euclidean distance."""
    if p != 2:
        return False
    return compute_mode == 1 or (compute_mode in (None, 0) and (r1 > 25 or r2 > 25))


@lowering(aten._cdist_forward.default, dots=True)
def cdist(x1, x2, p, compute_mode):
    a, b = _up(x1), _up(x2)
    if _uses_mm(p, x1.shape[-2], x2.shape[-2], compute_mode):
        sq = jnp.sum(a * a, -1)[..., :, None] + jnp.sum(b * b, -1)[..., None, :] \
            - 2 * jnp.einsum("...id,...jd->...ij", a, b, precision=matmul_precision())
        return jnp.sqrt(jnp.maximum(sq, 0)).astype(x1.dtype)
    d = jnp.abs(a[..., :, None, :] - b[..., None, :, :])
    if p == 0:
        out = jnp.sum(d != 0, -1).astype(a.dtype)
    elif p == math.inf:
        out = jnp.max(d, -1, initial=0)
    elif p == 1:
        out = jnp.sum(d, -1)
    else:
        out = jnp.sum(d ** p, -1) ** (1 / p)
    return out.astype(x1.dtype)


def _pnorm_grad(diff, dist, p):
    """d dist / d diff for dist = ||diff||_p along the last axis; 0 where dist is 0, as in PyTorch."""
    if p == 0:
        return jnp.zeros_like(diff)
    if p == 1:
        per = jnp.sign(diff)
    elif p == math.inf:
        per = jnp.sign(diff) * (jnp.abs(diff) == dist)
    elif p < 2:
        per = jnp.sign(diff) * jnp.abs(diff) ** (p - 1) / jnp.where(dist == 0, 1, dist) ** (p - 1)
        per = jnp.where(diff == 0, 0, per)  # |0|^(p-1) is infinite for p < 1
    else:
        per = diff * jnp.abs(diff) ** (p - 2) / jnp.where(dist == 0, 1, dist) ** (p - 1)
    return jnp.where(dist == 0, 0, per)


@lowering(aten._cdist_backward.default)
def cdist_backward(g, x1, x2, p, dist):
    diff = _up(x1)[..., :, None, :] - _up(x2)[..., None, :, :]
    per = _pnorm_grad(diff, _up(dist)[..., None], p)
    return jnp.sum(_up(g)[..., None] * per, axis=-2).astype(x1.dtype)


def _pairs(n: int):
    return tuple(jnp.asarray(i) for i in np.triu_indices(n, 1))


@lowering(aten._pdist_forward.default)
def pdist(x, p=2.0):
    i, j = _pairs(x.shape[0])
    d = jnp.abs(_up(x)[i] - _up(x)[j])
    if p == 0:
        out = jnp.sum(d != 0, -1).astype(d.dtype)
    elif p == math.inf:
        out = jnp.max(d, -1, initial=0)
    else:
        out = jnp.sum(d ** p, -1) ** (1 / p)
    return out.astype(x.dtype)


@lowering(aten._pdist_backward.default)
def pdist_backward(g, x, p, dist):
    i, j = _pairs(x.shape[0])
    per = _up(g)[:, None] * _pnorm_grad(_up(x)[i] - _up(x)[j], _up(dist)[:, None], p)
    grad = jnp.zeros(x.shape, per.dtype).at[i].add(per).at[j].add(-per)
    return grad.astype(x.dtype)


# ---------------------------------------------------------------- convolution

def _tuple(v, n):
    v = [v] if isinstance(v, int) else list(v)
    return tuple(v * n) if len(v) == 1 else tuple(v)


def _conv(x, w, stride, padding, dilation, transposed, output_padding, groups):
    """N-d convolution (or its transpose) of NC... input with PyTorch's weight layout, in opmath."""
    nd = x.ndim - 2
    stride, padding, dilation = _tuple(stride, nd), _tuple(padding, nd), _tuple(dilation, nd)
    spatial = "DHW"[-nd:] if nd <= 3 else None
    if spatial is None:
        raise NotImplementedError(f"convolution: {nd}-d convolutions are not supported on the tpu device")
    dn = lax.conv_dimension_numbers(x.shape, w.shape, ("NC" + spatial, "OI" + spatial, "NC" + spatial))
    acc = opmath(x.dtype)
    if not transposed:
        return lax.conv_general_dilated(
            x, w, stride, [(p, p) for p in padding], rhs_dilation=dilation,
            dimension_numbers=dn, feature_group_count=groups, precision=matmul_precision(),
            preferred_element_type=acc)
    # transposed conv = conv of the stride-dilated input with the flipped, in/out-swapped kernel
    output_padding = _tuple(output_padding, nd)
    cin, cout_g = w.shape[0], w.shape[1]
    k = w.shape[2:]
    w = w.reshape((groups, cin // groups, cout_g) + k)
    w = jnp.swapaxes(w, 1, 2).reshape((groups * cout_g, cin // groups) + k)
    w = jnp.flip(w, axis=tuple(range(2, 2 + nd)))
    pads = [(d * (kk - 1) - p, d * (kk - 1) - p + op)
            for d, kk, p, op in zip(dilation, k, padding, output_padding)]
    dn = lax.conv_dimension_numbers(x.shape, w.shape, ("NC" + spatial, "OI" + spatial, "NC" + spatial))
    return lax.conv_general_dilated(
        x, w, (1,) * nd, pads, lhs_dilation=stride, rhs_dilation=dilation,
        dimension_numbers=dn, feature_group_count=groups, precision=matmul_precision(),
        preferred_element_type=acc)


@lowering(aten.convolution.default, dots=True)
def convolution(x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    if x.ndim != w.ndim:
        raise RuntimeError(f"Expected {w.ndim}-dimensional input for {w.ndim}-dimensional weight "
                           f"{list(w.shape)}, but got {x.ndim}-dimensional input of size {list(x.shape)} instead")
    if x.dtype != w.dtype:
        raise RuntimeError(f"Input type ({x.dtype}) and weight type ({w.dtype}) should be the same")
    y = _conv(x, w, stride, padding, dilation, transposed, output_padding, groups)
    if bias is not None:
        y = y + _up(bias).reshape(_channel_shape(y))
    return y.astype(x.dtype)


@lowering(aten.convolution_backward.default, dots=True)
def convolution_backward(g, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding,
                         groups, output_mask):
    def fwd(a, b):
        return _conv(a, b, stride, padding, dilation, transposed, output_padding, groups)

    _, vjp = jax.vjp(fwd, x, w)
    gx, gw = vjp(_up(g))
    gb = jnp.sum(_up(g), axis=(0,) + tuple(range(2, g.ndim))).astype(g.dtype) if output_mask[2] else None
    bias_shape = tuple(bias_sizes) if bias_sizes else (g.shape[1],)
    grads = (gx.astype(x.dtype) if output_mask[0] else None, gw.astype(w.dtype) if output_mask[1] else None, gb)
    return _defined(grads, [(x.shape, x.dtype), (w.shape, w.dtype), (bias_shape, g.dtype)])


# ---------------------------------------------------------------- pooling

def _pool_out(size, k, s, p, d, ceil_mode):
    """PyTorch's pooling output size (ceil mode never starts a window in the right padding)."""
    span = size + 2 * p - d * (k - 1) - 1
    out = (-(-span // s) if ceil_mode else span // s) + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out


def _pool_args(x, kernel, stride, padding, nd, dilation=None):
    kernel = _tuple(kernel, nd)
    stride = _tuple(stride, nd) if stride else kernel
    padding = _tuple(padding, nd)
    dilation = _tuple(dilation, nd) if dilation is not None else (1,) * nd
    for k, p, d in zip(kernel, padding, dilation):
        if p > ((k - 1) * d + 1) // 2:
            raise RuntimeError(f"pad should be at most half of effective kernel size, but got pad={p}, "
                               f"kernel_size={k} and dilation={d}")
    return kernel, stride, padding, dilation


def _windows(x, kernel, stride, padding, dilation, out, fill):
    """Stack every kernel offset's strided slice of the padded input: (..., K, *out)."""
    nd = len(kernel)
    spatial = x.shape[-nd:]
    pads = [(0, 0)] * (x.ndim - nd)
    for n, k, s, p, d, o in zip(spatial, kernel, stride, padding, dilation, out):
        need = (o - 1) * s + d * (k - 1) + 1
        pads.append((p, max(need - n - p, 0)))
    xp = jnp.pad(x, pads, constant_values=fill)
    slices = []
    for offset in np.ndindex(*kernel):
        start = [0] * (x.ndim - nd) + [o * d for o, d in zip(offset, dilation)]
        limit = list(xp.shape[:x.ndim - nd]) + [st + (o - 1) * s + 1 for st, o, s in
                                                 zip(start[x.ndim - nd:], out, stride)]
        strides = [1] * (x.ndim - nd) + list(stride)
        slices.append(lax.slice(xp, start, limit, strides))
    return jnp.stack(slices, axis=x.ndim - nd)


def _max_pool(x, kernel, stride, padding, dilation, ceil_mode, nd):
    kernel, stride, padding, dilation = _pool_args(x, kernel, stride, padding, nd, dilation)
    spatial = x.shape[-nd:]
    out = [_pool_out(n, k, s, p, d, ceil_mode) for n, k, s, p, d in zip(spatial, kernel, stride, padding, dilation)]
    if jnp.issubdtype(x.dtype, jnp.floating):
        fill = -jnp.inf
    else:
        fill = jnp.iinfo(x.dtype).min
    win = _windows(x, kernel, stride, padding, dilation, out, fill)
    axis = x.ndim - nd
    arg = jnp.argmax(win, axis=axis)
    values = jnp.take_along_axis(win, arg[(slice(None),) * axis + (None,)], axis=axis).squeeze(axis)
    # flat index into the input's spatial plane, as PyTorch returns it
    offsets = np.array(list(np.ndindex(*kernel)))  # (K, nd)
    index = jnp.zeros(arg.shape, jnp.int64)
    for i in range(nd):
        pos = jnp.asarray(offsets[:, i] * dilation[i])[arg]
        base = (jnp.arange(out[i]) * stride[i] - padding[i]).reshape((-1,) + (1,) * (nd - 1 - i))
        index = index * spatial[i] + (pos + base)
    return values, index


def _max_pool_backward(g, x, indices, nd):
    lead = x.shape[:-nd]
    plane = math.prod(x.shape[-nd:])
    gf = _up(g).reshape(lead + (-1,))
    idx = indices.reshape(lead + (-1,))
    flat = jnp.zeros(lead + (plane,), gf.dtype)
    batch = tuple(jnp.indices(idx.shape, sparse=True))[:-1]
    flat = flat.at[batch + (idx,)].add(gf)
    return flat.reshape(x.shape).astype(x.dtype)


def _max_pool_lowerings(nd: int, fwd, bwd):
    @lowering(fwd)
    def forward(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
        return _max_pool(x, kernel_size, stride, padding, dilation, ceil_mode, nd)

    @lowering(bwd)
    def backward(g, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
        return _max_pool_backward(g, x, indices, nd)


_max_pool_lowerings(2, aten.max_pool2d_with_indices.default, aten.max_pool2d_with_indices_backward.default)
_max_pool_lowerings(3, aten.max_pool3d_with_indices.default, aten.max_pool3d_with_indices_backward.default)


def _adaptive_windows(n: int, o: int) -> np.ndarray:
    """(o, K) input indices of each adaptive window, padded by repeating its last index."""
    starts = [(i * n) // o for i in range(o)]
    ends = [-(-((i + 1) * n) // o) for i in range(o)]
    k = max(e - s for s, e in zip(starts, ends))
    return np.array([[min(s + j, e - 1) for j in range(k)] for s, e in zip(starts, ends)])


def _adaptive_max(x, output_size):
    nd = len(output_size)
    spatial = x.shape[-nd:]
    lead = x.ndim - nd
    windows = [_adaptive_windows(n, o) for n, o in zip(spatial, output_size)]
    y = x
    for i, w in enumerate(windows):  # axis lead+2i of length n becomes (o, K)
        y = jnp.take(y, jnp.asarray(w), axis=lead + 2 * i)
    perm = list(range(lead)) + [lead + 2 * i for i in range(nd)] + [lead + 2 * i + 1 for i in range(nd)]
    y = jnp.transpose(y, perm)
    y = y.reshape(y.shape[:lead + nd] + (-1,))
    arg = jnp.argmax(y, axis=-1)
    values = jnp.take_along_axis(y, arg[..., None], axis=-1)[..., 0]
    # flat input index of the chosen element
    ks = [w.shape[1] for w in windows]
    offsets = np.array(list(np.ndindex(*ks)))
    index = jnp.zeros(arg.shape, jnp.int64)
    for i, w in enumerate(windows):
        window = jnp.arange(w.shape[0]).reshape((-1,) + (1,) * (nd - 1 - i))
        pos = jnp.asarray(w)[window, jnp.asarray(offsets[:, i])[arg]]
        index = index * spatial[i] + pos
    return values, index


def _adaptive_max_lowerings(nd: int, fwd, bwd):
    @lowering(fwd)
    def forward(x, output_size):
        return _adaptive_max(x, _tuple(output_size, nd))

    @lowering(bwd)
    def backward(g, x, indices):
        return _max_pool_backward(g, x, indices, nd)


_adaptive_max_lowerings(2, aten.adaptive_max_pool2d.default, aten.adaptive_max_pool2d_backward.default)
_adaptive_max_lowerings(3, aten.adaptive_max_pool3d.default, aten.adaptive_max_pool3d_backward.default)


def _avg_divisor(spatial, kernel, stride, padding, out, count_include_pad, divisor_override):
    """The per-output divisor of PyTorch's avg pool, computed once from static shapes."""
    if divisor_override:
        return np.float64(divisor_override)
    sizes = []
    for n, k, s, p, o in zip(spatial, kernel, stride, padding, out):
        start = np.arange(o) * s - p
        end = np.minimum(start + k, n + p)
        if count_include_pad:
            sizes.append(end - start)
        else:
            sizes.append(np.minimum(end, n) - np.maximum(start, 0))
    div = sizes[0]
    for extra in sizes[1:]:
        div = np.multiply.outer(div, extra)
    return div


def _avg_pool(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override, nd):
    kernel, stride, padding, dilation = _pool_args(x, kernel, stride, padding, nd)
    spatial = x.shape[-nd:]
    out = [_pool_out(n, k, s, p, 1, ceil_mode) for n, k, s, p in zip(spatial, kernel, stride, padding)]
    xf = _up(x)
    pads = [(0, 0)] * (x.ndim - nd) + [(p, max((o - 1) * s + k - n - p, 0))
                                       for n, k, s, p, o in zip(spatial, kernel, stride, padding, out)]
    # a NumPy zero init lets JAX see a sum window (differentiable), not a generic reduction
    summed = lax.reduce_window(jnp.pad(xf, pads), np.zeros((), xf.dtype), lax.add,
                               (1,) * (x.ndim - nd) + kernel, (1,) * (x.ndim - nd) + stride, "VALID")
    summed = summed[(Ellipsis,) + tuple(slice(0, o) for o in out)]
    div = _avg_divisor(spatial, kernel, stride, padding, out, count_include_pad, divisor_override)
    return (summed / jnp.asarray(div, xf.dtype)).astype(x.dtype)


def _avg_pool_lowerings(nd: int, fwd, bwd):
    @lowering(fwd)
    def forward(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                divisor_override=None):
        return _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, nd)

    @lowering(bwd)
    def backward(g, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
        _, vjp = jax.vjp(lambda a: _avg_pool(a, kernel_size, stride, padding, ceil_mode, count_include_pad,
                                             divisor_override, nd), _up(x))
        return vjp(_up(g))[0].astype(x.dtype)


_avg_pool_lowerings(2, aten.avg_pool2d.default, aten.avg_pool2d_backward.default)
_avg_pool_lowerings(3, aten.avg_pool3d.default, aten.avg_pool3d_backward.default)


def _adaptive_matrix(n: int, o: int) -> np.ndarray:
    """(o, n) averaging matrix of PyTorch's adaptive pooling windows."""
    m = np.zeros((o, n))
    for i in range(o):
        start, end = (i * n) // o, -(-((i + 1) * n) // o)
        m[i, start:end] = 1 / (end - start)
    return m


def _adaptive_avg(x, output_size):
    nd = len(output_size)
    y = _up(x)
    for i, o in enumerate(output_size):
        axis = x.ndim - nd + i
        m = jnp.asarray(_adaptive_matrix(x.shape[axis], o), y.dtype)
        y = jnp.moveaxis(jnp.tensordot(y, m, axes=([axis], [1]), precision=HIGHEST), -1, axis)
    return y


def _adaptive_lowerings(nd: int, fwd, bwd):
    @lowering(fwd)
    def forward(x, output_size):
        return _adaptive_avg(x, _tuple(output_size, nd)).astype(x.dtype)

    @lowering(bwd)
    def backward(g, x):
        out = g.shape[-nd:]
        _, vjp = jax.vjp(lambda a: _adaptive_avg(a, out), _up(x))
        return vjp(_up(g))[0].astype(x.dtype)


_adaptive_lowerings(2, aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool2d_backward.default)
_adaptive_lowerings(3, aten._adaptive_avg_pool3d.default, aten._adaptive_avg_pool3d_backward.default)


# ---------------------------------------------------------------- upsampling

def _scale(n_in: int, n_out: int, scale, align_corners: bool = False) -> float:
    """PyTorch's source-index scale for one axis."""
    if align_corners:
        return (n_in - 1) / (n_out - 1) if n_out > 1 else 0.0
    return 1.0 / scale if scale is not None and scale > 0 else n_in / n_out


def _nearest_index(n_in, n_out, scale, exact: bool) -> np.ndarray:
    s = np.float32(_scale(n_in, n_out, scale))
    i = np.arange(n_out, dtype=np.float32)
    src = np.floor((i + 0.5) * s) if exact else np.floor(i * s)
    return np.minimum(src.astype(np.int64), n_in - 1)


def _linear_matrix(n_in, n_out, scale, align_corners, dtype=np.float32) -> np.ndarray:
    """(n_out, n_in) interpolation matrix of PyTorch's linear upsampling along one axis."""
    s = dtype(_scale(n_in, n_out, scale, align_corners))
    i = np.arange(n_out, dtype=dtype)
    src = i * s if align_corners else np.maximum((i + dtype(0.5)) * s - dtype(0.5), 0)
    lo = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    hi = np.minimum(lo + 1, n_in - 1)
    frac = (src - lo).astype(dtype)
    m = np.zeros((n_out, n_in), dtype)
    np.add.at(m, (np.arange(n_out), lo), 1 - frac)
    np.add.at(m, (np.arange(n_out), hi), frac)
    return m


def _cubic_matrix(n_in, n_out, scale, align_corners, dtype=np.float32) -> np.ndarray:
    """(n_out, n_in) matrix of PyTorch's bicubic (A = -0.75) taps, border indices clamped."""
    a = -0.75
    s = dtype(_scale(n_in, n_out, scale, align_corners))
    i = np.arange(n_out, dtype=dtype)
    src = i * s if align_corners else (i + dtype(0.5)) * s - dtype(0.5)
    base = np.floor(src)
    t = (src - base).astype(dtype)

    def near(x):  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x):  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    coeffs = [far(t + 1), near(t), near(1 - t), far(2 - t)]
    m = np.zeros((n_out, n_in), dtype)
    for k, c in enumerate(coeffs):
        idx = np.clip(base.astype(np.int64) - 1 + k, 0, n_in - 1)
        np.add.at(m, (np.arange(n_out), idx), c)
    return m


def _upsample_nearest(x, output_size, scales, exact=False):
    nd = len(output_size)
    for i, (o, s) in enumerate(zip(output_size, scales)):
        axis = x.ndim - nd + i
        x = jnp.take(x, jnp.asarray(_nearest_index(x.shape[axis], o, s, exact)), axis=axis)
    return x


def _upsample_linear(x, output_size, align_corners, scales, matrix=_linear_matrix):
    """Separable interpolation: one (out, in) matrix product per spatial axis."""
    nd = len(output_size)
    y = _up(x)
    for i, (o, s) in enumerate(zip(output_size, scales)):
        axis = x.ndim - nd + i
        # PyTorch computes the source positions in the accumulate type: double for double
        m = jnp.asarray(matrix(x.shape[axis], o, s, align_corners, np.dtype(y.dtype).type), y.dtype)
        y = jnp.moveaxis(jnp.tensordot(y, m, axes=([axis], [1]), precision=HIGHEST), -1, axis)
    return y


def _upsample_lowerings(nd: int, fwd, bwd, exact: bool):
    @lowering(fwd)
    def forward(x, output_size, *scales):
        return _upsample_nearest(x, tuple(output_size), _pad_scales(scales, nd), exact)

    @lowering(bwd)
    def backward(g, output_size, input_size, *scales):
        _, vjp = jax.vjp(lambda a: _upsample_nearest(a, tuple(output_size), _pad_scales(scales, nd), exact),
                         jnp.zeros(tuple(input_size), opmath(g.dtype)))
        return vjp(_up(g))[0].astype(g.dtype)


def interpolation_lowerings(fwd, bwd, interpolate) -> None:
    """Register an interpolating upsample op and its backward (the vjp of the forward), given
    ``interpolate(x, output_size, align_corners, scales)`` computed in opmath."""

    @lowering(fwd)
    def forward(x, output_size, align_corners, *scales):
        return interpolate(x, output_size, align_corners, scales).astype(x.dtype)

    @lowering(bwd)
    def backward(g, output_size, input_size, align_corners, *scales):
        _, vjp = jax.vjp(lambda a: interpolate(a, output_size, align_corners, scales),
                         jnp.zeros(tuple(input_size), opmath(g.dtype)))
        return vjp(_up(g))[0].astype(g.dtype)


def _linear_lowerings(nd: int, fwd, bwd, matrix=_linear_matrix):
    def interpolate(x, output_size, align_corners, scales):
        return _upsample_linear(x, tuple(output_size), align_corners, _pad_scales(scales, nd), matrix)

    interpolation_lowerings(fwd, bwd, interpolate)


def _pad_scales(scales, nd):
    scales = list(scales) + [None] * (nd - len(scales))
    return scales[:nd]


for _nd, _name in ((1, "1d"), (2, "2d"), (3, "3d")):
    _upsample_lowerings(_nd, getattr(aten, f"upsample_nearest{_name}").default,
                        getattr(aten, f"upsample_nearest{_name}_backward").default, False)
    _upsample_lowerings(_nd, getattr(aten, f"_upsample_nearest_exact{_name}").default,
                        getattr(aten, f"_upsample_nearest_exact{_name}_backward").default, True)
_linear_lowerings(1, aten.upsample_linear1d.default, aten.upsample_linear1d_backward.default)
_linear_lowerings(2, aten.upsample_bilinear2d.default, aten.upsample_bilinear2d_backward.default)
_linear_lowerings(3, aten.upsample_trilinear3d.default, aten.upsample_trilinear3d_backward.default)
_linear_lowerings(2, aten.upsample_bicubic2d.default, aten.upsample_bicubic2d_backward.default, _cubic_matrix)
