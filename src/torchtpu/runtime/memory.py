"""Device memory statistics, shaped like ``torch.cuda``'s.

PJRT reports allocator figures on GPU and TPU; XLA:CPU reports none, so there the figures are
torchtpu's own accounting of live device buffers (``source`` in ``memory_stats`` says which).
"""

from __future__ import annotations

import gc

import jax

from torchtpu.runtime import platform

_peak: dict[int, int] = {}
_reserved_peak: dict[int, int] = {}


def _live_bytes(index: int) -> tuple[int, int]:
    """Bytes and count of the live arrays on ``tpu:index`` (for an array spread over several
    devices, only its shards on this one). Runs at every ``synchronize``: kept cheap."""
    dev = platform.jax_device(index)
    alone = platform.device_count() == 1  # every single-device array of the platform is on ``dev``
    single = jax.sharding.SingleDeviceSharding
    total = count = 0
    for array in jax.live_arrays(platform.platform()):
        try:
            sharding = array.sharding
            if type(sharding) is single:
                if alone or dev in sharding.device_set:
                    total += array.size * array.dtype.itemsize
                    count += 1
            else:  # an array over a mesh (e.g. a collective's global array): our shards of it
                mine = [s.data.nbytes for s in array.addressable_shards if s.device == dev]
                total += sum(mine)
                count += bool(mine)
        except Exception:  # deleted (donated) while we looked
            continue
    return total, count


def record_peak() -> None:
    """Update every device's observed peak (called at queries and ``synchronize``)."""
    for i in platform.local_indices():
        memory_stats(i)


def memory_stats(index: int) -> dict[str, int]:
    """Allocator statistics of ``tpu:index``, under PyTorch's names (``allocated_bytes.all.current``,
    ...): torch.tpu.memory_stats returns them, and torch.accelerator's memory functions read them
    through the device allocator of the C++ hooks."""
    stats = platform.pjrt_stats(index)
    if stats:
        current = int(stats.get("bytes_in_use", 0))
        peak = int(stats.get("peak_bytes_in_use", current))
        reserved = int(stats.get("bytes_reserved", current))
        reserved_peak = int(stats.get("peak_bytes_reserved", reserved))
        extra = {"source": "pjrt", **{f"pjrt.{k}": v for k, v in stats.items()}}
    else:  # XLA:CPU: no allocator figures, and no cache: reserved is what is allocated
        current, count = _live_bytes(index)
        peak = reserved = reserved_peak = current
        extra = {"active.all.current": count, "source": "live_buffers"}
    _peak[index] = max(_peak.get(index, 0), peak)
    _reserved_peak[index] = max(_reserved_peak.get(index, 0), reserved_peak, reserved)
    return {"allocated_bytes.all.current": current, "allocated_bytes.all.peak": _peak[index],
            "active_bytes.all.current": current, "active_bytes.all.peak": _peak[index],
            "reserved_bytes.all.current": reserved, "reserved_bytes.all.peak": _reserved_peak[index],
            "num_alloc_retries": 0, **extra}


def reset_peak(index: int) -> None:
    _peak.pop(index, None)
    _reserved_peak.pop(index, None)


def memory_reserved(index: int) -> int:
    return memory_stats(index)["reserved_bytes.all.current"]


def mem_get_info(index: int) -> tuple[int, int]:
    """(free, total) bytes of ``tpu:index``, as torch.cuda.mem_get_info.

    Where PJRT reports a limit (GPU, TPU), total is the memory XLA may use on the device
    (``bytes_limit``) and free is that less the bytes in use. On XLA:CPU the device's memory is
    the host's: total is the host memory this process may use (physical memory, or its cgroup's
    limit if lower) and free is total less the bytes of live tpu buffers, not the host's free
    memory (other programs and this process's CPU tensors are not counted).
    """
    total = platform.total_memory(index)
    stats = platform.pjrt_stats(index)
    used = int(stats.get("bytes_in_use", 0)) if stats and "bytes_limit" in stats else _live_bytes(index)[0]
    return max(total - used, 0), total


def empty_cache() -> None:
    """Free device buffers that no tensor uses any more (XLA frees a buffer when its array dies)."""
    gc.collect()
