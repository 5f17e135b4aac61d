"""Indexing ops: advanced indexing, gather/scatter, masks, sorting and searching, histograms, unique.

Out-of-range indices follow XLA, not PyTorch: gathers clamp them into range and scatters drop
them, where PyTorch raises "index X is out of bounds". Checking would cost a device→host sync
per op. Negative indices wrap where PyTorch wraps them (``x[idx]``, ``index_put``, ``take``).

Boolean masks give data-dependent shapes: ``index`` with a bool mask, ``masked_select``,
``nonzero``, ``unique``, ``bincount`` and ``repeat_interleave`` run eagerly (``jit=False``) on
concrete arrays, read what decides the shape on the host (one sync), then call jitted code. In a
``torch.compile`` graph they never appear with a mask (dynamo breaks the graph there).
``index_put`` with a single mask (``x[mask] = v``, ``x[mask] += v``) keeps its shape, so it runs
without a sync and traces.

Sorting is stable everywhere; where PyTorch leaves the order of equal elements unspecified
(``sort(stable=False)``, ``topk``, ``kthvalue``) the indices of ties may differ from the CPU's.
``unique(sorted=False)`` returns sorted values.
"""

from __future__ import annotations

import builtins
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from torchtpu.ops import checks
from torchtpu.ops.dtypes import is_float, is_integral, opmath, promote
from torchtpu.ops.registry import aten, lowering


def _dim(dim: int, ndim: int) -> int:
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], but got {dim})")
    return dim % n


def _is_mask(a) -> bool:
    return a is not None and a.dtype in (np.bool_, np.uint8)


# ---------------------------------------------------------------- advanced indexing

def _masks_to_indices(x, indices) -> list:
    """Bool/uint8 masks replaced by the integer indices of their True entries (needs concrete masks)."""
    out, pos = [], 0
    for idx in indices:
        if not _is_mask(idx):
            out.append(idx)
            pos += 1
            continue
        if isinstance(idx, jax.core.Tracer):
            raise NotImplementedError("indexing with a boolean mask has a data-dependent shape and cannot be "
                                      "traced; index with integer tensors (e.g. mask.nonzero()) instead")
        if idx.ndim == 0:
            raise NotImplementedError("tpu: indexing with a 0-d boolean tensor is not supported; use x[None] or x[:0]")
        for k, n in enumerate(idx.shape):
            if pos + k >= x.ndim or x.shape[pos + k] != n:
                raise IndexError(f"The shape of the mask {list(idx.shape)} at index {k} does not match the shape "
                                 f"of the indexed tensor {list(x.shape)} at index {pos + k}")
        out.extend(_device_put(x, *np.nonzero(np.asarray(idx))))
        pos += idx.ndim
    return out


def _index_tuple(pattern, arrays):
    it = iter(arrays)
    return tuple(slice(None) if p is None else next(it) for p in pattern)


@functools.cache
def _gather(pattern):
    """A jitted ``x[index]`` for one pattern of given (True) and full-slice (None) indices."""
    return jax.jit(lambda x, *arrays: x[_index_tuple(pattern, arrays)])


@functools.partial(jax.jit, static_argnums=(0, 1))
def _put(pattern, accumulate, x, values, *arrays):
    where = _index_tuple(pattern, arrays)
    if accumulate:
        return _add_at(x, where, values)
    return x.at[where].set(values.astype(x.dtype))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _put_masked(lead, accumulate, x, mask, values):
    """``x[(:,)*lead + (mask,)] = values`` (or ``+=``) with no host sync: the k-th True entry of
    ``mask`` takes the k-th row of ``values``, found by a running count of the mask."""
    trailing = x.shape[lead + mask.ndim:]
    target = x.shape[:lead] + (None,) + trailing  # None: the masked entries' dim
    values = jnp.asarray(values).astype(x.dtype)
    values = values.reshape((1,) * (len(target) - values.ndim) + values.shape)
    rows = values.shape[lead]
    if rows == 0:  # no values: the mask has no True entry (PyTorch raises otherwise)
        return x
    values = jnp.broadcast_to(values, x.shape[:lead] + (rows,) + trailing)
    position = jnp.clip(jnp.cumsum(mask.reshape(-1)) - 1, 0, rows - 1)
    picked = jnp.take(values, position, axis=lead).reshape(x.shape)
    keep = mask.reshape((1,) * lead + mask.shape + (1,) * len(trailing))
    if accumulate:
        return _add_at_where(x, keep, picked)
    return jnp.where(keep, picked, x)


def _add_at_where(x, keep, values):
    if x.dtype == np.bool_:
        return x | (keep & values)
    return x + jnp.where(keep, values, jnp.zeros((), x.dtype))


def _split(x, indices):
    """The pattern of given indices and their arrays, each checked against its dim's size."""
    for dim, i in enumerate(indices):
        if i is not None and dim < x.ndim:
            checks.in_bounds(i, x.shape[dim], dim)
    return tuple(True if i is not None else None for i in indices), [i for i in indices if i is not None]


# _unsafe_*: PyTorch's decompositions call them with indices they made in bounds; unchecked, as on CUDA
@lowering(aten.index.Tensor, graph_only=True, checked=True)  # a graph's indices are integers: they trace
@lowering(aten.index.Tensor, jit=False, checked=True)
@lowering(aten._unsafe_index.Tensor, graph_only=True)
@lowering(aten._unsafe_index.Tensor, jit=False)
def index(x, indices):
    if len(indices) > max(x.ndim, 1):
        raise IndexError(f"too many indices for tensor of dimension {x.ndim} (got {len(indices)})")
    pattern, arrays = _split(x, _masks_to_indices(x, indices))
    return _gather(pattern)(x, *arrays)


def _single_mask(indices):
    """The position of the only index if it is a (non 0-d) bool mask, else None."""
    given = [k for k, i in enumerate(indices) if i is not None]
    if len(given) == 1 and indices[given[0]].dtype == np.bool_ and indices[given[0]].ndim:
        return given[0]
    return None


@lowering(aten.index_put.default, graph_only=True, checked=True)
@lowering(aten.index_put.default, jit=False, checked=True)
@lowering(aten._unsafe_index_put.default, graph_only=True)
@lowering(aten._unsafe_index_put.default, jit=False)
def index_put(x, indices, values, accumulate=False):
    lead = _single_mask(indices)
    if lead is not None:  # the common x[mask] = v: traceable, no host sync
        mask = indices[lead]
        if x.shape[lead:lead + mask.ndim] != mask.shape:
            raise IndexError(f"The shape of the mask {list(mask.shape)} at index 0 does not match the shape "
                             f"of the indexed tensor {list(x.shape)} at index {lead}")
        _check_masked_rows(x, lead, mask, values)
        return _put_masked(lead, bool(accumulate), x, mask, values)
    pattern, arrays = _split(x, _masks_to_indices(x, indices))
    return _put(pattern, bool(accumulate), x, jnp.asarray(values), *arrays)


def _check_masked_rows(x, lead: int, mask, values) -> None:
    """PyTorch's shape check of ``x[mask] = values`` where it does not depend on the mask's values:
    more rows of values than the mask has elements (and not 1, which broadcasts). Whether the rows
    match the mask's True count is checked on the device (reading the mask on every call would
    synchronise), raised at the next synchronization as an out-of-bounds index is."""
    values = jnp.asarray(values)
    at = lead + values.ndim - (x.ndim - mask.ndim + 1)  # values' dims align with the result's from the right
    rows = values.shape[at] if 0 <= at < values.ndim else 1
    if rows > 1 and rows <= mask.size:  # the True count must be ``rows``: checked on the device
        shape = ", ".join([*map(str, x.shape[:lead]), "the mask's number of True elements",
                           *map(str, x.shape[lead + mask.ndim:])])
        checks.require(jnp.sum(mask) != rows, f"shape mismatch: value tensor of shape {list(values.shape)} "
                       f"cannot be broadcast to indexing result of shape [{shape}]")
    if rows > 1 and rows > mask.size:
        try:  # an error: the True count (read here) makes PyTorch's message
            count = [int(jnp.sum(mask))]
        except jax.errors.ConcretizationTypeError:  # traced in a graph
            count = ["the mask's number of True elements"]
        shape = list(x.shape[:lead]) + count + list(x.shape[lead + mask.ndim:])
        raise RuntimeError(f"shape mismatch: value tensor of shape {list(values.shape)} cannot be broadcast to "
                           f"indexing result of shape {shape}")


@lowering(aten._index_put_impl_.default, jit=False, checked=True)
def _index_put_impl(x, indices, values, accumulate=False, unsafe=False):
    return index_put(x, indices, values, accumulate)


# ---------------------------------------------------------------- index_* along one dim

def _along(x, dim: int, index, negative: bool = False):
    """The index tuple that picks ``index`` along ``dim`` (x at least 1-d), checked against its
    size (``negative``: counting from the end allowed)."""
    checks.in_bounds(index, x.shape[dim], dim, negative)
    where = [slice(None)] * x.ndim
    where[dim] = index.reshape(-1)
    return tuple(where)


def _at_least_1d(fn):
    """Run ``fn(x, dim, ...)`` on 0-d ``x`` as on a 1-element vector, as PyTorch allows."""

    @functools.wraps(fn)
    def wrapper(x, dim, *args, **kwargs):
        if x.ndim:
            return fn(x, _dim(dim, x.ndim), *args, **kwargs)
        _dim(dim, 0)
        args = [a.reshape(1) if hasattr(a, "ndim") and a.ndim == 0 and k != 0 else a for k, a in enumerate(args)]
        return fn(x.reshape(1), 0, *args, **kwargs).reshape(())

    return wrapper


@lowering(aten.index_select.default, checked=True)
@_at_least_1d
def index_select(x, dim, index):
    checks.in_bounds(index, x.shape[dim], dim, negative=False)
    return jnp.take(x, index.reshape(-1), axis=dim, mode="clip")


@lowering(aten.index_add.default, checked=True)
@_at_least_1d
def index_add(x, dim, index, source, *, alpha=1):
    return _add_at(x, _along(x, dim, index), source * alpha)


@lowering(aten.index_copy.default, checked=True)
@_at_least_1d
def index_copy(x, dim, index, source):
    return x.at[_along(x, dim, index)].set(source.astype(x.dtype))


@lowering(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor, checked=True)
@_at_least_1d
def index_fill(x, dim, index, value):
    return x.at[_along(x, dim, index, negative=True)].set(jnp.asarray(value).astype(x.dtype))


def _identity(reduce: str, dtype):
    if reduce in ("sum", "mean"):
        return 0
    if reduce == "prod":
        return 1
    info = jnp.finfo(dtype) if is_float(dtype) else jnp.iinfo(dtype)
    big = jnp.inf if is_float(dtype) else info.max
    small = -jnp.inf if is_float(dtype) else info.min
    return small if reduce == "amax" else big


_AT_METHODS = {"sum": "add", "prod": "multiply", "amax": "max", "amin": "min"}


def _reduce_into(x, where, src, reduce: str, include_self: bool):
    """``x`` with ``src`` reduced into positions ``where`` (scatter_reduce / index_reduce)."""
    if x.dtype == np.bool_:  # XLA has no bool arithmetic: reduce as 0/1 integers
        return _reduce_into(x.astype(jnp.int32), where, src.astype(jnp.int32), reduce, include_self) != 0
    src = src.astype(x.dtype)
    base = x if include_self else x.at[where].set(_identity(reduce, x.dtype))
    if reduce != "mean":
        return getattr(base.at[where], _AT_METHODS[reduce])(src)
    total = base.at[where].add(src)
    count = jnp.full(x.shape, 1 if include_self else 0, x.dtype).at[where].add(jnp.ones_like(src))
    count = jnp.where(count == 0, 1, count)
    return total // count if is_integral(x.dtype) else total / count


@lowering(aten.index_reduce.default, checked=True)
@_at_least_1d
def index_reduce(x, dim, index, source, reduce, *, include_self=True):
    return _reduce_into(x, _along(x, dim, index), source, reduce, include_self)


# ---------------------------------------------------------------- gather / scatter

def _positions(index, dim: int, size: int):
    """Scatter coordinates: ``index`` along ``dim`` (checked against its ``size``), the element's
    own position elsewhere."""
    checks.in_bounds(index, size, dim, negative=False)
    grid = list(np.indices(index.shape, sparse=True))
    grid[dim] = index
    return tuple(grid)


def _crop(src, shape):
    return src[tuple(slice(0, n) for n in shape)]


@lowering(aten.gather.default, checked=True)
def gather(x, dim, index, *, sparse_grad=False):
    """The result has ``index``'s shape (also for 0-d ``x`` and empty ``index``)."""
    if index.size == 0:
        return jnp.zeros(index.shape, x.dtype)
    dim = _dim(dim, x.ndim)
    checks.in_bounds(index, x.shape[dim] if x.ndim else 1, dim, negative=False)
    x1, index1 = x.reshape(x.shape or (1,)), index.reshape(index.shape or (1,))
    shape = tuple(n if k != dim else x1.shape[k] for k, n in enumerate(index1.shape))
    return jnp.take_along_axis(_crop(x1, shape), index1, axis=dim, mode="clip").reshape(index.shape)


def _add_at(x, where, values):
    """``x.at[where].add(values)``; for bool, a logical or (XLA has no bool add)."""
    if x.dtype == np.bool_:
        return x.astype(jnp.int32).at[where].add(jnp.asarray(values).astype(jnp.int32)) != 0
    return x.at[where].add(jnp.asarray(values).astype(x.dtype))


def _scatter(x, dim, index, src, method: str):
    if index.size == 0:
        return x
    if index.ndim == 0:
        index = index.reshape(1)
    src = _crop(src, index.shape) if hasattr(src, "ndim") and src.ndim else src
    if method == "add":
        return _add_at(x, _positions(index, dim, x.shape[dim]), src)
    at = x.at[_positions(index, dim, x.shape[dim])]
    return getattr(at, method)(jnp.asarray(src).astype(x.dtype))


@lowering(aten.scatter.src, aten.scatter.value, checked=True)
@_at_least_1d
def scatter(x, dim, index, src):
    return _scatter(x, dim, index, src, "set")


_SCATTER_REDUCE = {"add": "add", "multiply": "multiply"}


@lowering(aten.scatter.reduce, aten.scatter.value_reduce, checked=True)
@_at_least_1d
def scatter_reduce_legacy(x, dim, index, src, *, reduce):
    if reduce not in _SCATTER_REDUCE:
        raise RuntimeError(f"reduce argument must be either add or multiply, got {reduce}")
    return _scatter(x, dim, index, src, _SCATTER_REDUCE[reduce])


@lowering(aten.scatter_add.default, checked=True)
@_at_least_1d
def scatter_add(x, dim, index, src):
    return _scatter(x, dim, index, src, "add")


@lowering(aten.scatter_reduce.two, checked=True)
@_at_least_1d
def scatter_reduce(x, dim, index, src, reduce, *, include_self=True):
    if index.size == 0:
        return x
    if index.ndim == 0:
        index = index.reshape(1)
    return _reduce_into(x, _positions(index, dim, x.shape[dim]), _crop(src, index.shape), reduce, include_self)


@lowering(aten.put.default, checked=True)
def put(x, index, source, accumulate=False):
    flat = x.reshape(-1)
    checks.in_bounds(index, flat.size)
    index = jnp.where(index < 0, index + flat.size, index).reshape(-1)
    source = source.reshape(-1)
    out = _add_at(flat, index, source) if accumulate else flat.at[index].set(source.astype(x.dtype))
    return out.reshape(x.shape)


@lowering(aten.take.default, checked=True)
def take(x, index):
    flat = x.reshape(-1)
    checks.in_bounds(index, flat.size)
    index = jnp.where(index < 0, index + flat.size, index)
    return jnp.take(flat, index, mode="clip")


# ---------------------------------------------------------------- masks

@lowering(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(x, mask, value):
    return jnp.where(mask, jnp.asarray(value).astype(x.dtype), x)


def _broadcast(x, mask):
    shape = jnp.broadcast_shapes(x.shape, mask.shape)
    return jnp.broadcast_to(x, shape), jnp.broadcast_to(mask, shape)


@lowering(aten.masked_scatter.default)
def masked_scatter(x, mask, source):
    x, mask = _broadcast(x, mask)
    flat = mask.reshape(-1)
    if source.size == 0:
        return x
    position = jnp.clip(jnp.cumsum(flat) - 1, 0, source.size - 1)
    values = source.reshape(-1)[position].astype(x.dtype)
    return jnp.where(flat, values, x.reshape(-1)).reshape(x.shape)


@lowering(aten.masked_scatter_backward.default)
def masked_scatter_backward(grad, mask, sizes):
    grad, mask = _broadcast(grad, mask)
    flat = mask.reshape(-1)
    n = int(np.prod(sizes))
    position = jnp.where(flat, jnp.cumsum(flat) - 1, n)
    return jnp.zeros((n,), grad.dtype).at[position].set(grad.reshape(-1), mode="drop").reshape(sizes)


@lowering(aten.masked_select.default, jit=False)
def masked_select(x, mask):
    x, mask = _broadcast(x, mask)
    return index(x.reshape(-1), [mask.reshape(-1)])


@lowering(aten.nonzero.default, jit=False)
def nonzero(x):
    return _device_put(x, np.argwhere(_host(x, "nonzero (use nonzero_static)")).astype(np.int64))[0]


@lowering(aten.nonzero_static.default)
def nonzero_static(x, *, size, fill_value=-1):
    if x.size == 0:
        return jnp.full((size, x.ndim), fill_value, jnp.int64)
    return jnp.argwhere(x, size=size, fill_value=fill_value).astype(jnp.int64).reshape(size, x.ndim)


# ---------------------------------------------------------------- sorting

def _sort(x, dim: int, descending: bool):
    """Stable sort along ``dim``: (values, int64 indices); NaN sorts as the largest value."""
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    d = _dim(dim, x.ndim)
    iota = lax.broadcasted_iota(jnp.int64, x.shape, d)
    if not descending:
        return tuple(lax.sort((x, iota), dimension=d, is_stable=True, num_keys=1))
    # stable descending: reverse, stable ascending sort, reverse back (ties keep original order)
    values, indices = lax.sort((jnp.flip(x, d), jnp.flip(iota, d)), dimension=d, is_stable=True, num_keys=1)
    return jnp.flip(values, d), jnp.flip(indices, d)


@lowering(aten.sort.default)
def sort(x, dim=-1, descending=False):
    return _sort(x, dim, descending)


@lowering(aten.sort.stable)
def sort_stable(x, *, stable=None, dim=-1, descending=False):
    return _sort(x, dim, descending)


@lowering(aten.argsort.stable)
def argsort_stable(x, *, stable, dim=-1, descending=False):
    return _sort(x, dim, descending)[1]


@lowering(aten.topk.default)
def topk(x, k, dim=-1, largest=True, sorted=True):
    values, indices = _sort(x, dim, largest)
    if x.ndim == 0:
        return values, indices
    d = _dim(dim, x.ndim)
    if k > x.shape[d]:
        raise RuntimeError("selected index k out of range")
    return lax.slice_in_dim(values, 0, k, axis=d), lax.slice_in_dim(indices, 0, k, axis=d)


@lowering(aten.kthvalue.default)
def kthvalue(x, k, dim=-1, keepdim=False):
    values, indices = _sort(x, dim, False)
    if x.ndim == 0:
        return values, indices
    d = _dim(dim, x.ndim)
    if not 1 <= k <= x.shape[d]:
        raise IndexError(f"kthvalue(): selected number k out of range for dimension {dim}")
    pick = lambda a: lax.index_in_dim(a, k - 1, axis=d, keepdims=keepdim)  # noqa: E731
    return pick(values), pick(indices)


# ---------------------------------------------------------------- searching and counting

def _searchsorted(seq, x, side: str, out_int32: bool, sorter=None):
    if sorter is not None:
        seq = jnp.take_along_axis(seq, sorter, axis=-1)
    dtype = jnp.int32 if out_int32 else jnp.int64
    if seq.ndim <= 1:
        return jnp.searchsorted(seq, x, side=side).astype(dtype)
    batch = int(np.prod(seq.shape[:-1]))
    if batch == 0 or x.size == 0:
        return jnp.zeros(x.shape, dtype)
    rows = seq.reshape(batch, seq.shape[-1])
    found = jax.vmap(lambda s, v: jnp.searchsorted(s, v, side=side))(rows, x.reshape(batch, -1))
    return found.reshape(x.shape).astype(dtype)


@lowering(aten.searchsorted.Tensor, aten.searchsorted.Scalar)
def searchsorted(seq, x, *, out_int32=False, right=False, side=None, sorter=None):
    side = side or ("right" if right else "left")
    return _searchsorted(seq, jnp.asarray(x, dtype=seq.dtype if not hasattr(x, "ndim") else None), side,
                         out_int32, sorter)


@lowering(aten.bucketize.Tensor, aten.bucketize.Scalar)
def bucketize(x, boundaries, *, out_int32=False, right=False):
    return _searchsorted(boundaries, jnp.asarray(x), "right" if right else "left", out_int32)


@lowering(aten.isin.Tensor_Tensor, aten.isin.Tensor_Scalar, aten.isin.Scalar_Tensor)
def isin(elements, test_elements, *, assume_unique=False, invert=False):
    """Each element's membership in ``test_elements``, compared in PyTorch's common dtype of the
    two (a Python number takes the tensor's, as a wrapped number does). One program (JAX picks a
    comparison of all pairs or a sort by the sizes), where PyTorch's decomposition is several ops."""
    compute, _ = promote(elements, test_elements)
    found = jnp.isin(jnp.asarray(elements).astype(compute), jnp.asarray(test_elements).astype(compute).reshape(-1))
    return jnp.logical_not(found) if invert else found


@lowering(aten.bincount.default, jit=False)
def bincount(x, weights=None, minlength=0):
    host = _host(x, "bincount")
    if host.ndim != 1 or (host.size and host.min() < 0):
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    length = max(int(host.max()) + 1 if host.size else 0, minlength)
    return _bincount(length, x, weights)


@functools.partial(jax.jit, static_argnums=0)
def _bincount(length, x, weights):
    if weights is None:
        return jnp.zeros((length,), jnp.int64).at[x].add(1)
    dtype = weights.dtype if is_float(weights.dtype) else jnp.float64
    return jnp.zeros((length,), dtype).at[x].add(weights.astype(dtype))


@lowering(aten.histc.default)
def histc(x, bins=100, min=0, max=0):
    lo, hi = jnp.asarray(min, x.dtype), jnp.asarray(max, x.dtype)
    same = lo == hi
    lo = jnp.where(same, jnp.min(x, initial=jnp.inf), lo)
    hi = jnp.where(same, jnp.max(x, initial=-jnp.inf), hi)
    lo, hi = jnp.where(lo == hi, lo - 1, lo), jnp.where(lo == hi, hi + 1, hi)
    bin_of = jnp.floor((x - lo) * bins / (hi - lo)).astype(jnp.int64)
    bin_of = jnp.where(x == hi, bins - 1, bin_of)
    valid = (x >= lo) & (x <= hi)
    return jnp.zeros((bins,), x.dtype).at[jnp.where(valid, bin_of, bins)].add(1, mode="drop")


# ---------------------------------------------------------------- histogram / histogramdd
# PyTorch's CPU algorithm: an element goes to bin ``upper_bound(edges, x) - 1`` (the last bin keeps
# its right edge), elements outside [edges[0], edges[-1]] (and NaN) are dropped. Edges inferred from
# the data are not checked for being finite (that would need a host sync): NaN/inf data gives NaN edges.

def _points(x, name: str = "histogramdd"):
    """``x`` as (M, N) points; floating dtypes only, as on PyTorch's CPU."""
    if not is_float(x.dtype):
        raise RuntimeError(f"torch.{name}: input dtype {np.dtype(x.dtype).name} is not supported; "
                           "use a floating point tensor")
    if x.ndim < 2:
        raise RuntimeError(f"torch.histogramdd: input tensor should have at least 2 dimensions, but got {x.ndim}")
    return x.reshape(-1, x.shape[-1])


def _outer_edges(points, range_):
    """Per-dim (leftmost, rightmost) edges in float64: ``range``, else the data's extremes (numpy's
    [0, 1] for no data), widened by 0.5 each side where they meet."""
    n = points.shape[1]
    if range_ is not None:
        if len(range_) != 2 * n:
            raise RuntimeError(f"torch.histogramdd: for a {n}-dimensional histogram range should have "
                               f"{2 * n} elements, but got {len(range_)}")
        for d in builtins.range(n):
            lo, hi = range_[2 * d], range_[2 * d + 1]
            if not (np.isfinite(lo) and np.isfinite(hi)):
                raise RuntimeError(f"torch.histogramdd: dimension {d}'s range [{lo}, {hi}] is not finite")
            if lo > hi:
                raise RuntimeError(f"torch.histogramdd: min should not exceed max, but got min {lo} max {hi} "
                                   f"for dimension {d}")
        lo, hi = jnp.asarray(range_[0::2], jnp.float64), jnp.asarray(range_[1::2], jnp.float64)
    elif points.shape[0]:
        lo, hi = jnp.min(points, axis=0).astype(jnp.float64), jnp.max(points, axis=0).astype(jnp.float64)
    else:
        lo, hi = jnp.zeros((n,), jnp.float64), jnp.ones((n,), jnp.float64)
    same = lo == hi
    return jnp.where(same, lo - 0.5, lo), jnp.where(same, hi + 0.5, hi)


def _linspace_rows(start, end, counts: list, dtype):
    """Row d: torch.linspace(start[d], end[d], counts[d] + 1) by the CPU's formula (the first half
    counts up from start, the rest down from end), padded with +inf to the longest row."""
    steps = jnp.asarray(counts, jnp.int64)[:, None] + 1
    start, end = start.astype(dtype)[:, None], end.astype(dtype)[:, None]
    step = (end - start) / (steps - 1).astype(dtype)
    i = jnp.arange(max(counts) + 1)[None, :]
    up = start + step * i.astype(dtype)
    down = end - step * (steps - 1 - i).astype(dtype)
    return jnp.where(i < steps, jnp.where(i < steps // 2, up, down), jnp.inf).astype(dtype)


def _bin_edges(points, bins, range_):
    """Equal-width edges for ``bins`` (bin counts per dim) as PyTorch builds them: (N, max + 1)."""
    n = points.shape[1]
    if len(bins) != n:
        raise RuntimeError("histogramdd: The size of bins must be equal to the innermost dimension of the input.")
    for d, count in enumerate(bins):
        if count <= 0:
            raise RuntimeError(f"torch.histogram(): bins must be > 0, but got {count} for dimension {d}")
    if n == 0:
        return jnp.zeros((0, 1), points.dtype)
    return _linspace_rows(*_outer_edges(points, range_), list(bins), points.dtype)


def _stack_edges(points, bins: list):
    """Bin edge tensors (one per dim) as one (N, max length) array padded with +inf."""
    for d, e in enumerate(bins):
        if e.dtype != points.dtype or e.ndim != 1 or e.shape[0] == 0:
            raise RuntimeError(f"torch.histogramdd: bins for dimension {d} should be a non-empty 1-d tensor "
                               f"of the input's dtype")
    longest = max((e.shape[0] for e in bins), default=1)
    return jnp.stack([jnp.pad(e, (0, longest - e.shape[0]), constant_values=jnp.inf) for e in bins]
                     or [jnp.zeros((1,), points.dtype)])


def _upper_bound(edges, lengths, x):
    """``std::upper_bound(edges[d][:lengths[d]], x[:, d])``, bisecting exactly as libstdc++ does, so
    edges that are not sorted give the bins PyTorch's CPU gives. edges: (N, L), x: (M, N)."""
    first = jnp.zeros(x.shape, jnp.int64)
    length = jnp.broadcast_to(jnp.asarray(lengths, jnp.int64), x.shape)
    for _ in builtins.range(max(lengths).bit_length()):
        half = length // 2
        middle = first + half
        probe = jnp.take_along_axis(edges.T, jnp.minimum(middle, edges.shape[1] - 1), axis=0)
        right = (length > 0) & ~(x < probe)
        first = jnp.where(right, middle + 1, first)
        length = jnp.where(right, length - half - 1, half)
    return first


def _histogramdd(points, edges, counts: list, weight, density: bool, linear: bool):
    """The histogram of (M, N) ``points`` over the (N, L) padded ``edges``, ``counts[d]`` bins in dim d.
    ``linear``: the edges are sorted (made by linspace), so a bin is found by counting edges.
    (One vectorised pass over all dims: each XLA kernel costs compile time, paid per shape.)"""
    m, n = points.shape
    if weight is not None and (weight.dtype != points.dtype or weight.size != m):
        raise RuntimeError("torch.histogramdd: if weight tensor is provided it should have the input's dtype "
                           "and its shape excluding its innermost dimension")
    size = int(np.prod(counts, dtype=np.int64))
    if n == 0:  # no dimensions: nothing is counted
        hist = jnp.zeros((), points.dtype)
        return hist / hist if density else hist
    first, last = edges[:, 0], edges[np.arange(n), np.asarray(counts)]
    keep = jnp.all((points >= first) & (points <= last), axis=1)
    if linear:
        upper = jnp.sum(edges[None, :, :] <= points[:, :, None], axis=2)
    else:
        upper = _upper_bound(edges, [c + 1 for c in counts], points)
    pos = jnp.minimum(upper - 1, jnp.asarray(counts) - 1)  # the last bin keeps its right edge
    strides = np.cumprod([1] + list(counts[:0:-1]))[::-1].astype(np.int64)
    flat = jnp.where(keep, jnp.sum(pos * strides, axis=1), size)
    w = jnp.ones((m,), points.dtype) if weight is None else weight.reshape(m)
    hist = jnp.zeros((size,), points.dtype).at[flat].add(w, mode="drop").reshape(counts)
    if density:
        hist = hist / jnp.sum(hist, dtype=opmath(hist.dtype)).astype(hist.dtype)
        widths = jnp.diff(edges, axis=1)
        for d, count in enumerate(counts):
            hist = hist / widths[d, :count].reshape([count if k == d else 1 for k in builtins.range(n)])
    return hist


@lowering(aten.histogram.bin_ct)
def histogram(x, bins=100, *, range=None, weight=None, density=False):
    points = _points(x.reshape(-1, 1), "histogram")
    edges = _bin_edges(points, [bins], range)
    return _histogramdd(points, edges, [bins], weight, density, linear=True), edges[0]


@lowering(aten.histogram.bins_tensor)
def histogram_bins_tensor(x, bins, *, weight=None, density=False):
    points = _points(x.reshape(-1, 1), "histogram")
    edges = _stack_edges(points, [bins])
    return _histogramdd(points, edges, [bins.shape[0] - 1], weight, density, linear=False), bins


@lowering(aten._histogramdd_bin_edges.default)
def histogramdd_bin_edges(x, bins, *, range=None, weight=None, density=False):
    edges = _bin_edges(_points(x), bins, range)
    return [edges[d, :count + 1] for d, count in enumerate(bins)]


@lowering(aten._histogramdd_from_bin_cts.default)
def histogramdd_from_bin_cts(x, bins, *, range=None, weight=None, density=False):
    points = _points(x)
    return _histogramdd(points, _bin_edges(points, bins, range), list(bins), weight, density, linear=True)


@lowering(aten._histogramdd_from_bin_tensors.default)
def histogramdd_from_bin_tensors(x, bins, *, weight=None, density=False):
    points = _points(x)
    counts = [e.shape[0] - 1 for e in bins]
    return _histogramdd(points, _stack_edges(points, bins), counts, weight, density, linear=False)


# ---------------------------------------------------------------- unique

def _host(x, name: str) -> np.ndarray:
    """``x``'s values on the host: data-dependent shapes are computed there (one sync)."""
    if isinstance(x, jax.core.Tracer):
        raise NotImplementedError(f"{name} has a data-dependent output shape and cannot be traced")
    return np.asarray(x)


def _device_put(like, *arrays):
    """Host results onto ``like``'s device."""
    device = next(iter(like.devices())) if hasattr(like, "devices") else None
    return tuple(jax.device_put(np.asarray(a), device) for a in arrays)


_EMPTY_LONG = np.zeros((0,), np.int64)


@lowering(aten._unique2.default, jit=False)
def unique2(x, sorted=True, return_inverse=False, return_counts=False):
    values, inverse, counts = np.unique(_host(x, "unique").reshape(-1), return_inverse=True, return_counts=True)
    return _device_put(x, values, inverse.reshape(x.shape).astype(np.int64) if return_inverse else _EMPTY_LONG,
                       counts.astype(np.int64) if return_counts else _EMPTY_LONG)


@lowering(aten.unique_dim.default, jit=False)
def unique_dim(x, dim, sorted=True, return_inverse=False, return_counts=False):
    values, inverse, counts = np.unique(_host(x, "unique"), return_inverse=True, return_counts=True,
                                        axis=_dim(dim, x.ndim))
    return _device_put(x, values, inverse.reshape(-1).astype(np.int64) if return_inverse else _EMPTY_LONG,
                       counts.astype(np.int64) if return_counts else _EMPTY_LONG)


@lowering(aten.unique_consecutive.default, jit=False)
def unique_consecutive(x, return_inverse=False, return_counts=False, dim=None):
    host = _host(x, "unique_consecutive")
    d = 0 if dim is None else _dim(dim, x.ndim)
    moved = host.reshape(-1) if dim is None else np.moveaxis(host, d, 0)
    n = moved.shape[0]
    rows = moved.reshape(n, int(np.prod(moved.shape[1:])))
    change = np.concatenate([np.ones(min(n, 1), bool), np.any(rows[1:] != rows[:-1], axis=1)])
    starts = np.flatnonzero(change)
    values = moved[starts] if dim is None else np.moveaxis(moved[starts], 0, d)
    inverse = np.cumsum(change) - 1
    counts = np.diff(np.append(starts, n))
    return _device_put(x, values, inverse.reshape(x.shape if dim is None else -1) if return_inverse else _EMPTY_LONG,
                       counts if return_counts else _EMPTY_LONG)


# ---------------------------------------------------------------- embedding_bag

_SUM, _MEAN, _MAX = range(3)


def _bags(indices, offsets, include_last_offset: bool):
    """(number of bags, the bag of each index)."""
    bags = offsets.shape[0] - (1 if include_last_offset else 0)
    starts = offsets[:bags]
    bag_of = jnp.searchsorted(starts, jnp.arange(indices.shape[0]), side="right") - 1
    return bags, bag_of.astype(jnp.int64)


def _kept(indices, padding_idx: int):
    return indices != padding_idx if padding_idx >= 0 else jnp.ones(indices.shape, bool)


@lowering(aten._embedding_bag.default, aten._embedding_bag_forward_only.default, checked=True)
def embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                  per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    """(output, offset2bag, bag_size, max_indices) laid out as PyTorch's CPU kernel returns them."""
    checks.in_bounds(indices, weight.shape[0], negative=False)
    bags, bag_of = _bags(indices, offsets, include_last_offset)
    keep = _kept(indices, padding_idx)
    rows = jnp.take(weight, indices, axis=0, mode="clip")
    if per_sample_weights is not None:
        rows = rows * per_sample_weights[:, None].astype(rows.dtype)
    count = jnp.zeros((bags,), jnp.int64).at[bag_of].add(keep.astype(jnp.int64), mode="drop")
    zeros = jnp.zeros((bags,), jnp.int64)
    if mode == _MAX:
        masked = jnp.where(keep[:, None], rows, -jnp.inf)
        best = jnp.full((bags, weight.shape[1]), -jnp.inf, weight.dtype).at[bag_of].max(masked, mode="drop")
        hit = (masked == best[bag_of]) & keep[:, None]
        big = jnp.iinfo(jnp.int64).max
        arg = jnp.full(best.shape, big, jnp.int64).at[bag_of].min(
            jnp.where(hit, indices[:, None].astype(jnp.int64), big), mode="drop")
        empty = (count == 0)[:, None]
        return jnp.where(empty, 0, best).astype(weight.dtype), bag_of, count, jnp.where(empty, 0, arg)
    total = jnp.zeros((bags, weight.shape[1]), weight.dtype).at[bag_of].add(
        jnp.where(keep[:, None], rows, 0), mode="drop")
    if mode == _SUM:
        return total, bag_of, zeros, zeros
    mean = total / jnp.maximum(count, 1)[:, None].astype(weight.dtype)
    return mean.astype(weight.dtype), bag_of, count, count


@lowering(aten._embedding_bag_dense_backward.default)
def embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                 scale_grad_by_freq, mode, per_sample_weights, padding_idx=-1):
    out = jnp.zeros((num_weights, grad.shape[1]), grad.dtype)
    if mode == _MAX:
        columns = np.arange(grad.shape[1])[None, :]
        return out.at[maximum_indices, columns].add(jnp.where((bag_size > 0)[:, None], grad, 0))
    rows = grad[offset2bag]
    if mode == _MEAN:
        rows = rows / jnp.maximum(bag_size[offset2bag], 1)[:, None].astype(grad.dtype)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights[:, None].astype(grad.dtype)
    if scale_grad_by_freq:
        freq = jnp.zeros((num_weights,), grad.dtype).at[indices].add(1)
        rows = rows / freq[indices][:, None]
    return out.at[indices].add(jnp.where(_kept(indices, padding_idx)[:, None], rows, 0))


@lowering(aten._embedding_bag_per_sample_weights_backward.default)
def embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode, padding_idx=-1):
    if mode != _SUM:
        raise RuntimeError("embedding_bag_backward: per_sample_weights only supported for mode='sum'")
    dots = jnp.sum(grad[offset2bag] * jnp.take(weight, indices, axis=0, mode="clip"), axis=1)
    return jnp.where(_kept(indices, padding_idx), dots, 0).astype(grad.dtype)


@lowering(aten._embedding_bag_backward.default)
def embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, maximum_indices, num_weights,
                           scale_grad_by_freq, mode, sparse, per_sample_weights, padding_idx=-1):
    if sparse:
        raise NotImplementedError("tpu: embedding_bag(sparse=True) gradients are not supported; use sparse=False")
    return embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                        scale_grad_by_freq, mode, per_sample_weights, padding_idx)


@functools.partial(jax.jit, static_argnums=0)
def _repeat_positions(length, repeats):
    return jnp.repeat(jnp.arange(repeats.shape[0], dtype=repeats.dtype), repeats, total_repeat_length=length)


@lowering(aten.repeat_interleave.Tensor, jit=False)
def repeat_interleave(repeats, *, output_size=None):
    """``[0]*repeats[0] + [1]*repeats[1] + ...``; the length is read on the host unless given."""
    if repeats.ndim != 1:
        raise RuntimeError("repeat_interleave only accept 1D vector as repeat")
    if output_size is None:
        host = _host(repeats, "repeat_interleave without output_size")
        if host.size and host.min() < 0:
            raise RuntimeError("repeats can not be negative")
        output_size = int(host.sum())
    return _repeat_positions(output_size, repeats)


@lowering(aten._unique.default, jit=False)
def unique_legacy(x, sorted=True, return_inverse=False):
    return unique2(x, sorted, return_inverse, False)[:2]
