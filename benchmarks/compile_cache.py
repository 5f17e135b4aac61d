"""Cold vs warm first call of a compiled GPT train step, each in a fresh process, per warm-start mode.

A cold process starts with empty caches; a warm one finds what an earlier process left on disk:
only the XLA executables (``TORCHTPU_WARM_START=off``), also aot_autograd's graphs (``aot``, the
default) or also dynamo's (``dynamo``). The first call is ``torch.compile``'s whole work (dynamo,
aot_autograd, lowering to JAX, XLA) plus one step; rounds alternate the processes, and the table
shows medians. Processes run one at a time, so other load on the machine shows in every row.

    python benchmarks/compile_cache.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
    # a bound method: PyTorch's Dynamo cache keys functions by name, which a callable object lacks
    step = torch.compile(AdamWTrainStep(GPT(config).to("tpu")).__call__, backend="tpu", fullgraph=True)
    start = time.perf_counter()
    loss = step(x, y).item()
    first = time.perf_counter() - start
    start = time.perf_counter()
    step(x, y).item()
    steady = time.perf_counter() - start
    stats = tpu_compile.compiler.cache_stats()
    print("RESULT" + json.dumps(dict(first=first, steady=steady, loss=loss, **stats)))
""")

# (row, warm-start mode, which cache directory: cold processes start one)
PROCESSES = [("cold", "aot", "a"), ("warm, XLA cache only (off)", "off", "a"),
             ("warm, + AOTAutograd cache (aot, default)", "aot", "a"),
             ("cold, Dynamo cache on (dynamo)", "dynamo", "b"), ("warm, + Dynamo cache (dynamo)", "dynamo", "b")]


def fresh_dir(root: str) -> str:
    """A cache directory whose C++ extension build is this machine's (else each cold process builds it)."""
    from torchtpu.config import config

    path = tempfile.mkdtemp(prefix="torchtpu-cache-", dir=root)
    ext = os.path.join(config.cache_dir, "ext")
    if os.path.isdir(ext):
        os.symlink(ext, os.path.join(path, "ext"), target_is_directory=True)
    return path


def run(cache_dir: str, mode: str) -> dict:
    env = {**os.environ, "TORCHTPU_CACHE_DIR": cache_dir, "TORCHTPU_PLATFORM": "cpu", "TORCHTPU_WARM_START": mode,
           "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache_dir, "torch")}
    for name in ("JAX_COMPILATION_CACHE_DIR", "TORCH_CACHING_PRECOMPILE"):
        env.pop(name, None)
    code = CHILD.format(bench_dir=os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {name: [] for name, _, _ in PROCESSES}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="torchtpu-bench-") as root:
        for _ in range(args.rounds):
            dirs = {"a": fresh_dir(root), "b": fresh_dir(root)}
            for name, mode, which in PROCESSES:
                results[name].append(run(dirs[which], mode))
    losses = {r["loss"] for rs in results.values() for r in rs}
    cold = statistics.median(r["first"] for r in results["cold"])
    print(f"GPT train step (d_model 256, 4 layers, seq 128, batch 8, AdamW), medians of {args.rounds} rounds\n")
    print("| process | first call (s), median | / cold | each round (s) | steady call (s) | XLA compilations | "
          "XLA loads | aot_autograd cache hits | graphs reused |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        first = statistics.median(r["first"] for r in runs)
        rounds = ", ".join(f"{r['first']:.1f}" for r in runs)
        counts = [" / ".join(str(int(r[k])) for r in runs)
                  for k in ("compilations", "persistent_hits", "warm_hits", "warm_loads")]
        print(f"| {name} | {first:.2f} | {first / cold:.2f}x | {rounds} | "
              f"{statistics.median(r['steady'] for r in runs):.3f} | {' | '.join(counts)} |")
    print(f"\nload average (1 min) before / after: {load_before:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"every process's first loss: {sorted(losses)} ({'the same' if len(losses) == 1 else 'DIFFERENT'})")


if __name__ == "__main__":
    main()
