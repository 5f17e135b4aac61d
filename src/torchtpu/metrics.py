"""Always-on counters: ops dispatched, CPU fallbacks, decompositions, transfers, compilations,
recompilations, fused-eager materialisations, evictions from the bounded caches.

Counting is a dict increment on the hot path (``count_op`` runs once per eager op);
``snapshot()`` returns the counters as plain data, ``report()`` prints them as tables and
``reset()`` zeroes them. XLA programs are counted from JAX's monitoring events, so they cost
nothing per call: every program JAX builds is either **compiled** by XLA or **loaded** from the
persistent compilation cache (``TORCHTPU_CACHE_DIR``), and is counted as a **graph** program
while a ``torch.compile`` graph is being compiled (``compiling_graph()``), else as an **eager**
program (eager kernels, view writes, casts, fused-eager programs, and any JAX program of your
own in the process). ``end_step()`` closes a step: the report then shows the programs each step
compiled and loaded (a decode loop whose sequence grows by one compiles a few programs per step).
"""

from __future__ import annotations

import contextlib
import io
import threading
from collections import Counter, defaultdict
from typing import Any, Callable, Iterator

from jax import monitoring

ops: Counter = Counter()
fallbacks: Counter = Counter()
decompositions: Counter = Counter()
transfers: Counter = Counter()  # keys: "to_device", "to_host", "to_device_bytes", "to_host_bytes"
materializations: Counter = Counter()  # fused eager: why pending work had to run
evictions: Counter = Counter()  # bounded caches (torchtpu/caches.py): entries dropped, by cache
compiles: defaultdict[str, Counter] = defaultdict(Counter)  # per compiled function
recompiles: Counter = Counter()  # (function, reason) -> count
xla_compiles: defaultdict[str, Counter] = defaultdict(Counter)  # per XLA program, from JAX events
# XLA programs by kind ("eager", "graph"): compiled / loaded (persistent-cache hits), and seconds
programs: defaultdict[str, Counter] = defaultdict(Counter)
steps: list[dict[str, int]] = []  # programs per step, closed by end_step() (the last MAX_STEPS)
MAX_STEPS = 10000
_steps_ended = 0
_step_start: Counter = Counter()  # ``programs`` at the start of the current step
_local = threading.local()  # .graph: compiling a torch.compile graph; .loaded: the build came from disk


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


def count_eviction(cache: str, n: int = 1) -> None:
    """Bounded cache ``cache`` dropped ``n`` least recently used entries (it was at its limit)."""
    evictions[cache] += n


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


_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # a compilation or a persistent-cache load
_CACHE_HIT = "/jax/compilation_cache/cache_hits"  # recorded inside that span, before it ends, same thread


@contextlib.contextmanager
def compiling_graph() -> Iterator[None]:
    """XLA programs built in this block (this thread) are torch.compile graphs, not eager programs."""
    previous = getattr(_local, "graph", False)
    _local.graph = True
    try:
        yield
    finally:
        _local.graph = previous


def _on_jax_event(event: str, **kwargs) -> None:
    if event == _CACHE_HIT:
        _local.loaded = True


def _on_jax_duration(event: str, duration: float, **kwargs) -> None:
    if event == _BACKEND_COMPILE:
        loaded = getattr(_local, "loaded", False)
        _local.loaded = False
        stats = xla_compiles[str(kwargs.get("fun_name", "?"))]
        stats["compilations"] += 1  # built: compiled, or loaded from the persistent cache
        stats["compile_seconds"] += duration
        kind = programs["graph" if getattr(_local, "graph", False) else "eager"]
        if loaded:
            stats["persistent_hits"] += 1
            kind["loaded"] += 1
            kind["load_seconds"] += duration
        else:
            kind["compiled"] += 1
            kind["compile_seconds"] += duration


monitoring.register_event_listener(_on_jax_event)
monitoring.register_event_duration_secs_listener(_on_jax_duration)


def _program_counts() -> Counter:
    return Counter({f"{kind}_{what}": programs[kind][what] for kind in ("eager", "graph")
                    for what in ("compiled", "loaded")})


def end_step() -> dict[str, int]:
    """Close a step (call it once per training or decode step): returns the XLA programs it
    compiled and loaded (``eager_compiled``, ``eager_loaded``, ``graph_compiled``,
    ``graph_loaded``); ``report()`` and ``snapshot()["steps"]`` list them per step."""
    global _step_start, _steps_ended
    now = _program_counts()
    step = {"step": _steps_ended, **{k: now[k] - _step_start[k] for k in now}}
    _step_start, _steps_ended = now, _steps_ended + 1
    steps.append(step)
    del steps[:-MAX_STEPS]
    return step


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
        "cache_evictions": dict(evictions),
        "compiles": _compile_table(compiles),
        "recompiles": [{"function": f, "reason": r, "count": n} for (f, r), n in recompiles.items()],
        "xla_compiles": {name: {"compilations": c["compilations"], "persistent_hits": c["persistent_hits"],
                                "compile_seconds": c["compile_seconds"]} for name, c in xla_compiles.items()},
        "eager_compiles": _kind(programs["eager"]),
        "graph_compiles": _kind(programs["graph"]),
        "steps": [dict(step) for step in steps],
    }
    for name, fn in _EXTRA.items():
        snap[name] = fn()
    return snap


def _kind(c: Counter) -> dict[str, float]:
    return {"compilations": c["compiled"], "persistent_hits": c["loaded"], "compile_seconds": c["compile_seconds"],
            "load_seconds": c["load_seconds"]}


def reset() -> None:
    """Zero every counter kept here (registered sources keep their own); steps count from 0 again."""
    global _steps_ended
    _steps_ended = 0
    for table in (ops, fallbacks, decompositions, transfers, materializations, evictions, compiles, recompiles,
                  xla_compiles, programs, steps, _step_start):
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


def _compiles(title: str, stats: dict[str, dict[str, float]], top: int, noun: str = "compilations"):
    total = sum(s["compilations"] for s in stats.values())
    seconds = sum(s["compile_seconds"] for s in stats.values())
    heading = f"{title}: {total} {noun}, {seconds:.2f} s ({len(stats)} functions)"
    if not stats:
        return heading, None
    columns = [c for c in ("compilations", "cache_hits", "persistent_hits", "compile_seconds")
               if all(c in s for s in stats.values())]
    table = _table("function", *(">" + c.replace("_", " ") for c in columns))
    ranked = sorted(stats.items(), key=lambda kv: -kv[1]["compile_seconds"])
    for name, s in ranked[:top]:
        table.add_row(name, *(f"{s[c]:.3f}" if c == "compile_seconds" else str(s[c]) for c in columns))
    if len(ranked) > top:
        table.add_row(f"... {len(ranked) - top} more", *("" for _ in columns))
    return heading, table


def _programs(snap: dict[str, Any]):
    table = _table("programs", ">compiled", ">compile s", ">loaded from disk", ">load s")
    for kind, label in (("eager_compiles", "eager programs"), ("graph_compiles", "torch.compile graphs")):
        k = snap[kind]
        table.add_row(label, str(k["compilations"]), f"{k['compile_seconds']:.2f}", str(k["persistent_hits"]),
                      f"{k['load_seconds']:.2f}")
    total = snap["eager_compiles"]["compilations"] + snap["graph_compiles"]["compilations"]
    loaded = snap["eager_compiles"]["persistent_hits"] + snap["graph_compiles"]["persistent_hits"]
    return f"XLA programs: {total} compiled, {loaded} loaded from the persistent cache", table


_STEP_COLUMNS = ("eager_compiled", "eager_loaded", "graph_compiled", "graph_loaded")


def _steps(entries: list[dict[str, int]]):
    """Programs per step (end_step()), runs of equal steps on one row."""
    if not entries:
        return "XLA programs per step: call torchtpu.metrics.end_step() after each step to see them", None
    table = _table("steps", *(">" + c.replace("_", " ") for c in _STEP_COLUMNS))
    rows: list[list] = []  # [first step, last step, counts]
    for step in entries:
        i, counts = step["step"], tuple(step.get(c, 0) for c in _STEP_COLUMNS)
        if rows and rows[-1][2] == counts and rows[-1][1] == i - 1:
            rows[-1][1] = i
        else:
            rows.append([i, i, counts])
    for start, end, counts in rows[:40]:
        table.add_row(str(start) if start == end else f"{start}-{end}", *map(str, counts))
    if len(rows) > 40:
        table.add_row(f"... {len(rows) - 40} more rows", *("" for _ in _STEP_COLUMNS))
    compiled = [s.get("eager_compiled", 0) + s.get("graph_compiled", 0) for s in entries]
    return (f"XLA programs per step: {len(entries)} steps, {sum(compiled) / len(entries):.1f} compiled per step "
            f"(last step: {compiled[-1]})"), table


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
                _counts("cache evictions", snap["cache_evictions"], top),
                _compiles("compiled functions", snap["compiles"], top),
                _recompiles(snap["recompiles"]),
                _programs(snap),
                _steps(snap["steps"]),
                _compiles("XLA programs by function", snap["xla_compiles"], top,
                          "built (compiled, or loaded: persistent hits)")]
    sections += [_extra(name, snap[name]) for name in _EXTRA]
    text = Console(file=io.StringIO(), width=120, color_system=None)
    shown = Console(file=file, width=120)  # file=None: stdout
    for console in (text, shown):
        for heading, table in sections:
            console.print(heading, style="bold", highlight=False)
            if table is not None:
                console.print(table)
    return text.file.getvalue()
