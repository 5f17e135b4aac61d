"""Shape ops: copies, concatenation, flips, padding, triangles and the ``*_scatter`` family.

View ops are declared here once, in ``_VIEWS``, and registered with ``view=True``: eager runs
each as metadata (``eager/views.py`` takes the view's geometry from the op itself, evaluated on
a meta tensor) so a view shares its base's storage, and compiled graphs compute the value with
the function given here. In a compiled graph a view's input is a value, so ``as_strided`` reads
its input as a contiguous storage. ``alias``, ``detach`` and ``lift_fresh`` are graph-only
(FakeTensor needs PyTorch's own kernels for them in eager), and so are: ``_to_copy`` (eager's
``.to()`` also moves data between devices, which a lowering cannot); ``copy``/``copy_`` (graph
mutation epilogues); advanced indexing (``index.Tensor``, ``index_put``: its eager lowering is
``jit=False`` for boolean masks, but a graph only ever holds integer indices, which trace); and
``empty``, ``full_like``, ``zeros_like``, ``ones_like`` (``factories.py``: eager runs its own lazy
``empty``, and its ``*_like`` may change device).

``clone`` returns a contiguous tensor whatever the input's strides (PyTorch's default
``preserve_format`` would keep a dense input's strides), so ``as_strided_scatter`` reads its
input's elements in contiguous order.

The ``*_copy`` overloads (``expand_copy``, ``permute_copy``, ...) are functional, so they are
ordinary lowerings built from the same table.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from torchtpu.ops.dtypes import result_type, to_jax_dtype
from torchtpu.runtime.compat import OpOverload
from torchtpu.runtime.dtypes import convert
from torchtpu.ops.registry import aten, lowering


def _dim(dim: int, ndim: int) -> int:
    """A dimension wrapped like PyTorch's (0-d tensors accept dims 0 and -1)."""
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], but got {dim})")
    return dim % n


# ---------------------------------------------------------------- views (compile backend only)

def _infer_size(size, numel: int) -> tuple[int, ...]:
    size = list(size)
    if -1 in size:
        known = math.prod(s for s in size if s != -1)
        size[size.index(-1)] = numel // known if known else 0
    return tuple(size)


def _view(x, size):
    return jnp.reshape(x, _infer_size(size, x.size))


def _view_dtype(x, dtype):
    target = to_jax_dtype(dtype)
    if target.itemsize == x.dtype.itemsize:
        return lax.bitcast_convert_type(x, target)
    if target.itemsize < x.dtype.itemsize:  # each element splits into a new trailing dim
        y = lax.bitcast_convert_type(x, target)
        return y.reshape(*x.shape[:-1], -1)
    ratio = target.itemsize // x.dtype.itemsize
    return lax.bitcast_convert_type(x.reshape(*x.shape[:-1], -1, ratio), target)


def _expand(x, size, *, implicit=False):
    lead = len(size) - x.ndim
    shape = tuple(x.shape[i - lead] if s == -1 else s for i, s in enumerate(size))
    return jnp.broadcast_to(x, shape)


def _slice(x, dim=0, start=None, end=None, step=1):
    if x.ndim == 0:
        return x
    d = _dim(dim, x.ndim)
    n = x.shape[d]
    start, end, _ = slice(start, end).indices(n)  # clamps like PyTorch
    end = max(start, end)
    return lax.slice_in_dim(x, start, end, step, axis=d)


def _select(x, dim, index):
    d = _dim(dim, x.ndim)
    n = x.shape[d]
    if not -n <= index < n:
        raise IndexError(f"select(): index {index} out of range for tensor of size {list(x.shape)} at dimension {dim}")
    return lax.index_in_dim(x, index % n, axis=d, keepdims=False)


def _unsqueeze(x, dim):
    return jnp.expand_dims(x, _dim(dim, x.ndim + 1))


def _squeeze_dims(x, dims):
    dims = {_dim(d, x.ndim) for d in dims} if x.ndim else set()
    return jnp.squeeze(x, tuple(d for d in dims if x.shape[d] == 1))


def _as_strided(x, size, stride, storage_offset=None):
    flat = x.reshape(-1)
    offset = storage_offset or 0
    index = np.full(tuple(size), offset, dtype=np.int64)
    for d, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = n
        index = index + (np.arange(n) * s).reshape(shape)
    return flat[index] if index.size else jnp.zeros(tuple(size), x.dtype)


def _diagonal(x, offset=0, dim1=0, dim2=1):
    return jnp.diagonal(x, offset, _dim(dim1, x.ndim), _dim(dim2, x.ndim))


def _unfold(x, dimension, size, step):
    if x.ndim == 0:
        return x.reshape(1)
    d = _dim(dimension, x.ndim)
    count = (x.shape[d] - size) // step + 1
    index = (np.arange(count)[:, None] * step + np.arange(size)[None, :])
    windows = jnp.take(x, index, axis=d)  # (..., count, size, ...)
    return jnp.moveaxis(windows, d + 1, -1)


def _split_with_sizes(x, split_sizes, dim=0):
    d = _dim(dim, x.ndim)
    bounds = np.cumsum([0, *split_sizes])
    return [lax.slice_in_dim(x, int(a), int(b), axis=d) for a, b in zip(bounds[:-1], bounds[1:])]


def _split(x, split_size, dim=0):
    n = x.shape[_dim(dim, x.ndim)]
    sizes = [min(split_size, n - i) for i in range(0, n, split_size)] if split_size else [n]
    return _split_with_sizes(x, sizes or [0], dim)  # an empty dim splits into one empty chunk


def _unbind(x, dim=0):
    d = _dim(dim, x.ndim)
    return [lax.index_in_dim(x, i, axis=d, keepdims=False) for i in range(x.shape[d])]


def _identity(x, *args, **kwargs):
    return x


def _fresh_copy(x):
    return jnp.copy(x)  # a copy op must not hand back its input's buffer


def _to_copy(x, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    return x if dtype is None else convert(x, to_jax_dtype(dtype))


# view overload → JAX function; the *_copy overload of the same name reuses it
_VIEWS: dict[OpOverload, Callable] = {
    aten.view.default: _view,
    aten._unsafe_view.default: _view,
    aten._reshape_alias.default: lambda x, size, stride: _view(x, size),
    aten.reshape.default: _view,
    aten.view.dtype: _view_dtype,
    aten.permute.default: lambda x, dims: jnp.transpose(x, [_dim(d, x.ndim) for d in dims]),
    aten.transpose.int: lambda x, dim0, dim1: jnp.swapaxes(x, _dim(dim0, x.ndim), _dim(dim1, x.ndim)) if x.ndim else x,
    aten.t.default: lambda x: x.T,
    aten.expand.default: _expand,
    aten.slice.Tensor: _slice,
    aten.select.int: _select,
    aten.unsqueeze.default: _unsqueeze,
    aten.squeeze.default: lambda x: _squeeze_dims(x, range(x.ndim)),
    aten.squeeze.dim: lambda x, dim: _squeeze_dims(x, [dim]),
    aten.squeeze.dims: _squeeze_dims,
    aten.as_strided.default: _as_strided,
    aten.diagonal.default: _diagonal,
    aten.unfold.default: _unfold,
    aten.split_with_sizes.default: _split_with_sizes,
    aten.split.Tensor: _split,
    aten.unbind.int: _unbind,
    aten.narrow.default: lambda x, dim, start, length: _slice(x, dim, start, start + length),
    aten.view_as_real.default: lambda x: jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1),
    aten.view_as_complex.default: lambda x: lax.complex(x[..., 0], x[..., 1]),
}
for _op, _fn in _VIEWS.items():
    lowering(_op, view=True)(_fn)
_IDENTITIES = (aten.alias.default, aten.detach.default, aten.lift_fresh.default)
lowering(*_IDENTITIES, graph_only=True)(_identity)
lowering(aten._to_copy.default, graph_only=True)(_to_copy)


@lowering(aten._assert_scalar.default, static_scalars=True, graph_only=True)
def _assert_scalar(condition, assert_msg):
    """A graph's shape assertion (``torch._check`` on a symbolic size): sizes are concrete while
    the graph is traced, so it is checked then, once per program."""
    if not condition:
        raise RuntimeError(assert_msg)


@lowering(aten.copy.default, aten.copy_.default, graph_only=True)
def _copy(dst, src, non_blocking=False):
    return jnp.broadcast_to(convert(src, dst.dtype), dst.shape)


def _register_copies() -> None:
    for op, fn in [*_VIEWS.items(), *((op, _identity) for op in _IDENTITIES)]:
        if op is aten.as_strided.default:
            continue  # as_strided_copy reads the input's storage, not its values: PyTorch decomposes it
        name = op._schema.name.split("::")[1]
        packet = getattr(aten, name + "_copy", None)
        if packet is not None and op._overloadname in packet.overloads():
            lowering(getattr(packet, op._overloadname))(_fresh_copy if fn is _identity else fn)


_register_copies()


@lowering(aten.clone.default)
def clone(x, *, memory_format=None):
    return jnp.copy(x)


# ---------------------------------------------------------------- joining and rearranging

@lowering(aten.cat.default)
def cat(tensors, dim=0):
    dtype = result_type(*tensors) if len(tensors) > 1 else tensors[0].dtype
    # PyTorch's legacy rule: 1-d empty tensors are skipped whatever their rank
    kept = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]
    if not kept:
        return jnp.zeros((0,), dtype)
    return jnp.concatenate([t.astype(dtype) for t in kept], axis=_dim(dim, kept[0].ndim))


@lowering(aten.stack.default)
def stack(tensors, dim=0):
    dtype = result_type(*tensors) if len(tensors) > 1 else tensors[0].dtype
    return jnp.stack([t.astype(dtype) for t in tensors], axis=_dim(dim, tensors[0].ndim + 1))


@lowering(aten.flip.default)
def flip(x, dims):
    return jnp.flip(x, tuple(_dim(d, x.ndim) for d in dims)) if x.ndim else x


@lowering(aten.roll.default)
def roll(x, shifts, dims=()):
    if not dims:
        return jnp.roll(x.reshape(-1), tuple(shifts)).reshape(x.shape)
    return jnp.roll(x, tuple(shifts), tuple(_dim(d, x.ndim) for d in dims))


@lowering(aten.repeat.default)
def repeat(x, repeats):
    if len(repeats) < x.ndim:
        raise RuntimeError("Number of dimensions of repeat dims can not be smaller than number of dimensions of tensor")
    x = x.reshape((1,) * (len(repeats) - x.ndim) + x.shape)
    return jnp.tile(x, tuple(repeats))


@lowering(aten.rot90.default)
def rot90(x, k=1, dims=(0, 1)):
    return jnp.rot90(x, k, tuple(_dim(d, x.ndim) for d in dims))


# ---------------------------------------------------------------- padding

def _pad_config(ndim: int, pad) -> list[tuple[int, int]]:
    """PyTorch's pad list (last dim first, (before, after) pairs) as a per-dim list."""
    pairs = [(0, 0)] * ndim
    for i in range(len(pad) // 2):
        pairs[ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1])
    return pairs


@lowering(aten.constant_pad_nd.default)
def constant_pad_nd(x, pad, value=0):
    config = [(lo, hi, 0) for lo, hi in _pad_config(x.ndim, pad)]
    return lax.pad(x, jnp.asarray(value).astype(x.dtype), config)  # negative pads crop, as in PyTorch


def _source_index(mode: str, n: int, lo: int, hi: int) -> np.ndarray:
    """For each output position along a padded dim, the input position it reads (PyTorch's rule,
    which also gives negative pads their meaning)."""
    i = np.arange(-lo, n + hi)
    if mode == "replication":
        return np.clip(i, 0, n - 1)
    i = np.abs(i)
    return (n - 1) - np.abs((n - 1) - i)


def _pad_mode(mode: str, spatial: int):
    def forward(x, padding):
        if x.ndim not in (spatial + 1, spatial + 2):
            raise RuntimeError(f"{mode}_pad{spatial}d: expected {spatial + 1}D or {spatial + 2}D input, got {x.ndim}D")
        for d, (lo, hi) in enumerate(_pad_config(x.ndim, padding)):
            if lo == hi == 0:
                continue
            n = x.shape[d]
            if mode == "reflection" and max(lo, hi) >= n:
                raise RuntimeError(f"Argument #4: Padding size should be less than the corresponding input "
                                   f"dimension, but got: padding ({lo}, {hi}) at dimension {d} of input "
                                   f"{list(x.shape)}")
            if n + lo + hi <= 0 or n == 0:
                return jnp.zeros(x.shape[:d] + (max(n + lo + hi, 0),) + x.shape[d + 1:], x.dtype)
            x = jnp.take(x, _source_index(mode, n, lo, hi), axis=d)
        return x

    def backward(grad, x, padding):
        return jax.vjp(lambda v: forward(v, padding), x)[1](grad)[0]

    return forward, backward


for _mode in ("reflection", "replication"):
    for _n in (1, 2, 3):
        _forward, _backward = _pad_mode(_mode, _n)
        lowering(getattr(aten, f"{_mode}_pad{_n}d").default)(_forward)
        lowering(getattr(aten, f"{_mode}_pad{_n}d_backward").default)(_backward)


# ---------------------------------------------------------------- triangles and diagonals

@lowering(aten.tril.default)
def tril(x, diagonal=0):
    return jnp.tril(x, diagonal)


@lowering(aten.triu.default)
def triu(x, diagonal=0):
    return jnp.triu(x, diagonal)


def _diag_index(shape, offset: int, dim1: int, dim2: int):
    """Index tuple selecting the ``offset`` diagonal of dims (dim1, dim2), diagonal axis last."""
    n1, n2 = shape[dim1], shape[dim2]
    length = max(0, min(n1 + min(offset, 0), n2 - max(offset, 0)))
    diag = np.arange(length)
    rows, cols = diag - min(offset, 0), diag + max(offset, 0)
    others = [d for d in range(len(shape)) if d not in (dim1, dim2)]
    index = [None] * len(shape)
    for k, d in enumerate(others):
        r = np.arange(shape[d]).reshape([-1 if j == k else 1 for j in range(len(others))] + [1])
        index[d] = r
    lead = len(others)
    index[dim1] = rows.reshape([1] * lead + [-1])
    index[dim2] = cols.reshape([1] * lead + [-1])
    return tuple(index), length


@lowering(aten.diag_embed.default)
def diag_embed(x, offset=0, dim1=-2, dim2=-1):
    ndim = x.ndim + 1
    d1, d2 = _dim(dim1, ndim), _dim(dim2, ndim)
    n = x.shape[-1] + abs(offset)
    shape = [0] * ndim
    rest = iter(x.shape[:-1])
    for d in range(ndim):
        shape[d] = n if d in (d1, d2) else next(rest)
    index, _ = _diag_index(shape, offset, d1, d2)
    return jnp.zeros(shape, x.dtype).at[index].set(x)


@lowering(aten.diagonal_scatter.default)
def diagonal_scatter(x, src, offset=0, dim1=0, dim2=1):
    index, _ = _diag_index(x.shape, offset, _dim(dim1, x.ndim), _dim(dim2, x.ndim))
    return x.at[index].set(src.astype(x.dtype))


@lowering(aten.slice_scatter.default)
def slice_scatter(x, src, dim=0, start=None, end=None, step=1):
    d = _dim(dim, x.ndim)
    start, end, _ = slice(start, end).indices(x.shape[d])
    index = [slice(None)] * x.ndim
    index[d] = slice(start, max(start, end), step)
    return x.at[tuple(index)].set(src.astype(x.dtype))


@lowering(aten.select_scatter.default)
def select_scatter(x, src, dim, index):
    d = _dim(dim, x.ndim)
    where = [slice(None)] * x.ndim
    where[d] = index % x.shape[d]
    return x.at[tuple(where)].set(src.astype(x.dtype))


@lowering(aten.as_strided_scatter.default)
def as_strided_scatter(x, src, size, stride, storage_offset=None):
    flat = x.reshape(-1)
    index = np.full(tuple(size), storage_offset or 0, dtype=np.int64)
    for d, (n, s) in enumerate(zip(size, stride)):
        index = index + (np.arange(n) * s).reshape([n if j == d else 1 for j in range(len(size))])
    return flat.at[index].set(src.astype(x.dtype)).reshape(x.shape)
