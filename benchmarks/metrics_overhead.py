"""Cost of the always-on metrics on the eager per-op path, as users run it.

The eager kernels count each op with one dict increment inlined in the kernel
(``_op_counts[name] += 1`` on ``torchtpu.metrics.ops``): nothing can switch it off without editing
the code, so an on/off A/B would compare identical code. Instead this runs the real loops (a small
elementwise op, and an AdamW step whose updates are ``_foreach_*`` kernels), checks from the
counters how many increments each op made, times that exact statement on the live counter and
key, and reports it as a share of the measured per-op time.

    python benchmarks/metrics_overhead.py [--ops 2000] [--repeats 11]
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit

import torch

from torchtpu import metrics


def _add_loop(x: torch.Tensor, n: int) -> None:
    for _ in range(n):
        torch.add(x, x)


def _adamw_loop(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    for _ in range(n):
        opt.step()


def _per_op(loop, n: int) -> tuple[float, int]:
    """Seconds per dispatched op of ``loop(n)``, and the op count it made (from the counters)."""
    before = sum(metrics.ops.values())
    torch.tpu.synchronize()
    start = time.perf_counter()
    loop(n)
    torch.tpu.synchronize()
    seconds = time.perf_counter() - start
    ops = sum(metrics.ops.values()) - before
    return seconds / max(ops, 1), ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000, help="ops per timed add loop")
    parser.add_argument("--repeats", type=int, default=11, help="timed loops per workload")
    args = parser.parse_args()

    x = torch.randn(16, device="tpu")
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(8)]).to("tpu")
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    workloads = {"torch.add, 16 elements": (lambda n: _add_loop(x, n), args.ops),
                 "AdamW step, 16 params (foreach)": (lambda n: _adamw_loop(model, opt, n), max(args.ops // 20, 10))}
    increment = min(timeit.repeat("c[k] += 1", globals={"c": metrics.ops, "k": "aten.add.Tensor"},
                                  number=200_000, repeat=7)) / 200_000

    print(f"{'workload':34s} {'us/op':>8s} {'ops':>7s} {'counter us/op':>14s} {'share':>7s}")
    for name, (loop, n) in workloads.items():
        loop(n)  # compile and warm up
        runs = [_per_op(loop, n) for _ in range(args.repeats)]
        per_op = statistics.median(r[0] for r in runs)
        ops = runs[-1][1]
        print(f"{name:34s} {per_op * 1e6:8.2f} {ops:7d} {increment * 1e6:14.3f} {100 * increment / per_op:6.2f}%")
    print("counter us/op: one inlined increment of torchtpu.metrics.ops, timed alone on the live counter "
          "(each dispatched op makes exactly one; the op count above comes from the same counter)")


if __name__ == "__main__":
    main()
