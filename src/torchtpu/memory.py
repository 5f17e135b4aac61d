"""``torch.tpu.memory_summary()``: the device's memory statistics as a text table, shaped like
``torch.cuda.memory_summary()``."""

from __future__ import annotations

from typing import Any, Callable

from torchtpu import tpu_module as tpu
from torchtpu.runtime import state

_WIDTH = 49  # " Metric (21) | current (10) | peak (10) "


def _format_size(nbytes: int, reference: int) -> str:
    """Bytes in the unit that suits ``reference`` (the row's first value), as torch.cuda prints them."""
    units = ["B  ", "KiB", "MiB", "GiB", "TiB", "PiB"]
    unit = units[0]
    for bigger in units[1:]:
        if reference < 768 * 1024:
            break
        unit, nbytes, reference = bigger, nbytes // 1024, reference / 1024
    return f"{nbytes:6d} {unit}"


def _format_count(count: int, reference: int) -> str:
    units = [" ", "K", "M"]
    unit = units[0]
    for bigger in units[1:]:
        if reference < 750 * 1000:
            break
        unit, count, reference = bigger, count // 1000, reference / 1000
    return f"{count:7d} {unit} "


# (row label, stat key of the current value, stat key of the peak value, formatter, in the abbreviated summary)
_ROWS: list[tuple[str, str, str | None, Callable[[int, int], str], bool]] = [
    ("Allocated memory", "allocated_bytes.all.current", "allocated_bytes.all.peak", _format_size, True),
    ("Reserved memory", "pjrt.bytes_reserved", "pjrt.peak_bytes_reserved", _format_size, True),
    ("Memory limit", "pjrt.bytes_limit", None, _format_size, True),
    ("Pool memory", "pjrt.pool_bytes", "pjrt.peak_pool_bytes", _format_size, False),
    ("Largest allocation", "pjrt.largest_alloc_size", None, _format_size, False),
    ("Largest free block", "pjrt.largest_free_block_bytes", None, _format_size, False),
    ("Allocations", "pjrt.num_allocs", None, _format_count, False),
    ("Live buffers", "active.all.current", None, _format_count, False),
]

_SOURCES = {
    "pjrt": "PJRT allocator statistics",
    "live_buffers": "live buffers counted by torchtpu",
}


def _cell(stats: dict[str, Any], key: str | None, fmt, reference: int) -> str:
    if key is None or key not in stats:
        return f"{'N/A':>10}"
    return fmt(int(stats[key]), reference)


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    """A human-readable table of ``torch.tpu.memory_stats(device)``, like ``torch.cuda.memory_summary``."""
    index = state.device_index(device)
    stats = tpu.memory_stats(index)
    title = f"torchtpu memory summary, device ID {index} ({tpu.get_device_name(index)})"
    source = f"source: {_SOURCES.get(stats.get('source'), stats.get('source', '?'))}"
    width = max(_WIDTH, len(title) + 2, len(source) + 2)
    rule, double = "-" * width, "=" * width
    lines = [double, f"{title:^{width}}", rule,
             f" alloc retries: {stats.get('num_alloc_retries', 0)}".ljust(width), f" {source}".ljust(width),
             double, f" {'Metric':<21} | {'Cur Usage':^10} | {'Peak Usage':^10} ".ljust(width)]
    for label, current, peak, fmt, brief in _ROWS:
        if (abbreviated and not brief) or (current not in stats and label != "Allocated memory"):
            continue
        reference = int(stats.get(current, 0))
        lines.append(rule)
        lines.append(f" {label:<21} | {_cell(stats, current, fmt, reference)} | "
                     f"{_cell(stats, peak, fmt, reference)} ".ljust(width))
    lines.append(double)
    return "|" + "|\n|".join(lines) + "|\n"
