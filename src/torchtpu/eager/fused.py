"""``EagerMode.DEFER_AND_FUSE``: record eager ops, run them as one XLA program when needed.

Every jitted call the eager path makes (an op's lowering through ``modes.execute``, a view's
gather, a write's scatter or cast through ``bridge.apply``) goes, in this mode, to the current
context's ``FusedExecutor`` (each thread or asyncio task in this mode has its own, see
``eager/modes.py``), which records a node and returns a ``Deferred`` (shape and dtype known from
``jax.eval_shape``, cached). Storages hold the ``Deferred`` like an array; reading one in another
context runs its own executor's pending work, under that executor's lock. When a value must
exist (``.item()``, ``.cpu()``, printing, a data-dependent op, a CPU fallback, ``synchronize``,
a transfer, a mode change, the graph reaching its size bound, or, at the next op, the end of an
``optimizer.step()``: a training step's end, so a loop that reads nothing still runs one program
per step, the same each step) the pending nodes are compiled
into one ``jax.jit`` program, cached (shared by all executors, bounded) by the graph's structure
(which jitted functions, wired how, on which input shapes/dtypes — never the data), and run.
Only values whose ``Deferred`` is still referenced (by a tensor's storage) become outputs; the
rest stay inside the program, so XLA fuses them and nothing is materialised for them.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import Counter

import jax
from torch.optim.optimizer import register_optimizer_step_post_hook

from torchtpu import caches, metrics
from torchtpu.device import bridge
from torchtpu.eager import modes
from torchtpu.runtime import errors

MAX_NODES = 4096
# Run what a read needs first and the rest behind it (see ``FusedExecutor.flush``), when the
# rest has at least SPLIT_MIN_NODES nodes (a second program costs a dispatch: not worth it for a
# few ops, e.g. a loop that reads a value after every handful of ops).
SPLIT_AT_READ = True
SPLIT_MIN_NODES = 16
# A loop that reads nothing and steps no torch optimizer (a hand-written update) is cut where its
# op sequence repeats: at these recording lengths the last half is searched for a period, and once
# one is found the recording is cut after every PERIOD_MIN_NODES or more ops of it (whole periods).
PERIOD_CHECKS = (512, 1024, 2048)
PERIOD_MIN_NODES = 256


class Deferred(bridge.Lazy):
    """A value that a pending node will produce."""

    __slots__ = ("graph", "executor", "ref", "shape", "dtype", "weak_type", "key", "value", "__weakref__")

    def __init__(self, graph, node: int, index: int, key: tuple):
        self.graph = graph
        self.executor = graph.executor  # who computes it (the bridge compares it with the context's)
        self.ref = ("v", node, index)  # how the graph's program reads it
        self.key = key  # (shape, dtype, weak_type): its part of a jit key
        self.shape, self.dtype, self.weak_type = key
        self.value = None

    @property
    def node(self) -> int:
        return self.ref[1]

    @property
    def index(self) -> int:
        return self.ref[2]

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
        """The value, running its executor's pending work (what this value needs first) if needed;
        from any thread."""
        if self.value is None:
            self.executor.flush("value_needed", (self,))
            if self.value is None:
                raise _lost(self)
        return self.value


class _Graph:
    """The nodes one executor recorded since its last flush."""

    def __init__(self, executor: "FusedExecutor"):
        self.executor = executor
        self.nodes: list[tuple] = []  # (fn, arg refs, number of outputs)
        self.inputs: list = []  # concrete arrays and Python numbers fed to the program
        self.input_ids: dict[int, int] = {}  # id(array) → input position (arrays only)
        self.scalar_ids: dict = {}  # (type, value) → input position: a literal used by many ops is one input
        self.outputs: list[list[weakref.ref]] = []  # per node, weakrefs to its Deferreds
        self.holders: list = []  # keeps input arrays alive while their id is used as a key
        self.error: str | None = None  # what failed, if running this graph raised

    def ref(self, arg):
        if isinstance(arg, Deferred):
            if arg.value is None and arg.executor is not self.executor:
                # another context's pending value (the bridge computes these before recording:
                # this is a safety net)
                arg.materialize()
            if arg.value is not None:
                return self._input(arg.value)
            if arg.graph is not self:
                raise _lost(arg)
            return arg.ref
        if isinstance(arg, jax.Array):
            return self._input(arg)
        return self.scalar(arg)

    def scalar(self, value):
        """A Python number or numpy scalar: a dynamic input (its type stays in the jit key).
        Equal values of one type share an input: a training step's ``0.5``s and ``1.0``s would
        otherwise be a hundred program arguments, each converted on every run."""
        try:
            key = (value.__class__, value if value else repr(value))  # 0.0 and -0.0 stay apart
            pos = self.scalar_ids.get(key)
        except (TypeError, ValueError):  # not a hashable scalar (an array): an input of its own
            key = pos = None
        if pos is None:
            pos = len(self.inputs)
            self.inputs.append(value)
            if key is not None:
                self.scalar_ids[key] = pos
        return ("in", pos)

    def _input(self, array):
        pos = self.input_ids.get(id(array))
        if pos is None:
            pos = self.input_ids[id(array)] = len(self.inputs)
            self.inputs.append(array)
            self.holders.append(array)
        return ("in", pos)


# Shared by every executor (they record the same functions on the same shapes), bounded.
_avals_cache = caches.LRU("fused_shapes", "fused_shape_cache_size")  # (fn, input keys) -> output avals
_programs = caches.LRU("fused_programs", "fused_program_cache_size")  # graph structure -> jitted program
_stats_lock = threading.Lock()
_stats: Counter = Counter()  # programs_compiled, program_cache_hits, run_seconds, ops_recorded
_materializations: Counter = Counter()  # by reason


def _spec(arg):
    if isinstance(arg, Deferred):
        return jax.ShapeDtypeStruct(arg.shape, arg.dtype, weak_type=arg.weak_type)
    if isinstance(arg, jax.Array):
        return jax.ShapeDtypeStruct(arg.shape, arg.dtype, weak_type=getattr(arg, "weak_type", False))
    return arg


class FusedExecutor:
    """Records one context's jitted calls and runs them as fused programs. ``lock`` guards the
    graph: another thread that reads one of its values flushes it."""

    captures = False  # a graph capture's recorder (``eager/capture.py``) says True

    def __init__(self):
        self.graph = _Graph(self)
        self.lock = threading.RLock()
        self.step_ended = False  # an optimizer step ended since the last flush: cut before the next op
        self.find_periods = True  # until an optimizer step marks where steps end
        self.check_at = PERIOD_CHECKS[0]  # the recording length at which to look for a period next
        self.period: list | None = None  # the functions of a repeating run of ops being followed
        self.period_pos = 0  # where in it the next op should be

    # ------------------------------------------------------------ recording
    def call(self, fn, *args):
        # The hot path of the mode (every eager op): one pass over the arguments builds both the
        # node's references and its shape key; output avals come from a cache after the first call.
        with self.lock:
            if self.step_ended:
                self.find_periods = False
                self.flush("optimizer_step")
            graph = self.graph
            keys = []
            refs = []
            for a in args:
                if a.__class__ is Deferred:
                    keys.append(a.key)
                    refs.append(a.ref if a.value is None and a.graph is graph else graph.ref(a))
                elif isinstance(a, jax.Array):
                    keys.append((a.shape, a.dtype, a.weak_type))
                    refs.append(graph._input(a))
                else:  # Python numbers and numpy scalars: dynamic inputs (their type is in the key)
                    keys.append(type(a))
                    refs.append(graph.scalar(a))
            key = (fn, tuple(keys))
            info = _avals_cache.get(key)
            if info is None:
                out_avals = jax.eval_shape(fn, *[_spec(a) for a in args])
                single = not isinstance(out_avals, (tuple, list))
                info = _avals_cache[key] = (single, isinstance(out_avals, tuple), [
                    None if aval is None else (tuple(aval.shape), aval.dtype, getattr(aval, "weak_type", False))
                    for aval in ([out_avals] if single else out_avals)])  # None: an output the op has not
            single, is_tuple, flat = info
            node = len(graph.nodes)
            graph.nodes.append((fn, tuple(refs), len(flat)))
            outs = [None if k is None else Deferred(graph, node, i, k) for i, k in enumerate(flat)]
            graph.outputs.append([_no_value if d is None else weakref.ref(d) for d in outs])
            if self.period is not None:
                self._follow_period(fn)
            elif node + 1 >= self.check_at:
                self._look_for_period(node + 1)
            if single:
                return outs[0]
            return tuple(outs) if is_tuple else outs

    def _look_for_period(self, length: int) -> None:
        """At a checkpoint or the size bound: cut here if the recording's last half repeats, and
        from now on after each whole number of its periods."""
        fns = [node[0] for node in self.graph.nodes]
        period = _tail_period(fns[length // 2:]) if self.find_periods else 0
        if period:
            repeats = -(-PERIOD_MIN_NODES // period)
            # a periodic sequence continues with what came one period earlier: follow that
            self.period, self.period_pos = fns[length - period:] * repeats, 0
            self.flush("repeat")
        elif length >= MAX_NODES:
            self.flush("graph_size")
        else:
            self.check_at = next((n for n in PERIOD_CHECKS if n > length), MAX_NODES)

    def _follow_period(self, fn) -> None:
        """Check the op just recorded against the period followed; cut after each whole run of it."""
        if self.period[self.period_pos] is not fn:  # the loop changed: look for a period afresh
            self.period = None
            self.check_at = max(len(self.graph.nodes) + 1, PERIOD_CHECKS[0])
            return
        self.period_pos += 1
        if self.period_pos == len(self.period):
            self.period_pos = 0
            self.flush("repeat")

    # ------------------------------------------------------------ running
    def flush(self, reason: str, wanted=()) -> None:
        """Run the pending nodes whose values are still referenced.

        ``wanted``: the values the caller is about to read (``.item()``'s tensor). The nodes they
        need run first, as one program the caller waits for; the rest (a training step's
        backward and update, after ``loss.item()``) runs as a second program, dispatched without
        waiting, so it computes while Python records the next step.
        """
        with self.lock:
            self.step_ended = False
            self.check_at = PERIOD_CHECKS[0] if self.find_periods and self.period is None else MAX_NODES
            graph = self.graph
            if not graph.nodes:
                return
            self.graph = _Graph(self)
            live = [(n, i, r()) for n, refs in enumerate(graph.outputs) for i, r in enumerate(refs)]
            live = [(n, i, d) for n, i, d in live if d is not None]
            with _stats_lock:
                _materializations[reason] += 1
                _stats["ops_recorded"] += len(graph.nodes)
            metrics.count_materialization(reason)
            first = {d.ref[1] for d in wanted if d.__class__ is Deferred and d.value is None and d.graph is graph} \
                if SPLIT_AT_READ else set()
            needed = _needed_nodes(graph, {n for n, _, _ in live} | first)
            head = _needed_nodes(graph, first) if first else needed
            if len(needed) - len(head) < max(SPLIT_MIN_NODES, 1):
                self._run(graph, needed, live, (), (), (), reason)
                return
            in_head = set(head)
            tail = [n for n in needed if n not in in_head]
            # the head's values the tail reads: outputs of the first program, inputs of the second
            boundary = sorted({(r[1], r[2]) for n in tail for r in graph.nodes[n][1] if r[0] == "v" and r[1] in in_head})
            values = self._run(graph, head, [x for x in live if x[0] in in_head], boundary, (), (), reason)
            self._run(graph, tail, [x for x in live if x[0] not in in_head], (), boundary, values, reason)

    def _run(self, graph: _Graph, nodes: list[int], live: list, extra: list, externals: list,
             external_values, reason: str) -> list:
        """Run ``nodes`` as one cached program; set the ``live`` Deferreds' values and return the
        values of ``extra`` (more (node, index) outputs). ``externals`` are (node, index) values
        computed by an earlier program, passed in as ``external_values``."""
        outputs = [(n, i) for n, i, _ in live] + list(extra)
        structure = (tuple([graph.nodes[n] for n in nodes]), tuple(outputs), tuple(externals), len(graph.inputs))
        program = _programs.get(structure)
        if program is None:
            program = _programs[structure] = _build(graph, nodes, outputs, externals)
            counter = "programs_compiled"
        else:
            counter = "program_cache_hits"
        with _stats_lock:
            _stats[counter] += 1
        start = time.perf_counter()
        try:
            results = program(*graph.inputs, *external_values)
        except jax.errors.JaxRuntimeError as exc:
            names = ", ".join(sorted({getattr(graph.nodes[n][0], "__name__", "?") for n in nodes})[:8])
            what = f"a fused program of {len(nodes)} ops ({names}) run for {reason}"
            graph.error = what
            raise errors.device_error(exc, None, what) from exc
        with _stats_lock:
            _stats["run_seconds"] += time.perf_counter() - start
        for (_, _, deferred), value in zip(live, results):
            deferred.value = value
        return results[len(live):]

    def pending(self) -> list[str]:
        """The recorded, not yet run ops, by name, in order."""
        with self.lock:
            return [getattr(fn, "__name__", repr(fn)) for fn, _, _ in self.graph.nodes]


def _no_value() -> None:
    """The reference kept for an output an op does not have (batch_norm's absent running stats)."""
    return None


def _lost(value: Deferred) -> RuntimeError:
    """The error for reading a value whose graph was discarded without computing it."""
    if value.graph.error:
        return RuntimeError(f"tpu: this tensor has no value: {value.graph.error} failed before computing it "
                            f"(that error was raised then); recompute the tensor")
    return RuntimeError("tpu: a deferred value was lost (its graph was discarded without running it)")


def _tail_period(seq: list) -> int:
    """The smallest period of ``seq`` if it repeats at least twice, else 0 (KMP's failure function:
    the longest proper prefix that is also a suffix leaves the period)."""
    fail = [0] * len(seq)
    k = 0
    for i in range(1, len(seq)):
        while k and seq[i] is not seq[k]:
            k = fail[k - 1]
        if seq[i] is seq[k]:
            k += 1
        fail[i] = k
    period = len(seq) - fail[-1] if seq else 0
    return period if 0 < period <= len(seq) // 2 else 0


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


def _build(graph: _Graph, needed: list[int], outputs: list[tuple[int, int]], externals=()):
    nodes = [(n, graph.nodes[n]) for n in needed]
    first_external = len(graph.inputs)

    def program(*inputs):
        env: dict[tuple[int, int], object] = {ref: inputs[first_external + k] for k, ref in enumerate(externals)}
        for n, (fn, refs, _) in nodes:
            args = [inputs[r[1]] if r[0] == "in" else env[(r[1], r[2])] for r in refs]
            out = fn(*args)
            for i, value in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
                env[(n, i)] = value
        return [env[ref] for ref in outputs]

    return jax.jit(program)


def current_executor() -> FusedExecutor | None:
    """The executor the current context records into (None outside DEFER_AND_FUSE)."""
    return modes.current().executor


def _optimizer_step_ended(optimizer, args, kwargs) -> None:
    """Mark a training step's end: the current context's next recorded op cuts the recording there."""
    # The cut waits for the next op rather than flushing here, so that a read right after
    # ``opt.step()`` (``loss.item()``) still runs only what it needs first and the rest behind it.
    executor = modes.current().executor
    if executor is not None:
        executor.step_ended = True


# Without a cut, a loop that reads nothing each step records across steps up to MAX_NODES and
# cuts wherever that lands: a new program every time, never reused. ``optimizer.step()`` is where
# a step ends, in the same place every step (docs/design.md, "Where a fused program ends").
_step_hook = register_optimizer_step_post_hook(_optimizer_step_ended)


def pending_graph() -> list[str]:
    """The ops the current context recorded and has not run yet (``torch.tpu.debug.pending_graph()``)."""
    executor = current_executor()
    return executor.pending() if executor is not None else []


def stats() -> dict:
    """Counters of every context's executor together: materializations by reason, programs
    compiled and cache hits, seconds running programs, ops recorded (counted when they run), and the
    programs and output shapes cached."""
    with _stats_lock:
        counters = {"materializations": dict(_materializations), "programs_compiled": 0, "program_cache_hits": 0,
                    "run_seconds": 0.0, "ops_recorded": 0, **_stats}
    return {**counters, "programs_cached": len(_programs), "shapes_cached": len(_avals_cache)}
