"""XLA programs an eager decode loop compiles per step, in a cold and a warm process.

A small GPT (``torchtpu.demo.CharGPT``) samples tokens in eager mode (DEFER_NEVER, or
``TORCHTPU_DEFER_AND_FUSE=1``); the sequence grows by one each step, so every step has new
shapes. Each process prints, per step, how many XLA programs were compiled and how many were
loaded from the persistent cache, counted from JAX's own monitoring events (so the script also
measures builds of torchtpu without ``torchtpu.metrics``' eager counters). The second process
shares the first one's ``TORCHTPU_CACHE_DIR``.

    python benchmarks/decode_compiles.py [--steps 24] [--per-program] [--report]
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
    import collections, json, sys, time
    from jax import monitoring
    import torch
    import torchtpu
    from torchtpu import metrics
    from torchtpu.demo import CharGPT, GPTConfig

    # Every XLA program built in the process (compiled, or loaded from the persistent cache), by
    # name, independent of torchtpu's own counters (so this also measures builds without them).
    names = collections.Counter()
    def on_duration(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            names[str(kw.get("fun_name", "?"))] += 1
    monitoring.register_event_duration_secs_listener(on_duration)
    hits = collections.Counter()
    def on_event(event, **kw):
        if event == "/jax/compilation_cache/cache_hits":
            hits["n"] += 1
    monitoring.register_event_listener(on_event)

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=65, block_size=64, n_embd=64, n_head=4, n_layer=2)
    model = CharGPT(cfg).to("tpu").eval()
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (1, 4)).to("tpu")
    torch.tpu.synchronize()
    metrics.reset()
    names.clear(); hits.clear()
    rows = []
    start_all = time.perf_counter()
    with torch.no_grad():
        for step in range({steps}):
            before, hits_before, t0 = collections.Counter(names), hits["n"], time.perf_counter()
            logits = model(idx[:, -cfg.block_size:])[:, -1, :] / 0.8
            probs = logits.softmax(-1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=gen).to("tpu")
            idx = torch.cat([idx, nxt], dim=1)
            torch.tpu.synchronize()
            if hasattr(metrics, "end_step"):
                metrics.end_step()
            new, loaded = names - before, hits["n"] - hits_before  # builds: compiled or loaded
            rows.append(dict(step=step, t=idx.shape[1], compiles=sum(new.values()) - loaded, loaded=loaded,
                             seconds=time.perf_counter() - t0, programs=sorted(new)))
    total = time.perf_counter() - start_all
    snap = metrics.snapshot()
    print("RESULT" + json.dumps(dict(rows=rows, total_seconds=total, compiles=sum(names.values()) - hits["n"],
                                     loaded=hits["n"], eager=snap.get("eager_compiles"))))
    if {report}:
        metrics.report()
""")


def run(cache_dir: str, steps: int, report: bool = False) -> dict:
    env = {**os.environ, "TORCHTPU_CACHE_DIR": cache_dir, "TORCHTPU_PLATFORM": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    code = CHILD.replace("{steps}", str(steps)).replace("{report}", str(report))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    if report:
        print(proc.stdout[proc.stdout.index(line) + len(line):])
    return json.loads(line[len("RESULT"):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--per-program", action="store_true", help="list the programs each step compiled")
    parser.add_argument("--cache-dir", help="reuse this cache dir (default: a fresh temporary one)")
    parser.add_argument("--report", action="store_true", help="print torchtpu.metrics.report() of each process")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="torchtpu-cache-") as tmp:
        cache_dir = args.cache_dir or tmp
        results = [("cold", run(cache_dir, args.steps, args.report)), ("warm", run(cache_dir, args.steps, args.report))]
    for label, r in results:
        print(f"## {label} process: {r['compiles']} XLA compilations, {r['loaded']} loaded from disk, "
              f"{r['total_seconds']:.2f} s for {args.steps} steps")
        print("| step | seq len | compiled | loaded from disk | seconds |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        for row in r["rows"]:
            print(f"| {row['step']} | {row['t']} | {row['compiles']} | {row['loaded']} | {row['seconds']:.3f} |")
            if args.per_program and row["programs"]:
                print("    " + ", ".join(row["programs"]))
        if r.get("eager"):
            print("metrics eager_compiles:", json.dumps(r["eager"]))


if __name__ == "__main__":
    main()
