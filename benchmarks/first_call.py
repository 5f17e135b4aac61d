"""What an eager op's first call costs on XLA:CPU, and what the compile flags torchtpu sets there
change: side by side in one run, each setting in a process of its own (XLA reads its flags once
per process), the persistent compilation cache off in both.

- ``default``: ``TORCHTPU_CPU_FAST_COMPILE=0``, XLA:CPU's default (MLIR-based) fusion emitters;
- ``fast``: ``TORCHTPU_CPU_FAST_COMPILE=1`` (torchtpu's default), XLA's elemental emitters
  (``--xla_cpu_use_fusion_emitters=false``, set while the PJRT client starts).

For each op: the median first call on ``tpu`` of ``--shapes`` new shapes (each one a new XLA
program: trace, lower, compile, run; inputs made and synchronised before), and the median run of
the compiled program on a 1024x1024 input (loops of 10 calls ended by reading one value of the
last; what the flags must not slow down). A fresh machine's
test suite is mostly such first calls.

    python benchmarks/first_call.py [--shapes 8] [--runs 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

OPS = ["add", "mul scalar", "relu", "gelu", "softmax", "layer_norm", "sum dim", "matmul", "cat",
       "index_select", "cumsum", "where"]


def _op(name):
    import torch
    import torch.nn.functional as F

    return {
        "add": lambda x: x + x,
        "mul scalar": lambda x: x * 1.5,
        "relu": torch.relu,
        "gelu": F.gelu,
        "softmax": lambda x: torch.softmax(x, -1),
        "layer_norm": lambda x: F.layer_norm(x, x.shape[-1:]),
        "sum dim": lambda x: x.sum(1),
        "matmul": lambda x: x @ x.T,
        "cat": lambda x: torch.cat([x, x]),
        "index_select": lambda x: x.index_select(0, torch.zeros(3, dtype=torch.long, device=x.device)),
        "cumsum": lambda x: x.cumsum(1),
        "where": lambda x: torch.where(x > 0, x, -x),
    }[name]


def child(shapes: int, runs: int) -> dict:
    """This process's figures for the setting it was started with."""
    import jax
    import torch

    import torchtpu  # noqa: F401  (the tpu device)

    assert not jax.config.jax_enable_compilation_cache  # (off in ``measure``: every first call compiles)
    torch.ones(1, device="tpu").cpu()  # the runtime started: the flags read
    sync = torch.tpu.synchronize
    out = {}
    for k, name in enumerate(OPS):
        fn = _op(name)
        inputs = [torch.rand(5, 6 + 100 * k + s, device="tpu") for s in range(shapes)]
        sync()
        firsts = []
        for x in inputs:
            start = time.perf_counter()
            y = fn(x)
            sync()  # (it waits for the arrays still alive: y must be)
            firsts.append(time.perf_counter() - start)
            del y
        big = torch.rand(1024, 1024, device="tpu")
        fn(big).view(-1)[0].item()
        times = []
        for _ in range(runs):  # a loop of 10 calls, ended by reading one value of the last one
            start = time.perf_counter()
            for _ in range(10):
                y = fn(big)
            y.view(-1)[0].item()
            times.append((time.perf_counter() - start) / 10)
        out[name] = {"first_ms": statistics.median(firsts) * 1e3, "run_us": statistics.median(times) * 1e6}
    return out


def measure(setting: str, shapes: int, runs: int) -> dict:
    env = {**os.environ, "TORCHTPU_CPU_FAST_COMPILE": setting, "TORCHTPU_PLATFORM": "cpu",
           "JAX_ENABLE_COMPILATION_CACHE": "false"}
    done = subprocess.run([sys.executable, __file__, "--child", "--shapes", str(shapes), "--runs", str(runs)],
                          env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the TORCHTPU_CPU_FAST_COMPILE={setting} run failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=int, default=8, help="new shapes (programs) per op")
    parser.add_argument("--runs", type=int, default=20, help="timed loops of 10 calls of each op on 1024x1024")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.shapes, args.runs)))
        return
    default, fast = measure("0", args.shapes, args.runs), measure("1", args.shapes, args.runs)
    print(f"first call of a new shape (median of {args.shapes}) and run on 1024x1024 (median of {args.runs} loops), "
          "XLA:CPU; default: XLA's fusion emitters, fast: TORCHTPU_CPU_FAST_COMPILE=1")
    print("| op | first call default (ms) | first call fast (ms) | fast/default | run default (us) "
          "| run fast (us) | fast/default |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in OPS:
        d, f = default[name], fast[name]
        print(f"| {name} | {d['first_ms']:.1f} | {f['first_ms']:.1f} | {f['first_ms'] / d['first_ms']:.2f} "
              f"| {d['run_us']:.0f} | {f['run_us']:.0f} | {f['run_us'] / d['run_us']:.2f} |")
    first = [fast[n]["first_ms"] / default[n]["first_ms"] for n in OPS]
    run = [fast[n]["run_us"] / default[n]["run_us"] for n in OPS]
    print(f"| geometric mean | | | {statistics.geometric_mean(first):.2f} | | | {statistics.geometric_mean(run):.2f} |")


if __name__ == "__main__":
    main()
