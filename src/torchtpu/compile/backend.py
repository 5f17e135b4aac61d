"""The ``tpu`` backend of ``torch.compile``: dynamo graph → aot_autograd → one XLA program per graph.

aot_autograd traces the graph to core aten (forward and backward split by the min-cut
partitioner, which recomputes cheap ops instead of saving them), functionalised, with inference
graphs' input mutations kept as ``copy_`` epilogues so they run inside the XLA program.
Each resulting graph becomes a ``CompiledGraph`` (one program; with collectives, one program
over their group's devices), or, when its collectives use several groups, a ``PiecewiseGraph``
of one ``CompiledGraph`` per consecutive piece of one group (``collectives.py``).
"""

from __future__ import annotations

from typing import Any, Callable

from torch.fx import GraphModule

from torchtpu.compile import warm
from torchtpu.compile.cache import compiler_options
from torchtpu.compile.decompositions import decompositions
from torchtpu.compile.executable import build_graph
from torchtpu.compile.graph_code import GraphCode
from torchtpu.runtime.compat import SerializableAOTDispatchCompiler, aot_autograd, min_cut_rematerialization_partition

# torch.compile's ``mode`` tunes Inductor; XLA has no equivalent, so they are accepted and ignored.
_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _compiler(kind: str, options: dict[str, Any], cache_key: str | None) -> Callable:
    def compile_graph(gm: GraphModule, example_inputs) -> Callable:
        graph = build_graph(gm, kind, options)
        if cache_key is not None:  # AOTAutogradCache stores it (warm.py)
            return GraphCode(gm=gm, kind=kind, options=options, key=cache_key, graph=graph)

        def run(args: list) -> list:
            return graph(args)

        run._boxed_call = True  # aot_autograd passes one list we may free (and functools.wraps keeps this)
        run.graph = graph
        return run

    if cache_key is not None:
        return SerializableAOTDispatchCompiler(GraphCode, compile_graph)
    return compile_graph


def backend(gm: GraphModule, example_inputs, *, options: dict[str, Any] | None = None,
            mode: str | None = None) -> Callable:
    """The ``tpu`` dynamo backend (``torch.compile(fn, backend="tpu", options={xla options})``)."""
    if mode not in _MODES:
        raise ValueError(f"torch.compile mode {mode!r} is not known; the tpu backend accepts {_MODES[1:]}")
    xla_options = compiler_options(options)
    table = decompositions()
    cache_key = warm.key(xla_options, table) if warm.enabled() else None
    aot = aot_autograd(
        fw_compiler=_compiler("forward", xla_options, cache_key),
        bw_compiler=_compiler("backward", xla_options, cache_key),
        inference_compiler=_compiler("inference", xla_options, cache_key),
        partition_fn=min_cut_rematerialization_partition,
        decompositions=table,
        keep_inference_input_mutations=True,
    )
    if cache_key is None:
        return aot(gm, example_inputs)
    setattr(gm, warm.KEY_ATTR, cache_key)  # our part of AOTAutogradCache's key
    with warm.caching():
        return aot(gm, example_inputs)
