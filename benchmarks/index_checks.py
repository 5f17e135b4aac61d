"""What the device-side index checks cost (``ops/checks.py``): indexing ops with the checks and
without them, side by side, in each eager mode and compiled, and the PyTorch CPU eager time.

Each variant runs in a process of its own (the programs differ: one built without the checks
has no code output), alternating checked and unchecked, ``--rounds`` times; the table gives the
median µs per op and the ratio checked / unchecked. Inputs are new each loop (``torch.randint``
indices), and the loop reads its result at the end (``--read every``: after every op).

    python benchmarks/index_checks.py [--rounds 5] [--read end|every]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

CALLS = 100
SIZES = {"small": (64, 32), "large": (4096, 256)}  # rows x columns of the indexed table


def _ops(device: str, rows: int, cols: int) -> dict:
    table = torch.randn(rows, cols, device=device)
    flat = table.reshape(-1)
    rows8 = torch.randn(8, cols, device=device)

    def idx(n=32):
        return torch.randint(0, rows, (n,), device=device)

    return {
        "x[idx]": lambda: table[idx()],
        "index_select": lambda: torch.index_select(table, 0, idx()),
        "embedding": lambda: F.embedding(idx(), table),
        "gather": lambda: torch.gather(flat, 0, idx(256)),
        "x[idx] = v": lambda: table.index_put_((idx(),), torch.tensor(1.0, device=device)),
        "index_add_": lambda: table.index_add_(0, idx(8), rows8),
    }


def _time(fn, device: str, read_every: bool) -> float:
    """µs per call of ``fn``: the best of 5 loops of CALLS calls (a read at the end or each call)."""
    sync = torch.tpu.synchronize if device == "tpu" else (lambda: None)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(CALLS):
            out = fn()
            if read_every:
                out.sum().item()
        sync()
        best = min(best, time.perf_counter() - start)
    return best / CALLS * 1e6


def child(variant: str, read_every: bool) -> dict:
    """Times of every op in this process; ``variant``: checked, unchecked or cpu."""
    if variant == "unchecked":
        from torchtpu.ops import checks

        checks.in_bounds = lambda *args, **kwargs: None  # every program built here has no check
    device = "cpu" if variant == "cpu" else "tpu"
    results = {}
    for size, (rows, cols) in SIZES.items():
        ops = _ops(device, rows, cols)
        # DEFER_AND_FUSE on the small table only: a loop that never reads is cut where its ops
        # repeat, and its first programs (hundreds of ops) take most of a run to compile
        modes = ["cpu"] if device == "cpu" else ["defer_never", "compiled"] + (["defer_and_fuse"] * (size == "small"))
        for mode in modes:
            for name, fn in ops.items():
                run = torch.compile(fn, backend="tpu") if mode == "compiled" else fn
                context = torch.tpu.set_eager_mode("defer_never" if mode == "compiled" else mode) \
                    if device == "tpu" else _nothing()
                with context:
                    for _ in range(20):  # compile and warm
                        run()
                    results[f"{size}|{mode}|{name}"] = _time(run, device, read_every)
    return results


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--read", choices=["end", "every"], default="end")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    read_every = args.read == "every"
    if args.child:
        print(json.dumps(child(args.child, read_every)))
        return
    runs: dict[str, list[dict]] = {"checked": [], "unchecked": [], "cpu": []}
    for _ in range(args.rounds):
        for variant in runs:
            out = subprocess.run([sys.executable, __file__, "--child", variant, "--read", args.read],
                                 capture_output=True, text=True, check=True, env=os.environ)
            runs[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
    median = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in runs.items()}
    print(f"torch {torch.__version__}, device {torch.tpu.get_device_name()}, read at the "
          f"{'every op' if read_every else 'end'}, median of {args.rounds} rounds of best-of-5 loops, µs per op\n")
    print("| table | mode | op | checked | unchecked | checked / unchecked | PyTorch CPU | checked / CPU |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    ratios = []
    for key, checked in median["checked"].items():
        size, mode, name = key.split("|")
        unchecked, cpu = median["unchecked"][key], median["cpu"][f"{size}|cpu|{name}"]
        ratios.append(checked / unchecked)
        print(f"| {size} | {mode} | {name} | {checked:.1f} | {unchecked:.1f} | {checked / unchecked:.2f}x | "
              f"{cpu:.1f} | {checked / cpu:.1f}x |")
    print(f"\nchecked / unchecked: median {statistics.median(ratios):.2f}x, max {max(ratios):.2f}x")


if __name__ == "__main__":
    main()
