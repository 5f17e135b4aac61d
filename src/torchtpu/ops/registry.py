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

Every executor calls a lowering the same way: ``Lowering.call(key, args, kwargs, platform)``
(the key is passed only to random ops, drawn from the op's ``generator=`` if it has one, else from
the device's state; the platform picks an override, below).

**Platform overrides.** ``@lowering(op, platform="gpu")`` registers a replacement for the generic
lowering on one platform (a Pallas or cuDNN kernel); the generic lowering stays the reference,
and ``check_override`` compares the two on given inputs.

**Graph-only lowerings** (``graph_only=True``): what compiled graphs compute for ops whose eager
kernel is not a lowering (a copy, a lazy conjugate bit, ``empty``, a mask index that eager runs
unjitted); ``for_graph`` reads them first. **Views** (``view=True``):
in eager a view shares its base's storage (``eager/views.py`` makes it from the op's geometry);
in a compiled graph its lowering computes the value.

Op-family modules are the modules of this package: ``load_all`` imports each one.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable

import torch

from torchtpu.runtime.compat import OpOverload, OpOverloadPacket

aten = torch.ops.aten
PLATFORMS = ("cpu", "gpu", "tpu")


@dataclass(frozen=True)
class Lowering:
    op: OpOverload
    fn: Callable
    random: bool = False
    static_scalars: bool = False  # Scalar arguments are static (e.g. arange's bounds set its shape)
    jit: bool = True  # False: output shapes depend on values (nonzero); eager runs it unjitted
    mutates: tuple[str, ...] = ()  # arguments the op writes (besides self/out): new values returned last
    view: bool = False  # a view op: eager shares the base's storage, graphs compute the value
    dots: bool = False  # fp32 dots/convolutions at torch's matmul precision: its programs key on it (precision.py)
    dynamic: tuple[str, ...] = ()  # float arguments passed as values, not compiled in (a scheduled lr)
    checked: bool = False  # checks its indices on the device (ops/checks.py): programs return a code too

    def impl(self, platform: str | None = None) -> Callable:
        """The function that computes the op on ``platform``: its override, else the generic one."""
        return OVERRIDES.get((self.op, platform), self.fn) if platform else self.fn

    def call(self, key, args, kwargs, platform: str | None = None):
        """Run the lowering: ``key`` (a ``jax.random`` key) goes first for random ops only. A
        random op's ``generator=`` never reaches its lowering: the executor draws ``key`` from
        that generator's state instead of the device's (``eager/dispatch.py``)."""
        fn = self.impl(platform)
        if not self.random:
            return fn(*args, **kwargs)
        if kwargs.get("generator") is not None or any(isinstance(a, torch.Generator) for a in args):
            raise NotImplementedError(
                f"tpu: {self.op} was given a torch.Generator where its key comes from the device's "
                f"state (a torch.compile graph); run it outside the compiled region "
                f"(torch.compiler.disable), or seed the device with torch.tpu.manual_seed instead")
        return fn(key, *args, **kwargs)

    def graph_problem(self) -> str | None:
        """Why a compiled graph cannot contain this op, or None if it can."""
        if self.mutates:  # functionalisation replaces ops that write their arguments
            return f"{self.op} writes its arguments"
        if not self.jit:
            return (f"tpu: {self.op} has a data-dependent output shape and cannot run in a compiled graph; "
                    f"mark the code with torch._dynamo.graph_break() before it")
        return None


LOWERINGS: dict[OpOverload, Lowering] = {}
GRAPH_ONLY: dict[OpOverload | str, Lowering] = {}  # by overload, or by schema name (prims that may not exist yet)
OVERRIDES: dict[tuple[OpOverload, str], Callable] = {}
_listeners: list[Callable[[OpOverload], None]] = []


def _overloads(op) -> list[OpOverload]:
    if isinstance(op, OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    return [op]


def lowering(*ops, random: bool = False, static_scalars: bool = False, jit: bool = True,
             mutates: tuple[str, ...] = (), view: bool = False, graph_only: bool = False,
             platform: str | None = None, dots: bool = False,
             dynamic: tuple[str, ...] = (), checked: bool = False) -> Callable[[Callable], Callable]:
    """Register ``fn`` as the JAX lowering of each aten overload in ``ops``.

    ``random``: ``fn`` takes a ``jax.random`` key first. ``static_scalars``: the op's ``Scalar``
    arguments are passed as static Python numbers (needed when they decide a shape).
    ``jit=False``: the output shape depends on the input values (``nonzero``, ``masked_select``):
    eager calls ``fn`` on concrete arrays, and ``torch.compile`` graphs never contain it
    (dynamo breaks the graph there). ``mutates``: argument names the op writes besides ``self``
    and ``out`` (schemas do not always mark them): ``fn`` returns the op's outputs, then the new
    value of each named argument (ignored where the argument is None; a ``Tensor[]`` argument's
    values one per element, flat; an op lowered in its in-place or out= form names ``self`` or
    ``out`` too); eager writes them back, and ``torch.compile`` graphs never contain such an op
    (functionalisation replaces it).
    ``view=True``: a view op; ``graph_only=True``: what compiled graphs compute (module docstring).
    ``dots=True``: ``fn`` computes fp32 dot products or convolutions with
    ``precision=precision.matmul_precision()``, so its programs follow
    ``torch.set_float32_matmul_precision`` and carry the setting in their cache keys.
    ``dynamic``: names of ``float`` arguments that eager passes as 0-d values, like ``Scalar``
    arguments, instead of compiling them in: an optimizer's learning rate changes every step
    under a scheduler, and a static one would compile a new program each time.
    ``checked=True``: ``fn`` checks its indices with ``checks.in_bounds`` and returns one array;
    its eager programs return the checks' code after it (``ops/checks.py``).
    ``platform``: register ``fn`` as the op's override on that platform (the op must have, or
    later get, a generic lowering, which stays the reference). An op may also be a schema name
    string (``"prims::fma"``) for operators that may not exist yet when this runs.
    """
    if platform is not None and platform not in PLATFORMS:
        raise ValueError(f"unknown platform {platform!r}; expected one of {', '.join(PLATFORMS)}")

    def register(fn: Callable) -> Callable:
        table = GRAPH_ONLY if graph_only else LOWERINGS
        for op in ops:
            for overload in [op] if isinstance(op, str) else _overloads(op):
                if platform is not None:
                    add_override(overload, platform, fn)
                    continue
                if overload in table:
                    raise ValueError(f"{overload} already has a lowering ({table[overload].fn.__module__})")
                table[overload] = Lowering(overload, fn, random, static_scalars, jit, tuple(mutates), view, dots,
                                           tuple(dynamic), checked)
        return fn

    return register


def add_override(op: OpOverload, platform: str, fn: Callable | None) -> None:
    """Make ``fn`` compute ``op`` on ``platform`` (None removes the override); executors that
    cached the previous function are told (``on_change``)."""
    key = (op, platform)
    if fn is None:
        OVERRIDES.pop(key, None)
    else:
        if key in OVERRIDES:
            raise ValueError(f"{op} already has a {platform} override ({OVERRIDES[key].__module__})")
        OVERRIDES[key] = fn
    for listener in _listeners:
        listener(op)


def on_change(listener: Callable[[OpOverload], None]) -> None:
    """Call ``listener(op)`` whenever ``op``'s override changes."""
    _listeners.append(listener)


def check_override(op: OpOverload, platform: str, *args, rtol: float = 1e-5, atol: float = 1e-6, key=None,
                   **kwargs) -> None:
    """Compare ``op``'s override on ``platform`` with the generic lowering on the same JAX inputs;
    AssertionError naming the op where an output differs."""
    import numpy as np
    from jax.tree_util import tree_leaves

    low = LOWERINGS[op]
    if (op, platform) not in OVERRIDES:
        raise KeyError(f"{op} has no {platform} override")
    expected = tree_leaves(low.call(key, args, kwargs))
    actual = tree_leaves(low.call(key, args, kwargs, platform))
    if len(expected) != len(actual):
        raise AssertionError(f"{op}: the {platform} override returns {len(actual)} outputs, the reference "
                             f"{len(expected)}")
    for i, (e, a) in enumerate(zip(expected, actual)):
        e, a = np.asarray(e), np.asarray(a)
        if e.shape != a.shape or e.dtype != a.dtype:
            raise AssertionError(f"{op}: the {platform} override's output {i} is {a.dtype}{list(a.shape)}, "
                                 f"the reference's {e.dtype}{list(e.shape)}")
        if not np.allclose(a, e, rtol=rtol, atol=atol, equal_nan=True):
            worst = float(np.max(np.abs(a.astype(np.float64) - e.astype(np.float64))))
            raise AssertionError(f"{op}: the {platform} override differs from the reference in output {i} "
                                 f"(max abs difference {worst:g})")


def get(op: OpOverload) -> Lowering | None:
    """The lowering eager uses for ``op``, or None."""
    return LOWERINGS.get(op)


def for_graph(op) -> Lowering | None:
    """What a compiled graph computes for ``op`` (an overload; anything else gives None): its
    graph-only lowering, else its lowering, else one derived (``_foreach_*`` from its per-tensor op)."""
    schema = getattr(op, "_schema", None)  # Python callables and higher-order operators have none
    if schema is None:
        return None
    low = GRAPH_ONLY.get(op) or LOWERINGS.get(op) or GRAPH_ONLY.get(schema.name)
    if low is None:
        for prefix, derive in _DERIVERS.items():
            if schema.name.startswith(prefix):
                return derive(op)
    return low


# Lowerings derived on demand for a family of ops, by schema-name prefix, registered by the module
# that derives them (``_foreach_*``: foreach.py, which imports this one; ``load_all`` imports it).
_DERIVERS: dict[str, Callable[[OpOverload], Lowering | None]] = {}


def deriver(prefix: str) -> Callable:
    """Register the decorated ``fn(op) -> Lowering | None`` for the ops whose schema name starts with ``prefix``."""
    def register(fn: Callable[[OpOverload], Lowering | None]) -> Callable[[OpOverload], Lowering | None]:
        _DERIVERS[prefix] = fn
        return fn

    return register


_loaded = False


def load_all() -> dict[OpOverload, Lowering]:
    """Import every op-family module of this package so the registry is complete; returns it."""
    global _loaded
    if not _loaded:
        package = importlib.import_module(__package__)
        for module in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{__package__}.{module.name}")
        _loaded = True
    return LOWERINGS
