"""Eager execution modes: how a registered op runs when it is called.

The mode is per context (thread or asyncio task; ``runtime/execution.py`` holds it): a context
in ``with eager_mode(...)`` has its own, every other context uses the process default that
``set_mode`` (``torch.tpu.eager_mode = ...``) sets. Each context in DEFER_AND_FUSE records into
an executor of its own, so threads in different modes run side by side, each with its own
semantics. ``execute`` is the one place an eager op runs (eager and foreach kernels alike).
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import threading
import weakref
from typing import Iterator

import jax
from jax.profiler import TraceAnnotation

from torchtpu.config import config
from torchtpu.device.bridge import Lazy
from torchtpu.runtime import errors, execution, state
from torchtpu.runtime.execution import Execution, current


class EagerMode(enum.Enum):
    """How eager ``tpu`` ops execute (``torch.tpu.eager_mode``)."""

    DEFER_NEVER = "defer_never"
    """Each op is dispatched at once and runs asynchronously (the default)."""
    DEFER_NEVER_AND_LAUNCH_BLOCKING = "defer_never_and_launch_blocking"
    """Each op is dispatched at once and waited for, so errors surface at the op that caused them."""
    DEFER_AND_FUSE = "defer_and_fuse"
    """Ops are recorded and run as one fused XLA program when a value is needed."""


_NEVER = EagerMode.DEFER_NEVER
_BLOCKING = EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
_FUSE = EagerMode.DEFER_AND_FUSE
_AT_ONCE = {_NEVER: Execution(_NEVER), _BLOCKING: Execution(_BLOCKING)}  # no executor: shared

# The DEFER_AND_FUSE executor class, plugged in by eager/fused.py; None while it is unavailable.
_new_executor = None
# The executor of a context that follows a DEFER_AND_FUSE process default, made on its first use.
_context_executor: contextvars.ContextVar = contextvars.ContextVar("torchtpu_default_executor")
_default_executors: "weakref.WeakSet" = weakref.WeakSet()  # all of those, flushed when the default changes
_followers: "weakref.WeakSet" = weakref.WeakSet()  # contexts' copies of the fused default, made stale by a change
_default_lock = threading.Lock()


class _FusedDefault(Execution):
    """The process default when it is DEFER_AND_FUSE: each context that follows it records into an
    executor of its own. The first use in a context makes that executor and gives the context a
    copy of this default holding it (``execution.follow``), so later reads take one ContextVar read;
    changing the default marks the copies stale."""

    __slots__ = ()

    def __init__(self):
        self.mode = _FUSE
        self.stale = False

    @property
    def executor(self):
        caller = execution.caller_context()
        if caller is not None:  # an autograd thread, for a caller without its copy: the caller's executor
            executor = caller.get(_context_executor)
            if executor is not None:
                return executor
        executor = _context_executor.get(None)
        if executor is None:
            _require_fused()
            executor = _new_executor()
            _context_executor.set(executor)
            with _default_lock:
                _default_executors.add(executor)
        if caller is None:  # (an autograd thread keeps no copy: its current() must reach its callers')
            copy = Execution(_FUSE, executor)
            with _default_lock:
                if execution.default() is self:  # not changed meanwhile
                    _followers.add(copy)
                    execution.follow(copy)
        return executor


def _initial_mode() -> EagerMode:
    if config.defer_and_fuse:
        return _FUSE
    if config.launch_blocking:
        return _BLOCKING
    return _NEVER


def _default_for(mode: EagerMode) -> Execution:
    return _FusedDefault() if mode is _FUSE else _AT_ONCE[mode]


execution.set_default(_default_for(_initial_mode()))


def get_mode() -> EagerMode:
    """The current context's eager mode (its own, else the process default)."""
    return current().mode


def set_mode(mode: EagerMode | str) -> None:
    """Set the process default eager mode, used by every context (thread) without its own
    (``eager_mode``). Leaving DEFER_AND_FUSE runs what the contexts that followed it have pending."""
    mode = _coerce(mode)
    if mode is _FUSE:
        _require_fused()
    with _default_lock:
        previous = execution.default().mode
        if previous is mode:
            return
        execution.set_default(_default_for(mode))
        pending = []
        if previous is _FUSE:
            for copy in _followers:
                copy.stale = True
            _followers.clear()
            pending = list(_default_executors)
    for executor in pending:
        executor.flush("mode_change")


def _coerce(mode) -> EagerMode:
    if isinstance(mode, EagerMode):
        return mode
    if isinstance(mode, str):
        for m in EagerMode:
            if mode.lower() in (m.value, m.name.lower()):
                return m
    raise ValueError(f"unknown eager mode {mode!r}; expected one of: {', '.join(m.name for m in EagerMode)}")


@contextlib.contextmanager
def eager_mode(mode: EagerMode | str) -> Iterator[None]:
    """Run a block in ``mode`` in the current context only (this thread or asyncio task), then
    restore the previous one. Changing mode runs the pending deferred work of the mode left."""
    mode = _coerce(mode)
    if mode is _FUSE:
        _require_fused()
    outer = current()
    outer_executor = outer.executor if outer.mode is _FUSE else None
    if mode is _FUSE:  # a block nested in DEFER_AND_FUSE keeps recording into the same graph
        inner = Execution(_FUSE, outer_executor or _new_executor())
    else:
        inner = _AT_ONCE[mode]
        if outer_executor is not None:
            outer_executor.flush("mode_change")
    token = execution.enter(inner)
    try:
        yield
    finally:
        execution.leave(token)
        if inner.executor is not None and inner.executor is not outer_executor:
            inner.executor.flush("mode_change")


def _require_fused() -> None:
    if _new_executor is None:
        state.start()  # the runtime's start installs the eager kernels and this mode's executor
    if _new_executor is None:
        raise NotImplementedError("EagerMode.DEFER_AND_FUSE is not available in this build of torchtpu")


def deferring() -> bool:
    """Whether the current context records ops (DEFER_AND_FUSE) rather than running them."""
    return current().executor is not None


def flush(reason: str, wanted=()) -> None:
    """Run the current context's pending deferred work (a no-op outside DEFER_AND_FUSE); what
    ``wanted`` (deferred values about to be read) needs runs first, the rest without the caller
    waiting for it."""
    executor = current().executor
    if executor is not None:
        executor.flush(reason, wanted)


def install_fused(executor_class) -> None:
    """Plug in the DEFER_AND_FUSE executor class (one instance per context that records)."""
    global _new_executor
    _new_executor = executor_class


tracing = False
"""True while ``torchtpu.profiler.trace`` records: each op then runs inside a span named after it."""


def execute(kernel, fn, dyn, device_index: int | None = None):
    """Run one op's jitted program ``fn`` on ``dyn`` in the current context's mode."""
    span = TraceAnnotation("dispatch " + kernel.name) if tracing else None
    if span is not None:
        span.__enter__()
    now = current()
    mode = now.mode
    try:
        if mode is not _FUSE or not kernel.lowering.jit:
            for a in dyn:
                if isinstance(a, Lazy):
                    # A deferred argument of an op that runs at once: the process default left
                    # DEFER_AND_FUSE while this op was under way in a context that follows it (its
                    # arguments were read then), or a data-dependent op reads a recorded value.
                    dyn = [a.materialize() if isinstance(a, Lazy) else a for a in dyn]
                    break
            if mode is _BLOCKING and kernel.lowering.jit:
                return jax.block_until_ready(fn(*dyn))
            return fn(*dyn)
        return now.executor.call(fn, *dyn)
    except jax.errors.JaxRuntimeError as exc:
        _op_failed(exc, kernel, device_index)
    finally:
        if span is not None:
            span.__exit__(None, None, None)


def _op_failed(exc, kernel, device_index):
    # name the op that failed, as CUDA_LAUNCH_BLOCKING users expect
    raise errors.device_error(exc, device_index, kernel.name) from exc
