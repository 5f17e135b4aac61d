"""Capture a region's eager ops once and replay them as one XLA program (``torch.tpu.graph``).

While a context captures, its eager ops are recorded, not run, by a ``CaptureExecutor`` (the
fused mode's recorder, ``eager/fused.py``). The first time the region touches a storage that
existed before the capture (``bridge`` reports every storage it reads or writes), the storage's
array becomes an input of the program: a placeholder (``_input``) stands in for it, and each replay
reads the storage's array as it is then. Random ops draw (seed, offset) inputs too, so each replay
draws fresh numbers, the same ones eager execution would have drawn. When the capture ends:

- every storage whose value the region changed or created, and that is still alive, becomes an
  output: a replay writes its new array into it (the static outputs of the CUDA-graphs idiom);
- nothing has run, as with CUDA graphs: storages that existed get their arrays back, and new
  ones hold zeros until the first replay.

What a captured program cannot express raises at capture time, naming the op: reading a value on
the host (``.item()``, ``.cpu()``, printing), an op whose output shape depends on data, the CPU
fallback, synchronising, or a host→device copy into a tensor that existed before the capture.
"""

from __future__ import annotations

import sys
import time
import weakref

import jax
import numpy as np
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from torchtpu import metrics
from torchtpu.device import bridge
from torchtpu.eager import fused, modes
from torchtpu.runtime import errors, execution, rng
from torchtpu.runtime.compat import ArrayImpl
from torchtpu.runtime.execution import Execution, current

_U32 = ((), np.dtype(np.uint32), False)


class CaptureError(RuntimeError):
    """Something in a captured region cannot be part of a captured program."""


def _input(graph, position: int, key: tuple) -> fused.Deferred:
    """A program input that each replay reads afresh (a storage's array, or a random stream's
    seed or offset): a ``Deferred`` that the program reads from its arguments."""
    value = fused.Deferred(graph, -1, 0, key)
    value.ref = ("in", position)
    return value


_WHAT = {
    "value_needed": "reads a tensor's value on the host",
    "item": "calls .item()",
    "transfer_to_host": "copies a tensor to the host (.cpu(), .tolist(), .numpy(), printing)",
    "data_dependent": "runs an op whose output shape depends on tensor values",
    "cpu_fallback": "runs an op on the CPU fallback",
    "synchronize": "synchronizes the device",
    "mode_change": "changes the eager mode",
}


class CaptureExecutor(fused.FusedExecutor):
    """Records a captured region; ``finish`` turns the recording into a ``CapturedProgram``."""

    captures = True

    def __init__(self):
        super().__init__()
        self.find_periods = False
        self.check_at = float("inf")  # a captured region is never cut
        self.storages: dict[int, tuple] = {}  # id(storage) -> (weakref, array it held before, device index)
        self.sources: dict[int, tuple] = {}  # input position -> ("storage", id) | ("rng", stream key, part)
        self.streams: dict[tuple, list] = {}  # (device index, generator) -> [hi, lo, base inputs, draws]
        self.optimizers: list = []  # (optimizer, hyperparameters) stepped in the region
        self.held: list = []  # static outputs of earlier captures read here (see CapturedProgram.held)
        self.auto_capturable = False  # switch optimizers to capturable=True rather than refuse them
        self.stateless: dict[int, set] = {}  # id(optimizer) -> its params without state before its step

    @property
    def step_ended(self) -> bool:
        return False  # the fused mode's cut at optimizer.step() does not apply to a capture

    @step_ended.setter
    def step_ended(self, value) -> None:
        pass

    # ------------------------------------------------------------ recording
    def touch(self, storage, tensor=None, made: bool = False) -> None:
        """Note ``storage`` the first time the region touches it (through ``tensor``, if given;
        ``made``: the region creates it); an array it held from before the capture becomes a
        program input."""
        seen = self.storages.get(id(storage))
        array = bridge.array_of(storage)
        if seen is not None and seen[0]() is storage:
            if seen[1] is not None or made or tensor is not None or array is None or isinstance(array, bridge.Lazy):
                return
            # made in the region and given a host value (``torch.tensor(..., device="tpu")``, an
            # optimizer's step count moved to the device): an input too, kept alive with the program
            self.held.append(storage)
        index = storage.device.index or 0
        if made:
            array = None
        elif isinstance(array, bridge.Lazy):
            if array.graph is self.graph and array.value is None:  # made in the region
                array = None
            else:
                array = array.materialize()  # another context's value, from before the capture
        elif array is None and tensor is not None:
            # no array yet (``torch.empty``): zeros now, outside the program, so that a replay
            # reads what is copied into it later (a static input made with empty_like)
            array = bridge.zeros_for(tensor, storage)
            bridge.set_array(storage, array)
        self.storages[id(storage)] = (weakref.ref(storage), array, index)
        if getattr(storage, "_static", False):
            self.held.append(storage)
        if array is not None:
            bridge.set_array(storage, self._new_input(("storage", id(storage)), array,
                                                      (tuple(array.shape), array.dtype, False)))

    def _new_input(self, source: tuple, placeholder, key: tuple) -> fused.Deferred:
        position = len(self.graph.inputs)
        self.graph.inputs.append(placeholder)
        self.sources[position] = source
        return _input(self.graph, position, key)

    def draw(self, index: int, generator) -> tuple:
        """A random op's (seed_hi, seed_lo, offset): the stream's inputs, and its offset plus the
        number of draws before this one in the region."""
        key = (index, generator)
        stream = self.streams.get(key)
        if stream is None:
            stream = self.streams[key] = [
                self._new_input(("rng", key, part), np.uint32(0), _U32) for part in range(3)] + [0]
        hi, lo, base, draws = stream
        stream[3] += 1
        return hi, lo, self.call(_add_u32, base, np.uint32(draws))

    def flush(self, reason: str, wanted=()) -> None:
        if reason in ("optimizer_step", "repeat", "graph_size"):
            return
        what = _WHAT.get(reason, f"needs its values computed ({reason})")
        op = _op_in_flight()
        raise CaptureError(
            f"tpu graph capture: the captured region {what}{f' in {op}' if op else ''}. A captured "
            f"program runs without returning to Python, so no value can come back to the host in "
            f"the middle of it and no shape can depend on data (the same rule as CUDA graphs). Move "
            f"this out of the captured region, or capture a smaller region.")

    # ------------------------------------------------------------ ending
    def finish(self) -> "CapturedProgram":
        """The captured program; restores the storages (nothing ran)."""
        graph = self.graph
        outputs = []  # (storage weakref, value ref, key)
        for key, (ref, before, index) in self.storages.items():
            storage = ref()
            if storage is None:
                continue
            now = bridge.array_of(storage)
            if isinstance(now, fused.Deferred) and now.graph is graph and now.value is None:
                if not (now.ref[0] == "in" and self.sources.get(now.ref[1]) == ("storage", key)):
                    outputs.append((ref, now.ref, now.key, index))
            elif now is not before and before is not None:
                raise CaptureError(
                    "tpu graph capture: the captured region copied host data into a tensor that "
                    "existed before the capture; a replay would not copy it again. Copy new data "
                    "into the static inputs before replay(), outside the captured region.")
        self.restore()
        program = CapturedProgram(self, outputs)
        # the arrays the storages held before the capture: a leftover value of the region (none
        # should outlive it) must not keep them alive
        graph.inputs, graph.holders, graph.input_ids = [], [], {}
        return program

    def restore(self) -> None:
        """Give storages that existed their arrays back (nothing ran); storages the region made
        hold zeros until a replay (CUDA leaves them uninitialised)."""
        for ref, before, index in self.storages.values():
            storage = ref()
            if storage is None:
                continue
            if before is not None:
                bridge.set_array(storage, before)
                continue
            now = bridge.array_of(storage)
            if isinstance(now, fused.Deferred) and now.graph is self.graph and now.value is None:
                bridge.set_array(storage, bridge._zeros(now.size, now.dtype, index)())  # (flat: any shape holds a storage)
                storage._static = True  # a static output: a later capture that reads it keeps it alive
        self.graph.error = "the graph capture that recorded it"


def _op_in_flight() -> str | None:
    """The aten op being run, from the Python stack (only to name it in an error)."""
    frame = sys._getframe(2)
    while frame is not None:
        local = frame.f_locals
        owner = local.get("self")
        name = getattr(owner, "name", None) if frame.f_code.co_name in ("run", "__call__") else None
        if isinstance(name, str) and name.startswith("aten"):
            return name
        op = local.get("op")
        if op is not None and hasattr(op, "_schema"):
            return str(op._schema.name)
        if frame.f_code.co_name == "_local_scalar_dense":
            return "aten::_local_scalar_dense (.item())"
        frame = frame.f_back
    return None


@jax.jit
def _add_u32(base, draws):
    return base + draws


class CapturedProgram:
    """One captured region as one jitted program, with where its inputs come from and where its
    outputs go."""

    def __init__(self, executor: CaptureExecutor, outputs: list):
        graph = executor.graph
        self.ops = len(graph.nodes)
        self.outputs = [ref for ref, _, _, _ in outputs]
        refs = [value for _, value, _, _ in outputs]
        nodes = fused._needed_nodes(graph, {r[1] for r in refs if r[0] == "v"})
        used = {r[1] for n in nodes for r in graph.nodes[n][1] if r[0] == "in"} | \
            {r[1] for r in refs if r[0] == "in"}
        # Python numbers are constants of the program (a number argument costs a conversion per
        # call); arrays are arguments: storages' (read at each replay), the rest fixed
        self.dynamic = [p for p, v in enumerate(graph.inputs)
                        if p in used and (p in executor.sources or not _is_number(v))]
        written = {id(ref()) for ref in self.outputs}
        self.fixed = []  # the arguments that stay (arrays made in the region from host values)
        self.plan = []  # storages read: (argument slot, storage id, weakref, shape, dtype, donate)
        self.draws = []  # random streams' values: (argument slot, stream key, part)
        for slot, p in enumerate(self.dynamic):
            source = executor.sources.get(p)
            self.fixed.append(None if source is not None else graph.inputs[p])
            if source is None:
                continue
            if source[0] == "rng":
                self.draws.append((slot, source[1], source[2]))
                continue
            ref, before, _ = executor.storages[source[1]]
            # a storage the program reads and then overwrites: XLA may update its buffer in place
            self.plan.append((slot, source[1], ref, before.shape, before.dtype, source[1] in written))
        # Static outputs of another capture that this one reads (a graphed forward's activations,
        # read by its backward) live as long as this program, as a CUDA graph's pool memory does.
        self.held = executor.held
        self.streams = {key: stream[3] for key, stream in executor.streams.items()}
        self.optimizers = [(weakref.ref(opt), settings, _param_storages(opt)) for opt, settings in executor.optimizers]
        body = _program([(n, graph.nodes[n]) for n in nodes], refs, self.dynamic, graph.inputs)
        self.program = jax.jit(body, donate_argnums=tuple(entry[0] for entry in self.plan if entry[5]))
        self.shared = jax.jit(body)  # for a replay where a buffer to donate is also held elsewhere
        self.compiled = False

    def arguments(self) -> tuple[list, bool, set]:
        """The program's arguments now, whether the buffers to donate are held by nothing else
        (their storage alone: a tensor the user keeps from an earlier replay holds its own), and
        their ids."""
        args = list(self.fixed)
        bases = {}
        for key, draws in self.streams.items():
            index, generator = key
            bases[key] = rng.split(*rng.reserve(index, generator, draws))
        for slot, key, part in self.draws:
            args[slot] = bases[key][part]
        sole, seen = True, set()
        for slot, key, ref, shape, dtype, donate in self.plan:
            array = bridge.array_of(ref())
            if array.__class__ is not ArrayImpl or array.shape != shape or array.dtype != dtype:
                array = self._storage_array(ref, shape, dtype)
            if donate:
                sole = sole and sys.getrefcount(array) <= bridge.SOLE_OWNER_REFS and id(array) not in seen
                seen.add(id(array))
            args[slot] = array
        return args, sole, seen

    @staticmethod
    def _storage_array(ref, shape, dtype):
        """A storage's array when it is not simply there: pending, read in another shape, freed."""
        storage = ref()
        if storage is None:
            raise RuntimeError("tpu graph replay: a tensor the captured region reads has been freed; keep "
                               "the static inputs, parameters and optimizer state alive, or capture again")
        array = bridge.array_of(storage)
        if isinstance(array, bridge.Lazy):
            array = array.materialize()
        if array is not None and array.shape != shape and array.size == _size(shape) and array.dtype == dtype:
            array = bridge._reshape(shape)(array)  # the same bytes, read in another shape since
            bridge.set_array(storage, array)
        if array is None or array.shape != shape or array.dtype != dtype:
            raise RuntimeError(f"tpu graph replay: a tensor the captured region reads changed size or type "
                               f"since the capture (it held {dtype}{list(shape)}); capture again")
        return array

    def stale(self) -> str | None:
        """Why replaying would no longer compute what the region did, or None: an optimizer stepped
        in it has a changed hyperparameter (a Python number is a constant of the program) or other
        parameters than at the capture."""
        for ref, settings, storages in self.optimizers:
            optimizer = ref()
            if optimizer is None:
                continue
            name = type(optimizer).__name__
            now = hyperparameters(optimizer)
            if now != settings:
                return f"{name} {_changed(settings, now)}"
            if _param_storages(optimizer) != storages:
                return f"{name}'s parameters are other tensors than at the capture (replaced, or .data reassigned)"
        return None

    def feed_slot(self, storage) -> tuple | None:
        """(argument slot, shape, dtype) where the program reads ``storage`` without overwriting
        it: a caller may pass another array of that shape there (``replay(feeds)``) rather than
        copy it into the storage first; None if the program does not only read it."""
        for slot, key, ref, shape, dtype, donate in self.plan:
            if ref() is storage and not donate:
                return slot, shape, dtype
        return None

    def replay(self, feeds=()) -> None:
        """Run the program on the inputs' current arrays (and ``feeds``: (slot, array) pairs from
        ``feed_slot``); write its outputs into their storages."""
        modes.flush("graph_replay")
        args, sole, donated = self.arguments()
        for slot, array in feeds:
            args[slot] = array
            sole = sole and id(array) not in donated  # (a buffer given twice cannot be donated)
        start = time.perf_counter()
        try:
            results = (self.program if sole else self.shared)(*args)
        except jax.errors.JaxRuntimeError as exc:
            raise errors.device_error(exc, None, f"a captured graph of {self.ops} ops") from exc
        if not self.compiled:
            self.compiled = True
            metrics.count_compile("captured_graph", time.perf_counter() - start, cache_hit=False)
        for ref, value in zip(self.outputs, results):
            storage = ref()
            if storage is not None:
                bridge.set_array(storage, value)


def _size(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _is_number(value) -> bool:
    return isinstance(value, (bool, int, float, complex, np.generic))


def _program(nodes: list, outputs: list, dynamic: list, inputs: list):
    slot_of = {p: slot for slot, p in enumerate(dynamic)}
    constants = {p: v for p, v in enumerate(inputs) if p not in slot_of and _is_number(v)}

    def program(*args):
        def value(ref, env):
            if ref[0] == "in":
                p = ref[1]
                return args[slot_of[p]] if p in slot_of else constants[p]
            return env[(ref[1], ref[2])]

        env: dict = {}
        for n, (fn, refs, _) in nodes:
            out = fn(*[value(r, env) for r in refs])
            for i, v in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
                env[(n, i)] = v
        return [value(r, env) for r in outputs]

    return program


# ---------------------------------------------------------------- begin / end

class Capture:
    """One capture in progress in the current context (``begin`` ... ``end``)."""

    def __init__(self, auto_capturable: bool = False):
        modes.flush("capture")  # what the context recorded before runs first, outside the program
        self.executor = CaptureExecutor()
        self.executor.auto_capturable = auto_capturable
        self._token = execution.enter(Execution(modes.EagerMode.DEFER_AND_FUSE, self.executor))
        _capturing(+1)

    def _leave(self) -> None:
        _capturing(-1)
        execution.leave(self._token)

    def end(self) -> CapturedProgram:
        try:
            return self.executor.finish()
        finally:
            self._leave()

    def abort(self) -> None:
        try:
            self.executor.restore()
        finally:
            self._leave()


def capturing() -> CaptureExecutor | None:
    """The current context's capture recorder, if it is capturing."""
    executor = current().executor
    return executor if executor is not None and executor.captures else None


def _capturing(delta: int) -> None:
    bridge.capturing += delta
    rng.capture_draw = _draw if bridge.capturing else None


def _draw(index: int, generator):
    executor = capturing()
    return executor.draw(index, generator) if executor is not None else None


# ---------------------------------------------------------------- optimizers in a capture

def hyperparameters(optimizer) -> list[dict]:
    """An optimizer's settings that a captured program holds as constants (tensors are inputs)."""
    return [{k: v for k, v in group.items() if k != "params" and not isinstance(v, torch.Tensor)}
            for group in optimizer.param_groups]


def _param_storages(optimizer) -> list:
    return [id(p.untyped_storage()) for group in optimizer.param_groups for p in group["params"]]


def _changed(before: list[dict], now: list[dict]) -> str:
    for i, (old, new) in enumerate(zip(before, now)):
        for k in sorted(set(old) | set(new), key=str):
            if old.get(k) != new.get(k):
                return f"param_groups[{i}][{k!r}] changed from {old.get(k)!r} to {new.get(k)!r} since the capture"
    return "param_groups changed since the capture"


def _before_step(optimizer, args, kwargs) -> None:
    executor = capturing()
    if executor is None:
        return
    name = type(optimizer).__name__
    for group in optimizer.param_groups:
        if group.get("capturable") is False and not group.get("fused"):
            if executor.auto_capturable:
                make_capturable(optimizer)
                break
            raise CaptureError(
                f"tpu graph capture: {name}.step() with capturable=False keeps its step count on the "
                f"host, so every replay would reuse the captured step's bias corrections. Construct it "
                f"with capturable=True (torch.tpu.compile_step switches it on itself).")
    stateless = {id(p) for group in optimizer.param_groups for p in group["params"] if not optimizer.state.get(p)}
    executor.optimizers.append((optimizer, hyperparameters(optimizer)))
    executor.stateless[id(optimizer)] = stateless


def make_capturable(optimizer) -> None:
    """Keep ``optimizer``'s step counts on the device (``capturable=True``), so that a captured
    step advances them; Adam's and AdamW's learning rate becomes a device tensor, which LR
    schedulers update in place (``fill_``) and a replay reads, so a schedule needs no new capture."""
    tensor_lr = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
    for group in optimizer.param_groups:
        if group.get("capturable") is False and not group.get("fused"):
            group["capturable"] = True
            for p in group["params"]:
                state = optimizer.state.get(p)
                step = state.get("step") if state else None
                if isinstance(step, torch.Tensor) and step.device != p.device:
                    state["step"] = step.to(p.device)
            if tensor_lr and not isinstance(group["lr"], torch.Tensor) and group["params"]:
                group["lr"] = torch.tensor(group["lr"], dtype=torch.float32, device=group["params"][0].device)


def _after_step(optimizer, args, kwargs) -> None:
    executor = capturing()
    if executor is None:
        return
    stateless = executor.stateless.pop(id(optimizer), set())
    if any(optimizer.state.get(p) for group in optimizer.param_groups for p in group["params"] if id(p) in stateless):
        raise CaptureError(
            f"tpu graph capture: {type(optimizer).__name__}.step() created its state (step counts, "
            f"momentum buffers) inside the captured region, so every replay would start it afresh. Run "
            f"the step once before capturing (a warm-up, as CUDA graphs also require).")


_hooks = (register_optimizer_step_pre_hook(_before_step), register_optimizer_step_post_hook(_after_step))
