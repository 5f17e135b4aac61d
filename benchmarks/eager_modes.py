"""Eager modes side by side: the same training loops in DEFER_NEVER, DEFER_NEVER_AND_LAUNCH_BLOCKING,
DEFER_AND_FUSE and torch.compile(backend="tpu"), in one run.

Two loops: an elementwise-heavy MLP with a hand-written optimizer update (dispatch-bound, where
fusing pays most) and the GPT train step of the compile benchmark. Each step reads the loss with
``.item()``, as a training loop that logs does. The modes are timed in interleaved rounds; prints
steps/s (median per mode) and the ratios the fused mode is judged by, the fused program-cache hit
rate after warm-up, and the bound on the fused speedup that the per-op cost of a Python device
kernel sets (the dispatcher and a new tensor per op, measured in the same run).

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

def _context(mode: str):
    # compiled steps run with eager ops in the default mode (there are none inside the graph)
    return torch.tpu.set_eager_mode(getattr(torch.tpu.EagerMode, "DEFER_NEVER" if mode == "compiled" else mode))


def interleaved_steps(make_step, steps: int, rounds: int, warmup: int) -> tuple[dict, float, float]:
    """Seconds per step of every mode, timed in ``rounds`` interleaved rounds (this machine drifts
    between runs; interleaving makes every mode see the same drift): the median per mode, the
    fused program-cache hit rate after warm-up and the fused ops recorded per step."""
    runners = {}
    for mode in MODES:
        step = make_step()
        runners[mode] = torch.compile(step, backend="tpu") if mode == "compiled" else step
        with _context(mode):
            for _ in range(warmup):
                runners[mode]().item()
    hits0, compiled0 = fused.stats()["program_cache_hits"], fused.stats()["programs_compiled"]
    ops0 = fused.stats()["ops_recorded"]
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(rounds):
        for mode in MODES:
            with _context(mode):
                start = time.perf_counter()
                for _ in range(steps):
                    runners[mode]().item()
                torch.tpu.synchronize()
                times[mode].append((time.perf_counter() - start) / steps)
    hits = fused.stats()["program_cache_hits"] - hits0
    misses = fused.stats()["programs_compiled"] - compiled0
    ops = (fused.stats()["ops_recorded"] - ops0) / (rounds * steps)
    return {mode: statistics.median(t) for mode, t in times.items()}, hits / max(hits + misses, 1), ops


def python_kernel_floor(repeats: int = 5, n: int = 2000) -> float:
    """Seconds per op of the cheapest eager op a Python device kernel can be: PyTorch's dispatcher
    calling a kernel that only returns a new ``tpu`` tensor (no recording, no JAX)."""
    from torchtpu.device import bridge

    lib = torch.library.Library("torchtpu_floor", "FRAGMENT")
    lib.define("noop(Tensor a, Tensor b) -> Tensor")
    x = torch.randn(64, 256, device="tpu")
    array = bridge.read(x)
    lib.impl("noop", lambda a, b: bridge.wrap(array, 0), "PrivateUse1")
    op = torch.ops.torchtpu_floor.noop.default
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(n):
            op(x, x)
        best = min(best, (time.perf_counter() - start) / n)
    return best


def table(title: str, make_step, steps: int, rounds: int, warmup: int, floor: float) -> dict[str, float]:
    print(f"\n## {title}\n")
    seconds, hit_rate, ops = interleaved_steps(make_step, steps, rounds, warmup)
    print("| mode | steps/s | vs DEFER_NEVER | fused cache hit rate |")
    print("| --- | ---: | ---: | ---: |")
    results = {mode: 1 / s for mode, s in seconds.items()}
    for mode, rate in results.items():
        hit = f"{hit_rate:.1%}" if mode == "DEFER_AND_FUSE" else ""
        print(f"| {mode} | {rate:.2f} | {rate / results['DEFER_NEVER']:.2f}x | {hit} |")
    print(f"\nDEFER_AND_FUSE / DEFER_NEVER = {results['DEFER_AND_FUSE'] / results['DEFER_NEVER']:.2f}x; "
          f"DEFER_AND_FUSE / compiled = {results['DEFER_AND_FUSE'] / results['compiled']:.0%}")
    # The best any Python-kernel recording could do: every op at least costs the dispatcher and a
    # new tensor, and the step's XLA work (the compiled step's time) still has to run.
    bound = ops * floor + seconds["compiled"]
    print(f"{ops:.0f} ops recorded per step: {(seconds['DEFER_AND_FUSE'] - seconds['compiled']) / ops * 1e6:.1f} us "
          f"per op above the compiled step; the Python-kernel floor is {floor * 1e6:.1f} us per op, so "
          f"DEFER_AND_FUSE / DEFER_NEVER <= {seconds['DEFER_NEVER'] / bound:.2f}x for any design that records in "
          f"Python kernels")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller models and fewer steps")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of every mode")
    args = parser.parse_args()
    quick = args.quick
    floor = python_kernel_floor()
    print(f"torch {torch.__version__}, device {torch.tpu.get_device_name()}, "
          f"{'quick' if quick else 'full'} sizes, median of {args.rounds} interleaved rounds")
    width, depth, batch = (128, 4, 32) if quick else (256, 6, 64)
    table(f"Elementwise-heavy MLP ({depth} layers of {width}, batch {batch}, hand-written SGD update)",
          lambda: make_mlp_loop(width, depth, batch), steps=10 if quick else 20, rounds=args.rounds, warmup=3,
          floor=floor)
    config = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, d_model=64) if quick else GPTConfig()
    table(f"GPT train step (d_model {config.d_model}, {config.n_layer} layers, seq {config.block_size}, "
          f"batch {4 if quick else 8})", lambda: make_gpt_loop(config, 4 if quick else 8),
          steps=3 if quick else 5, rounds=args.rounds, warmup=2, floor=floor)


if __name__ == "__main__":
    main()
