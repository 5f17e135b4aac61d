"""Small eager ops on tpu, per op the best and the median of 30 loops of 200 calls (µs per op).

For A/B runs of two trees, one process per tree, alternating (see docs/performance.md): the best
loop is what the code costs; the median also carries whatever else the machine was doing.

    PYTHONPATH=<tree>/src python benchmarks/ab_small_ops.py
"""

from __future__ import annotations

import statistics
import time

import torch


def main() -> None:
    x = torch.randn(64, 128).to("tpu")
    y = torch.randn(64, 128).to("tpu")
    ops = {"add": lambda: x + y, "mul": lambda: x * y, "scal": lambda: x * 2, "relu": lambda: torch.relu(x),
           "exp": lambda: torch.exp(x), "add_": lambda: x.add_(y), "sum": lambda: x.sum(dim=1)}
    for op in ops.values():  # compile and warm every kernel first
        for _ in range(50):
            op()
    torch.tpu.synchronize()
    loops: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(30):
        for name, op in ops.items():
            start = time.perf_counter()
            for _ in range(200):
                op()
            torch.tpu.synchronize()
            loops[name].append((time.perf_counter() - start) / 200 * 1e6)
    print("op best/median (us): " + " ".join(f"{name} {min(v):.1f}/{statistics.median(v):.1f}"
                                               for name, v in loops.items()))


if __name__ == "__main__":
    main()
