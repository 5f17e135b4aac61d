"""Decode speed of Hugging Face ``generate`` on a tiny Llama: tpu vs CPU, eager vs compiled.

A random Llama (4 layers, d 256, 8 heads, 4 KV heads, vocab 4096) decodes greedily at batch 1
and 8. Four rows per batch, timed in turns (round after round, each row once per round, so a
busy spell on a shared machine hits them all alike):

- ``tpu eager``: the default dynamic cache, every op eager on ``tpu`` (the common ops through the
  native eager kernel, ``csrc/eager.cpp``);
- ``tpu eager python``: the same with the native kernel switched off (every op's Python kernel);
- ``tpu fused``: the same in ``DEFER_AND_FUSE`` (ops recorded, natively where the call is known,
  and run as one program per read: Transformers reads the stopping criteria each token);
- ``tpu static+compile``: ``cache_implementation="static"``; Transformers compiles the decode
  step itself, with the ``"tpu"`` backend;
- ``cpu eager``: PyTorch on the CPU, dynamic cache;
- ``cpu static+inductor``: static cache, decode step compiled by Inductor.

Decode tokens/s = batch x (new - 1) / (time of ``new`` tokens - time of 1 token), medians, so
the prefill is left out. The ratio columns compare each row with ``cpu static+inductor`` and
with ``cpu eager``.

    python benchmarks/hf_generate.py [--new 32] [--prompt 16] [--rounds 5] [--batches 1 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM

from torchtpu.eager import native_kernels

ROWS = ["tpu eager", "tpu eager python", "tpu fused", "tpu static+compile", "cpu eager", "cpu static+inductor"]
REFERENCE = "cpu static+inductor"
EAGER = "cpu eager"


def build(device: str) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    return model.to(device) if device != "cpu" else model


def generate_fn(row: str, models: dict):
    """A function (ids, new tokens) -> tokens for the row, on the row's device."""
    device = row.split()[0]
    model = models[device]
    kwargs = dict(do_sample=False, pad_token_id=0)
    if "static" in row:
        kwargs["cache_implementation"] = "static"
    if row == REFERENCE:  # Transformers compiles on CUDA/XPU/tpu by itself; on CPU it must be asked
        config = CompileConfig(backend="inductor", mode="default", dynamic=False)
        config._compile_all_devices = True
        kwargs["compile_config"] = config

    def run(ids: torch.Tensor, new: int) -> torch.Tensor:
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kwargs)
        return out.cpu()  # waits for the device

    if row == "tpu fused":
        def run_fused(ids: torch.Tensor, new: int) -> torch.Tensor:
            with torch.tpu.set_eager_mode("defer_and_fuse"):
                return run(ids, new)
        return run_fused

    if row != "tpu eager python":
        return run

    def run_python(ids: torch.Tensor, new: int) -> torch.Tensor:
        native_kernels.set_enabled(False)
        try:
            return run(ids, new)
        finally:
            native_kernels.set_enabled(True)
    return run_python


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def measure(batch: int, args, models) -> dict[str, float]:
    """Decode tokens/s per row, medians over args.rounds rounds taken in turns."""
    ids = torch.randint(0, 4096, (batch, args.prompt), generator=torch.Generator().manual_seed(batch))
    inputs = {"tpu": ids.to("tpu"), "cpu": ids}
    fns = {row: generate_fn(row, models) for row in ROWS}
    outputs = {}
    for row in ROWS:  # warm-up: compiles, and every shape the eager rows meet
        for new in (1, args.new):
            outputs[row] = fns[row](inputs[row.split()[0]], new)
    agree = all(torch.equal(outputs[row], outputs["cpu eager"]) for row in ROWS)
    full, one = {row: [] for row in ROWS}, {row: [] for row in ROWS}
    for _ in range(args.rounds):
        for row in ROWS:
            x = inputs[row.split()[0]]
            one[row].append(timed(fns[row], x, 1))
            full[row].append(timed(fns[row], x, args.new))
    rates = {row: batch * (args.new - 1) / (statistics.median(full[row]) - statistics.median(one[row]))
             for row in ROWS}
    print(f"batch {batch}: greedy tokens {'agree' if agree else 'DIFFER'} across rows")
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new", type=int, default=32, help="tokens generated per timed call")
    parser.add_argument("--prompt", type=int, default=16, help="prompt length")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    models = {"tpu": build("tpu"), "cpu": build("cpu")}
    print(f"tpu backed by {torch.tpu.get_device_name()}; torch CPU threads {torch.get_num_threads()}")
    results = {batch: measure(batch, args, models) for batch in args.batches}
    print(f"\n| row | {' | '.join(f'batch {b} tok/s' for b in args.batches)} | "
          f"{' | '.join(f'batch {b} vs inductor' for b in args.batches)} | "
          f"{' | '.join(f'batch {b} vs cpu eager' for b in args.batches)} |")
    print("| --- |" + " ---: |" * (3 * len(args.batches)))
    for row in ROWS:
        rates = [results[b][row] for b in args.batches]
        ratios = [results[b][row] / results[b][REFERENCE] for b in args.batches]
        eager = [results[b][row] / results[b][EAGER] for b in args.batches]
        print(f"| {row} | {' | '.join(f'{r:.0f}' for r in rates)} | {' | '.join(f'{r:.2f}x' for r in ratios)} | "
              f"{' | '.join(f'{r:.2f}x' for r in eager)} |")


if __name__ == "__main__":
    main()
