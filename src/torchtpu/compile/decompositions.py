"""The decomposition table aot_autograd traces ``tpu`` graphs with (and ``torchtpu.export`` runs).

Below the backend and the flex_attention lowering, which both need it: core-aten decompositions,
minus the ops torchtpu lowers directly, plus any functional op that lacks a lowering.
"""

from __future__ import annotations

import functools

from torchtpu.compile import graph as graph_lowering
from torchtpu.ops import registry
from torchtpu.runtime.compat import core_aten_decompositions, decomposition_table


@functools.cache
def _decompositions(nlowerings: int) -> dict:
    """Core-aten decompositions, minus ops we lower directly, plus any that lack a lowering."""
    del nlowerings  # the cache key: rebuild when ops are added to the registry
    table = {op: fn for op, fn in core_aten_decompositions().items() if not graph_lowering.has_lowering(op)}
    for op, fn in decomposition_table.items():
        if op not in table and not graph_lowering.has_lowering(op) and _functional(op):
            table[op] = fn
    return table


def _functional(op) -> bool:
    schema = getattr(op, "_schema", None)
    if schema is None:  # higher-order operators
        return False
    return not schema.is_mutable and not any(a.is_out for a in schema.arguments)


def decompositions() -> dict:
    """The decomposition table aot_autograd traces with."""
    return _decompositions(len(registry.load_all()))
