"""Device memory statistics, shaped like ``torch.cuda``'s.

PJRT reports allocator figures on GPU and TPU; XLA:CPU reports none, so there the figures are
torchtpu's own accounting of live device buffers (``source`` in ``memory_stats`` says which).
"""

from __future__ import annotations

import gc

import jax

from torchtpu.runtime import platform

_peak: dict[int, int] = {}


def pjrt_stats(index: int) -> dict | None:
    """PJRT's allocator statistics for ``tpu:index``, or None where the platform has none."""
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


def record_peak() -> None:
    """Update every device's observed peak (called at queries and ``synchronize``)."""
    for i in range(platform.device_count()):
        memory_stats(i)


def memory_stats(index: int) -> dict[str, int]:
    """Allocator statistics of ``tpu:index``."""
    stats = pjrt_stats(index)
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


def reset_peak(index: int) -> None:
    _peak.pop(index, None)


def memory_reserved(index: int) -> int:
    stats = pjrt_stats(index)
    if stats:
        return int(stats.get("bytes_reserved", stats.get("bytes_in_use", 0)))
    return memory_stats(index)["allocated_bytes.all.current"]


def empty_cache() -> None:
    """Free device buffers that no tensor uses any more (XLA frees a buffer when its array dies)."""
    gc.collect()
