"""A core-aten FX graph as one pure JAX function, built from the shared op registry.

Each node's aten overload is looked up with ``registry.for_graph`` (graph-only lowerings first:
input mutation, prims; views become values in a functional graph) and called as every executor
calls a lowering (``Lowering.call``).
Python callables in the graph (``operator.getitem``, SymInt arithmetic) run as they are: shapes
and scalars are concrete while the function is traced, so they are static.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.fx import GraphModule, Node

from torchtpu.compile import collectives
from torchtpu.ops import checks, foreach, registry  # noqa: F401  (foreach: derives _foreach_* lowerings for registry.for_graph)
from torchtpu.runtime import platform, rng
from torchtpu.runtime.compat import HigherOrderOperator, OpOverload, unset_fake_temporarily

aten = torch.ops.aten


def has_lowering(op: OpOverload) -> bool:
    if collectives.is_collective(op):
        return collectives.supported(op)
    low = registry.for_graph(op)
    return low is not None and not low.mutates


@dataclass
class _Step:
    node: Node
    fn: Callable  # a Python callable of the graph (getitem, SymInt arithmetic), or a constant's maker
    lowering: registry.Lowering | None = None  # an aten op's: called as every executor calls it
    random_index: int = -1  # >= 0: the op takes a key, folded from the call's key with this index


class MissingLowering(NotImplementedError):
    pass


def _with_effects(token, op: OpOverload, *args, **kwargs):
    """aot_autograd's wrapper for ops with side effects (``_linalg_check_errors``): run the op's
    lowering in order and pass the token through; returns (token, *outputs)."""
    low = registry.for_graph(op)
    if low is None:
        raise MissingLowering(str(op))
    out = low.call(None, args, kwargs, platform.platform())
    outs = () if out is None else tuple(out) if isinstance(out, (tuple, list)) else (out,)
    if token is None:  # the runtime passes no token in; the graph still returns one (discarded)
        token = jnp.zeros((0,), jnp.float32)
    return (token, *outs)


# Lowerings of higher-order ops, by name, registered by the module that owns each (flex_attention's:
# ``compile/flex_attention.py``, imported by ``executable.py`` and ``torchtpu.export``). They lower
# their subgraphs through this module's interpreter, so this module cannot import them.
HOP_LOWERINGS: dict[str, Callable] = {}


def _hop_lowering(target) -> Callable | None:
    if not isinstance(target, HigherOrderOperator):
        return None
    return HOP_LOWERINGS.get(getattr(target, "_name", None))


def _resolve(node: Node, random_count: int) -> _Step:
    target = node.target
    if target is torch.ops.higher_order.with_effects:
        return _Step(node, _with_effects)
    hop = _hop_lowering(target)  # flex_attention's HOPs: their subgraphs are traced in
    if hop is not None:
        return _Step(node, hop)
    if not isinstance(target, OpOverload):
        return _Step(node, target)
    if collectives.is_collective(target):
        return _Step(node, collectives.lowering(node))
    low = registry.for_graph(target)
    if low is None:
        raise MissingLowering(str(target))
    problem = low.graph_problem()
    if problem is not None:
        raise MissingLowering(problem)
    return _Step(node, low.fn, low, random_count if low.random else -1)


@dataclass
class GraphFunction:
    """``gm`` as a JAX-traceable function of its placeholders' values."""

    gm: GraphModule
    steps: list[_Step] = field(default_factory=list)
    placeholders: list[Node] = field(default_factory=list)
    mutated: list[int] = field(default_factory=list)  # placeholder index of each input mutation
    random_ops: int = 0
    dots: bool = False  # an op with fp32 dots: its programs follow the matmul precision (ops/precision.py)
    output: Node | None = None
    groups: dict[tuple[int, ...], str] = field(default_factory=dict)  # its collectives' groups: ranks -> a name

    def __post_init__(self) -> None:
        missing = sorted({str(n.target) for n in self.gm.graph.nodes
                          if n.op == "call_function" and isinstance(n.target, OpOverload) and not has_lowering(n.target)})
        if missing:
            raise MissingLowering(
                f"tpu: this torch.compile graph uses ops with no lowering and no decomposition: "
                f"{', '.join(missing)}. Run the function without torch.compile (eager falls back to the "
                f"CPU for them), and please report it.")
        self.groups = collectives.groups(self.gm)
        index = {}
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                index[node] = len(self.placeholders)
                self.placeholders.append(node)
            elif node.op == "call_function":
                step = _resolve(node, self.random_ops)
                self.random_ops += step.random_index >= 0
                # a step that is no registry lowering (a higher-order op's) says so by a ``dots`` attribute
                self.dots = self.dots or bool(step.lowering.dots if step.lowering is not None
                                              else getattr(step.fn, "dots", False))
                self.steps.append(step)
                if node.target is aten.copy_.default and node.args[0] in index \
                        and index[node.args[0]] not in self.mutated:
                    self.mutated.append(index[node.args[0]])
            elif node.op == "get_attr":
                self.steps.append(_Step(node, _constant(getattr(self.gm, node.target))))
            elif node.op == "output":
                self.output = node
            else:
                raise NotImplementedError(f"tpu: unsupported FX node {node.op} ({node.target}) in a compiled graph")

    def __call__(self, key, inputs: list) -> tuple[list, list]:
        """Trace the graph on ``inputs``; returns (outputs, new values of the mutated inputs)."""
        env: dict[Node, Any] = dict(zip(self.placeholders, inputs))
        plat = platform.platform()
        mutations: dict[int, Any] = {}
        place = {n: i for i, n in enumerate(self.placeholders)}
        for step in self.steps:
            node = step.node
            if node.op == "get_attr":
                env[node] = step.fn()
                continue
            args, kwargs = _values(node.args, env), _values(node.kwargs, env)
            if step.lowering is None:  # a Python callable or a higher-order op's subgraph: unchecked
                with checks.suspended():
                    value = step.fn(*args, **kwargs)
            else:
                op_key = jax.random.fold_in(key, step.random_index) if step.random_index >= 0 else None
                if step.lowering.checked:
                    checks.naming(str(node.target))
                value = step.lowering.call(op_key, args, kwargs, plat)
            env[node] = value
            if node.target is aten.copy_.default and node.args[0] in place:
                # later reads of the input see the new value, as the mutation in eager would
                env[node.args[0]] = value
                mutations[place[node.args[0]]] = value
        outputs = _values(self.output.args[0], env)
        return list(outputs), [mutations[i] for i in self.mutated]


def _values(args, env):
    return torch.fx.node.map_aggregate(args, lambda a: env[a] if isinstance(a, Node) else a)


def _constant(value) -> Callable:
    if isinstance(value, torch.Tensor):
        with unset_fake_temporarily():  # aot_autograd calls the compiler under its fake mode
            return _tensor_constant(value)
    return lambda: value


def _tensor_constant(value: torch.Tensor) -> Callable:
    if value.device.type == "tpu":
        from torchtpu.device import bridge

        array = bridge.read(value)
    else:
        array = np.asarray(value.detach().numpy())
    return lambda: jnp.asarray(array)


def base_key(key_args) -> jax.Array:
    """The call's random key from the device RNG's (seed_hi, seed_lo, offset)."""
    return rng.make_key(*key_args)

