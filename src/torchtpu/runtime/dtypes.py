"""torch ⇄ JAX dtypes: the one table, and the clear error for dtypes XLA cannot hold."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

# torch dtype -> numpy dtype of the jax.Array that holds it (np.dtype() costs ~1 µs a call: once here)
TORCH_TO_JAX: dict[torch.dtype, np.dtype] = {t: np.dtype(j) for t, j in {
    torch.bool: jnp.bool_,
    torch.uint8: jnp.uint8,
    torch.int8: jnp.int8,
    torch.int16: jnp.int16,
    torch.int32: jnp.int32,
    torch.int64: jnp.int64,
    torch.float16: jnp.float16,
    torch.bfloat16: jnp.bfloat16,
    torch.float32: jnp.float32,
    torch.float64: jnp.float64,
    torch.complex64: jnp.complex64,
    torch.complex128: jnp.complex128,
    torch.uint16: jnp.uint16,
    torch.uint32: jnp.uint32,
    torch.uint64: jnp.uint64,
    # float8 (TPU v7 trains in it): held and cast; PyTorch's own CPU kernels compute little in it
    torch.float8_e4m3fn: jnp.float8_e4m3fn,
    torch.float8_e5m2: jnp.float8_e5m2,
    torch.float8_e4m3fnuz: jnp.float8_e4m3fnuz,
    torch.float8_e5m2fnuz: jnp.float8_e5m2fnuz,
}.items()}
JAX_TO_TORCH: dict[np.dtype, torch.dtype] = {j: t for t, j in TORCH_TO_JAX.items()}

# float8 formats whose casts saturate in PyTorch (to the largest finite value, also from inf);
# XLA's convert gives NaN there
_SATURATING = {np.dtype(jnp.float8_e4m3fn): 448.0}


# Float -> integer casts as PyTorch's CPU makes them (C++'s cast, compiled to x86's truncating
# convert): into a 32-bit int (64-bit for int64), where a value out of its range, inf or NaN
# becomes the smallest value, then wrapped to a narrower type (300.0 -> uint8 44, -2.0 -> 254).
# XLA's convert saturates instead (300.0 -> 255, NaN -> 0).
_FLOAT_TO_INT_VIA = {np.dtype(t): np.dtype(np.int64 if t is np.int64 else np.int32)
                     for t in (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.int64)}


def convert(x, dtype):
    """``x.astype(dtype)`` with PyTorch's rounding of out-of-range values (traceable)."""
    dtype = np.dtype(dtype)
    bound = _SATURATING.get(dtype)
    if bound is not None and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
        x = jnp.clip(x, -bound, bound)  # (NaN stays NaN)
    via = _FLOAT_TO_INT_VIA.get(dtype)
    if via is not None and jnp.issubdtype(x.dtype, jnp.floating):
        low = np.iinfo(via).min
        inside = (x >= low) & (x < -float(low))  # false for NaN
        x = jnp.where(inside, jnp.where(inside, x, 0).astype(via), low)
    return x.astype(dtype)


class UnsupportedDtype(TypeError):
    """A dtype the tpu device cannot hold: a ``TypeError``, as PyTorch's for a dtype a device
    lacks (MPS's float64); torchtpu's own refusal, never re-read as an argument error."""


def to_jax_dtype(dtype: torch.dtype) -> np.dtype:
    """The JAX dtype for a torch dtype; a clear TypeError for ones XLA cannot hold."""
    try:
        return TORCH_TO_JAX[dtype]
    except KeyError:
        raise UnsupportedDtype(
            f"dtype {dtype} is not supported on the tpu device; supported: "
            + ", ".join(str(d).removeprefix("torch.") for d in TORCH_TO_JAX)
        ) from None


def to_torch_dtype(dtype) -> torch.dtype:
    """The torch dtype of a JAX/numpy dtype."""
    return JAX_TO_TORCH[np.dtype(dtype)]


_SCALAR_TYPE_NAMES = {
    torch.uint8: "Byte", torch.int8: "Char", torch.int16: "Short", torch.int32: "Int", torch.int64: "Long",
    torch.float16: "Half", torch.float32: "Float", torch.float64: "Double", torch.complex32: "ComplexHalf",
    torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble", torch.bool: "Bool",
    torch.bfloat16: "BFloat16", torch.uint16: "UInt16", torch.uint32: "UInt32", torch.uint64: "UInt64",
}


def scalar_type_name(dtype) -> str:
    """PyTorch's name of a dtype in its kernel errors ('Long', 'Float', 'Bool', ...); torch or JAX dtype."""
    if not isinstance(dtype, torch.dtype):
        dtype = to_torch_dtype(dtype)
    return _SCALAR_TYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
