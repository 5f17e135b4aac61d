"""What the C++ PrivateUse1 hooks (``csrc/hooks.cpp``) ask of Python: one function per question,
called by name (``runtime/native.register_hooks`` passes this module).

Imported during ``import torch`` (the autoload entry point), so it imports no JAX: what needs the
runtime is imported when a hook is called.
"""

from __future__ import annotations

from torchtpu.runtime import rng, state

is_available = state.is_available
current_device = state.current_device
check_index = state.check_index  # an index past the count the C++ guard holds
rng_state = rng.seed_offset  # a device's default generator: its (seed, offset)
set_rng_state = rng.set_seed_offset


def manual_seed(index: int, seed: int) -> None:
    """A device's default generator's ``manual_seed``: ``torch.tpu.manual_seed`` for that device."""
    rng.manual_seed(seed, index)


def has_primary_context(index: int) -> bool:
    """Whether the runtime has started (it starts every device at once)."""
    return state.started()


def is_initialized() -> bool:
    """Whether the allocator has anything to report: the runtime has started."""
    return state.started()


def allocate(nbytes: int) -> tuple[int, int]:
    """(device index, fake address) for a storage PyTorch itself creates on the current tpu
    device (``torch.UntypedStorage(n, device="tpu")``); its array comes at first use."""
    from torchtpu.device import bridge

    return state.current_device(), bridge.reserve_address(nbytes) if nbytes else 0


def resize_storage(storage, nbytes: int) -> int:
    """``storage.resize_(nbytes)``: resize its array; returns its new fake address."""
    from torchtpu.device import bridge

    return bridge.resize_storage(storage, nbytes)


def memory_stats(index: int) -> dict:
    from torchtpu.runtime import memory

    return memory.memory_stats(index)


def reset_peak_memory_stats(index: int) -> None:
    from torchtpu.runtime import memory

    memory.reset_peak(index)


def mem_get_info(index: int) -> tuple[int, int]:
    from torchtpu.runtime import memory

    return memory.mem_get_info(state.check_index(index))


def empty_cache() -> None:
    from torchtpu.runtime import memory

    memory.empty_cache()


def supported_dtypes() -> list:
    """``torch.accelerator.get_device_capability``: the dtypes a tpu tensor can hold."""
    from torchtpu.runtime import dtypes

    return list(dtypes.TORCH_TO_JAX)


def synchronize(index: int) -> None:
    """``torch.accelerator.synchronize``: wait for the device's work; nothing to wait for before
    the runtime starts (and it is not started for that)."""
    if state.started():
        from torchtpu.runtime import streams

        streams.synchronize(index)
