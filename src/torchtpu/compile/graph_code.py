"""``GraphCode``: a tpu compiled graph as PyTorch's compile caches store it (``warm.py`` says why).

A separate module because it subclasses Inductor's ``OutputCode``: ``warm.py`` must import while
Inductor is itself being imported.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Iterator

import torch
from torch.fx import GraphModule

from torchtpu.compile import cache
from torchtpu.compile.warm import key
from torchtpu.runtime.compat import OutputCode


@dataclasses.dataclass
class GraphCode(OutputCode):
    """A compiled graph that AOTAutogradCache can store: pickled as its aten graph, rebuilt on load."""

    gm: GraphModule | None = None
    kind: str = "inference"
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    key: str = ""  # key(): checked on load, as PyTorch's Dynamo cache stores entries without it
    graph: Callable | None = dataclasses.field(default=None, repr=False)  # CompiledGraph / PiecewiseGraph
    pickled_gm: bytes | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        # aot_autograd passes one list we may free. An instance attribute: its wrappers copy the
        # instance's __dict__ (functools.update_wrapper), not the class's.
        self._boxed_call = True

    def __call__(self, args: list) -> list:
        return self.graph(args)

    def prepare_for_serialization(self) -> None:
        # Called on a copy (BundledOutputCodeLoadable.pre_save): the live graph keeps running.
        from torchtpu.compile import collectives
        from torchtpu.runtime.compat import BypassAOTAutogradCache, GraphPickler, GraphPicklerOptions

        if collectives.groups(self.gm):  # their process groups belong to this process: not stored
            raise BypassAOTAutogradCache("tpu: a graph with collectives is not stored across processes")
        if self.gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.with_effects):
            # aot_autograd's wrapper of a loaded entry passes no effect token (measured: linalg.inv)
            raise BypassAOTAutogradCache("tpu: a graph with effect tokens is not stored")
        if any(isinstance(v, torch.Tensor) and v.device.type != "cpu" for v in _constants(self.gm)):
            # GraphPickler copies constants to the CPU under a FakeTensorMode, which a tpu tensor fails
            raise BypassAOTAutogradCache("tpu: a graph with tpu tensor constants is not stored")
        self.pickled_gm = GraphPickler.dumps(self.gm, GraphPicklerOptions(ops_filter=None))
        self.gm = self.graph = None

    def post_compile(self, example_inputs, constants, graph_kwargs) -> None:
        if self.graph is not None:
            return
        try:
            from torchtpu.compile.decompositions import decompositions

            if self.key != key(self.options, decompositions()):
                raise RuntimeError("it was made by another torchtpu, JAX, platform or decomposition table")
            self.graph = _rebuild(self.pickled_gm, self.kind, self.options)
            cache.count("warm_loads")
        except Exception as exc:  # PyTorch then traces the graph again (a RuntimeError for the Dynamo cache)
            cache.count("warm_errors")
            warnings.warn(f"tpu: could not reuse a compiled graph from PyTorch's compile caches "
                          f"({type(exc).__name__}: {exc}); tracing it again", RuntimeWarning, stacklevel=2)
            raise RuntimeError(f"tpu: unusable cache entry: {exc}") from exc
        self.pickled_gm = None

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        pass


def _constants(gm: GraphModule) -> Iterator[Any]:
    for node in gm.graph.find_nodes(op="get_attr"):
        yield getattr(gm, node.target, None)


def _rebuild(pickled_gm: bytes, kind: str, options: dict[str, Any]):
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from torchtpu.compile.executable import build_graph
    from torchtpu.runtime.compat import FakeTensorMode, GraphPickler

    gm = GraphPickler.loads(pickled_gm, FakeTensorMode(shape_env=ShapeEnv()))
    return build_graph(gm, kind, options)
