"""How eager work runs in the current thread or asyncio task: ``current()``, read in one place.

An ``Execution`` says how jitted calls run: its ``mode`` (an ``EagerMode``, ``eager/modes.py``)
and its ``executor``: None to run each call at once, else the DEFER_AND_FUSE executor that
records it (``executor.call(fn, *args)``) and runs it later (``executor.flush(reason, wanted)``).

A context's own ``Execution`` (set by ``with torch.tpu.set_eager_mode(...)``) lives in a
``ContextVar``, so every thread, and every asyncio task, has its own; a context without one uses
the process default (``torch.tpu.eager_mode = ...``). Nothing here imports JAX.

Autograd runs a backward pass on its own device threads, not on the thread that called
``backward()``. PyTorch hands those threads the caller's contextvars (``_engine_run_backward``
stashes ``contextvars.copy_context()`` in the thread-local state it propagates, under
``"context"``), so a backward runs in its caller's mode, and records into its caller's executor.
"""

from __future__ import annotations

import contextvars

from torchtpu.runtime.compat import AUTOGRAD_CALLER_KEY as _CALLER
from torchtpu.runtime.compat import get_obj_in_tls as _get_obj_in_tls, is_key_in_tls as _is_key_in_tls


class Execution:
    """How a context runs jitted calls: ``mode`` and ``executor`` (None: at once). ``stale``: set
    on a context's copy of a process default that has changed since (``follow``)."""

    __slots__ = ("mode", "executor", "stale", "__weakref__")

    def __init__(self, mode, executor=None):
        self.mode = mode
        self.executor = executor
        self.stale = False

    def __repr__(self) -> str:
        return f"Execution({getattr(self.mode, 'name', self.mode)}, executor={self.executor!r})"


_override: contextvars.ContextVar[Execution] = contextvars.ContextVar("torchtpu_execution")
_default = Execution(None)  # replaced by eager/modes.py at import with the configured mode


def current() -> Execution:
    """The current context's ``Execution``: its own, else (in an autograd thread running a
    backward pass) its caller's, else the process default. The hot path: one ContextVar read, and
    one thread-local key check in a context without its own."""
    execution = _override.get(None)
    if execution is not None and not execution.stale:
        return execution
    if _is_key_in_tls(_CALLER):
        caller = _get_obj_in_tls(_CALLER)
        execution = caller.get(_override) if caller is not None else None
        if execution is not None and not execution.stale:
            return execution
    return _default


def caller_context() -> contextvars.Context | None:
    """In an autograd thread running a backward pass: the contextvars of the thread that called
    ``backward()``; else None."""
    return _get_obj_in_tls(_CALLER) if _is_key_in_tls(_CALLER) else None


def default() -> Execution:
    return _default


def set_default(execution: Execution) -> None:
    """Make ``execution`` the process default (for every context without its own)."""
    global _default
    _default = execution


def follow(execution: Execution) -> None:
    """Let the current context keep ``execution``, its own copy of the process default (with its
    own executor), so ``current()`` finds it in one read; whoever changes the default marks it
    ``stale`` and the context falls back to the default again."""
    _override.set(execution)


def enter(execution: Execution) -> contextvars.Token:
    """Give the current context its own ``execution``; ``leave(token)`` restores the previous one."""
    return _override.set(execution)


def leave(token: contextvars.Token) -> None:
    _override.reset(token)
