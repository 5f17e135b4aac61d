"""Factory ops: tensors made from nothing but sizes and values."""

from __future__ import annotations

import jax.numpy as jnp

from torchtpu.ops.dtypes import to_jax_dtype
from torchtpu.ops.registry import aten, lowering


def _dtype(dtype, default):
    import torch

    return to_jax_dtype(dtype if dtype is not None else (default or torch.get_default_dtype()))


@lowering(aten.fill.Scalar)
def fill_scalar(x, value):
    return jnp.full(x.shape, value, dtype=x.dtype)


@lowering(aten.fill.Tensor)
def fill_tensor(x, value):
    return jnp.broadcast_to(value.astype(x.dtype), x.shape)


@lowering(aten.zero.default)
def zero(x):
    return jnp.zeros_like(x)


@lowering(aten.full.default)
def full(size, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None):
    import torch

    if dtype is None:
        kind = _py_kind(fill_value)
        dtype = {bool: torch.bool, int: torch.int64, complex: torch.complex64}.get(kind, torch.get_default_dtype())
    return jnp.full(tuple(size), fill_value, dtype=to_jax_dtype(dtype))


def _py_kind(value):
    import numpy as np

    if isinstance(value, (bool, int, float, complex)):
        return type(value) if type(value) in (bool, int, float, complex) else {
            np.dtype(np.bool_): bool, np.dtype(np.int64): int, np.dtype(np.float64): float,
            np.dtype(np.complex128): complex}[np.dtype(type(value))]
    return {"b": bool, "i": int, "u": int, "f": float, "c": complex}[np.dtype(value.dtype).kind]


@lowering(aten.scalar_tensor.default)
def scalar_tensor(s, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.asarray(s).astype(_dtype(dtype, None))


@lowering(aten.arange.start_step, static_scalars=True)
def arange(start, end, step=1, *, dtype=None, layout=None, device=None, pin_memory=None):
    import torch

    if dtype is None:
        kinds = {_py_kind(v) for v in (start, end, step)}
        dtype = torch.get_default_dtype() if float in kinds else torch.int64
    jdt = to_jax_dtype(dtype)
    start, end, step = (float(v) if not isinstance(v, (int, float)) else v for v in (start, end, step))
    import math

    n = max(0, math.ceil((end - start) / step))
    return (start + jnp.arange(n, dtype=jnp.float64 if jnp.issubdtype(jdt, jnp.floating) else jnp.int64) * step).astype(jdt)


@lowering(aten.arange.default, static_scalars=True)
def arange_end(end, *, dtype=None, layout=None, device=None, pin_memory=None):
    return arange(0, end, 1, dtype=dtype)


@lowering(aten.arange.start, static_scalars=True)
def arange_start(start, end, *, dtype=None, layout=None, device=None, pin_memory=None):
    return arange(start, end, 1, dtype=dtype)


@lowering(aten.zeros.default)
@lowering(aten._efficientzerotensor.default)  # autograd's zero gradients (sgn, ...): plain zeros here
def zeros(size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), _dtype(dtype, None))


@lowering(aten.ones.default)
def ones(size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.ones(tuple(size), _dtype(dtype, None))


@lowering(aten.eye.default, aten.eye.m)
def eye(n, m=None, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.eye(n, n if m is None else m, dtype=_dtype(dtype, None))


def _linspace(start, end, steps: int, dtype):
    """PyTorch's linspace: the first half counts up from ``start``, the second down from ``end``."""
    import numpy as np

    if steps < 0:
        raise RuntimeError("number of steps must be non-negative")
    integral = jnp.issubdtype(dtype, jnp.integer)
    compute = jnp.float64 if integral else dtype
    # PyTorch converts the bounds to the output dtype first
    start, end = (jnp.asarray(v).astype(dtype).astype(compute) for v in (start, end))
    if steps <= 1:
        return jnp.full((steps,), start, compute).astype(dtype)
    step = (end - start) / (steps - 1)
    idx = np.arange(steps)
    up = start + step * idx.astype(compute)
    down = end - step * (steps - idx - 1).astype(compute)
    return jnp.where(idx < steps // 2, up, down)


@lowering(aten.linspace.default, aten.linspace.Tensor_Tensor, aten.linspace.Tensor_Scalar,
          aten.linspace.Scalar_Tensor)
def linspace(start, end, steps, *, dtype=None, layout=None, device=None, pin_memory=None):
    jdt = _dtype(dtype, None)
    return _linspace(start, end, steps, jdt).astype(jdt)


@lowering(aten.logspace.default, aten.logspace.Tensor_Tensor, aten.logspace.Tensor_Scalar,
          aten.logspace.Scalar_Tensor)
def logspace(start, end, steps, base=10.0, *, dtype=None, layout=None, device=None, pin_memory=None):
    jdt = _dtype(dtype, None)
    exponents = _linspace(start, end, steps, jnp.float64 if jnp.issubdtype(jdt, jnp.integer) else jdt)
    return jnp.power(jnp.asarray(base, jnp.float64), exponents.astype(jnp.float64)).astype(jdt)


def _triangle_indices(select, row, col, offset, dtype):
    import numpy as np
    import torch

    rows, cols = select(row, offset, col)
    return jnp.asarray(np.stack([rows, cols]).reshape(2, -1), to_jax_dtype(dtype or torch.int64))


@lowering(aten.tril_indices.default)
def tril_indices(row, col, offset=0, *, dtype=None, layout=None, device=None, pin_memory=None):
    import numpy as np

    return _triangle_indices(np.tril_indices, row, col, offset, dtype)


@lowering(aten.triu_indices.default)
def triu_indices(row, col, offset=0, *, dtype=None, layout=None, device=None, pin_memory=None):
    import numpy as np

    return _triangle_indices(np.triu_indices, row, col, offset, dtype)



def _like_dtype(x, dtype):
    return x.dtype if dtype is None else to_jax_dtype(dtype)


def full_like(x, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.full(x.shape, fill_value, _like_dtype(x, dtype))


def zeros_like(x, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.zeros(x.shape, _like_dtype(x, dtype))


def ones_like(x, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.ones(x.shape, _like_dtype(x, dtype))


def empty(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.zeros(tuple(size), _dtype(dtype, None))  # XLA has no uninitialised memory


def empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return empty(size, dtype=dtype)


def empty_permuted(size, physical_layout, *, dtype=None, layout=None, device=None, pin_memory=None):
    return empty(size, dtype=dtype)  # (empty_like's decomposition; the layout is XLA's to choose)


# Graph-only. In eager, ``zeros_like(x, device="cpu")`` must leave the device, which a lowering
# cannot, so eager keeps PyTorch's empty_like + fill_ path; eager's ``empty`` is a lazy shell
# (eager/views.py).
for _op, _fn in {aten.full_like.default: full_like, aten.zeros_like.default: zeros_like,
                 aten.ones_like.default: ones_like, aten.empty.memory_format: empty,
                 aten.empty_strided.default: empty_strided, aten.empty_permuted.default: empty_permuted}.items():
    lowering(_op, graph_only=True)(_fn)
