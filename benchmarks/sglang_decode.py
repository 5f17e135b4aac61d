"""SGLang on tpu: decode step time eager vs compiled (``--enable-torch-compile``), and how many
programs the compiled decode needs for batch sizes 1..32.

    /tmp/sglangenv/bin/python benchmarks/sglang_decode.py [--rounds 5] [--steps 64]

Each mode runs ``sglang.Engine`` on the tiny Llama (``tools/make_tiny_llama.py``) in a child
process (its scheduler's log is where the compiled runner reports its programs):

1. every batch size 1..32 decodes a few tokens (all requests the same length, ``ignore_eos``):
   the compiled runner pads them to SGLang's capture sizes and logs each new program;
2. for batch sizes 1, 8 and 32, a decode step's time is (time of ``1 + steps`` tokens - time of
   1 token) / steps, the prefill cancelling out; the median of ``rounds`` rounds is printed.

The two modes run one after the other in one invocation; the machine is shared, so compare
the ratio of one run, not absolute times across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIMED_BATCHES = (1, 8, 32)
PROGRAMS_LINE = re.compile(r"tpu decode graph: new shape .*: (\d+) shapes, (\d+) dynamo graphs, (\d+) XLA programs")


def prompts(n: int) -> list[str]:
    return [f"Request {i} asks the clockmaker about" for i in range(n)]


def generate_seconds(llm, n: int, new_tokens: int) -> float:
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    start = time.perf_counter()
    llm.generate(prompts(n), params)
    return time.perf_counter() - start


def child(compiled: bool, rounds: int, steps: int, model_dir: str) -> None:
    """One mode: warm every batch size, then time decode steps; prints one JSON line."""
    import sglang as sgl

    # No radix cache: a repeated prompt would prefill a different (cached) shape in every round,
    # and its first eager compile would land in the timings.
    llm = sgl.Engine(model_path=model_dir, dtype="float32", max_total_tokens=8192, log_level="info",
                     enable_torch_compile=compiled, torch_compile_max_bs=32, disable_radix_cache=True)
    try:
        start = time.perf_counter()
        for n in range(1, 33):
            generate_seconds(llm, n, 4)
        warm = time.perf_counter() - start
        step_ms = {}
        for n in TIMED_BATCHES:
            generate_seconds(llm, n, 1 + steps)  # untimed: the longer keys' shapes compile here
            samples = [(generate_seconds(llm, n, 1 + steps) - generate_seconds(llm, n, 1)) / steps * 1e3
                       for _ in range(rounds)]
            step_ms[n] = statistics.median(samples)
    finally:
        llm.shutdown()
    print("RESULT " + json.dumps({"warm_s": warm, "step_ms": step_ms}), flush=True)


def run_mode(compiled: bool, args, model_dir: str) -> dict:
    cmd = [sys.executable, __file__, "--child", "compiled" if compiled else "eager", "--rounds", str(args.rounds),
           "--steps", str(args.steps), "--model-dir", model_dir]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "SGLANG_PLATFORM": "tpu"})
    log = proc.stdout + proc.stderr
    results = [line for line in log.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        raise SystemExit(f"the {'compiled' if compiled else 'eager'} run failed:\n{log[-4000:]}")
    result = json.loads(results[-1][len("RESULT "):])
    counts = [tuple(map(int, m.groups())) for m in PROGRAMS_LINE.finditer(log)]
    result["shapes"], result["graphs"], result["programs"] = counts[-1] if counts else (0, 0, 0)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--child", choices=("eager", "compiled"))
    parser.add_argument("--model-dir")
    args = parser.parse_args()
    if args.child:
        child(args.child == "compiled", args.rounds, args.steps, args.model_dir)
        return
    sys.path.insert(0, str(REPO / "tools"))
    from make_tiny_llama import make_tiny_llama

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_tiny_llama(Path(tmp) / "tiny-llama"))
        eager, compiled = run_mode(False, args, model_dir), run_mode(True, args, model_dir)
    print(f"SGLang on tpu, tiny Llama, decode step (median of {args.rounds}, {args.steps} steps each); "
          f"shared machine, noisy")
    print(f"{'batch':>5} {'eager ms':>9} {'compiled ms':>12} {'speedup':>8}")
    for n in TIMED_BATCHES:
        e, c = eager["step_ms"][str(n)], compiled["step_ms"][str(n)]
        print(f"{n:>5} {e:>9.1f} {c:>12.1f} {e / c:>7.2f}x")
    print(f"compiled decode: {compiled['shapes']} shapes (capture size x key bucket), {compiled['graphs']} dynamo "
          f"graphs, {compiled['programs']} XLA programs for batch sizes 1..32 and the timed runs "
          f"(warm-up over 1..32: compiled {compiled['warm_s']:.0f} s, eager {eager['warm_s']:.0f} s)")


if __name__ == "__main__":
    main()
