"""Synchronisation, streams and events, shaped like ``torch.cuda``'s.

XLA runs a device's work in order on one stream, so a ``Stream`` is that order and ``Event``
marks a point in it. Work the layers above hold back (the fused eager mode's pending program)
must run before a wait means anything: they register it with ``before_synchronize``.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import torch

from torchtpu.runtime import memory, platform, state

_before_synchronize: list[Callable[[], None]] = []


def before_synchronize(callback: Callable[[], None]) -> None:
    """Run ``callback`` (e.g. pending deferred work) at the start of every ``synchronize``."""
    _before_synchronize.append(callback)


def synchronize(device: Any = None) -> None:
    """Wait until all work queued on the device (or on all devices) has finished: a program that
    does nothing, launched on each device, has run (XLA runs a device's programs in launch order,
    so this covers work whose outputs were freed already, which no array is left to wait on), and
    every live array is ready (transfers too)."""
    state.start()
    for callback in _before_synchronize:
        callback()
    index = None if device is None else state.device_index(device)
    target = None if index is None else platform.jax_device(index)
    for each in [target] if target is not None else [platform.jax_device(i) for i in range(platform.device_count())]:
        _barrier(each)().block_until_ready()
    arrays = jax.live_arrays(platform.platform())
    if target is not None and platform.device_count() > 1:
        arrays = [a for a in arrays if target in a.devices()]
    try:
        jax.block_until_ready(arrays)  # one batched wait
    except RuntimeError:  # an array was deleted (donated) while we looked: wait one by one
        for array in arrays:
            try:
                array.block_until_ready()
            except RuntimeError:
                continue
    memory.record_peak()


@functools.lru_cache(maxsize=None)  # (keyed by jax's device object: a restarted runtime has new ones)
def _barrier(device) -> Callable[[], jax.Array]:
    """A program with no inputs and one byte of output, placed on ``device``."""
    return jax.jit(lambda: jnp.zeros((), jnp.int8), out_shardings=jax.sharding.SingleDeviceSharding(device))


class Stream(torch.Stream):
    """The device's one in-order stream, a ``torch.Stream`` (so ``Tensor.record_stream`` and
    ``torch.accelerator`` take it): ``wait_stream`` and ``wait_event`` are no-ops because ordering
    already holds; ``synchronize`` waits for everything queued on the device."""

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs):
        return super().__new__(cls, device=torch.device("tpu", state.device_index(device)), priority=priority)

    def __init__(self, device: Any = None, priority: int = 0, **kwargs):
        self._priority = priority  # (torch.Stream.__new__ made the stream)

    @property
    def priority(self) -> int:
        return self._priority

    def synchronize(self) -> None:
        synchronize(self.device)

    def query(self) -> bool:
        synchronize(self.device)
        return True

    def wait_stream(self, stream: "Stream") -> None:
        pass

    def wait_event(self, event: "Event") -> None:
        pass

    def record_event(self, event: "Event | None" = None) -> "Event":
        event = event or Event()
        event.record(self)
        return event

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Event:
    """Marks a point in a device's (single, in-order) stream; ``synchronize`` waits for it."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing
        self._time: float | None = None
        self._device: torch.device | None = None

    def record(self, stream: Stream | None = None) -> None:
        self._device = (stream or current_stream()).device
        if self.enable_timing:
            synchronize(self._device)
        self._time = time.perf_counter()

    def synchronize(self) -> None:
        if self._device is not None:
            synchronize(self._device)

    def query(self) -> bool:
        self.synchronize()
        return True

    def wait(self, stream: Stream | None = None) -> None:
        pass

    def elapsed_time(self, end: "Event") -> float:
        """Milliseconds between this event and ``end`` (both recorded with enable_timing=True)."""
        if not (self.enable_timing and end.enable_timing) or self._time is None or end._time is None:
            raise RuntimeError("Both events must be recorded with enable_timing=True to measure elapsed time")
        return (end._time - self._time) * 1000.0


def current_stream(device: Any = None) -> Stream:
    return Stream(device)


def default_stream(device: Any = None) -> Stream:
    return Stream(device)


@contextlib.contextmanager
def stream(s: Stream | None) -> Iterator[None]:
    yield


class StreamContext:
    """``torch.cuda.StreamContext``: run a block on ``stream``. Work on a device runs in one order
    already, so there is nothing to switch; libraries written for CUDA (SGLang's scheduler)
    enter it all the same."""

    def __init__(self, stream: Stream | None):
        self.stream = stream

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: Any) -> None:
        return None
