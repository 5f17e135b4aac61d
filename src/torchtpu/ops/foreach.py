"""``_foreach_*`` ops (optimizers' multi-tensor updates) from the per-tensor lowerings.

``_foreach_add.List(xs, ys)`` is ``[add.Tensor(x, y) for x, y in zip(xs, ys)]``: list arguments
(tensor lists and scalar lists) are taken element by element, other arguments are shared. Eager
mode runs the whole list as one jitted call (``eager/dispatch.ForeachKernel``); compiled graphs
inline it.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax.numpy as jnp
import torch

from torchtpu.ops import registry
from torchtpu.runtime.compat import OpOverload
from torchtpu.runtime.dtypes import to_jax_dtype

aten = torch.ops.aten

# _foreach_op overload → the per-tensor op's overloads to try, in order
_BASE_OVERLOADS = {"List": ("Tensor", "default"), "Tensor": ("Tensor", "default"),
                   "Scalar": ("Scalar", "default"), "ScalarList": ("Scalar", "default"),
                   "ScalarAndTensor": ("Scalar",), "default": ("default",)}


def base_op(op: OpOverload) -> OpOverload | None:
    """The per-tensor overload a functional ``_foreach_*`` overload applies element-wise."""
    name = op._schema.name
    if not name.startswith("aten::_foreach_") or name.endswith("_"):
        return None
    packet = getattr(aten, name[len("aten::_foreach_"):], None)
    overloads = packet.overloads() if packet is not None else []
    return next((getattr(packet, o) for o in _BASE_OVERLOADS.get(op._overloadname, ()) if o in overloads), None)


@functools.cache
def foreach_fn(op: OpOverload) -> Callable | None:
    """A function of JAX values computing functional ``_foreach_*`` overload ``op`` element by
    element with its base op's lowering, or None if the base op has none."""
    base = base_op(op)
    if base is None:
        return None
    low = registry.LOWERINGS.get(base)
    if low is None or not low.jit or low.random or low.mutates:
        return None
    fn = low.fn
    # foreach ops take positionally what their base op may take by keyword (addcmul's value);
    # they must line up by name, or the op is left to PyTorch's per-tensor loop
    npos = sum(not a.kwarg_only for a in base._schema.arguments)
    keywords = [a.name for a in base._schema.arguments if a.kwarg_only]
    extras = [a.name for a in op._schema.arguments if not a.kwarg_only][npos:]
    cast_to = None
    if extras and extras[-1] == "dtype" and "dtype" not in keywords:  # _foreach_norm(..., dtype)
        cast_to, extras = len(extras) - 1, extras[:-1]
    if extras != keywords[:len(extras)]:
        return None

    def each(*args, **kwargs):
        n = len(next(a for a in args if isinstance(a, (list, tuple))))
        dtype = None
        if cast_to is not None and len(args) > npos + cast_to:
            dtype, args = args[npos + cast_to], args[:npos + cast_to]
        results = []
        for i in range(n):
            values = [a[i] if isinstance(a, (list, tuple)) else a for a in args]
            if dtype is not None:  # as norm's dtype does: the input is cast before computing
                values = [v.astype(to_jax_dtype(dtype)) if _inexact(v) else v for v in values]
            extra_kwargs = dict(zip(keywords, values[npos:]))
            results.append(fn(*values[:npos], **extra_kwargs, **kwargs))
        return results

    each.__name__ = str(op).replace(".", "_")
    return each


def _inexact(v) -> bool:
    # integer inputs stay as they are, so the base op raises PyTorch's error for them
    return hasattr(v, "dtype") and (jnp.issubdtype(v.dtype, jnp.floating) or jnp.issubdtype(v.dtype, jnp.complexfloating))


@registry.deriver("aten::_foreach_")
@functools.cache
def derived(op: OpOverload) -> registry.Lowering | None:
    """``op``'s lowering, derived from its per-tensor op (what compiled graphs inline)."""
    fn = foreach_fn(op)
    return None if fn is None else registry.Lowering(op, fn, static_scalars=static_scalars(op))


def static_scalars(op: OpOverload) -> bool:
    """Whether the base op needs its Scalar arguments static (they decide a shape)."""
    low = registry.LOWERINGS.get(base_op(op))
    return bool(low is not None and low.static_scalars)
