"""Collectives in compiled graphs: ``_c10d_functional`` ops as XLA collectives in the graph's program.

funcol, DTensor and compiled FSDP2/TP put ``torch.ops._c10d_functional`` ops into torch.compile
graphs (``all_reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``,
``all_to_all_single``, ``broadcast`` and the ``_coalesced`` forms, each followed by
``wait_tensor``). A graph whose collectives all use one group (its global ranks; two groups of
the same ranks are one) is one SPMD program: ``shard_map`` over ``programs.mesh(ranks)``, each
input and output this process's shard (``programs.spec``, ``programs.assembler``), every other
op per shard as without collectives. A collective's lowering is the body the eager c10d backend runs
(``distributed/programs.py``), so both paths share the axis ``"ranks"`` and the XLA:CPU
reduce-scatter workaround; ``wait_tensor`` is the identity (XLA orders the program).

A graph whose collectives use several groups (FSDP x TP on a 2-D DeviceMesh) is ``split`` into
consecutive pieces whose collectives use one group each; each piece is a compiled graph of its
own. Splits are counted (``metrics.snapshot()["compiled_collectives"]``) and logged, with the
groups, once per graph.

When a program is built, its group's ranks check that they traced the same collectives
(``agree``): ranks that did not get an error instead of an XLA collective that never completes.
A ``broadcast``'s ``src`` is a rank within the group, as c10d's ``rootRank``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import Counter
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch.fx import GraphModule, Node

from torchtpu import metrics
from torchtpu.distributed import programs
from torchtpu.runtime.compat import OpOverload, resolve_process_group

c10d = torch.ops._c10d_functional
log = logging.getLogger("torchtpu.compile")
counts: Counter = Counter()  # graphs: "one_program" (SPMD), "split", "pieces" (of split graphs)
metrics.register_source("compiled_collectives", lambda: dict(counts))

_REDUCE_OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor")
_LOWERINGS: dict[OpOverload, Callable] = {}


def is_collective(op) -> bool:
    """Whether ``op`` is a ``_c10d_functional`` op (supported or not)."""
    return isinstance(op, OpOverload) and op.namespace == "_c10d_functional"


def supported(op) -> bool:
    return op in _LOWERINGS


def _lowering(*ops: OpOverload):
    def register(fn):
        for op in ops:
            _LOWERINGS[op] = fn
        return fn
    return register


# ---------------------------------------------------------------- groups

def ranks_of(group_name) -> tuple[int, ...]:
    """The global ranks of a ``_c10d_functional`` op's group, in group order."""
    pg = resolve_process_group(group_name)
    return tuple(dist.get_process_group_ranks(pg))


def group_of(node: Node) -> tuple[int, ...] | None:
    """The global ranks of ``node``'s collective (None for ``wait_tensor`` and non-collectives)."""
    name = _group_name(node)
    return None if name is None else ranks_of(name)


def _group_name(node: Node):
    if not is_collective(node.target) or "group_name" not in _argument_names(node.target):
        return None
    index = _argument_names(node.target).index("group_name")
    return node.args[index] if index < len(node.args) else node.kwargs["group_name"]


@functools.cache
def _argument_names(op: OpOverload) -> tuple[str, ...]:
    return tuple(a.name for a in op._schema.arguments)


def groups(gm: GraphModule) -> dict[tuple[int, ...], str]:
    """The groups of ``gm``'s collectives, in order of first use: global ranks -> a group name."""
    found: dict[tuple[int, ...], str] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            name = _group_name(node)
            if name is not None:
                found.setdefault(ranks_of(name), name)
    return found


def check_member(ranks: tuple[int, ...], what: str) -> int:
    """This process's global rank; raises when it is not one of ``ranks`` (it cannot run their program)."""
    me = dist.get_rank() if dist.is_initialized() else 0
    if me not in ranks:
        raise RuntimeError(f"tpu: {what} has a collective over global ranks {list(ranks)}, but this is rank {me}: "
                           f"only members of a group may run its collectives")
    return me


def lowering(node: Node) -> Callable:
    """The function a graph step calls with ``node``'s arguments (group size bound); while
    ``recording()``, each call notes what it runs."""
    ranks = group_of(node)
    fn = _LOWERINGS[node.target]
    if ranks is None:
        return fn
    if node.target is c10d.all_to_all_single.default:
        outs, ins = node.args[1], node.args[2]
        static = all(isinstance(v, int) for v in (*ins, *outs))
        if static and not _even(ins, outs):
            fn = functools.partial(fn, block=agreed_block(ins, node.args[3]))
    op = node.target._schema.name.split("::")[1]
    group_index = _argument_names(node.target).index("group_name")

    def call(*args, **kwargs):
        calls = _recorded.get()
        if calls is not None:
            calls.append(_describe(op, ranks, _shared(op, args[:group_index])))
        return fn(len(ranks), *args, **kwargs)
    return call


# ---------------------------------------------------------------- the ranks agree on a program's collectives

_recorded: ContextVar[list | None] = ContextVar("torchtpu_compiled_collectives", default=None)


@contextlib.contextmanager
def recording() -> Iterator[list[str]]:
    """Collect, in order, a description of each collective traced in this block."""
    calls: list[str] = []
    token = _recorded.set(calls)
    try:
        yield calls
    finally:
        _recorded.reset(token)


def _shared(op: str, args: tuple) -> tuple:
    """The arguments every rank must pass alike: all, except all_to_all_single's row counts and
    splits, which differ by rank when uneven (the padded blocks agree: ``agreed_block``)."""
    if op == "all_to_all_single":
        x = args[0]
        return (f"{x.dtype}[*, {', '.join(map(str, x.shape[1:]))}]",)
    return args


def _describe(op: str, ranks, args) -> str:
    def one(a):
        if hasattr(a, "shape") and hasattr(a, "dtype"):
            return f"{a.dtype}{list(a.shape)}"
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(map(one, a)) + "]"
        return repr(a)
    return f"{op}({', '.join(map(one, args))}) over {list(ranks)}"


def agree(group_name, calls: list[str], what: str) -> None:
    """Check, when a program is built, that every rank of its group traced the same collectives
    (or XLA would wait forever for a collective some ranks never run): one small object
    all-gather over the group; raises a RuntimeError naming the program, the group and the first
    difference. A rank that never builds the program makes this all-gather time out instead."""
    pg = resolve_process_group(group_name)
    if dist.get_world_size(pg) == 1:
        return
    everyone: list = [None] * dist.get_world_size(pg)
    dist.all_gather_object(everyone, calls, group=pg)
    ranks = dist.get_process_group_ranks(pg)
    for rank, theirs in zip(ranks, everyone):
        if theirs != calls:
            me = dist.get_rank()
            step = next((i for i, (a, b) in enumerate(zip(calls, theirs)) if a != b), min(len(calls), len(theirs)))
            mine_at = calls[step] if step < len(calls) else "nothing more"
            theirs_at = theirs[step] if step < len(theirs) else "nothing more"
            raise RuntimeError(f"tpu: {what}: the ranks of group {ranks} compiled different collectives; collective "
                               f"{step}: rank {me} runs {mine_at}, rank {rank} runs {theirs_at}. Every rank must "
                               f"run the same collectives in the same order (a rank-dependent branch around a "
                               f"collective?)")


# ---------------------------------------------------------------- splitting graphs of several groups

def _piece_of(gm: GraphModule) -> dict[Node, int]:
    """Each computing node's piece: a new piece starts at each collective whose group differs
    from the current piece's (placeholders and the output belong to none)."""
    pieces, piece, current = {}, 0, None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        ranks = group_of(node) if node.op == "call_function" else None
        if ranks is not None:
            if current is not None and ranks != current:
                piece += 1
            current = ranks
        pieces[node] = piece
    return pieces


@dataclass
class Piece:
    """One piece of a split graph: its graph, the nodes of the whole graph it takes (in its
    placeholders' order) and those it gives back (in its outputs' order)."""

    gm: GraphModule
    inputs: list[Node]
    outputs: list[Node]


def split(gm: GraphModule) -> list[Piece]:
    """``gm`` as consecutive pieces, each with the collectives of one group (see ``_piece_of``)."""
    piece_of = _piece_of(gm)
    npieces = max(piece_of.values(), default=0) + 1
    inputs: list[dict[Node, None]] = [{} for _ in range(npieces)]
    outputs: list[dict[Node, None]] = [{} for _ in range(npieces)]
    for node in gm.graph.nodes:
        target = piece_of.get(node, npieces)  # npieces: the whole graph's output
        for arg in node.all_input_nodes:
            source = piece_of.get(arg, -1)  # -1: a placeholder of the whole graph
            if source != target:
                if target < npieces:
                    inputs[target].setdefault(arg)
                if source >= 0:
                    outputs[source].setdefault(arg)
    pieces = []
    for p in range(npieces):
        graph = torch.fx.Graph()
        env: dict[Node, Node] = {}
        for node in inputs[p]:
            env[node] = graph.placeholder(node.name)
            env[node].meta = dict(node.meta)
        for node in gm.graph.nodes:
            if piece_of.get(node) == p:
                env[node] = graph.node_copy(node, lambda a: env[a])
        graph.output(tuple(env[n] for n in outputs[p]))
        pieces.append(Piece(GraphModule(gm, graph), list(inputs[p]), list(outputs[p])))
    return pieces


def note_split(name: str, found: list[tuple[int, ...]], npieces: int) -> None:
    counts["split"] += 1
    counts["pieces"] += npieces
    log.warning("tpu: compiled graph %s has collectives over %d groups (global ranks %s); one XLA program "
                "runs collectives of one group, so it runs as %d programs in sequence", name, len(found),
                ", ".join(str(list(r)) for r in found), npieces)


# ---------------------------------------------------------------- the lowerings
# Each takes the group size first, then the op's arguments; arrays are this process's shards.

def _reduce_op(op: str) -> str:
    op = op.lower()
    if op not in _REDUCE_OPS:
        raise NotImplementedError(f"tpu: reduce op {op!r} in a compiled collective is not supported "
                                  f"({', '.join(_REDUCE_OPS)} are)")
    return op


def _run(make, n: int, x):
    (out,) = make(n)(x.reshape(1) if x.ndim == 0 else x)
    return out


@_lowering(c10d.all_reduce.default)
def all_reduce(n, x, reduce_op, group_name):
    return _run(programs.all_reduce(_reduce_op(reduce_op)), n, x).reshape(x.shape)


@_lowering(c10d.all_gather_into_tensor.default)
def all_gather_into_tensor(n, x, group_size, group_name):
    return _run(programs.all_gather(), n, x)


@_lowering(c10d.reduce_scatter_tensor.default)
def reduce_scatter_tensor(n, x, reduce_op, group_size, group_name):
    return _run(programs.reduce_scatter(_reduce_op(reduce_op)), n, x)


@_lowering(c10d.broadcast.default)
def broadcast(n, x, src, group_name):
    return _run(programs.broadcast(src), n, x).reshape(x.shape)


@_lowering(c10d.all_to_all_single.default)
def all_to_all_single(n, x, output_split_sizes, input_split_sizes, group_name, *, block=None):
    ins, outs = tuple(map(int, input_split_sizes)), tuple(map(int, output_split_sizes))
    if _even(ins, outs):
        return _run(programs.all_to_all(), n, x)
    if block is None:  # splits that were symbolic when the graph was built: agree now, while tracing
        block = agreed_block(ins, group_name)
    return _run(programs.all_to_all_uneven(ins, outs, block), n, x)


def _even(ins, outs) -> bool:
    return len(set(ins)) == 1 and set(ins) == set(outs)


def agreed_block(in_splits, group_name) -> int:
    """The largest split of any rank of the group: every rank must pad its blocks to the same
    size, and its own splits show only its row of the split matrix. One small object all-gather
    over the group, when the graph is built (every rank builds it)."""
    from torchtpu.runtime.compat import unset_fake_temporarily

    pg = resolve_process_group(group_name)
    everyone: list = [None] * dist.get_world_size(pg)
    with unset_fake_temporarily():
        dist.all_gather_object(everyone, max(map(int, in_splits)), group=pg)
    return max(1, *everyone)


def _each(fn):
    def coalesced(n, inputs, *args):
        return [fn(n, x, *args) for x in inputs]
    return coalesced


_lowering(c10d.all_reduce_coalesced.default)(_each(all_reduce))
_lowering(c10d.all_gather_into_tensor_coalesced.default)(_each(all_gather_into_tensor))
_lowering(c10d.reduce_scatter_tensor_coalesced.default)(_each(reduce_scatter_tensor))
_lowering(c10d.wait_tensor.default)(lambda x: x)
