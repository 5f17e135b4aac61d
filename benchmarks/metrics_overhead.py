"""Cost of the always-on metrics on the eager per-op path.

Times a loop of small elementwise ops with ``metrics.count_op`` as shipped and with it
replaced by a no-op, interleaving the two so machine load hits both alike; prints the medians
and their ratio, and the cost of one ``count_op`` call measured alone.

    python benchmarks/metrics_overhead.py [--ops 2000] [--repeats 21]
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit

import torch

from torchtpu import metrics


def _loop(x: torch.Tensor, n: int) -> float:
    """Seconds per op for ``n`` eager adds (dispatch cost: the work itself is tiny)."""
    torch.tpu.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        y = torch.add(x, x)
    torch.tpu.synchronize()
    del y
    return (time.perf_counter() - start) / n


def _no_op(name: str) -> None:
    pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000, help="ops per timed loop")
    parser.add_argument("--repeats", type=int, default=21, help="timed loops per variant")
    args = parser.parse_args()

    x = torch.randn(16, device="tpu")
    counting = metrics.count_op
    _loop(x, args.ops)  # compile and warm up
    on, off = [], []
    for _ in range(args.repeats):
        metrics.count_op = _no_op
        off.append(_loop(x, args.ops))
        metrics.count_op = counting
        on.append(_loop(x, args.ops))
    metrics.count_op = counting

    on_us, off_us = statistics.median(on) * 1e6, statistics.median(off) * 1e6
    call_us = min(timeit.repeat(lambda: counting("aten.add.Tensor"), number=100_000, repeat=7)) / 100_000 * 1e6
    print(f"eager torch.add on a 16-element tpu tensor, {args.ops} ops x {args.repeats} repeats")
    print(f"  metrics on : {on_us:8.2f} us/op (median)")
    print(f"  metrics off: {off_us:8.2f} us/op (median; count_op replaced by a no-op)")
    print(f"  ratio on/off: {on_us / off_us:.3f}")
    print(f"  one count_op call alone: {call_us:.3f} us = {100 * call_us / off_us:.2f}% of an op")


if __name__ == "__main__":
    main()
