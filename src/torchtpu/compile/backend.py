"""The ``tpu`` backend of ``torch.compile``: dynamo graph → aot_autograd → one XLA program per graph.

aot_autograd traces the graph to core aten (forward and backward split by the min-cut
partitioner, which recomputes cheap ops instead of saving them), functionalised, with inference
graphs' input mutations kept as ``copy_`` epilogues so they run inside the XLA program.
Each resulting graph becomes a ``CompiledGraph`` (one program; with collectives, one program
over their group's devices), or, when its collectives use several groups, a ``PiecewiseGraph``
of one ``CompiledGraph`` per consecutive piece of one group (``collectives.py``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from torch._decomp import core_aten_decompositions, decomposition_table
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.fx import GraphModule

from torchtpu.compile import collectives, graph as graph_lowering
from torchtpu.compile.cache import compiler_options
from torchtpu.compile.executable import CompiledGraph, PiecewiseGraph
from torchtpu.ops import registry

# torch.compile's ``mode`` tunes Inductor; XLA has no equivalent, so they are accepted and ignored.
_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


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


def _compiler(kind: str, options: dict[str, Any]) -> Callable:
    def compile_graph(gm: GraphModule, example_inputs) -> Callable:
        several_groups = len(collectives.groups(gm)) > 1  # collectives of several groups: one program each
        graph = (PiecewiseGraph if several_groups else CompiledGraph)(gm, kind, options)

        def run(args: list) -> list:
            return graph(args)

        run._boxed_call = True  # aot_autograd passes one list we may free (and functools.wraps keeps this)
        run.graph = graph
        return run

    return compile_graph


def backend(gm: GraphModule, example_inputs, *, options: dict[str, Any] | None = None,
            mode: str | None = None) -> Callable:
    """The ``tpu`` dynamo backend (``torch.compile(fn, backend="tpu", options={xla options})``)."""
    if mode not in _MODES:
        raise ValueError(f"torch.compile mode {mode!r} is not known; the tpu backend accepts {_MODES[1:]}")
    xla_options = compiler_options(options)
    aot = aot_autograd(
        fw_compiler=_compiler("forward", xla_options),
        bw_compiler=_compiler("backward", xla_options),
        inference_compiler=_compiler("inference", xla_options),
        partition_fn=min_cut_rematerialization_partition,
        decompositions=decompositions(),
        keep_inference_input_mutations=True,
    )
    return aot(gm, example_inputs)
