"""torch ⇄ JAX dtypes, and PyTorch's type promotion evaluated at trace time."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

TORCH_TO_JAX = {
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
}
JAX_TO_TORCH = {np.dtype(v): k for k, v in TORCH_TO_JAX.items()}


_NP_DTYPES = {k: np.dtype(v) for k, v in TORCH_TO_JAX.items()}  # np.dtype() costs ~1 µs a call


def to_jax_dtype(dtype: torch.dtype) -> np.dtype:
    """The JAX dtype for a torch dtype; a clear TypeError for ones XLA cannot hold."""
    try:
        return _NP_DTYPES[dtype]
    except KeyError:
        raise TypeError(
            f"dtype {dtype} is not supported on the tpu device; supported: "
            + ", ".join(str(d).removeprefix("torch.") for d in TORCH_TO_JAX)
        ) from None


def to_torch_dtype(dtype) -> torch.dtype:
    return JAX_TO_TORCH[np.dtype(dtype)]


# Python numbers (aten `Scalar` arguments, and numbers PyTorch passes in Tensor slots) travel
# into jitted code as JAX weakly-typed scalars: their value is dynamic (no recompilation per
# value) and the weak type marks them as Python numbers for PyTorch's type promotion.
_KIND_OF = {"b": bool, "i": int, "u": int, "f": float, "c": complex}


def python_kind(x) -> type | None:
    """bool/int/float/complex if ``x`` stands for a Python number, else None (a tensor)."""
    if isinstance(x, (bool, int, float, complex)):
        return _KIND_OF[np.dtype(type(x)).kind] if type(x) not in (bool, int, float, complex) else type(x)
    if x.ndim == 0 and getattr(x, "weak_type", False):
        return _KIND_OF[np.dtype(x.dtype).kind]
    return None


_KINDS = {k.name: k for k in ELEMENTWISE_TYPE_PROMOTION_KIND}
_META_CACHE: dict = {}


def _meta(dtype: torch.dtype, ndim: int) -> torch.Tensor:
    key = (dtype, ndim > 0)
    t = _META_CACHE.get(key)
    if t is None:
        t = _META_CACHE[key] = torch.empty((1,) if ndim else (), dtype=dtype, device="meta")
    return t


@functools.lru_cache(maxsize=8192)
def _promote(sig: tuple, kind: str) -> tuple[torch.dtype, torch.dtype]:
    args = [_meta(*value) if tag == "t" else value(1) for tag, value in sig]
    return elementwise_dtypes(*args, type_promotion_kind=_KINDS[kind])


def _sig_of(x):
    kind = python_kind(x)
    if kind is not None:
        return ("py", kind)
    return ("t", (to_torch_dtype(x.dtype), x.ndim))


def promote(*args, kind: str = "DEFAULT") -> tuple[np.dtype, np.dtype]:
    """PyTorch's (computation dtype, result dtype) for an elementwise op on ``args``.

    ``args`` are arrays, tracers or Python numbers (None is skipped); weakly-typed scalars count
    as Python numbers, as PyTorch's wrapped numbers do. ``kind`` names a
    ``torch._prims_common.ELEMENTWISE_TYPE_PROMOTION_KIND``: DEFAULT, INT_TO_FLOAT,
    ALWAYS_BOOL, COMPLEX_TO_FLOAT, BOOL_TO_LONG or NO_OPMATH.
    """
    sig = tuple(_sig_of(a) for a in args if a is not None)
    compute, result = _promote(sig, kind)
    return to_jax_dtype(compute), to_jax_dtype(result)


def result_type(*args, kind: str = "DEFAULT") -> np.dtype:
    """PyTorch's result dtype for an elementwise op on ``args`` (see ``promote``)."""
    return promote(*args, kind=kind)[1]


def is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def is_complex(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.complexfloating)


def is_integral(dtype, include_bool: bool = False) -> bool:
    dt = np.dtype(dtype)
    return jnp.issubdtype(dt, jnp.integer) or (include_bool and dt == np.bool_)


def float_of(dtype) -> np.dtype:
    """The floating dtype an op on ``dtype`` computes in (ints and bools promote to float32)."""
    if is_float(dtype) or is_complex(dtype):
        return np.dtype(dtype)
    return to_jax_dtype(torch.get_default_dtype())


def opmath(dtype) -> np.dtype:
    """PyTorch's accumulation dtype: float16/bfloat16 compute in float32."""
    dt = np.dtype(dtype)
    if dt in (np.dtype(jnp.float16), np.dtype(jnp.bfloat16)):
        return np.dtype(jnp.float32)
    return dt


def as_scalar(value, dtype) -> jax.Array:
    """A Python or traced scalar cast to ``dtype``."""
    return jnp.asarray(value).astype(dtype)
