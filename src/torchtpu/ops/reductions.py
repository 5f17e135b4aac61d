"""Reductions and scans: sum/mean/prod/amax/..., var/std, norms, arg- and sort-based reductions,
cumulative ops, segment_reduce, hash_tensor. Dtypes follow PyTorch: integers and bools sum to
int64, float16/bfloat16 accumulate in float32 (``opmath``), ``dim=None`` (and ``dim=[]`` where
PyTorch says so) reduce every dimension, and a 0-d tensor accepts ``dim`` 0 and -1."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from torchtpu.ops.dtypes import is_complex, is_float, is_integral, opmath, to_jax_dtype
from torchtpu.ops.elementwise import logaddexp_complex
from torchtpu.ops.registry import aten, lowering
from torchtpu.runtime.dtypes import scalar_type_name

_INT64 = np.dtype(jnp.int64)
_BOOL = np.dtype(jnp.bool_)


# ---------------------------------------------------------------- dims and dtypes

def wrap_dim(dim: int, ndim: int) -> int:
    """``dim`` as a non-negative index, PyTorch's IndexError when out of range (0-d: [-1, 0])."""
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], "
                         f"but got {dim})")
    return dim % n


def reduction_axes(x, dim, empty_means_all: bool = True) -> tuple[int, ...]:
    """The JAX axes a PyTorch ``dim`` argument (None, int or list) reduces over."""
    if dim is None:
        return tuple(range(x.ndim))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    if not dims and empty_means_all:
        return tuple(range(x.ndim))
    wrapped = [wrap_dim(d, x.ndim) for d in dims]
    for d in set(wrapped):
        if wrapped.count(d) > 1:
            raise RuntimeError(f"dim {d} appears multiple times in the list of dims")
    return tuple(sorted(set(wrapped))) if x.ndim else ()


def _one_axis(x, dim: int) -> tuple[int, ...]:
    axis = wrap_dim(dim, x.ndim)
    return () if x.ndim == 0 else (axis,)


def _real(dtype) -> np.dtype:
    return np.dtype(jnp.finfo(dtype).dtype) if is_complex(dtype) else np.dtype(dtype)


def _accumulating_dtype(x, dtype) -> np.dtype:
    """sum/prod/cumsum's result dtype: ``dtype`` if given, int64 for ints and bools."""
    if dtype is not None:
        return to_jax_dtype(dtype)
    return _INT64 if is_integral(x.dtype, include_bool=True) else np.dtype(x.dtype)


def _floating_dtype(name: str, x, dtype) -> np.dtype:
    """mean-like ops: ``dtype`` if given, else the input's, which must be floating or complex."""
    out = to_jax_dtype(dtype) if dtype is not None else np.dtype(x.dtype)
    if not (is_float(out) or is_complex(out)):
        raise RuntimeError(f"{name}(): could not infer output dtype. Input dtype must be either a floating "
                           f"point or complex dtype. Got: {scalar_type_name(out)}")
    return out


def _count(x, axes) -> int:
    return int(np.prod([x.shape[a] for a in axes], dtype=np.int64))


def _check_nonempty(name: str, x, axes, full: bool) -> None:
    """max/amax/argmax have no identity: PyTorch refuses empty reductions."""
    if x.size and all(x.shape[a] for a in axes):
        return
    if full:
        if x.size == 0:
            raise RuntimeError(f"{name}(): Expected reduction dim to be specified for input.numel() == 0. "
                               "Specify the reduction dim with the 'dim' argument.")
        return
    for a in axes:
        if x.shape[a] == 0:
            raise IndexError(f"{name}(): Expected reduction dim {a} to have non-zero size.")


# ---------------------------------------------------------------- sum-like (identity exists)

def _sum(x, dim=None, keepdim=False, *, dtype=None):
    out = _accumulating_dtype(x, dtype)
    return jnp.sum(x.astype(opmath(out)), axis=reduction_axes(x, dim), keepdims=keepdim).astype(out)


def _nansum(x, dim=None, keepdim=False, *, dtype=None):
    if is_float(x.dtype):
        x = jnp.where(jnp.isnan(x), jnp.zeros((), x.dtype), x)
    return _sum(x, dim, keepdim, dtype=dtype)


def _prod(x, dim=None, keepdim=False, *, dtype=None):
    out = _accumulating_dtype(x, dtype)
    return jnp.prod(x.astype(opmath(out)), axis=reduction_axes(x, dim), keepdims=keepdim).astype(out)


def _mean(x, dim=None, keepdim=False, *, dtype=None):
    out = _floating_dtype("mean", x, dtype)
    axes = reduction_axes(x, dim)
    total = jnp.sum(x.astype(opmath(out)), axis=axes, keepdims=keepdim)
    return (total / _count(x, axes)).astype(out)


# each accepts both the all-dims overload (x, *, dtype) and the dims one (x, dim, keepdim, *, dtype)
SUM_LIKE = {
    _sum: (aten.sum.default, aten.sum.dim_IntList),
    _nansum: (aten.nansum.default,),
    _prod: (aten.prod.default, aten.prod.dim_int),
    _mean: (aten.mean.default, aten.mean.dim),
}
for _fn, _ops in SUM_LIKE.items():
    lowering(*_ops)(_fn)


@lowering(aten.count_nonzero.dim_IntList)
def count_nonzero_dims(x, dim):
    return jnp.sum(x != 0, axis=reduction_axes(x, dim), dtype=_INT64)


@lowering(aten.count_nonzero.default)
def count_nonzero(x, dim=None):
    return jnp.sum(x != 0, axis=reduction_axes(x, dim), dtype=_INT64)


# ---------------------------------------------------------------- any / all

def _logical(fn, name: str):
    def lower(x, dim=None, keepdim=False):
        axes = reduction_axes(x, dim, empty_means_all=False) if dim is not None else tuple(range(x.ndim))
        out = fn(x != 0, axis=axes, keepdims=keepdim)
        # PyTorch keeps uint8 for uint8 inputs (a legacy of bool-as-byte)
        return out.astype(jnp.uint8) if x.dtype == jnp.uint8 else out

    lower.__name__ = name
    return lower


for _packet, _fn in ((aten.any, jnp.any), (aten.all, jnp.all)):
    lowering(_packet.default, _packet.dim, _packet.dims)(_logical(_fn, _packet.__name__))


# ---------------------------------------------------------------- max-like (no identity)

def _extreme(fn, name: str):
    def lower(x, dim=(), keepdim=False):
        axes = reduction_axes(x, dim)
        _check_nonempty(name, x, axes, full=not dim)
        return fn(x, axis=axes, keepdims=keepdim)

    lower.__name__ = name
    return lower


_amax = _extreme(jnp.max, "amax")
_amin = _extreme(jnp.min, "amin")
lowering(aten.amax.default)(_amax)
lowering(aten.amin.default)(_amin)


@lowering(aten.max.default)
def max_(x):
    _check_nonempty("max", x, (), full=True)
    return jnp.max(x)


@lowering(aten.min.default)
def min_(x):
    _check_nonempty("min", x, (), full=True)
    return jnp.min(x)


def _arg(fn, name: str):
    def lower(x, dim=None, keepdim=False):
        if dim is None:
            if x.size == 0:
                _empty_error(name)
            out = fn(x.reshape(-1), axis=0)
            return out.reshape((1,) * x.ndim if keepdim else ()).astype(_INT64)
        axes = _one_axis(x, dim)
        _check_nonempty(name, x, axes, full=False)
        if not axes:
            return jnp.zeros((), _INT64)
        return fn(x, axis=axes[0], keepdims=keepdim).astype(_INT64)

    lower.__name__ = name
    return lower


_argmax = _arg(jnp.argmax, "argmax")
_argmin = _arg(jnp.argmin, "argmin")
lowering(aten.argmax.default)(_argmax)
lowering(aten.argmin.default)(_argmin)


@lowering(aten.max.dim)
def max_dim(x, dim, keepdim=False):
    return _amax(x, [dim], keepdim), _argmax(x, dim, keepdim)


@lowering(aten.min.dim)
def min_dim(x, dim, keepdim=False):
    return _amin(x, [dim], keepdim), _argmin(x, dim, keepdim)


@lowering(aten.aminmax.default)
def aminmax(x, *, dim=None, keepdim=False):
    if dim is None:
        _check_nonempty("aminmax", x, (), full=True)
        shape = (1,) * x.ndim if keepdim else ()
        return jnp.min(x).reshape(shape), jnp.max(x).reshape(shape)
    return _amin(x, [dim], keepdim), _amax(x, [dim], keepdim)


# ---------------------------------------------------------------- var / std

def _var_mean(x, dim, correction, keepdim):
    out = _floating_dtype("var", x, None) if not is_complex(x.dtype) else np.dtype(x.dtype)
    acc = opmath(out)
    axes = reduction_axes(x, dim)
    n = _count(x, axes)
    xs = x.astype(acc)
    mean = jnp.sum(xs, axis=axes, keepdims=True) / n
    diff = xs - mean
    sq = (diff.real ** 2 + diff.imag ** 2) if is_complex(acc) else diff * diff
    correction = 1 if correction is None else correction
    dof = jnp.maximum(jnp.asarray(n, _real(acc)) - correction, 0)
    var = jnp.sum(sq, axis=axes, keepdims=keepdim) / dof
    if not keepdim:
        mean = jnp.squeeze(mean, axis=axes) if axes else mean
    return var.astype(_real(out)), mean.astype(out)


@lowering(aten.var.correction)
def var(x, dim=None, *, correction=None, keepdim=False):
    return _var_mean(x, dim, correction, keepdim)[0]


@lowering(aten.std.correction)
def std(x, dim=None, *, correction=None, keepdim=False):
    v = _var_mean(x, dim, correction, keepdim)[0]
    return jnp.sqrt(v.astype(opmath(v.dtype))).astype(v.dtype)


@lowering(aten.var_mean.correction)
def var_mean(x, dim=None, *, correction=None, keepdim=False):
    return _var_mean(x, dim, correction, keepdim)


@lowering(aten.std_mean.correction)
def std_mean(x, dim=None, *, correction=None, keepdim=False):
    v, m = _var_mean(x, dim, correction, keepdim)
    return jnp.sqrt(v.astype(opmath(v.dtype))).astype(v.dtype), m


# ---------------------------------------------------------------- logsumexp and norms

@lowering(aten.logsumexp.default)
def logsumexp(x, dim, keepdim=False):
    out = np.dtype(x.dtype) if is_float(x.dtype) or is_complex(x.dtype) else np.dtype(jnp.float32)
    xs = x.astype(opmath(out))
    axes = reduction_axes(x, dim)
    if x.size == 0:
        return jnp.log(jnp.sum(jnp.exp(xs), axis=axes, keepdims=keepdim)).astype(out)
    m = jnp.max(xs.real if is_complex(out) else xs, axis=axes, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0)  # all -inf (or inf) rows: no shift
    total = jnp.log(jnp.sum(jnp.exp(xs - m), axis=axes, keepdims=True)) + m
    return (total if keepdim else jnp.squeeze(total, axis=axes)).astype(out)


def _vector_norm(x, ord, axes, keepdim, out):
    """||x||_ord over ``axes``, computed in opmath(out), returned as ``out``."""
    a = jnp.abs(x.astype(opmath(out) if not is_complex(x.dtype) else x.dtype)).astype(opmath(_real(out)))
    if ord == float("inf") or ord == float("-inf"):
        _check_nonempty_norm(x, axes, ord)
        r = (jnp.max if ord > 0 else jnp.min)(a, axis=axes, keepdims=keepdim)
    elif ord == 0:
        r = jnp.sum(a != 0, axis=axes, keepdims=keepdim).astype(a.dtype)
    elif ord == 1:
        r = jnp.sum(a, axis=axes, keepdims=keepdim)
    elif ord == 2:
        r = jnp.sqrt(jnp.sum(a * a, axis=axes, keepdims=keepdim))
    else:
        if ord < 0:
            _check_nonempty_norm(x, axes, ord)
        r = jnp.sum(a ** ord, axis=axes, keepdims=keepdim) ** (1.0 / ord)
    return r.astype(_real(out))


def _check_nonempty_norm(x, axes, ord) -> None:
    if any(x.shape[a] == 0 for a in axes) or (not axes and x.size == 0):
        raise RuntimeError(f"linalg.vector_norm cannot compute the {ord} norm on an empty tensor because "
                           "the operation does not have an identity")


@lowering(aten.linalg_vector_norm.default, static_scalars=True)
def linalg_vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    _check_norm_input(x)  # even with a dtype, as PyTorch does
    if dtype is not None:
        x = x.astype(to_jax_dtype(dtype))
    return _vector_norm(x, float(ord), reduction_axes(x, dim), keepdim, np.dtype(x.dtype))


def _check_norm_input(x) -> None:
    if not (is_float(x.dtype) or is_complex(x.dtype)):
        raise RuntimeError(f"linalg.vector_norm: Expected a floating point or complex tensor as input. "
                           f"Got {scalar_type_name(x.dtype)}")




def _norm(x, p, dim, keepdim, dtype):
    _check_norm_input(x)
    p = 2.0 if p is None else float(p)
    x = x.astype(to_jax_dtype(dtype)) if dtype is not None else x
    return _vector_norm(x, p, reduction_axes(x, dim), keepdim, np.dtype(x.dtype))


@lowering(aten.norm.Scalar, static_scalars=True)
def norm(x, p=2):
    return _norm(x, p, None, False, None)


@lowering(aten.norm.ScalarOpt_dim, static_scalars=True)
def norm_dim(x, p, dim, keepdim=False):
    return _norm(x, p, dim, keepdim, None)


@lowering(aten.norm.ScalarOpt_dim_dtype, static_scalars=True)
def norm_dim_dtype(x, p, dim, keepdim, *, dtype):
    return _norm(x, p, dim, keepdim, dtype)


@lowering(aten.norm.ScalarOpt_dtype, static_scalars=True)
def norm_dtype(x, p, *, dtype):
    return _norm(x, p, None, False, dtype)


# ---------------------------------------------------------------- scans

def _scan_input(x, dim, dtype):
    out = _accumulating_dtype(x, dtype)
    axes = _one_axis(x, dim)
    return x.astype(opmath(out)), axes, out


@lowering(aten.cumsum.default)
def cumsum(x, dim, *, dtype=None):
    xs, axes, out = _scan_input(x, dim, dtype)
    return (lax.cumsum(xs, axes[0]) if axes else xs).astype(out)


@lowering(aten.cumprod.default)
def cumprod(x, dim, *, dtype=None):
    xs, axes, out = _scan_input(x, dim, dtype)
    return (lax.cumprod(xs, axes[0]) if axes else xs).astype(out)


@lowering(aten.logcumsumexp.default, aten._logcumsumexp.default)
def logcumsumexp(x, dim):
    axes = _one_axis(x, dim)
    xs = x.astype(opmath(x.dtype))
    if not axes or x.size == 0:
        return x
    if is_complex(x.dtype):
        return _sequential_scan(logaddexp_complex, xs, axes[0])
    return lax.associative_scan(jnp.logaddexp, xs, axis=axes[0]).astype(x.dtype)


def _sequential_scan(fn, x, axis: int):
    """An inclusive scan of ``fn`` along ``axis``, left to right (for non-associative rounding)."""
    moved = jnp.moveaxis(x, axis, 0)

    def step(acc, z):
        acc = fn(acc, z)
        return acc, acc

    _, out = lax.scan(step, moved[0], moved[1:])
    return jnp.moveaxis(jnp.concatenate([moved[:1], out]), 0, axis)


def _cum_extreme(better):
    """cummax/cummin: the running extreme and the index of its latest occurrence; NaN wins."""

    def combine(a, b):
        (av, ai), (bv, bi) = a, b
        take_b = _isnan(bv) | (~_isnan(av) & better(bv, av))
        return jnp.where(take_b, bv, av), jnp.where(take_b, bi, ai)

    def lower(x, dim):
        axes = _one_axis(x, dim)
        if not axes:
            return x, jnp.zeros((), _INT64)
        index = lax.broadcasted_iota(_INT64, x.shape, axes[0])
        if x.size == 0:
            return x, index
        return lax.associative_scan(combine, (x, index), axis=axes[0])

    return lower


def _isnan(x):
    return jnp.isnan(x) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.zeros(x.shape, bool)


lowering(aten.cummax.default)(_cum_extreme(jnp.greater_equal))
lowering(aten.cummin.default)(_cum_extreme(jnp.less_equal))


# ---------------------------------------------------------------- sort-based: median, mode

def _median_along(x, axis: int, ignore_nan: bool):
    """Lower median along ``axis`` (keepdim) and the index of that element."""
    order = jnp.argsort(x, axis=axis, stable=True)  # NaNs sort last
    ordered = jnp.take_along_axis(x, order, axis=axis)
    nan = _isnan(x)
    if ignore_nan:
        k = (jnp.sum(~nan, axis=axis, keepdims=True) - 1) // 2
        k = jnp.maximum(k, 0)
    else:
        k = jnp.full(x.shape[:axis] + (1,) + x.shape[axis + 1:], (x.shape[axis] - 1) // 2)
    values = jnp.take_along_axis(ordered, k, axis=axis)
    indices = jnp.take_along_axis(order, k, axis=axis).astype(_INT64)
    if not ignore_nan:
        has_nan = jnp.any(nan, axis=axis, keepdims=True)
        first_nan = jnp.argmax(nan, axis=axis, keepdims=True).astype(_INT64)
        values = jnp.where(has_nan, jnp.asarray(jnp.nan, x.dtype) if is_float(x.dtype) else values, values)
        indices = jnp.where(has_nan, first_nan, indices)
    return values, indices


def _median_full(name: str, ignore_nan: bool):
    def lower(x):
        if x.size == 0:
            return jnp.full((), jnp.nan, x.dtype) if is_float(x.dtype) else _empty_error(name)
        return _median_along(x.reshape(-1), 0, ignore_nan)[0].reshape(())

    return lower


def _empty_error(name: str):
    raise IndexError(f"{name}(): Expected reduction dim to be specified for input.numel() == 0.")


def _median_dim(name: str, ignore_nan: bool):
    def lower(x, dim, keepdim=False):
        axes = _one_axis(x, dim)
        if not axes:
            return x, jnp.zeros((), _INT64)
        _check_nonempty(name, x, axes, full=False)
        values, indices = _median_along(x, axes[0], ignore_nan)
        if not keepdim:
            values, indices = jnp.squeeze(values, axes[0]), jnp.squeeze(indices, axes[0])
        return values, indices

    return lower


lowering(aten.median.default)(_median_full("median", False))
lowering(aten.nanmedian.default)(_median_full("nanmedian", True))
lowering(aten.median.dim)(_median_dim("median", False))
lowering(aten.nanmedian.dim)(_median_dim("nanmedian", True))


@lowering(aten.mode.default)
def mode(x, dim=-1, keepdim=False):
    """The most frequent value along ``dim`` (smallest on ties) and its last index."""
    axes = _one_axis(x, dim)
    if not axes:
        return x, jnp.zeros((), _INT64)
    _check_nonempty("mode", x, axes, full=False)
    axis = axes[0]
    xm = jnp.moveaxis(x, axis, -1)
    # counts[..., i] = how many elements equal element i (O(n^2): mode's rows are short in practice)
    eq = (xm[..., :, None] == xm[..., None, :]) | (_isnan(xm)[..., :, None] & _isnan(xm)[..., None, :])
    counts = jnp.sum(eq, axis=-1)
    best = jnp.max(counts, axis=-1, keepdims=True)
    candidates = counts == best
    # among the most frequent values take the smallest, then its last position
    smallest = jnp.min(jnp.where(candidates & ~_isnan(xm), xm, _top(xm.dtype)), axis=-1, keepdims=True)
    if is_float(xm.dtype):  # NaN sorts last: it is the mode only when no number ties with it
        numbers = jnp.any(candidates & ~_isnan(xm), axis=-1, keepdims=True)
        smallest = jnp.where(numbers, smallest, jnp.nan)
    is_value = candidates & ((xm == smallest) | (_isnan(xm) & _isnan(smallest)))
    n = xm.shape[-1]
    last = (n - 1 - jnp.argmax(is_value[..., ::-1], axis=-1)).astype(_INT64)
    values = jnp.take_along_axis(xm, last[..., None], axis=-1)[..., 0]
    if keepdim:
        values, last = jnp.expand_dims(values, axis), jnp.expand_dims(last, axis)
    return values, last


def _top(dtype):
    if is_float(dtype):
        return jnp.asarray(jnp.inf, dtype)
    if dtype == _BOOL:
        return jnp.asarray(True)
    return jnp.asarray(jnp.iinfo(dtype).max, dtype)


# ---------------------------------------------------------------- segment_reduce

# per reduction: the segment op, how ``initial`` joins a segment's result, and the default initial
_SEGMENT = {
    "sum": (jax.ops.segment_sum, jnp.add, 0.0),
    "mean": (jax.ops.segment_sum, jnp.add, 0.0),
    "prod": (jax.ops.segment_prod, jnp.multiply, 1.0),
    "max": (jax.ops.segment_max, jnp.maximum, -jnp.inf),
    "min": (jax.ops.segment_min, jnp.minimum, jnp.inf),
}


class _Segments:
    """Where each row of ``data`` along ``axis`` goes: data as (outer, n, inner) rows, the segment
    of each row (``count`` for rows in no segment) numbered across the outer blocks, lengths."""

    def __init__(self, data, axis: int, lengths, offsets):
        shape = data.shape
        self.outer, n = int(np.prod(shape[:axis], dtype=np.int64)), shape[axis]
        self.rows = data.reshape(self.outer * n, int(np.prod(shape[axis + 1:], dtype=np.int64)))
        if offsets is not None:
            bounds = offsets.reshape(self.outer, -1)
            starts, ends = bounds[:, :-1], bounds[:, 1:]
        else:
            ends = jnp.cumsum(lengths.reshape(self.outer, -1), axis=1)
            starts = ends - lengths.reshape(self.outer, -1)
        self.count = count = ends.shape[1]
        self.out_shape = shape[:axis] + (count,) + shape[axis + 1:]
        self.lengths = (ends - starts).reshape(-1)
        position = jnp.arange(n)
        seg = jax.vmap(lambda e: jnp.searchsorted(e, position, side="right"))(ends)
        start = jnp.take_along_axis(starts, jnp.minimum(seg, count - 1), axis=1)
        seg = jnp.where((seg < count) & (position >= start), seg, count)
        self.ids = (seg + jnp.arange(self.outer)[:, None] * (count + 1)).reshape(-1)
        self.valid = (seg < count).reshape(-1, 1)

    def reduce(self, fn, values):
        """``fn`` (a jax.ops.segment_*) of ``values`` (rows) per segment: (outer * count, inner)."""
        out = fn(values, self.ids, num_segments=self.outer * (self.count + 1))
        return out.reshape(self.outer, self.count + 1, -1)[:, :self.count].reshape(self.outer * self.count, -1)

    def spread(self, per_segment):
        """Each row's segment's value of ``per_segment`` (outer * count, inner); 0 for rows in none."""
        padded = jnp.pad(per_segment.reshape(self.outer, self.count, -1), ((0, 0), (0, 1), (0, 0)))
        return padded.reshape(self.outer * (self.count + 1), -1)[self.ids]


def _segment_args(data, reduce: str, lengths, offsets, axis: int) -> _Segments:
    if reduce not in _SEGMENT:
        raise RuntimeError(f"unsupported reduction given! {reduce}")
    if lengths is None and offsets is None:
        raise RuntimeError("segment_reduce(): Either lengths or offsets must be defined")
    if not is_float(data.dtype):
        raise RuntimeError(f"\"segment_reduce\" not implemented for '{scalar_type_name(data.dtype)}'")
    return _Segments(data, wrap_dim(axis, data.ndim), lengths, offsets)


@lowering(aten.segment_reduce.default)
def segment_reduce(data, reduce, *, lengths=None, indices=None, offsets=None, axis=0, unsafe=False,
                   initial=None):
    """PyTorch's CPU kernel: ``initial`` joins every segment; an empty mean is NaN unless ``initial``
    is given. Lengths are not checked against the data (``unsafe``), which would need a host sync."""
    if indices is not None:
        raise RuntimeError("segment_reduce(): indices based reduction is not supported yet.")
    if data.size == 0:
        raise RuntimeError("segment_reduce(): Expected data to be non-empty")
    seg = _segment_args(data, reduce, lengths, offsets, axis)
    fn, combine, default = _SEGMENT[reduce]
    rows = seg.rows.astype(opmath(data.dtype))
    start = default if initial is None else initial
    out = combine(jnp.asarray(start, rows.dtype), seg.reduce(fn, rows))
    if reduce in ("max", "min"):  # NaN wins, as in PyTorch (XLA's scatter max/min may drop it)
        out = jnp.where(seg.reduce(jax.ops.segment_max, jnp.isnan(rows)), jnp.nan, out)
    if reduce == "mean":
        n = seg.lengths.reshape(-1, 1).astype(rows.dtype)
        empty = out if initial is not None else jnp.full_like(out, jnp.nan)
        out = jnp.where(n > 0, out / jnp.maximum(n, 1), empty)
    return out.reshape(seg.out_shape).astype(data.dtype)


@lowering(aten._segment_reduce_backward.default)
def segment_reduce_backward(grad, output, data, reduce, *, lengths=None, offsets=None, axis=0, initial=None):
    """The gradient PyTorch's CPU kernel computes, ties in max/min included (see below)."""
    seg = _segment_args(data, reduce, lengths, offsets, axis)
    acc = opmath(data.dtype)
    x = seg.rows.astype(acc)
    g = seg.spread(grad.astype(acc).reshape(seg.outer * seg.count, -1))
    out = seg.spread(output.astype(acc).reshape(seg.outer * seg.count, -1))
    if reduce == "sum":
        result = g
    elif reduce == "mean":
        result = g / jnp.maximum(seg.spread(seg.lengths.reshape(-1, 1)), 1).astype(acc)
    elif reduce in ("max", "min"):
        hit = jnp.isnan(x) | (x == out)
        ties = seg.spread(seg.reduce(jax.ops.segment_sum, hit.astype(acc)))
        result = jnp.where(hit, g, 0)
        # PyTorch shares a tied extreme's gradient only where it is positive (its kernel's test)
        result = jnp.where((ties >= 2) & (result > 0), result / ties, result)
    else:
        result = _prod_backward(seg, x, g, out, 1.0 if initial is None else initial)
    return jnp.where(seg.valid, result, 0).reshape(data.shape).astype(grad.dtype)


def _prod_backward(seg: _Segments, x, g, out, initial):
    """d prod / d x: out / x, or the product of the others where x is 0 or NaN."""
    nan, zero = jnp.isnan(x), x == 0
    special = nan | zero
    others = jnp.asarray(initial, x.dtype) * seg.reduce(jax.ops.segment_prod, jnp.where(special, 1, x))
    count = lambda m: seg.spread(seg.reduce(jax.ops.segment_sum, m.astype(x.dtype)))  # noqa: E731
    other_nan, other_zero = count(nan) - nan, count(zero) - zero
    factor = jnp.where(other_nan > 0, jnp.nan, jnp.where(other_zero > 0, 0.0, 1.0)).astype(x.dtype)
    exclusive = seg.spread(others) * factor
    return jnp.where(special, g * exclusive, g * out / jnp.where(special, 1, x))


# ---------------------------------------------------------------- hash_tensor

@lowering(aten.hash_tensor.default)
def hash_tensor(x, dim=(), *, keepdim=False, mode=0):
    """PyTorch's mode 0: the XOR of the elements' 64-bit patterns (floats as float64 bits, integers
    sign-extended to 64 bits), as uint64."""
    if mode != 0:
        raise RuntimeError(f"hash_tensor: only mode=0 (xor_sum) is supported, got mode={mode}")
    if is_complex(x.dtype):
        raise RuntimeError("hash_tensor: complex tensors are not supported")
    axes = reduction_axes(x, dim)
    _check_nonempty("hash_tensor", x, axes, full=not dim)
    if is_float(x.dtype):
        bits = lax.bitcast_convert_type(x.astype(jnp.float64), jnp.uint64)
    elif jnp.issubdtype(x.dtype, jnp.signedinteger):
        bits = lax.bitcast_convert_type(x.astype(jnp.int64), jnp.uint64)
    else:
        bits = x.astype(jnp.uint64)
    return jnp.bitwise_xor.reduce(bits, axis=axes, keepdims=keepdim)
