"""What the ``tpu`` backend made of a function: its XLA programs, their costs, and why it split or recompiled.

``hlo``, ``cost_analysis`` and ``explain`` (``torch.tpu.compiler.*``) compile and run a fresh copy
of ``fn`` on the given inputs, so they see every graph dynamo makes of it (graph breaks give
several), without touching the caches of the user's own ``torch.compile(fn)``. Where ``fn``
returns tensors that need gradients (inputs, parameters or captured tensors requiring grad), their
backward is run too, with ``torch.autograd.grad`` so that no ``.grad`` changes, to compile the
backward programs; each program is labelled forward, backward or inference. A training step that
calls ``backward()`` (and ``optimizer.step()``) itself compiles its backward as it runs, and so
changes what it would change when called: pass a copy of the model to keep it as it was. Graphs of callees that dynamo already
compiled as separate frames (after a graph break inside the callee) are reused, so not shown.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from torchtpu.compile import cache, recompiles
from torchtpu.config import config
from torchtpu.runtime.compat import pytree

STAGES = ("stablehlo", "optimized")


# --- compiling a fresh copy and collecting its graphs -------------------------------------------

def _unwrap(fn: Callable) -> Callable:
    """The user's callable behind a ``torch.compile`` result (function or module)."""
    if isinstance(fn, torch.nn.Module) and hasattr(fn, "_orig_mod"):
        return fn._orig_mod
    return getattr(fn, "_torchdynamo_orig_callable", fn)


def _clone(fn: types.FunctionType, **code_changes: Any) -> types.FunctionType:
    """``fn`` with a new code object: dynamo keeps its caches on code objects, so this one has none."""
    copy = types.FunctionType(fn.__code__.replace(**code_changes), fn.__globals__, fn.__name__, fn.__defaults__,
                              fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__dict__.update(fn.__dict__)
    return copy


def _fresh(fn: Callable) -> Callable:
    """A callable that runs ``fn`` from a frame dynamo has never compiled."""
    fn = _unwrap(fn)
    if isinstance(fn, types.FunctionType):
        return _clone(fn)
    if isinstance(fn, types.MethodType) and isinstance(fn.__func__, types.FunctionType):
        return types.MethodType(_clone(fn.__func__), fn.__self__)

    def call(*args, **kwargs):
        return fn(*args, **kwargs)

    # Dynamo skips frames of torchtpu.compile's files: the wrapper must not look like one.
    return _clone(call, co_filename=f"<torchtpu.compiler: {_name(fn)}>")


def _grad_leaves(outputs: Any) -> list[torch.Tensor]:
    """The leaf tensors a backward pass of ``outputs`` would reach: inputs, module parameters and
    tensors a closure holds (``lambda x: model(x).sum()``), found in the autograd graph itself."""
    leaves, seen = {}, set()
    stack = [t.grad_fn for t in pytree.tree_leaves(outputs)
             if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: the leaf it feeds
        if isinstance(variable, torch.Tensor):
            leaves[id(variable)] = variable
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(leaves.values())


def _run_backward(outputs: Any) -> None:
    """Differentiate the outputs (with ones) so aot_autograd compiles the backward graph; the
    gradients are returned, not accumulated, so no ``.grad`` changes."""
    outs = [t for t in pytree.tree_leaves(outputs)
            if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    leaves = _grad_leaves(outs)
    if outs and leaves:
        torch.autograd.grad(outs, leaves, [torch.ones_like(t) for t in outs], allow_unused=True)


@contextlib.contextmanager
def _dumping() -> Iterator[str]:
    """Make every compilation write its StableHLO to a directory (the user's dump dir if set)."""
    if config.dump_dir:
        yield config.dump_dir
        return
    with tempfile.TemporaryDirectory(prefix="torchtpu_hlo_") as tmp:
        config.dump_dir = tmp
        try:
            yield tmp
        finally:
            config.dump_dir = ""


def _order(graph) -> int:
    return int(graph.name.rsplit("_", 1)[1])


@dataclass
class _Capture:
    """The graphs compiled while running a fresh copy of a function, with their StableHLO."""

    graphs: list = field(default_factory=list)
    stablehlo: dict[str, str] = field(default_factory=dict)


def _capture(fn: Callable, inputs: tuple, backend: Any = "tpu") -> _Capture:
    """Compile and run a fresh copy of ``fn`` (and its backward); collect the new graphs."""
    before = set(cache._graphs)
    with _dumping() as directory:
        outputs = torch.compile(_fresh(fn), backend=backend)(*inputs)
        _run_backward(outputs)
        # graphs that compiled (a backward that never ran has a graph but no program yet)
        graphs = sorted((g for g in cache._graphs if g not in before and g.executables), key=_order)
        texts = {g.name: _read_dump(directory, g.name) for g in graphs}
    if not graphs:
        raise RuntimeError(f"torch.compile made no XLA program of {_name(fn)} on these inputs "
                           "(it has no tensor operations, or dynamo ran all of it eagerly)")
    return _Capture(graphs, texts)


def _read_dump(directory: str, name: str) -> str:
    with open(os.path.join(directory, f"{name}.stablehlo.mlir")) as f:
        return f.read()


def _name(fn: Callable) -> str:
    fn = _unwrap(fn)
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _kind(graph) -> str:
    return graph.name.split("_")[1]


def _shapes(signature: tuple) -> str:
    """An executable's input signature in short: ``f32[4,8], i64[]``."""
    parts = []
    for entry in signature:
        if entry[0] == "static":
            parts.append(repr(entry[2]))
        else:
            shape, dtype = (entry[1], entry[2]) if entry[0] == "cpu" else (entry[0], entry[1])
            parts.append(f"{dtype}[{','.join(map(str, shape))}]")
    return ", ".join(parts)


def _executables(graphs: list) -> Iterator[tuple[Any, tuple, Any]]:
    for graph in graphs:
        for (signature, _matmul_precision), executable in graph.executables.items():
            yield graph, signature, executable


# --- hlo and cost_analysis -----------------------------------------------------------------------

def hlo(fn: Callable, *inputs: Any, stage: str = "stablehlo") -> str:
    """The XLA programs ``fn`` compiles to on ``inputs``: StableHLO, or XLA's optimised HLO."""
    if stage not in STAGES:
        raise ValueError(f"hlo: stage must be one of {STAGES}, got {stage!r}")
    captured = _capture(fn, inputs)
    if stage == "stablehlo":
        sections = [(g, captured.stablehlo[g.name]) for g in captured.graphs]
    else:
        sections = [(g, e.compiled.as_text()) for g, _, e in _executables(captured.graphs)]
    total = len(sections)
    return "\n".join(f"// ===== graph {i} of {total}: {g.name} ({_kind(g)}) =====\n{text}"
                     for i, (g, text) in enumerate(sections, 1))


def _costs(compiled) -> dict[str, float]:
    costs = compiled.cost_analysis()
    if isinstance(costs, (list, tuple)):  # older JAX: one dict per device program
        costs = costs[0] if costs else {}
    return dict(costs or {})


def cost_analysis(fn: Callable, *inputs: Any) -> list[dict[str, Any]]:
    """XLA's cost analysis (flops, bytes accessed, ...) of each program ``fn`` compiles to."""
    captured = _capture(fn, inputs)
    return [{"graph": g.name, "kind": _kind(g), "inputs": _shapes(sig), **_costs(e.compiled)}
            for g, sig, e in _executables(captured.graphs)]


# --- explain -------------------------------------------------------------------------------------

def _where(frame) -> str:
    line = f" (`{frame.line.strip()}`)" if frame.line else ""
    return f"{frame.filename}:{frame.lineno} in {frame.name}{line}"


def _break_sentence(reason) -> str:
    """One graph break as ``file:line in f (`code`): why``."""
    lines = [line.strip() for line in str(reason.reason).splitlines() if line.strip()]
    explanation = next((line[len("Explanation:"):].strip() for line in lines
                        if line.startswith("Explanation:")), None)
    why = explanation or (lines[0] if lines else "unknown reason")
    stack = getattr(reason, "user_stack", None) or []
    where = _where(stack[-1]) if stack else "an unknown place"
    return f"graph break at {where}: {why}"


# Guard-failure texts of dynamo (torch/csrc/dynamo/guards.cpp and guards.py) and their plain words.
_GUARD_SENTENCES: list[tuple[re.Pattern, str]] = [(re.compile(p), s) for p, s in [
    (r"tensor '(?P<n>.+)' size mismatch at index (?P<i>\d+)\. expected (?P<a>\S+), actual (?P<b>\S+)",
     "dimension {i} of tensor `{n}` changed from {a} to {b}"),
    (r"tensor '(?P<n>.+)' stride mismatch at index (?P<i>\d+)\. expected (?P<a>\S+), actual (?P<b>\S+)",
     "the stride of dimension {i} of tensor `{n}` changed from {a} to {b} (a different memory layout)"),
    (r"tensor '(?P<n>.+)' rank mismatch\. expected (?P<a>\S+), actual (?P<b>\S+)",
     "tensor `{n}` changed from {a} to {b} dimensions"),
    (r"tensor '(?P<n>.+)' dtype mismatch\. expected (?P<a>\S+), actual (?P<b>\S+)",
     "the dtype of tensor `{n}` changed from {a} to {b}"),
    (r"tensor '(?P<n>.+)' requires_grad mismatch\. expected requires_grad=0",
     "tensor `{n}` now requires grad"),
    (r"tensor '(?P<n>.+)' requires_grad mismatch\. expected requires_grad=1",
     "tensor `{n}` no longer requires grad"),
    (r"tensor '(?P<n>.+)' (?:device|dispatch key set) mismatch",
     "tensor `{n}` moved to another device (or changed its dispatch keys)"),
    (r"BACKEND_MATCH failure", "it was called under a different torch.compile backend"),
    (r"^(?P<n>[\w.\[\]'\"]+) == (?P<a>[^#\n]+?)\s*(?:#|$)", "`{n}` is no longer {a}"),
]]
_COMPILE_ID = re.compile(r"^(\d+)/(\d+): ")


def _guard_sentence(text: str) -> str:
    """A failed guard in plain words (its first line, if the text is not one we know)."""
    body = _COMPILE_ID.sub("", text.strip())
    for pattern, sentence in _GUARD_SENTENCES:
        match = pattern.search(body)
        if match:
            groups = {k: _local_name(v) for k, v in match.groupdict().items()}
            return sentence.format(**groups)
    return f"the guard `{body.splitlines()[0].split('#')[0].strip()}` failed"


def _local_name(text: str) -> str:
    """``L['x']`` (dynamo's name of a local) as ``x``."""
    return re.sub(r"L\['([^']+)'\]", r"\1", text.strip())


def _recompile_groups(reasons: list[dict[str, str]]) -> list[tuple[str, str]]:
    """One (function, newest failed guard) per recompilation.

    A recompilation records one failure per cached version it tried, newest first, ending
    with version 0; the newest is the version the call came closest to.
    """
    groups, start = [], True
    for entry in reasons:
        if start:
            groups.append((entry["function"], entry["reason"]))
        match = _COMPILE_ID.match(entry["reason"].strip())
        start = match is None or match.group(2) == "0"
    return groups


def recompile_sentences() -> list[str]:
    """The recompilations recorded so far, each as a sentence."""
    sentences = []
    for function, reason in _recompile_groups(recompiles.recompile_reasons()):
        name, _, where = function.partition(" (")
        sentences.append(f"recompiled `{name}` ({where.rstrip(')')}) because {_guard_sentence(reason)}")
    return sentences


@dataclass
class Explanation:
    """What torch.compile made of a function: its graphs, graph breaks and recompilations."""

    function: str
    graph_count: int
    graph_breaks: list[str]
    recompilations: list[str]
    programs: list[str]

    def __str__(self) -> str:
        breaks = len(self.graph_breaks)
        lines = [f"`{self.function}` compiles to {self.graph_count} graph{'s' * (self.graph_count != 1)} "
                 f"({breaks} graph break{'s' * (breaks != 1)}); XLA programs: {', '.join(self.programs)}"]
        lines += _numbered("Graph breaks", self.graph_breaks)
        lines += _numbered("Recompilations so far (all functions)", self.recompilations)
        return "\n".join(lines)


def _numbered(title: str, items: list[str]) -> list[str]:
    if not items:
        return [f"{title}: none"]
    return [f"{title}:"] + [f"  {i}. {item}" for i, item in enumerate(items, 1)]


def explain(fn: Callable, *inputs: Any) -> Explanation:
    """Compile and run ``fn`` on ``inputs``; say in plain words how dynamo split it and what recompiled."""
    from torchtpu.runtime.compat import ExplainWithBackend

    # Read before compiling; and not torch._dynamo.explain, which resets every dynamo cache.
    recompilations = recompile_sentences()
    recorder = ExplainWithBackend("tpu")
    captured = _capture(fn, inputs, backend=recorder)
    return Explanation(
        function=_name(fn),
        graph_count=len(recorder.graphs),
        graph_breaks=[_break_sentence(r) for r in recorder.break_reasons],
        recompilations=recompilations,
        programs=[g.name for g in captured.graphs],
    )


__all__ = ["Explanation", "cost_analysis", "explain", "hlo", "recompile_sentences"]
