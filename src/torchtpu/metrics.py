"""Always-on counters: ops dispatched, CPU fallbacks, decompositions, transfers, compilations,
recompilations, fused-eager materialisations.

Counting is a dict increment on the hot path (``count_op`` runs once per eager op);
``snapshot()`` returns the counters as plain data, ``report()`` prints them as tables and
``reset()`` zeroes them. XLA compilations (eager kernels and compiled graphs alike) are counted
from JAX's monitoring events, so they cost nothing per call.
"""

from __future__ import annotations

import io
from collections import Counter, defaultdict
from typing import Any, Callable

from jax import monitoring

ops: Counter = Counter()
fallbacks: Counter = Counter()
decompositions: Counter = Counter()
transfers: Counter = Counter()  # keys: "to_device", "to_host", "to_device_bytes", "to_host_bytes"
materializations: Counter = Counter()  # fused eager: why pending work had to run
compiles: defaultdict[str, Counter] = defaultdict(Counter)  # per compiled function
recompiles: Counter = Counter()  # (function, reason) -> count
xla_compiles: defaultdict[str, Counter] = defaultdict(Counter)  # per XLA program, from JAX events


def count_op(name: str) -> None:
    ops[name] += 1


def count_fallback(name: str) -> None:
    fallbacks[name] += 1


def count_decomposition(name: str) -> None:
    decompositions[name] += 1


def count_transfer(direction: str, nbytes: int) -> None:
    transfers[direction] += 1
    transfers[direction + "_bytes"] += nbytes


def count_materialization(reason: str) -> None:
    """Fused eager ran its pending ops because of ``reason`` (e.g. ``"item"``, ``"cpu_fallback"``)."""
    materializations[reason] += 1


def count_compile(name: str, seconds: float = 0.0, cache_hit: bool = False) -> None:
    """One executable lookup for compiled function ``name``: a cache hit, or a compilation of ``seconds``."""
    stats = compiles[name]
    if cache_hit:
        stats["cache_hits"] += 1
    else:
        stats["compilations"] += 1
        stats["compile_seconds"] += seconds


def count_recompile(name: str, reason: str) -> None:
    """Compiled function ``name`` was compiled again because of ``reason`` (e.g. a failed guard)."""
    recompiles[(name, reason)] += 1


_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def _on_jax_duration(event: str, duration: float, **kwargs) -> None:
    if event == _BACKEND_COMPILE:
        stats = xla_compiles[str(kwargs.get("fun_name", "?"))]
        stats["compilations"] += 1
        stats["compile_seconds"] += duration


monitoring.register_event_duration_secs_listener(_on_jax_duration)

_EXTRA: dict[str, Callable[[], Any]] = {}


def register_source(name: str, fn: Callable[[], Any]) -> None:
    """Let another layer (compile, fused eager) add its counters to the snapshot under ``name``."""
    _EXTRA[name] = fn


def _compile_table(table: dict[str, Counter]) -> dict[str, dict[str, float]]:
    out = {}
    for name, c in table.items():
        out[name] = {"compilations": c["compilations"], "cache_hits": c["cache_hits"],
                     "cache_misses": c["compilations"], "compile_seconds": c["compile_seconds"]}
    return out


def snapshot() -> dict[str, Any]:
    """All counters as plain dicts and lists (safe to keep: later counting does not change it)."""
    snap = {
        "ops": dict(ops),
        "cpu_fallbacks": dict(fallbacks),
        "decompositions": dict(decompositions),
        "transfers": {k: transfers[k] for k in ("to_device", "to_device_bytes", "to_host", "to_host_bytes")},
        "materializations": dict(materializations),
        "compiles": _compile_table(compiles),
        "recompiles": [{"function": f, "reason": r, "count": n} for (f, r), n in recompiles.items()],
        "xla_compiles": {name: {"compilations": c["compilations"], "compile_seconds": c["compile_seconds"]}
                         for name, c in xla_compiles.items()},
    }
    for name, fn in _EXTRA.items():
        snap[name] = fn()
    return snap


def reset() -> None:
    """Zero every counter kept here (registered sources keep their own)."""
    for table in (ops, fallbacks, decompositions, transfers, materializations, compiles, recompiles,
                  xla_compiles):
        table.clear()


# ---------------------------------------------------------------- report

def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"


def _table(*columns: str):
    """A rich table; a column named with a leading '>' is right-aligned."""
    from rich.table import Table

    table = Table(box=None, padding=(0, 2), header_style="bold")
    for column in columns:
        table.add_column(column.lstrip(">"), justify="right" if column.startswith(">") else "left")
    return table


def _counts(title: str, counts: dict[str, int], top: int):
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])
    heading = f"{title}: {sum(counts.values())} ({len(counts)} distinct)"
    if not ranked:
        return heading, None
    table = _table(">count", "name")
    for name, n in ranked[:top]:
        table.add_row(str(n), str(name))
    if len(ranked) > top:
        table.add_row(str(sum(n for _, n in ranked[top:])), f"... {len(ranked) - top} more")
    return heading, table


def _transfers(t: dict[str, int]):
    table = _table("direction", ">count", ">bytes")
    for direction, label in (("to_device", "host -> device"), ("to_host", "device -> host")):
        table.add_row(label, str(t[direction]), _size(t[direction + "_bytes"]))
    return "host <-> device transfers", table


def _compiles(title: str, stats: dict[str, dict[str, float]], top: int):
    total = sum(s["compilations"] for s in stats.values())
    seconds = sum(s["compile_seconds"] for s in stats.values())
    heading = f"{title}: {total} compilations, {seconds:.2f} s ({len(stats)} functions)"
    if not stats:
        return heading, None
    columns = [c for c in ("compilations", "cache_hits", "compile_seconds") if all(c in s for s in stats.values())]
    table = _table("function", *(">" + c.replace("_", " ") for c in columns))
    ranked = sorted(stats.items(), key=lambda kv: -kv[1]["compile_seconds"])
    for name, s in ranked[:top]:
        table.add_row(name, *(f"{s[c]:.3f}" if c == "compile_seconds" else str(s[c]) for c in columns))
    if len(ranked) > top:
        table.add_row(f"... {len(ranked) - top} more", *("" for _ in columns))
    return heading, table


def _recompiles(entries: list[dict[str, Any]]):
    table = _table(">count", "function", "reason")
    for e in sorted(entries, key=lambda e: -e["count"]):
        table.add_row(str(e["count"]), e["function"], e["reason"])
    return f"recompilations: {sum(e['count'] for e in entries)}", table if entries else None


def _extra(name: str, value: Any):
    if not isinstance(value, dict):
        return f"{name}: {value}", None
    table = _table("counter", ">value")
    for k, v in value.items():
        table.add_row(str(k), f"{v:.3f}" if isinstance(v, float) else str(v))
    return name, table


def report(top: int = 15, file=None) -> str:
    """Print the counters as tables (to ``file``, default stdout) and return the text."""
    from rich.console import Console

    snap = snapshot()
    sections = [_counts("ops dispatched", snap["ops"], top),
                _counts("cpu fallbacks", snap["cpu_fallbacks"], top),
                _counts("decompositions", snap["decompositions"], top),
                _transfers(snap["transfers"]),
                _counts("fused-eager materialisations", snap["materializations"], top),
                _compiles("compiled functions", snap["compiles"], top),
                _recompiles(snap["recompiles"]),
                _compiles("XLA compilations", snap["xla_compiles"], top)]
    sections += [_extra(name, snap[name]) for name in _EXTRA]
    text = Console(file=io.StringIO(), width=120, color_system=None)
    shown = Console(file=file, width=120)  # file=None: stdout
    for console in (text, shown):
        for heading, table in sections:
            console.print(heading, style="bold", highlight=False)
            if table is not None:
                console.print(table)
    return text.file.getvalue()
