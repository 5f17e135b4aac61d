"""``EagerMode.DEFER_AND_FUSE``: record eager ops, run them as one XLA program when needed.

Every jitted call the eager path makes (an op's lowering, a view's gather, a write's scatter or
cast) goes through ``bridge.apply``; in this mode that records a node and returns a ``Deferred``
(shape and dtype known from ``jax.eval_shape``, cached). Storages hold the ``Deferred`` like an
array. When a value must exist (``.item()``, ``.cpu()``, printing, a data-dependent op, a CPU
fallback, ``synchronize``, a transfer, a mode change, or the graph reaching its size bound) the
pending nodes are compiled into one ``jax.jit`` program, cached by the graph's structure (which
jitted functions, wired how, on which input shapes/dtypes — never the data), and run. Only values
whose ``Deferred`` is still referenced (by a tensor's storage) become outputs; the rest stay
inside the program, so XLA fuses them and nothing is materialised for them.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import Counter

import jax

from torchtpu.device import bridge
from torchtpu.runtime import errors

MAX_NODES = 4096


class Deferred:
    """A value that a pending node will produce."""

    __slots__ = ("graph", "node", "index", "shape", "dtype", "weak_type", "value", "__weakref__")

    def __init__(self, graph, node: int, index: int, aval):
        self.graph = graph
        self.node = node
        self.index = index
        self.shape = tuple(aval.shape)
        self.dtype = aval.dtype
        self.weak_type = getattr(aval, "weak_type", False)
        self.value = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def materialize(self) -> jax.Array:
        if self.value is None:
            executor.flush("value_needed")
        if self.value is None:
            raise RuntimeError("tpu: a deferred value was lost (its graph was discarded after an error)")
        return self.value


class _Graph:
    """The nodes recorded since the last flush."""

    def __init__(self):
        self.nodes: list[tuple] = []  # (fn, arg refs, number of outputs)
        self.inputs: list = []  # concrete arrays and Python numbers fed to the program
        self.input_ids: dict[int, int] = {}  # id(array) → input position (arrays only)
        self.outputs: list[list[weakref.ref]] = []  # per node, weakrefs to its Deferreds
        self.holders: list = []  # keeps input arrays alive while their id is used as a key

    def ref(self, arg):
        if isinstance(arg, Deferred):
            if arg.value is not None:
                return self._input(arg.value)
            if arg.graph is not self:
                raise RuntimeError("tpu: a deferred value from another graph was used")
            return ("v", arg.node, arg.index)
        if isinstance(arg, jax.Array):
            return self._input(arg)
        # Python numbers and numpy scalars: dynamic inputs (their type stays in the jit key)
        self.inputs.append(arg)
        return ("in", len(self.inputs) - 1)

    def _input(self, array):
        pos = self.input_ids.get(id(array))
        if pos is None:
            pos = self.input_ids[id(array)] = len(self.inputs)
            self.inputs.append(array)
            self.holders.append(array)
        return ("in", pos)


_avals_cache: dict = {}


def _aval_key(arg):
    if arg.__class__ is Deferred:
        return (arg.shape, arg.dtype, arg.weak_type)
    if isinstance(arg, jax.Array):
        return (arg.shape, arg.dtype, arg.weak_type)
    return type(arg)


def _spec(arg):
    if isinstance(arg, Deferred):
        return jax.ShapeDtypeStruct(arg.shape, arg.dtype, weak_type=arg.weak_type)
    if isinstance(arg, jax.Array):
        return jax.ShapeDtypeStruct(arg.shape, arg.dtype, weak_type=getattr(arg, "weak_type", False))
    return arg


class FusedExecutor:
    """Records jitted calls and runs them as fused programs."""

    def __init__(self):
        self.graph = _Graph()
        self.lock = threading.RLock()
        self.programs: dict = {}
        self.materializations: Counter = Counter()
        self.stats = Counter()

    # ------------------------------------------------------------ recording
    def record(self, kernel, fn, dyn):
        return self.call(fn, *dyn)

    def call(self, fn, *args):
        with self.lock:
            key = (fn, tuple(_aval_key(a) for a in args))
            out_avals = _avals_cache.get(key)
            if out_avals is None:
                out_avals = _avals_cache[key] = jax.eval_shape(fn, *[_spec(a) for a in args])
            graph = self.graph
            refs = tuple(graph.ref(a) for a in args)
            node = len(graph.nodes)
            single = not isinstance(out_avals, (tuple, list))
            flat = [out_avals] if single else list(out_avals)
            graph.nodes.append((fn, refs, len(flat)))
            outs = [Deferred(graph, node, i, aval) for i, aval in enumerate(flat)]
            graph.outputs.append([weakref.ref(d) for d in outs])
            self.stats["ops_recorded"] += 1
            if len(graph.nodes) >= MAX_NODES:
                self.flush("graph_size")
            if single:
                return outs[0]
            return tuple(outs) if isinstance(out_avals, tuple) else list(outs)

    # ------------------------------------------------------------ running
    def flush(self, reason: str) -> None:
        with self.lock:
            graph = self.graph
            if not graph.nodes:
                return
            self.graph = _Graph()
            live = [(n, i, r()) for n, refs in enumerate(graph.outputs) for i, r in enumerate(refs)]
            live = [(n, i, d) for n, i, d in live if d is not None]
            needed = _needed_nodes(graph, {n for n, _, _ in live})
            structure = (tuple((graph.nodes[n][0], graph.nodes[n][1], graph.nodes[n][2]) for n in needed),
                         tuple((n, i) for n, i, _ in live))
            program = self.programs.get(structure)
            if program is None:
                program = self.programs[structure] = _build(graph, needed, [(n, i) for n, i, _ in live])
                self.stats["programs_compiled"] += 1
            else:
                self.stats["program_cache_hits"] += 1
            self.materializations[reason] += 1
            _count_materialization(reason)
            start = time.perf_counter()
            try:
                results = program(*graph.inputs)
            except jax.errors.JaxRuntimeError as exc:
                names = ", ".join(sorted({getattr(graph.nodes[n][0], "__name__", "?") for n in needed})[:8])
                what = f"a fused program of {len(needed)} ops ({names}) run for {reason}"
                if errors.is_out_of_memory(exc):
                    raise errors.out_of_memory(exc, None, what) from None
                raise RuntimeError(f"tpu: {what} failed: {exc}") from exc
            self.stats["run_seconds"] += time.perf_counter() - start
            for (_, _, deferred), value in zip(live, results):
                deferred.value = value

    def enter(self) -> None:
        """Start recording: the bridge's jitted calls now come here."""
        bridge.LAZY_TYPES = (Deferred,)
        bridge.apply = self.call
        bridge.deferring = True

    def leave(self) -> None:
        """Run what is pending and go back to running each call at once."""
        self.flush("mode_change")
        bridge.apply = bridge._run
        bridge.deferring = False

    def pending(self) -> list[str]:
        """The recorded, not yet run ops, by name, in order."""
        return [getattr(fn, "__name__", repr(fn)) for fn, _, _ in self.graph.nodes]


def _needed_nodes(graph: _Graph, roots: set[int]) -> list[int]:
    needed = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        for ref in graph.nodes[n][1]:
            if ref[0] == "v":
                stack.append(ref[1])
    return sorted(needed)


def _build(graph: _Graph, needed: list[int], outputs: list[tuple[int, int]]):
    nodes = [(n, graph.nodes[n]) for n in needed]

    def program(*inputs):
        env: dict[int, tuple] = {}
        for n, (fn, refs, _) in nodes:
            args = [inputs[r[1]] if r[0] == "in" else env[r[1]][r[2]] for r in refs]
            out = fn(*args)
            env[n] = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        return [env[n][i] for n, i in outputs]

    return jax.jit(program)


def _count_materialization(reason: str) -> None:
    from torchtpu import metrics

    counter = getattr(metrics, "count_materialization", None)
    if counter is not None:
        counter(reason)


executor = FusedExecutor()


def pending_graph() -> list[str]:
    """The ops recorded and not yet run (``torch.tpu.debug.pending_graph()``)."""
    return executor.pending()


def stats() -> dict:
    return {"materializations": dict(executor.materializations), **executor.stats,
            "programs_cached": len(executor.programs)}
