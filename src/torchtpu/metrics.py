"""Always-on counters: ops dispatched, CPU fallbacks, transfers, compilations.

Counting is a dict increment on the hot path; ``report()`` and ``snapshot()`` read them.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

ops: Counter = Counter()
fallbacks: Counter = Counter()
decompositions: Counter = Counter()
transfers: Counter = Counter()  # keys: "to_device", "to_host", "to_device_bytes", "to_host_bytes"


def count_op(name: str) -> None:
    ops[name] += 1


def count_fallback(name: str) -> None:
    fallbacks[name] += 1


def count_decomposition(name: str) -> None:
    decompositions[name] += 1


def count_transfer(direction: str, nbytes: int) -> None:
    transfers[direction] += 1
    transfers[direction + "_bytes"] += nbytes


_EXTRA: dict[str, Any] = {}


def register_source(name: str, fn) -> None:
    """Let another layer (compile, fused eager) add its counters to the snapshot."""
    _EXTRA[name] = fn


def snapshot() -> dict[str, Any]:
    """All counters as plain dicts."""
    snap = {
        "ops": dict(ops),
        "cpu_fallbacks": dict(fallbacks),
        "decompositions": dict(decompositions),
        "transfers": dict(transfers),
    }
    for name, fn in _EXTRA.items():
        snap[name] = fn()
    return snap


def reset() -> None:
    for c in (ops, fallbacks, decompositions, transfers):
        c.clear()


def report() -> str:
    """A readable table of the counters (also printed by ``torchtpu demo``)."""
    snap = snapshot()
    lines = []
    total = sum(snap["ops"].values())
    lines.append(f"ops dispatched: {total} ({len(snap['ops'])} distinct)")
    for name, n in sorted(snap["ops"].items(), key=lambda kv: -kv[1])[:15]:
        lines.append(f"  {n:>10}  {name}")
    lines.append(f"cpu fallbacks: {sum(snap['cpu_fallbacks'].values())}")
    for name, n in sorted(snap["cpu_fallbacks"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {n:>10}  {name}")
    t = snap["transfers"]
    lines.append(f"transfers: to device {t.get('to_device', 0)} ({t.get('to_device_bytes', 0)} B), "
                 f"to host {t.get('to_host', 0)} ({t.get('to_host_bytes', 0)} B)")
    for name, value in snap.items():
        if name not in ("ops", "cpu_fallbacks", "decompositions", "transfers"):
            lines.append(f"{name}: {value}")
    text = "\n".join(lines)
    print(text)
    return text
