"""torch ⇄ JAX dtypes, and PyTorch's type promotion evaluated at trace time."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchtpu.runtime.compat import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes
from torchtpu.runtime.dtypes import to_jax_dtype, to_torch_dtype  # noqa: F401  (the ops modules import them from here)


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
def _promote(sig: tuple, kind: str, default: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    # ``default``: torch.get_default_dtype(), which decides what a Python float (and an int with
    # INT_TO_FLOAT) promotes to; keyed on, or a result cached under float32 stays after
    # torch.set_default_dtype(torch.float64)
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
    compute, result = _promote(sig, kind, torch.get_default_dtype())
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


def to_opmath(x):
    """``x`` in its opmath dtype (fp16/bf16 → fp32), as PyTorch computes low-precision inputs."""
    return x.astype(opmath(x.dtype))


def as_scalar(value, dtype) -> jax.Array:
    """A Python or traced scalar cast to ``dtype``."""
    return jnp.asarray(value).astype(dtype)
