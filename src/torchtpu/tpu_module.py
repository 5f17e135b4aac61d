"""``torch.tpu``: the device module, shaped like ``torch.cuda``.

It re-exports what the layers own: device state, random numbers, memory, streams (``runtime/``),
the eager mode and the CPU-fallback switch (``eager/``), the compiler, debug and profiler tools.
Importing it imports no JAX and starts nothing, because ``import torch`` builds it: the names
whose home needs JAX are imported on first access (``_LAZY``), and the functions that need
devices start the runtime when called.
"""

from __future__ import annotations

import importlib
import types
from typing import Any

import torch

from torchtpu.runtime import compat, rng, state

# name -> (module, attribute; None for the module itself), imported on first access
_LAZY: dict[str, tuple[str, str | None]] = {
    "synchronize": ("torchtpu.runtime.streams", "synchronize"),
    "Stream": ("torchtpu.runtime.streams", "Stream"),
    "Event": ("torchtpu.runtime.streams", "Event"),
    "current_stream": ("torchtpu.runtime.streams", "current_stream"),
    "default_stream": ("torchtpu.runtime.streams", "default_stream"),
    "stream": ("torchtpu.runtime.streams", "stream"),
    "StreamContext": ("torchtpu.runtime.streams", "StreamContext"),
    "DeviceProperties": ("torchtpu.runtime.platform", "DeviceProperties"),
    "EagerMode": ("torchtpu.eager.modes", "EagerMode"),
    "set_eager_mode": ("torchtpu.eager.modes", "eager_mode"),
    "enable_cpu_fallback": ("torchtpu.eager.fallback", "enable_cpu_fallback"),
    "is_cpu_fallback_enabled": ("torchtpu.eager.fallback", "is_cpu_fallback_enabled"),
    "cpu_fallback_enabled": ("torchtpu.eager.fallback", "cpu_fallback_enabled"),
    "compiler": ("torchtpu.compile", "compiler"),
    "debug": ("torchtpu.debug", None),
    "profiler": ("torchtpu.profiler", None),
    "memory_summary": ("torchtpu.memory", "memory_summary"),
    "matmul_precision": ("torchtpu.ops.precision", "scope"),
    "jax_op": ("torchtpu.jax_ops", "jax_op"),
    "graph": ("torchtpu.graphs", "graph"),
    "TPUGraph": ("torchtpu.graphs", "TPUGraph"),
    "make_graphed_callables": ("torchtpu.graphs", "make_graphed_callables"),
    "compile_step": ("torchtpu.graphs", "compile_step"),
}


# ---------------------------------------------------------------- devices

is_available = state.is_available
device_count = state.device_count
current_device = state.current_device
set_device = state.set_device
is_initialized = state.started
_is_in_bad_fork = state.in_bad_fork


def _lazy_init() -> None:
    """torch calls this at a first ``tpu`` tensor factory (``device_lazy_init``). torch 2.11 counts
    the device as initialised only once it exists, and until then its
    ``torch.accelerator.synchronize()`` returns at once. Nothing to do: the runtime starts itself."""


def init() -> None:
    """Start the runtime now rather than at first use."""
    state.start()


class device:
    """Context manager that changes the current ``tpu`` device."""

    def __init__(self, device: Any):
        self.index = -1 if device is None or device == -1 else state.device_index(device)
        self.previous = -1

    def __enter__(self):
        self.previous = state.current_device()
        if self.index >= 0:
            state.set_device(self.index)
        return self

    def __exit__(self, *exc):
        state.set_device(self.previous)
        return False


def get_device_name(device: Any = None) -> str:
    from torchtpu.runtime import platform

    return platform.device_name(state.device_index(device))


def get_device_capability(device: Any = None) -> tuple[int, int]:
    return (0, 0)


def get_device_properties(device: Any = None):
    from torchtpu.runtime import platform

    return platform.device_properties(state.device_index(device))


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.bfloat16, torch.float16]


# ---------------------------------------------------------------- random numbers

# Host-side generator state, not aten ops: an AOT graph would drop a call traced into one, and
# dynamo tracing one under freeze_rng_state's no_dispatch (OpInfo's wrapper_set_seed) failed to
# fake the state tensor. Dynamo graph-breaks on torch.cuda's (trace_rules) and on
# torch.manual_seed (torch._disable_dynamo); ours take the latter: they run eagerly, in order.
# Its cost: the first call imports torch._dynamo (2 s) if nothing has yet, as torch.manual_seed's does.
_host_side = compat.disable_dynamo


@_host_side
def manual_seed(seed: int) -> None:
    rng.manual_seed(seed, state.current_device())


@_host_side
def manual_seed_all(seed: int) -> None:
    rng.manual_seed_all(seed)


@_host_side
def seed() -> int:
    return rng.seed(state.current_device())


@_host_side
def seed_all() -> None:
    rng.manual_seed_all(rng.seed(0))


@_host_side
def initial_seed() -> int:
    return rng.initial_seed(state.current_device())


@_host_side
def get_rng_state(device: Any = "tpu") -> torch.Tensor:
    return rng.get_state(state.device_index(device))


@_host_side
def set_rng_state(new_state: torch.Tensor, device: Any = "tpu") -> None:
    rng.set_state(new_state, state.device_index(device))


@_host_side
def get_rng_state_all() -> list[torch.Tensor]:
    return [rng.get_state(i) for i in range(state.device_count())]


@_host_side
def set_rng_state_all(states) -> None:
    for i, s in enumerate(states):
        rng.set_state(s, i)


# ---------------------------------------------------------------- memory

def memory_stats(device: Any = None) -> dict[str, int]:
    """Allocator statistics: from PJRT where the platform reports them, else torchtpu's own
    accounting of live device buffers (``source`` says which)."""
    from torchtpu.runtime import memory

    return memory.memory_stats(state.device_index(device))


def memory_allocated(device: Any = None) -> int:
    return memory_stats(device)["allocated_bytes.all.current"]


def max_memory_allocated(device: Any = None) -> int:
    return memory_stats(device)["allocated_bytes.all.peak"]


def max_memory_reserved(device: Any = None) -> int:
    return memory_stats(device)["reserved_bytes.all.peak"]


def reset_peak_memory_stats(device: Any = None) -> None:
    from torchtpu.runtime import memory

    memory.reset_peak(state.device_index(device))


def memory_reserved(device: Any = None) -> int:
    from torchtpu.runtime import memory

    return memory.memory_reserved(state.device_index(device))


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes of the device, as ``torch.cuda.mem_get_info``. Where PJRT reports a
    limit (GPU, TPU): the memory XLA may use and what of it is not in use. On XLA:CPU the device's
    memory is the host's: total is the host memory this process may use (physical memory, or its
    cgroup's limit if lower), free is that less the bytes of live tpu tensors (not the host's free
    memory)."""
    from torchtpu.runtime import memory

    return memory.mem_get_info(state.check_index(state.device_index(device)))


def empty_cache() -> None:
    """Free device buffers that no tensor uses (XLA frees buffers as tensors die)."""
    from torchtpu.runtime import memory

    memory.empty_cache()


# ---------------------------------------------------------------- the module object

class _TpuModule(types.ModuleType):
    """``torch.tpu``: a module with an ``eager_mode`` property and lazily imported names."""

    @property
    def eager_mode(self):
        from torchtpu.eager import modes

        return modes.get_mode()

    @eager_mode.setter
    def eager_mode(self, mode) -> None:
        from torchtpu.eager import modes

        modes.set_mode(mode)

    def __getattr__(self, name: str):
        try:
            module_name, attribute = _LAZY[name]
        except KeyError:
            raise AttributeError(f"module 'torch.tpu' has no attribute {name!r}") from None
        value = importlib.import_module(module_name)
        if attribute is not None:
            value = getattr(value, attribute)
        setattr(self, name, value)
        return value

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(_LAZY))


_PUBLIC = [
    "is_available", "is_initialized", "init", "device_count", "current_device", "set_device", "device",
    "manual_seed", "manual_seed_all", "seed", "seed_all", "initial_seed", "get_rng_state", "set_rng_state",
    "get_rng_state_all", "set_rng_state_all", "get_device_name", "get_device_capability",
    "get_device_properties", "memory_stats", "memory_allocated", "max_memory_allocated",
    "reset_peak_memory_stats", "memory_reserved", "max_memory_reserved", "mem_get_info", "empty_cache", "get_amp_supported_dtype",
    "_is_in_bad_fork", "_lazy_init",
]


def build() -> _TpuModule:
    """The ``torch.tpu`` module object."""
    module = _TpuModule("torch.tpu", __doc__)
    for name in _PUBLIC:
        setattr(module, name, globals()[name])
    module.__all__ = [n for n in _PUBLIC if not n.startswith("_")] + sorted(_LAZY)
    return module
