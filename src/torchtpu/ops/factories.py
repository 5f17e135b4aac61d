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
