"""Eager overhead: microseconds per op, tpu eager vs torch CPU eager, side by side in one run.

    python benchmarks/eager_overhead.py [--repeats 7] [--iters 200] [--mode MODE] [--update-docs]

Each op runs ``iters`` times in a loop (after a warm-up loop that compiles it); the tpu loop ends
with ``torch.tpu.synchronize()`` so queued work is counted. Each timed loop follows
an untimed one of the same call lasting at least ``SETTLE_S``: PyTorch's OpenMP threads keep
spinning for a while after a parallel op (a 256x256 matmul), and on a 2-core machine they took
the core of whichever loop came next (the tpu matmul right after the CPU's read 25-30 us slower
than the same loop placed elsewhere). The table shows the median over
``repeats`` loops. tpu is timed three ways: through the native eager kernel (``csrc/eager.cpp``, the
default) and with it switched off (every call through its Python kernel, the reference path);
a last column times the loop in DEFER_AND_FUSE (each call recorded, natively once known, and the
loop's synchronisation running them as one program): the fused mode's host cost per op. The loop
drops every result but the last, and the fused program computes only what is still referenced,
so that column is the recording, not the op's work (the matmul row computes one product).
Another column times the same computation as a bare ``jax.jit`` call on the same device: the
floor that any JAX-based eager op pays, so ``native - jax.jit`` is torchtpu's own overhead. Small
ops measure dispatch cost; matmul adds real work.

A second table is the per-op budget of the native path: three more loops per op with the C++
kernel's stage timer on (``native_kernels.budget``) splits a call into the time outside the kernel
(the Python binding of the torch call, PyTorch's dispatcher, the result back to Python, the loop),
the GIL, mode check and argument walk, the table lookup, the JAX call (the jitted program through
vectorcall: JAX's own dispatch and XLA's launch), the outputs (storage and tensor built, or the
in-place write) and the op count.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchtpu.eager import native_kernels
from torchtpu.runtime import platform

TARGET_US = 8.0  # goal for a small op on tpu (and at most 3.5x PyTorch's CPU eager)
SMALL = (64, 128)



@dataclass(frozen=True)
class Case:
    """One op to time: its inputs' shapes, the torch call, and the same computation in JAX."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    torch_fn: Callable
    jax_fn: Callable  # jitted once; the floor that any JAX-based eager op pays per call


CASES = [
    Case("add", (SMALL, SMALL), lambda x, y: x + y, jnp.add),
    Case("mul", (SMALL, SMALL), lambda x, y: x * y, jnp.multiply),
    Case("x * 2 (scalar)", (SMALL,), lambda x: x * 2, lambda x: x * 2),
    Case("relu", (SMALL,), torch.relu, jax.nn.relu),
    Case("exp", (SMALL,), torch.exp, jnp.exp),
    Case("add_ (in place)", (SMALL, SMALL), lambda x, y: x.add_(y, alpha=1e-3), lambda x, y: x + 1e-3 * y),
    Case("sum(dim=1)", (SMALL,), lambda x: x.sum(dim=1), lambda x: x.sum(axis=1)),
    Case("x.t() (view)", (SMALL,), lambda x: x.t(), lambda x: x.T),
    Case("cat", (SMALL, SMALL), lambda x, y: torch.cat([x, y], dim=1), lambda x, y: jnp.concatenate([x, y], 1)),
    # an elementwise op on a transposed input: its output is laid out like the input, as PyTorch
    # lays it out (a rotary embedding's q * cos on a [B, T, H, D] -> [B, H, T, D] view)
    Case("x.t() * y (laid out)", ((SMALL[1], SMALL[0]), SMALL), lambda x, y: x.t() * y, lambda x, y: x.T * y),
    Case("matmul", ((256, 256), (256, 256)), torch.matmul, jnp.matmul),
]
MATMUL = "matmul"


def _inputs(case: Case) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal(shape, dtype=np.float32) for shape in case.shapes]


def _bound(case: Case, where: str) -> Callable[[], object]:
    """A zero-argument call of ``case`` on ``where`` ("cpu", "tpu" or "jax")."""
    arrays = _inputs(case)
    if where == "jax":
        device = platform.jax_device(0)
        args, fn = [jax.device_put(a, device) for a in arrays], jax.jit(case.jax_fn)
    else:
        args, fn = [torch.from_numpy(a).to(where.split()[0]) for a in arrays], case.torch_fn
    return lambda: fn(*args)


def _sync(where: str, result) -> None:
    if where.startswith("tpu"):
        torch.tpu.synchronize()
    elif where == "jax":
        jax.block_until_ready(result)


def _loop(fn: Callable, where: str, iters: int) -> float:
    """Microseconds per call over one loop of ``iters`` calls, synchronised at the end."""
    start = time.perf_counter()
    for _ in range(iters):
        result = fn()
    _sync(where, result)
    return (time.perf_counter() - start) / iters * 1e6


PLACES = ("cpu", "tpu", "tpu python", "jax", "tpu fused")


SETTLE_S = 0.005  # the untimed loop before each timed one


def _settle(fn: Callable, where: str) -> None:
    """Call ``fn`` for at least SETTLE_S, untimed: the previous place's threads stop spinning and
    this place's are awake, as in a busy program."""
    end = time.perf_counter() + SETTLE_S
    while True:
        result = fn()
        if time.perf_counter() >= end:
            break
    _sync(where, result)


def _timed(where: str, fn: Callable, iters: int) -> float:
    """``_loop`` after ``_settle``; "tpu python" runs with the native eager kernel switched off,
    "tpu fused" in DEFER_AND_FUSE (the calls recorded, the synchronisation at the loop's end runs
    them as one program)."""
    if where == "tpu fused":  # (each block records into a fresh executor: the settling loop's
        with torch.tpu.set_eager_mode("defer_and_fuse"):  # length varies, and a long one would leave
            _settle(fn, where)  # the timed loop cut where its repeats fall, a new program each time)
        with torch.tpu.set_eager_mode("defer_and_fuse"):
            return _loop(fn, where, iters)
    if where == "tpu python":
        native_kernels.set_enabled(False)
    try:
        _settle(fn, where)
        return _loop(fn, where, iters)
    finally:
        if where == "tpu python":
            native_kernels.set_enabled(True)


def budget_case(fn: Callable, iters: int) -> dict[str, float] | None:
    """One loop of the native path with the C++ stage timer on: {stage: us per call}, "total" and
    "outside the kernel" (None where the native kernel is off)."""
    if not native_kernels.enabled():
        return None
    native_kernels.budget(True)
    try:
        total = _loop(fn, "tpu", iters)
        calls, stages = native_kernels.budget_read()
    finally:
        native_kernels.budget(False)
    if calls < iters:
        return None  # (the op did not run natively)
    return {"total": total, "outside the kernel": total - sum(stages.values()), **stages}


def time_case(case: Case, repeats: int, iters: int) -> dict[str, float]:
    """Median microseconds per call on each place; their loops alternate so all see the same load."""
    fns = {where: _bound(case, where) for where in PLACES}
    for where, fn in fns.items():  # warm-up: compiles the op, fills caches and thread pools
        _timed(where, fn, iters)
        _timed(where, fn, iters)  # (the native kernel learns a call signature on its first call)
    samples: dict[str, list[float]] = {where: [] for where in PLACES}
    for _ in range(repeats):
        for where, fn in fns.items():
            samples[where].append(_timed(where, fn, iters))
    medians = {where: statistics.median(values) for where, values in samples.items()}
    budgets = [b for b in (budget_case(fns["tpu"], iters) for _ in range(3)) if b is not None]
    if budgets:  # the figures of the loop with the median total
        medians["budget"] = sorted(budgets, key=lambda b: b["total"])[len(budgets) // 2]
    return medians


def run(repeats: int = 7, iters: int = 200, only: str | None = None) -> list[tuple[Case, dict[str, float]]]:
    """Each selected case with its median microseconds per place."""
    return [(case, time_case(case, repeats, iters)) for case in CASES if not only or only in case.name]


def _shape_note(case: Case) -> str:
    return ", ".join("x".join(map(str, shape)) for shape in case.shapes)


def table(rows: list[tuple[Case, dict[str, float]]]) -> str:
    """The results as a Markdown table: tpu next to torch CPU eager and to a bare jax.jit call."""
    lines = ["| op | input shapes | torch CPU eager (us) | tpu native (us) | tpu Python kernel (us) "
             "| bare jax.jit (us) | native / CPU | Python / native | native - jax.jit (us) | tpu DEFER_AND_FUSE, recording (us) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for case, us in rows:
        lines.append(f"| {case.name} | {_shape_note(case)} | {us['cpu']:.1f} | {us['tpu']:.1f} "
                     f"| {us['tpu python']:.1f} | {us['jax']:.1f} | {us['tpu'] / us['cpu']:.2f}x "
                     f"| {us['tpu python'] / us['tpu']:.2f}x | {us['tpu'] - us['jax']:.1f} | {us['tpu fused']:.1f} |")
    return "\n".join(lines)


def budget_table(rows) -> str:
    """Where each microsecond of a native call goes (ops in backticks)."""
    stages = ["outside the kernel", *native_kernels.BUDGET_STAGES]
    lines = ["| op (native budget) | total (us) | " + " | ".join(f"{s} (us)" for s in stages) + " | bare jax.jit (us) |",
             "| --- | ---: | " + " | ".join("---:" for _ in stages) + " | ---: |"]
    for case, us in rows:
        b = us.get("budget")
        if b is None:
            continue
        lines.append(f"| `{case.name}` | {b['total']:.1f} | " + " | ".join(f"{b[s]:.1f}" for s in stages)
                     + f" | {us['jax']:.1f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


DOCS = Path(__file__).resolve().parents[1] / "docs" / "performance.md"
DOCS_INTRO = """# Performance

Measured numbers, each produced by a script in `benchmarks/` (run them all with `torchtpu bench`).
Every section names the command that printed it; rerun the command to refresh it. Speed is
compared side by side in one run, never against numbers from another machine or another day.
"""
BEGIN, END = "<!-- eager_overhead:begin -->", "<!-- eager_overhead:end -->"


def update_docs(body: str, command: str) -> Path:
    """Replace this benchmark's section of docs/performance.md (creating the file if needed)."""
    text = DOCS.read_text(encoding="utf-8") if DOCS.exists() else DOCS_INTRO
    section = (f"{BEGIN}\n## Eager overhead per op\n\n"
               "Cost of one eager op on `tpu` next to torch's own CPU eager and to the same computation "
               "as a bare `jax.jit` call (the floor of any JAX-based eager op), small tensors "
               f"(target: <= {TARGET_US:.0f} us per small op on tpu). The header records the load "
               "average: on a busy machine the numbers measure contention more than dispatch, so "
               "compare columns within one run only.\n\n"
               f"```\n{command}\n```\n\n{body}\n{END}")
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + section + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    DOCS.parent.mkdir(parents=True, exist_ok=True)
    DOCS.write_text(text, encoding="utf-8")
    return DOCS


def report(rows, repeats: int, iters: int) -> str:
    """Header, table and verdict, as printed."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [f"{torch.tpu.get_device_name()} via torchtpu, eager mode {torch.tpu.eager_mode.name}, "
             f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, load average {load}; "
             f"median of {repeats} loops x {iters} calls (CPU, tpu and jax loops alternating), "
             "tpu synchronised at the end of each loop.",
             "", table(rows)]
    small = [us["tpu"] for case, us in rows if case.name != MATMUL]
    if small:
        median = statistics.median(small)
        ratio = statistics.median(us["tpu"] / us["cpu"] for case, us in rows if case.name != MATMUL)
        verdict = "meets" if median <= TARGET_US and ratio <= 3.5 else "MISSES"
        python = statistics.median(us["tpu python"] for case, us in rows if case.name != MATMUL)
        lines += ["", f"Small ops on tpu, native: median {median:.1f} us, worst {max(small):.1f} us, median "
                      f"{ratio:.2f}x PyTorch's CPU eager ({verdict} the {TARGET_US:.0f} us and 3.5x target); "
                      f"through the Python kernels: median {python:.1f} us."]
    budget = budget_table(rows)
    if budget:
        lines += ["", "Where a native call's time goes (three more loops per op, the one with the median total, the C++ kernel's "
                      "stage timer on; \"outside the kernel\": the torch call's Python binding, PyTorch's "
                      "dispatcher, the result back to Python, the loop):", "", budget]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7, help="timed loops per op; the median is shown")
    p.add_argument("--iters", type=int, default=200, help="calls per timed loop")
    p.add_argument("--mode", default=None, help="tpu eager mode (e.g. defer_never_and_launch_blocking)")
    p.add_argument("--only", default=None, help="run only ops whose name contains this")
    p.add_argument("--update-docs", action="store_true", help="write the table into docs/performance.md")
    args = p.parse_args(argv)

    if args.mode:
        torch.tpu.eager_mode = args.mode
    torch.ones(1, device="tpu")  # the runtime starts (and installs the native kernels)
    if not native_kernels.enabled():
        print("note: the native eager kernel is off in this process (TORCHTPU_NATIVE_EAGER=0 or no C++ "
              "extension): both tpu columns are the Python kernels")
    rows = run(args.repeats, args.iters, args.only)
    text = report(rows, args.repeats, args.iters)
    print(text)
    if args.update_docs:
        shown = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--update-docs"]
        command = " ".join(["python benchmarks/eager_overhead.py", *shown])
        print(f"\nwrote {update_docs(text, command)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
