"""Running a compiled graph: inputs in, one XLA executable per input signature, results out.

A call reads its tensors' arrays through the bridge, looks up the executable of its input
signature (shapes, dtypes, devices, static scalars, donations), runs it, writes the new values of
mutated inputs back into their tensors and wraps the outputs as ``tpu`` tensors. A mutated input
that owns its storage, and whose array nothing else holds, is donated to XLA, so optimizer steps
update parameters in place instead of doubling memory.

A graph with collectives (of one group: ``collectives.py``) is a ``shard_map`` program over the
group's mesh: its arrays go in as this process's shards of group-wide arrays and come out as
this process's shards. A graph without collectives is a plain ``jax.jit`` of its function.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import torch
from torch.fx import GraphModule, Node

from torchtpu.compile import cache, collectives
from torchtpu.compile import flex_attention  # noqa: F401  (registers its HOP lowerings with graph.py)
from torchtpu.compile.graph import GraphFunction, base_key
from torchtpu.distributed import programs
from torchtpu.config import config
from torchtpu import metrics
from torchtpu.device import bridge
from torchtpu.eager import capture, transfer
from torchtpu.ops import checks, precision
from torchtpu.runtime.dtypes import to_jax_dtype
from torchtpu.runtime import placement, rng, state
from torchtpu.runtime.compat import ArrayImpl

_names = itertools.count()
_SOLE_OWNER_REFS = bridge.SOLE_OWNER_REFS  # counted in ``_read`` itself (see its comment)


@dataclass(frozen=True)
class _Output:
    """What one graph output is: a tensor (with its device and dtype) or a static value."""

    tensor: bool
    device: torch.device | None = None
    dtype: Any = None
    ndim: int = 0


def _output_kinds(output: Node) -> list[_Output]:
    kinds = []
    for arg in output.args[0]:
        val = arg.meta.get("val") if isinstance(arg, Node) else None
        if isinstance(val, torch.Tensor):
            kinds.append(_Output(True, val.device, to_jax_dtype(val.dtype), val.dim()))
        else:
            kinds.append(_Output(False))
    return kinds


class _Executable:
    """One signature's XLA executable and the static outputs recorded while tracing it."""

    def __init__(self, graph: "CompiledGraph", statics: dict[int, Any], ninputs: int,
                 donate: tuple[int, ...], arrays: list, key_args: tuple, index: int, setting: str | None):
        self.graph = graph
        self.statics = statics
        self.ninputs = ninputs
        self.static_outputs: dict[int, Any] = {}
        self.index = index
        nkey = len(key_args)

        def run(*flat):
            key = base_key(flat[:nkey]) if nkey else None
            it = iter(flat[nkey:])
            values = [statics[i] if i in statics else next(it) for i in range(ninputs)]
            with precision.tracing(setting, what), checks.collecting(graph.name) as found:
                outputs, mutations = graph.fn(key, values)
            # the index checks' code (ops/checks.py); a program over a group of ranks returns none
            return self._split_outputs(outputs), mutations, checks.code(found, always=False) if graph.ranks is None else None

        run.__name__ = graph.name
        what = f"a lowering in compiled graph {graph.name}"
        donate_argnums = tuple(nkey + i for i in donate)
        start = time.perf_counter()
        with placement.default(index):
            if graph.ranks is None:
                lowered = jax.jit(run, donate_argnums=donate_argnums).lower(*key_args, *arrays)
            else:
                with collectives.recording() as calls:
                    lowered = self._lower_spmd(run, donate_argnums, key_args, arrays)
                collectives.agree(graph.group_name, calls, f"compiled graph {graph.name}")
        cache.count("trace_seconds", time.perf_counter() - start)
        _dump(lowered, graph.name)
        self.compiled = cache.compile_lowered(lowered, graph.options, graph.name)

    def _lower_spmd(self, run, donate_argnums, key_args, arrays):
        """``run`` as a ``shard_map`` program over the graph's group, every input and output a
        per-process shard (``programs.spec``)."""
        ranks, graph = self.graph.ranks, self.graph
        inputs = [*(np.asarray(k) for k in key_args), *arrays]
        mine = programs.device_of_rank(graph.rank)
        if placement.sharding(self.index).device_set != {mine}:
            raise RuntimeError(f"tpu: compiled graph {graph.name} runs collectives over global ranks {list(ranks)}; "
                               f"its inputs must be on this process's device of that group ({mine}), not on "
                               f"tpu:{self.index}")
        self.assemble = [programs.assembler(a.shape, a.dtype, ranks) for a in inputs]
        position = _array_positions(self.statics, self.ninputs)
        mutated = [arrays[position[i]].ndim for i in graph.fn.mutated]
        out_specs = ([programs.spec(k.ndim) for k in graph.outputs if k.tensor], [programs.spec(d) for d in mutated],
                     None)
        body = jax.shard_map(run, mesh=programs.mesh(ranks), in_specs=tuple(programs.spec(a.ndim) for a in inputs),
                             out_specs=out_specs, check_vma=False)
        shapes = [jax.ShapeDtypeStruct(programs.global_shape(a.shape, len(ranks)), a.dtype,
                                       sharding=programs.sharding(ranks, a.ndim)) for a in inputs]
        return jax.jit(body, donate_argnums=donate_argnums).lower(*shapes)

    def run_spmd(self, key_args: tuple, arrays: list):
        """Run the group's program on this process's arrays; returns this process's shards of
        (outputs, new values of the mutated inputs)."""
        if key_args:
            arrays = [placement.put(np.asarray(k), self.index) for k in key_args] + arrays
        outputs, mutations, _ = self.compiled(*(assemble(a) for assemble, a in zip(self.assemble, arrays)))
        return [programs.local_shard(o) for o in outputs], [programs.local_shard(m) for m in mutations]

    def _split_outputs(self, outputs: list) -> list:
        arrays = []
        for i, (value, kind) in enumerate(zip(outputs, self.graph.outputs)):
            if kind.tensor:
                value = jax.numpy.asarray(value)
                arrays.append(value if value.dtype == kind.dtype else value.astype(kind.dtype))
            else:
                self.static_outputs[i] = value
        return arrays


def _dump(lowered, name: str) -> None:
    if config.dump_dir:
        os.makedirs(config.dump_dir, exist_ok=True)
        with open(os.path.join(config.dump_dir, f"{name}.stablehlo.mlir"), "w") as f:
            f.write(lowered.as_text())


class CompiledGraph:
    """A graph from aot_autograd, callable with its (boxed) list of inputs."""

    def __init__(self, gm: GraphModule, kind: str, options: dict[str, Any]):
        self.fn = GraphFunction(gm)
        self.name = f"torchtpu_{kind}_{next(_names)}"
        self.options = options
        self.outputs = _output_kinds(self.fn.output)
        self.executables: dict[tuple, _Executable] = {}
        self.mutated = set(self.fn.mutated)
        # With collectives: the global ranks of their one group (a graph of several groups is
        # split into pieces first, in backend.py).
        self.ranks: tuple[int, ...] | None = None
        if self.fn.groups:
            if len(self.fn.groups) > 1:
                raise ValueError(f"tpu: graph {self.name} has collectives over several groups; split it first")
            (self.ranks, self.group_name), = self.fn.groups.items()
            self.rank = collectives.check_member(self.ranks, f"compiled graph {self.name}")
            collectives.counts["one_program"] += 1
        cache.track(self)

    def __call__(self, args: list) -> list:
        if bridge.capturing and capture.capturing() is not None:
            # its executable reads storages directly and would run now, once, at capture time
            raise capture.CaptureError(
                f"tpu graph capture: compiled graph {self.name} (a torch.compile'd function) was called "
                f"in the captured region; a capture records eager ops only. Capture the eager function, "
                f"or call the compiled one outside the region.")
        arrays, signature, statics, donate, index = self._read(args)
        key_args = tuple(rng.next_key_args(index)) if self.fn.random_ops else ()
        setting = precision.setting() if self.fn.dots else None  # part of the executable's key
        executable = self._lookup(signature, statics, donate, arrays, key_args, index, setting)
        if self.ranks is None:
            outputs, mutations, code = executable.compiled(*key_args, *arrays)
            checks.defer(code, False)  # read at the next synchronisation, as eager's
        else:
            outputs, mutations = executable.run_spmd(key_args, arrays)
        del arrays
        if donate:
            cache.count("donated_buffers", len(donate))
        for i, value in zip(self.fn.mutated, mutations):
            _write_back(args[i], value)
        args.clear()  # boxed convention: the inputs are ours to free
        return self._wrap(outputs, executable.static_outputs, index)

    def _lookup(self, signature, statics, donate, arrays, key_args, index, setting) -> _Executable:
        cache.count("requests")
        signature = (signature, setting)
        executable = self.executables.get(signature)
        if executable is not None:
            cache.count("hits")
            metrics.count_compile(self.name, 0.0, cache_hit=True)
            return executable
        cache.count("misses")
        start = time.perf_counter()
        executable = _Executable(self, statics, len(signature[0]), donate, arrays, key_args, index, setting)
        metrics.count_compile(self.name, time.perf_counter() - start, cache_hit=False)
        self.executables[signature] = executable
        return executable

    def _read(self, args: list):
        index = _device_index(args)
        arrays, signature, statics, donate, seen = [], [], {}, [], set()
        mutated = self.mutated
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                device = a.get_device()
                if device >= 0:
                    array = getattr(a.untyped_storage(), bridge.ATTR, None)
                    # the common case first: a tensor that owns its whole, already computed array
                    whole = array.__class__ is ArrayImpl and bridge.holds_whole_storage(a, array) \
                        and not (a.is_conj() or a.is_neg())  # (ArrayImpl: computed, not a Deferred)
                    if not whole:
                        array = bridge.read_computed(a)  # a view, or pending DEFER_AND_FUSE work: run it
                    sole = sys.getrefcount(array) <= _SOLE_OWNER_REFS
                    owned = whole and sole and i in mutated and id(array) not in seen
                    seen.add(id(array))
                    if owned:
                        donate.append(len(arrays))
                    signature.append((array.shape, array.dtype, device, owned))
                else:
                    array = transfer.to_device(a, index)  # a CPU tensor input (e.g. a CPU scalar tensor)
                    signature.append(("cpu", array.shape, array.dtype))
                arrays.append(array)
            else:
                value = _concrete(a)
                statics[i] = value
                signature.append(("static", type(value), value))
        return arrays, tuple(signature), statics, tuple(donate), index

    def _wrap(self, outputs: list, statics: dict[int, Any], index: int) -> list:
        it = iter(outputs)
        result = []
        for i, kind in enumerate(self.outputs):
            if not kind.tensor:
                result.append(statics[i])
            elif kind.device.type == "tpu":
                result.append(bridge.wrap(next(it), index if kind.device.index is None else kind.device.index))
            else:
                result.append(torch.from_numpy(np.array(next(it))))
        return result


class PiecewiseGraph:
    """A graph whose collectives use several groups, run as its pieces' compiled graphs in
    order (``collectives.split``), each piece one program over one group's mesh."""

    def __init__(self, gm: GraphModule, kind: str, options: dict[str, Any]):
        pieces = collectives.split(gm)
        self.pieces = [(CompiledGraph(p.gm, kind, options), p.inputs, p.outputs) for p in pieces]
        self.name = ", ".join(graph.name for graph, _, _ in self.pieces)
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.output = next(n for n in gm.graph.nodes if n.op == "output")
        last_use = {}  # node -> the piece after which nothing needs its value
        for i, (_, inputs, _) in enumerate(self.pieces):
            last_use.update({n: i for n in inputs})
        self.drop = [[n for n, last in last_use.items() if last == i and n not in self.output.all_input_nodes]
                     for i in range(len(self.pieces))]
        collectives.note_split(self.name, collectives.groups(gm), len(self.pieces))

    def __call__(self, args: list) -> list:
        env = dict(zip(self.placeholders, args))
        args.clear()  # boxed convention: the inputs are ours to free
        for (graph, inputs, outputs), drop in zip(self.pieces, self.drop):
            env.update(zip(outputs, graph([env[n] for n in inputs])))
            for n in drop:
                del env[n]
        return list(torch.fx.node.map_aggregate(self.output.args[0], lambda a: env[a] if isinstance(a, Node) else a))


def _array_positions(statics: dict[int, Any], ninputs: int) -> dict[int, int]:
    """Input position -> position among the call's arrays (static inputs have none)."""
    positions, n = {}, 0
    for i in range(ninputs):
        if i not in statics:
            positions[i] = n
            n += 1
    return positions


def _write_back(t: torch.Tensor, value) -> None:
    if t.device.type == "tpu":
        bridge.write(t, value)
    else:
        with torch.no_grad():
            t.copy_(torch.from_numpy(np.array(value)))


def _concrete(value):
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return value.node.hint if hasattr(value.node, "hint") else int(value)
    return value


def _device_index(args: list) -> int:
    for a in args:
        if isinstance(a, torch.Tensor) and a.device.type == "tpu":
            return a.get_device()
    return state.current_device()


def build_graph(gm: GraphModule, kind: str, options: dict[str, Any]):
    """One aot_autograd graph as a callable: one program, or one per piece of one collective group."""
    several_groups = len(collectives.groups(gm)) > 1  # collectives of several groups: one program each
    return (PiecewiseGraph if several_groups else CompiledGraph)(gm, kind, options)
