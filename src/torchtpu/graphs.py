"""Capture and replay on ``tpu``: the ``torch.cuda.graphs`` API, and a whole training step as one
program (``compile_step``).

``TPUGraph``, ``graph`` and ``make_graphed_callables`` keep their ``torch.cuda`` contract: static
input and output tensors; the user copies new data into the static inputs and calls ``replay()``,
which runs one cached XLA program and writes its results into the static outputs (and into every
tensor the region updates in place: parameters, gradients, optimizer state). How a capture is
recorded is in ``eager/capture.py``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch

from torchtpu import metrics
from torchtpu.device import bridge
from torchtpu.eager import capture as _capture
from torchtpu.runtime.compat import ArrayImpl, pytree

CaptureError = _capture.CaptureError


class TPUGraph:
    """A captured region of eager ``tpu`` work, replayed as one XLA program (``torch.cuda.CUDAGraph``)."""

    def __init__(self, keep_graph: bool = False):
        self._capture: _capture.Capture | None = None
        self._program: _capture.CapturedProgram | None = None
        self._capturable = False  # compile_step's captures switch optimizers to capturable=True

    def capture_begin(self, pool=None, capture_error_mode: str = "global") -> None:
        """Start recording this context's eager ``tpu`` ops (``torch.tpu.graph`` calls this)."""
        if self._capture is not None:
            raise RuntimeError("TPUGraph.capture_begin: this graph is already capturing")
        if self._program is not None:
            raise RuntimeError("TPUGraph.capture_begin: this graph was already captured; call reset() first")
        self._capture = _capture.Capture(auto_capturable=self._capturable)

    def capture_end(self) -> None:
        """Stop recording; the graph can be replayed from now on."""
        if self._capture is None:
            raise RuntimeError("TPUGraph.capture_end: capture_begin was not called")
        capture, self._capture = self._capture, None
        self._program = capture.end()

    def _abort(self) -> None:
        capture, self._capture = self._capture, None
        if capture is not None:
            capture.abort()

    def replay(self) -> None:
        """Run the captured program on the static inputs' current values."""
        program = self._require()
        reason = program.stale()
        if reason is not None:
            raise RuntimeError(f"TPUGraph.replay: {reason}: the captured program holds the old value. "
                               f"Capture again, or keep the value in a tensor (e.g. lr=torch.tensor(...)).")
        program.replay()

    def reset(self) -> None:
        """Drop the captured program (the static tensors stay as they are)."""
        self._program = None

    def pool(self) -> tuple:
        """A handle that ``torch.cuda`` code passes to the next capture to share memory; XLA owns
        device memory here, so it only identifies this graph."""
        return (id(self),)

    def debug_dump(self, path: str) -> None:
        """Write the captured program's StableHLO text to ``path``."""
        program = self._require()
        with open(path, "w") as f:
            f.write(program.shared.lower(*program.arguments()[0]).as_text())

    @property
    def num_ops(self) -> int:
        """How many eager ops the capture recorded."""
        return self._require().ops

    def _require(self) -> _capture.CapturedProgram:
        if self._program is None:
            raise RuntimeError("TPUGraph: nothing captured yet (use `with torch.tpu.graph(g): ...`)")
        return self._program


@contextlib.contextmanager
def graph(tpu_graph: TPUGraph, pool=None, stream=None, capture_error_mode: str = "global") -> Iterator[TPUGraph]:
    """Capture the block's eager ``tpu`` work into ``tpu_graph`` (``torch.cuda.graph``). Nothing in
    the block runs: ``tpu_graph.replay()`` runs it."""
    tpu_graph.capture_begin(pool, capture_error_mode)
    try:
        yield tpu_graph
    except BaseException:
        tpu_graph._abort()
        raise
    tpu_graph.capture_end()


# ---------------------------------------------------------------- make_graphed_callables

def make_graphed_callables(callables, sample_args, num_warmup_iters: int = 3, allow_unused_input: bool = False,
                           pool=None):
    """Graphed versions of ``callables`` (modules or functions), as ``torch.cuda.make_graphed_callables``:
    the forward and the backward each replay one captured program; the result is differentiable."""
    single = not isinstance(callables, tuple)
    if single:
        callables, sample_args = (callables,), (sample_args,)
    graphed = tuple(_graphed(c, tuple(args), num_warmup_iters, allow_unused_input)
                    for c, args in zip(callables, sample_args))
    return graphed[0] if single else graphed


def _graphed(fn, sample_args: tuple, warmup: int, allow_unused: bool):
    is_module = isinstance(fn, torch.nn.Module)
    if is_module and (fn._backward_hooks or fn._forward_hooks or fn._forward_pre_hooks):
        raise RuntimeError("make_graphed_callables: modules must not have hooks registered")
    flat_args, _ = pytree.tree_flatten(sample_args)
    if not all(isinstance(a, torch.Tensor) and a.device.type == "tpu" for a in flat_args):
        raise TypeError("make_graphed_callables: sample_args must be tpu tensors (nested in tuples or lists)")
    params = tuple(p for p in fn.parameters() if p.requires_grad) if is_module else ()
    surface = tuple(flat_args) + params
    call = fn.forward if is_module else fn

    def differentiable(outputs):
        return [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]

    def grads(outputs, grad_outputs):
        needing = [i for i in surface if i.requires_grad]
        got = torch.autograd.grad(differentiable(outputs), needing, grad_outputs=grad_outputs,
                                  allow_unused=allow_unused)
        it = iter(got)
        return tuple(next(it) if i.requires_grad else None for i in surface)

    for _ in range(warmup):  # builds lazy state (as the CUDA version), results discarded
        outputs = pytree.tree_leaves(call(*sample_args))
        if differentiable(outputs):
            grads(outputs, [torch.ones_like(o) for o in differentiable(outputs)])
    forward_graph, backward_graph = TPUGraph(), TPUGraph()
    with graph(forward_graph):
        static_out = call(*sample_args)
    flat_out, out_spec = pytree.tree_flatten(static_out)
    static_grad_out = [torch.empty_like(o) if isinstance(o, torch.Tensor) and o.requires_grad else None
                       for o in flat_out]
    static_grad_in: tuple = ()
    if differentiable(flat_out):
        with graph(backward_graph):
            static_grad_in = grads(flat_out, [g for g in static_grad_out if g is not None])

    class Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            for static, new in zip(surface, inputs):
                if static.data_ptr() != new.data_ptr():
                    static.copy_(new)
            forward_graph.replay()
            # new tensors holding the outputs' arrays (no copy): the next replay must not change
            # what the caller holds, nor an in-place op on it the static outputs the backward reads
            return tuple(_fresh(o) for o in flat_out)

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, *grad_outputs):
            for static, new in zip(static_grad_out, grad_outputs):
                if static is not None and new is not None and static.data_ptr() != new.data_ptr():
                    static.copy_(new)
            backward_graph.replay()
            # new tensors, not views of the static gradients: autograd may keep a returned gradient
            # as ``param.grad`` (it steals a tensor nothing else holds), and the next replay would
            # then write into ``.grad`` before autograd adds the new gradient to it: twice the value
            return tuple(_fresh(g) if g is not None else None for g in static_grad_in)

    def graphed(*user_args):
        flat, _ = pytree.tree_flatten(user_args)
        return pytree.tree_unflatten(list(Graphed.apply(*flat, *params)), out_spec)

    if not is_module:
        return graphed

    plain = fn.forward

    def forward(*user_args):
        return graphed(*user_args) if fn.training else plain(*user_args)

    fn.forward = forward
    return fn


# ---------------------------------------------------------------- a whole training step

class CompiledStep:
    """``step_fn`` (forward, loss, ``backward()``, ``optimizer.step()``, ``zero_grad()``) as one
    program per input signature: the first call runs eagerly (a warm-up that makes gradients and
    optimizer state), the second captures, every call replays."""

    def __init__(self, step_fn: Callable, warmup: int = 1):
        self.fn = step_fn
        self.warmup = max(int(warmup), 1)
        self.entries: dict = {}  # input signature -> _Entry
        self.recaptures: list[str] = []  # why each program after the first was made
        self.name = getattr(step_fn, "__qualname__", "step")
        functools.update_wrapper(self, step_fn)

    def __call__(self, *args):
        key = _signature(args)
        entry = self.entries.get(key)
        if entry is None:
            if self.entries:
                self._recaptured(f"new input signature {_describe(key)}")
            entry = self.entries[key] = _Entry()
        if entry.calls < self.warmup:
            entry.calls += 1
            return self.fn(*args)
        if entry.program is not None:
            reason = entry.program.stale()
            if reason is not None:
                self._recaptured(reason)
                entry.program = None
        if entry.program is None:
            self._capture(entry, args)
        feeds = []
        for static, new, slot in zip(entry.inputs, _tensors(args), entry.slots):
            if static is new:
                continue
            array = bridge.array_of(new.untyped_storage()) if slot is not None else None
            if array.__class__ is ArrayImpl and array.shape == slot[1] and array.dtype == slot[2] \
                    and bridge.holds_whole_storage(new, array) and not (new.is_conj() or new.is_neg()):
                feeds.append((slot[0], array))  # read in place of the static input: no copy
            else:
                static.copy_(new)
        entry.program.replay(feeds)
        metrics.count_compile(f"compile_step:{self.name}", cache_hit=True)
        return pytree.tree_map(_fresh, entry.output)

    def _capture(self, entry: "_Entry", args) -> None:
        statics = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
        g = TPUGraph()
        g._capturable = True
        with graph(g):
            output = self.fn(*statics)
        entry.program, entry.output = g._program, output
        entry.inputs = _tensors(statics)
        entry.slots = [entry.program.feed_slot(t.untyped_storage()) for t in entry.inputs]

    def _recaptured(self, reason: str) -> None:
        self.recaptures.append(reason)
        metrics.count_recompile(f"compile_step:{self.name}", reason)

    @property
    def programs(self) -> int:
        """How many programs are captured now (one per input signature)."""
        return sum(1 for e in self.entries.values() if e.program is not None)


class _Entry:
    __slots__ = ("calls", "program", "output", "inputs", "slots")

    def __init__(self):
        self.calls = 0
        self.program = self.output = None
        self.inputs: list = []
        self.slots: list = []  # per static input: where the program reads it (feed_slot), or None


def compile_step(step_fn: Callable | None = None, *, warmup: int = 1):
    """A training step as one XLA program (``torch.tpu.compile_step``), as a decorator or a call."""
    if step_fn is None:
        return lambda fn: CompiledStep(fn, warmup)
    return CompiledStep(step_fn, warmup)


def _tensors(args) -> list:
    return [a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]


def _signature(args) -> tuple:
    leaves, spec = pytree.tree_flatten(args)
    return (spec, tuple((tuple(a.shape), a.dtype, a.device, a.requires_grad) if isinstance(a, torch.Tensor)
                        else (type(a), a) for a in leaves))


def _describe(key) -> str:
    return ", ".join(f"{list(s)} {d}" if isinstance(s, tuple) and not isinstance(s, type) else repr(d)
                     for s, d, *_ in key[1])


def _fresh(value: Any):
    """A new tensor holding a static output's current value: the next replay does not change it."""
    if not isinstance(value, torch.Tensor) or value.device.type != "tpu":
        return value
    array = bridge.array_of(value.untyped_storage())
    if array is not None and not isinstance(array, bridge.Lazy) and bridge.holds_whole_storage(value, array):
        return bridge.wrap(array, value.get_device())
    return value.detach().clone()
