"""Eager execution modes: how a registered op runs when it is called."""

from __future__ import annotations

import contextlib
import enum
from typing import Iterator

import jax

from torchtpu.config import config
from torchtpu.runtime import errors


class EagerMode(enum.Enum):
    """How eager ``tpu`` ops execute (``torch.tpu.eager_mode``)."""

    DEFER_NEVER = "defer_never"
    """Each op is dispatched at once and runs asynchronously (the default)."""
    DEFER_NEVER_AND_LAUNCH_BLOCKING = "defer_never_and_launch_blocking"
    """Each op is dispatched at once and waited for, so errors surface at the op that caused them."""
    DEFER_AND_FUSE = "defer_and_fuse"
    """Ops are recorded and run as one fused XLA program when a value is needed."""


def _initial_mode() -> EagerMode:
    if config.defer_and_fuse:
        return EagerMode.DEFER_AND_FUSE
    if config.launch_blocking:
        return EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
    return EagerMode.DEFER_NEVER


_mode = _initial_mode()


def get_mode() -> EagerMode:
    return _mode


def set_mode(mode: EagerMode | str) -> None:
    """Switch the eager mode; pending deferred work runs first."""
    global _mode
    mode = _coerce(mode)
    if mode is EagerMode.DEFER_AND_FUSE:
        _require_fused()
    if _mode is EagerMode.DEFER_AND_FUSE and mode is not EagerMode.DEFER_AND_FUSE:
        fused_executor.leave()
    elif mode is EagerMode.DEFER_AND_FUSE and _mode is not EagerMode.DEFER_AND_FUSE:
        fused_executor.enter()
    _mode = mode


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
    """Run a block in ``mode``, then restore the previous one."""
    previous = _mode
    set_mode(mode)
    try:
        yield
    finally:
        set_mode(previous)


# The fused mode installs its executor here (eager/fused.py); None while it is unavailable.
fused_executor = None


def _require_fused() -> None:
    if fused_executor is None:
        raise NotImplementedError("EagerMode.DEFER_AND_FUSE is not available in this build of torchtpu")


def flush(reason: str, wanted=()) -> None:
    """Run any pending deferred work (a no-op outside DEFER_AND_FUSE); what ``wanted`` (deferred
    values about to be read) needs runs first, the rest without the caller waiting for it."""
    if fused_executor is not None:
        fused_executor.flush(reason, wanted)


def install_fused(executor) -> None:
    """Plug in the DEFER_AND_FUSE executor; start recording if that is the initial mode."""
    global fused_executor
    fused_executor = executor
    if _mode is EagerMode.DEFER_AND_FUSE:
        executor.enter()


def execute(kernel, fn, dyn, device_index: int | None = None):
    """Run one op's jitted program ``fn`` on ``dyn`` in the current mode."""
    try:
        if _mode is EagerMode.DEFER_NEVER or not kernel.lowering.jit:
            return fn(*dyn)
        if _mode is EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING:
            return jax.block_until_ready(fn(*dyn))
        return fused_executor.record(kernel, fn, dyn)
    except jax.errors.JaxRuntimeError as exc:
        if errors.is_out_of_memory(exc):
            raise errors.out_of_memory(exc, device_index, kernel.name) from None
        # name the op that failed, as CUDA_LAUNCH_BLOCKING users expect
        raise RuntimeError(f"tpu: {kernel.name} failed: {exc}") from exc
