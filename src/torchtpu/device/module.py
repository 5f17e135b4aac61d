"""``torch.tpu``: the device module, shaped like ``torch.cuda``."""

from __future__ import annotations

import contextlib
import threading
import types
from dataclasses import dataclass
from typing import Any, Iterator

import jax
import torch

from torchtpu.eager import fallback as _fallback
from torchtpu.eager import modes as _modes
from torchtpu.runtime import platform, rng

EagerMode = _modes.EagerMode
enable_cpu_fallback = _fallback.enable_cpu_fallback
is_cpu_fallback_enabled = _fallback.is_cpu_fallback_enabled
cpu_fallback_enabled = _fallback.cpu_fallback_enabled
set_eager_mode = _modes.eager_mode

_local = threading.local()
_initialized = False
_peak: dict[int, int] = {}


def _init() -> None:
    global _initialized
    if not _initialized:
        platform.devices()
        _initialized = True


def is_available() -> bool:
    """True when at least one PJRT device is usable."""
    try:
        return platform.device_count() > 0
    except RuntimeError:
        return False


def is_initialized() -> bool:
    return _initialized


def device_count() -> int:
    return platform.device_count()


def current_device() -> int:
    return getattr(_local, "index", 0)


def _index(device: Any) -> int:
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "tpu":
        raise ValueError(f"Expected a tpu device, but got: {device}")
    return current_device() if device.index is None else device.index


def set_device(device: Any) -> None:
    index = _index(device)
    platform.jax_device(index)  # validates
    _local.index = index


class device:
    """Context manager that changes the current ``tpu`` device."""

    def __init__(self, device: Any):
        self.index = -1 if device is None or device == -1 else _index(device)
        self.previous = -1

    def __enter__(self):
        self.previous = current_device()
        if self.index >= 0:
            set_device(self.index)
        return self

    def __exit__(self, *exc):
        set_device(self.previous)
        return False


def synchronize(device: Any = None) -> None:
    """Wait until all work queued on the device (or all devices) has finished."""
    _modes.flush("synchronize")
    index = None if device is None else _index(device)
    for array in jax.live_arrays(platform.platform()):
        if index is None or _array_device(array) == index:
            array.block_until_ready()
    _record_peak()


def _array_device(array) -> int | None:
    devs = platform.devices()
    try:
        d = next(iter(array.devices()))
    except Exception:
        return None
    return devs.index(d) if d in devs else None


# ---------------------------------------------------------------- random numbers

def manual_seed(seed: int) -> None:
    rng.manual_seed(seed, current_device())


def manual_seed_all(seed: int) -> None:
    rng.manual_seed_all(seed)


def seed() -> int:
    return rng.seed(current_device())


def seed_all() -> None:
    s = rng.seed(0)
    rng.manual_seed_all(s)


def initial_seed() -> int:
    return rng.initial_seed(current_device())


def get_rng_state(device: Any = "tpu") -> torch.Tensor:
    return rng.get_state(_index(device))


def set_rng_state(new_state: torch.Tensor, device: Any = "tpu") -> None:
    rng.set_state(new_state, _index(device))


def get_rng_state_all() -> list[torch.Tensor]:
    return [rng.get_state(i) for i in range(device_count())]


def set_rng_state_all(states) -> None:
    for i, state in enumerate(states):
        rng.set_state(state, i)


# ---------------------------------------------------------------- properties and memory

@dataclass(frozen=True)
class DeviceProperties:
    name: str
    platform: str
    device_kind: str
    index: int
    total_memory: int | None


def get_device_name(device: Any = None) -> str:
    return platform.device_name(_index(device))


def get_device_capability(device: Any = None) -> tuple[int, int]:
    return (0, 0)


def get_device_properties(device: Any = None) -> DeviceProperties:
    index = _index(device)
    dev = platform.jax_device(index)
    stats = _pjrt_stats(index) or {}
    return DeviceProperties(name=platform.device_name(index), platform=dev.platform,
                            device_kind=getattr(dev, "device_kind", dev.platform), index=index,
                            total_memory=stats.get("bytes_limit"))


def _pjrt_stats(index: int) -> dict | None:
    try:
        return platform.jax_device(index).memory_stats()
    except Exception:
        return None


def _live_bytes(index: int) -> tuple[int, int]:
    dev = platform.jax_device(index)
    total = count = 0
    for array in jax.live_arrays(platform.platform()):
        try:
            if dev in array.devices():
                total += array.nbytes
                count += 1
        except Exception:
            continue
    return total, count


def _record_peak() -> None:
    for i in range(device_count()):
        memory_allocated(i)


def memory_stats(device: Any = None) -> dict[str, int]:
    """Allocator statistics: from PJRT where the platform reports them, else torchtpu's own
    accounting of live device buffers (``source`` says which)."""
    index = _index(device)
    stats = _pjrt_stats(index)
    if stats:
        current = int(stats.get("bytes_in_use", 0))
        peak = int(stats.get("peak_bytes_in_use", current))
        _peak[index] = max(_peak.get(index, 0), peak)
        out = {"allocated_bytes.all.current": current, "allocated_bytes.all.peak": _peak[index],
               "num_alloc_retries": 0, "source": "pjrt"}
        for k, v in stats.items():
            out[f"pjrt.{k}"] = v
        return out
    current, count = _live_bytes(index)
    _peak[index] = max(_peak.get(index, 0), current)
    return {"allocated_bytes.all.current": current, "allocated_bytes.all.peak": _peak[index],
            "active.all.current": count, "num_alloc_retries": 0, "source": "live_buffers"}


def memory_allocated(device: Any = None) -> int:
    return memory_stats(device)["allocated_bytes.all.current"]


def max_memory_allocated(device: Any = None) -> int:
    return memory_stats(device)["allocated_bytes.all.peak"]


def reset_peak_memory_stats(device: Any = None) -> None:
    _peak.pop(_index(device), None)


def memory_reserved(device: Any = None) -> int:
    stats = _pjrt_stats(_index(device))
    if stats:
        return int(stats.get("bytes_reserved", stats.get("bytes_in_use", 0)))
    return memory_allocated(device)


def empty_cache() -> None:
    """Free cached device buffers that no tensor uses (XLA frees buffers as tensors die)."""
    import gc

    gc.collect()


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.bfloat16, torch.float16]


def _is_in_bad_fork() -> bool:
    return False


# ---------------------------------------------------------------- streams and events

class Stream:
    """XLA runs a device's work in order on one stream: this stream is that order.

    ``synchronize`` waits for everything queued on the device; ``wait_stream`` and
    ``wait_event`` are no-ops because ordering already holds.
    """

    def __init__(self, device: Any = None, priority: int = 0):
        self.device = torch.device("tpu", _index(device))
        self.priority = priority

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

    def __eq__(self, other) -> bool:
        return isinstance(other, Stream) and other.device == self.device

    def __hash__(self) -> int:
        return hash(("tpu-stream", self.device))


class Event:
    """Marks a point in a device's (single, in-order) stream; ``synchronize`` waits for it."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing
        self._time: float | None = None
        self._device: torch.device | None = None

    def record(self, stream: Stream | None = None) -> None:
        import time

        self._device = (stream or current_stream()).device
        synchronize(self._device) if self.enable_timing else None
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


# ---------------------------------------------------------------- the module object

class _TpuModule(types.ModuleType):
    """``torch.tpu``: a module with an ``eager_mode`` property."""

    @property
    def eager_mode(self) -> EagerMode:
        return _modes.get_mode()

    @eager_mode.setter
    def eager_mode(self, mode) -> None:
        _modes.set_mode(mode)


_PUBLIC = [
    "EagerMode", "enable_cpu_fallback", "is_cpu_fallback_enabled", "cpu_fallback_enabled", "set_eager_mode",
    "is_available",
    "is_initialized", "device_count", "current_device", "set_device", "device", "synchronize",
    "manual_seed", "manual_seed_all", "seed", "seed_all", "initial_seed", "get_rng_state", "set_rng_state",
    "get_rng_state_all", "set_rng_state_all", "DeviceProperties", "get_device_name",
    "get_device_capability", "get_device_properties", "memory_stats", "memory_allocated",
    "max_memory_allocated", "reset_peak_memory_stats", "memory_reserved", "empty_cache",
    "get_amp_supported_dtype", "_is_in_bad_fork", "Stream", "Event", "current_stream",
    "default_stream", "stream",
]


def build() -> _TpuModule:
    """The ``torch.tpu`` module object."""
    module = _TpuModule("torch.tpu", __doc__)
    for name in _PUBLIC:
        setattr(module, name, globals()[name])
    module.__all__ = [n for n in _PUBLIC if not n.startswith("_")]
    _init()
    return module
