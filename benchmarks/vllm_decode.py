"""vLLM on ``tpu``: decode step time and XLA programs, eager (``enforce_eager``) against compiled.

Each mode runs offline ``LLM.generate`` in its own process (the tiny random Llama of
``tools/make_tiny_llama.py``, float32, ``max_num_seqs=4``, ``max_num_batched_tokens=32``):

1. a mixed workload (``--mixed`` requests, prompts of 3-90 tokens, 4-24 new tokens, so prefills,
   chunked prefills and decode batches of 1-4 requests), served twice: the XLA programs torchtpu
   built (compiled, or loaded from its persistent cache) in the first pass and in the second;
2. the decode step: ``batch`` requests of a 16-token prompt make 8 and then 8 + ``--steps`` new
   tokens; the difference over ``--steps`` is one decode step of that batch. ``--rounds`` times;
   medians are printed, and compiled/eager ratios side by side.

    python benchmarks/vllm_decode.py [--python /tmp/vllmenv/bin/python] [--rounds 5] [--steps 32]

Needs the vllm extra (``tools/vllm_env.sh``); ``--python`` names the interpreter that has it.
Times are wall-clock on whatever else the machine is running: compare the two modes measured in
the same run, not figures across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

WORKER = r"""
import json, random, statistics, sys, time
from vllm import LLM, SamplingParams
from torchtpu import metrics

model, eager, rounds, steps, mixed = sys.argv[1], sys.argv[2] == "1", *map(int, sys.argv[3:6])
llm = LLM(model=model, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32,
          dtype="float32", block_size=16, enforce_eager=eager, enable_prefix_caching=False)
tokenizer = llm.get_tokenizer()
vocab = [i for i in range(len(tokenizer)) if i > 8]  # past the special tokens


def built():
    snap = metrics.snapshot()
    return {kind: int(snap[kind + "_compiles"]["compilations"] + snap[kind + "_compiles"]["persistent_hits"])
            for kind in ("graph", "eager")}


def serve(requests):
    prompts = [{"prompt_token_ids": ids} for ids, _ in requests]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    return llm.generate(prompts, params, use_tqdm=False)


rng = random.Random(0)
workload = [([rng.choice(vocab) for _ in range(rng.randint(3, 90))], rng.randint(4, 24))
            for _ in range(mixed)]
before = built()
serve(workload)
first = built()
serve([([rng.choice(vocab) for _ in ids], n) for ids, n in workload])  # same lengths, new ids
second = built()
result = {"programs_startup": before, "programs_first_pass": {k: first[k] - before[k] for k in first},
          "programs_second_pass": {k: second[k] - first[k] for k in first}, "step_ms": {}}
for batch in (1, 4):
    per_step = []
    for r in range(rounds + 1):  # round 0 warms the shapes up
        prompt = [[rng.choice(vocab) for _ in range(16)] for _ in range(batch)]
        times = []
        for n in (8, 8 + steps):
            start = time.perf_counter()
            serve([(ids, n) for ids in prompt])
            times.append(time.perf_counter() - start)
        if r:
            per_step.append((times[1] - times[0]) / steps * 1e3)
    result["step_ms"][batch] = statistics.median(per_step)
print("RESULT" + json.dumps(result))
"""


def run_mode(python: str, model: str, eager: bool, args) -> dict:
    env = {**os.environ, "VLLM_PLATFORM": "tpu", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([python, "-c", WORKER, model, "1" if eager else "0", str(args.rounds),
                           str(args.steps), str(args.mixed)],
                          capture_output=True, text=True, env=env, timeout=3600)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    if not line:
        sys.exit(f"vllm ({'eager' if eager else 'compiled'}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[0][len("RESULT"):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--python", default=sys.executable, help="interpreter with vllm installed")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--mixed", type=int, default=12)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([args.python, str(REPO / "tools" / "make_tiny_llama.py"), tmp], check=True,
                       capture_output=True)
        eager = run_mode(args.python, tmp, True, args)
        compiled = run_mode(args.python, tmp, False, args)
    print(f"{'':28}{'eager':>12}{'compiled':>12}{'ratio':>8}")
    for batch in ("1", "4"):
        e, c = eager["step_ms"][batch], compiled["step_ms"][batch]
        print(f"{'decode step, batch ' + batch + ' (ms)':28}{e:12.1f}{c:12.1f}{e / c:7.2f}x")
    for name in ("programs_startup", "programs_first_pass", "programs_second_pass"):
        for kind in ("graph", "eager"):
            label = f"{kind} programs, {name.split('_', 1)[1].replace('_', ' ')}"
            print(f"{label:28}{eager[name][kind]:12d}{compiled[name][kind]:12d}")
    print(f"(medians of {args.rounds} rounds, {args.steps} decode steps each; mixed workload of "
          f"{args.mixed} requests served twice)")


if __name__ == "__main__":
    main()
