"""Eager modes side by side: the same training loops in DEFER_NEVER, DEFER_NEVER_AND_LAUNCH_BLOCKING,
DEFER_AND_FUSE and torch.compile(backend="tpu"), in one run.

Two loops: an elementwise-heavy MLP with a hand-written optimizer update (dispatch-bound, where
fusing pays most) and the GPT train step of the compile benchmark. Each step reads the loss with
``.item()``, as a training loop that logs does. Prints steps/s (median of repeats) and the ratios
the fused mode is judged by, plus the fused program-cache hit rate after warm-up.

    python benchmarks/eager_modes.py            # full size (GPT d_model 256, 4 layers, seq 128)
    python benchmarks/eager_modes.py --quick    # smaller models, for a fast look
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import GPT, GPTConfig  # noqa: E402

from torchtpu.eager import fused  # noqa: E402

MODES = ["DEFER_NEVER", "DEFER_NEVER_AND_LAUNCH_BLOCKING", "DEFER_AND_FUSE", "compiled"]


# ---------------------------------------------------------------- the elementwise-heavy loop

def make_mlp_loop(width: int, depth: int, batch: int):
    torch.manual_seed(0)
    weights = [(torch.randn(width, width) / width**0.5).to("tpu") for _ in range(depth)]
    momenta = [torch.zeros_like(w) for w in weights]
    x = torch.randn(batch, width, device="tpu")
    target = torch.randn(batch, width, device="tpu")
    for w in weights:
        w.requires_grad_(True)

    def step():
        h = x
        for w in weights:  # GELU written out: many small elementwise ops
            z = h @ w
            h = 0.5 * z * (1.0 + torch.tanh(0.7978845608 * (z + 0.044715 * z * z * z)))
        loss = ((h - target) ** 2).mean()
        loss.backward()
        with torch.no_grad():  # SGD with momentum, weight decay and clipping, by hand
            for w, m in zip(weights, momenta):
                g = w.grad.clamp(-1.0, 1.0) + 1e-4 * w
                m.mul_(0.9).add_(g)
                w.sub_(0.01 * m)
                w.grad = None
        return loss

    return step


# ---------------------------------------------------------------- the GPT loop

def make_gpt_loop(config: GPTConfig, batch: int):
    torch.manual_seed(0)
    model = GPT(config).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    idx = torch.randint(0, config.vocab_size, (batch, config.block_size + 1), device="tpu")
    x, y = idx[:, :-1], idx[:, 1:]

    def step():
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


# ---------------------------------------------------------------- timing

def steps_per_second(make_step, mode: str, steps: int, repeats: int, warmup: int) -> tuple[float, float | None]:
    step = make_step()
    if mode == "compiled":
        step = torch.compile(step, backend="tpu")
        context = torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_NEVER)
    else:
        context = torch.tpu.set_eager_mode(getattr(torch.tpu.EagerMode, mode))
    with context:
        for _ in range(warmup):
            step().item()
        hits0 = fused.executor.stats["program_cache_hits"]
        compiled0 = fused.executor.stats["programs_compiled"]
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(steps):
                step().item()
            torch.tpu.synchronize()
            rates.append(steps / (time.perf_counter() - start))
        hit_rate = None
        if mode == "DEFER_AND_FUSE":
            hits = fused.executor.stats["program_cache_hits"] - hits0
            misses = fused.executor.stats["programs_compiled"] - compiled0
            hit_rate = hits / max(hits + misses, 1)
    return statistics.median(rates), hit_rate


def table(title: str, make_step, steps: int, repeats: int, warmup: int) -> dict[str, float]:
    print(f"\n## {title}\n")
    print("| mode | steps/s | vs DEFER_NEVER | fused cache hit rate |")
    print("| --- | ---: | ---: | ---: |")
    results = {}
    for mode in MODES:
        rate, hit_rate = steps_per_second(make_step, mode, steps, repeats, warmup)
        results[mode] = rate
        hit = f"{hit_rate:.1%}" if hit_rate is not None else ""
        print(f"| {mode} | {rate:.2f} | {rate / results['DEFER_NEVER']:.2f}x | {hit} |", flush=True)
    print(f"\nDEFER_AND_FUSE / DEFER_NEVER = {results['DEFER_AND_FUSE'] / results['DEFER_NEVER']:.2f}x; "
          f"DEFER_AND_FUSE / compiled = {results['DEFER_AND_FUSE'] / results['compiled']:.0%}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller models and fewer steps")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    quick = args.quick
    print(f"torch {torch.__version__}, device {torch.tpu.get_device_name()}, "
          f"{'quick' if quick else 'full'} sizes, median of {args.repeats} repeats")
    width, depth, batch = (128, 4, 32) if quick else (256, 6, 64)
    table(f"Elementwise-heavy MLP ({depth} layers of {width}, batch {batch}, hand-written SGD update)",
          lambda: make_mlp_loop(width, depth, batch), steps=10 if quick else 20, repeats=args.repeats, warmup=3)
    config = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, d_model=64) if quick else GPTConfig()
    table(f"GPT train step (d_model {config.d_model}, {config.n_layer} layers, seq {config.block_size}, "
          f"batch {4 if quick else 8})", lambda: make_gpt_loop(config, 4 if quick else 8),
          steps=3 if quick else 5, repeats=args.repeats, warmup=2)


if __name__ == "__main__":
    main()
