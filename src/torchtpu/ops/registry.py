"""The one op registry: aten overloads → pure JAX functions.

A lowering is written once and used by eager execution, the fused eager mode and the
``torch.compile`` backend alike::

    @lowering(aten.gelu.default)
    def gelu(x, approximate="none"):
        ...

Conventions (what a lowering receives and returns):

- It takes the aten overload's arguments, positionally and by keyword as in its schema.
  ``Tensor`` arguments arrive as ``jax.Array`` (or tracers), ``Tensor[]`` as lists of them.
- ``Scalar`` arguments (and Python numbers PyTorch passes in Tensor slots) arrive as Python
  numbers or as weakly-typed 0-d JAX values (eager passes them dynamically so a new value does
  not recompile). ``dtypes.promote`` treats both as Python numbers, as PyTorch does.
- Every other argument (int, float, bool, int[], dtype, str, None, ...) is a static Python value.
- Ops marked ``random=True`` take a ``jax.random`` key as their first argument.
- It returns what the aten op returns: an array, or a tuple of arrays, with PyTorch's dtypes.
- It never mutates: in-place (``add_``) and ``out=`` variants are derived from the functional
  lowering by the executor, which writes the result back. An op that also writes into other
  arguments (``native_batch_norm``'s running statistics) names them in ``mutates``: the lowering
  returns their new values after the op's own outputs, and eager writes them back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch._ops import OpOverload, OpOverloadPacket

aten = torch.ops.aten


@dataclass(frozen=True)
class Lowering:
    op: OpOverload
    fn: Callable
    random: bool = False
    static_scalars: bool = False  # Scalar arguments are static (e.g. arange's bounds set its shape)
    jit: bool = True  # False: output shapes depend on values (nonzero); eager runs it unjitted
    mutates: tuple[str, ...] = ()  # arguments the op writes (besides self/out): new values returned last


LOWERINGS: dict[OpOverload, Lowering] = {}


def _overloads(op) -> list[OpOverload]:
    if isinstance(op, OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    return [op]


def lowering(*ops, random: bool = False, static_scalars: bool = False, jit: bool = True,
             mutates: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Register ``fn`` as the JAX lowering of each aten overload in ``ops``.

    ``random``: ``fn`` takes a ``jax.random`` key first. ``static_scalars``: the op's ``Scalar``
    arguments are passed as static Python numbers (needed when they decide a shape).
    ``jit=False``: the output shape depends on the input values (``nonzero``, ``masked_select``):
    eager calls ``fn`` on concrete arrays, and ``torch.compile`` graphs never contain it
    (dynamo breaks the graph there). ``mutates``: argument names the op writes besides ``self``
    and ``out`` (schemas do not always mark them): ``fn`` returns the op's outputs, then the new
    value of each named argument (ignored where the argument is None); eager writes them back,
    and ``torch.compile`` graphs never contain such an op (functionalisation replaces it).
    """

    def register(fn: Callable) -> Callable:
        for op in ops:
            for overload in _overloads(op):
                if overload in LOWERINGS:
                    raise ValueError(f"{overload} already has a lowering ({LOWERINGS[overload].fn.__module__})")
                LOWERINGS[overload] = Lowering(overload, fn, random, static_scalars, jit, tuple(mutates))
        return fn

    return register


def get(op: OpOverload) -> Lowering | None:
    return LOWERINGS.get(op)


def load_all() -> dict[OpOverload, Lowering]:
    """Import every op family so the registry is complete; returns it."""
    from torchtpu.ops import (  # noqa: F401
        elementwise,
        factories,
        fft,
        indexing,
        linalg,
        nn,
        random,
        reductions,
        rnn,
        sampling,
        shape,
        special,
    )

    return LOWERINGS
