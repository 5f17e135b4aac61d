"""Cold vs warm compile time of a GPT train step, each in a fresh process sharing one cache dir.

The cold process compiles with an empty persistent cache; the warm ones find the executable on
disk. Compile time is the first call's time minus a steady-state call's, and torchtpu's own
``compile_seconds`` counter (lowering + XLA compile, or loading from disk).

    python benchmarks/compile_cache.py [--warm-runs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

CHILD = textwrap.dedent("""
    import json, os, sys, time
    import torch
    import torchtpu.compile as tpu_compile
    sys.path.insert(0, {bench_dir!r})
    from models import GPT, GPTConfig, AdamWTrainStep, gpt_batch

    tpu_compile.install()
    torch._dynamo.config.trace_autograd_ops = True
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=1024, block_size=128, n_layer=4, n_head=4, d_model=256)
    x, y = (t.to("tpu") for t in gpt_batch(config, 8))
    step = torch.compile(AdamWTrainStep(GPT(config).to("tpu")), backend="tpu", fullgraph=True)
    start = time.perf_counter()
    step(x, y).item()
    first = time.perf_counter() - start
    start = time.perf_counter()
    step(x, y).item()
    steady = time.perf_counter() - start
    stats = tpu_compile.compiler.cache_stats()
    print("RESULT" + json.dumps(dict(first=first, steady=steady, **stats)))
""")


def run(cache_dir: str) -> dict:
    env = {**os.environ, "TORCHTPU_CACHE_DIR": cache_dir, "TORCHTPU_PLATFORM": "cpu"}
    code = CHILD.format(bench_dir=os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm-runs", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="torchtpu-cache-") as cache_dir:
        results = [("cold", run(cache_dir))] + [(f"warm {i + 1}", run(cache_dir)) for i in range(args.warm_runs)]
    print("| process | first call (s) | steady call (s) | compile (s) | XLA compilations | loaded from disk |")
    print("|---|---|---|---|---|---|")
    for name, r in results:
        print(f"| {name} | {r['first']:.2f} | {r['steady']:.3f} | {r['compile_seconds']:.2f} | "
              f"{r['compilations']} | {r['persistent_hits']} |")
    cold, warm = results[0][1], results[-1][1]
    print(f"\nXLA compile time, cold / warm: {cold['compile_seconds'] / max(warm['compile_seconds'], 1e-9):.1f}x; "
          f"first call, cold / warm: {cold['first'] / warm['first']:.2f}x (the rest is dynamo + aot_autograd tracing)")


if __name__ == "__main__":
    main()
