"""Training-step throughput: torch CPU eager, torch CPU Inductor, tpu eager, tpu compiled.

Prints three tables measured side by side in one run (medians of per-step times, the variants
timed in interleaved rounds so that a shared machine's drift hits them alike):
1. the GPT step (4 layers, d_model 256, seq 128, vocab 1024, batch 8) with MFU against a matmul
   peak measured here (max of XLA:CPU's and torch's 2048x2048 fp32 matmul);
2. a small, dispatch-bound GPT (d 64, 2 layers, seq 32, batch 1, vocab 256): tpu compiled vs eager;
3. an MLP step (batch 64, 512 -> 2048 -> 512, ReLU, MSE, SGD): tpu compiled vs Inductor.

"tpu whole-step" is the canonical step (``loss.backward()``, ``optimizer.step()``, ``zero_grad()``)
through ``torch.tpu.compile_step``: one captured XLA program per step.

    python benchmarks/train_step.py [--steps 10] [--warmup 2]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from typing import Callable

os.environ.setdefault("TORCHTPU_PLATFORM", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

import torchtpu.compile as tpu_compile  # noqa: E402
from torchtpu.device import bridge  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import GPT, MLP, AdamWTrainStep, GPTConfig, gpt_batch  # noqa: E402

tpu_compile.install()
torch._dynamo.config.trace_autograd_ops = True  # autograd.grad inside the compiled step


def median_seconds(fn: Callable[[], object], steps: int, warmup: int) -> float:
    for _ in range(warmup):
        _sync(fn())
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        _sync(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_rates(variants: dict, steps: int, warmup: int, rounds: int) -> dict[str, float]:
    """Steps/s of each variant: ``rounds`` rounds, each timing ``steps`` steps of every variant in
    turn, so slow drifts of a shared machine hit all variants alike; the median step time of each."""
    for fn in variants.values():
        for _ in range(warmup):
            _sync(fn())
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            for _ in range(steps):
                start = time.perf_counter()
                _sync(fn())
                times[name].append(time.perf_counter() - start)
    return {name: 1 / statistics.median(t) for name, t in times.items()}


def _sync(value) -> None:
    # Waiting for the step's loss is enough: it depends on every parameter the previous step updated.
    if isinstance(value, torch.Tensor) and value.device.type == "tpu":
        bridge.read(value).block_until_ready()


def matmul_peak(n: int = 2048, reps: int = 5) -> tuple[float, float]:
    """FLOP/s of an n x n fp32 matmul: (XLA:CPU through jnp, torch CPU)."""
    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(jnp.matmul)
    jax_s = median_seconds(lambda: mm(a, a).block_until_ready(), reps, 2)
    t = torch.ones(n, n)
    torch_s = median_seconds(lambda: t @ t, reps, 2)
    flops = 2 * n ** 3
    return flops / jax_s, flops / torch_s


def step_flops(make_step: Callable[[], Callable], batch) -> float:
    """FLOPs of one training step, counted on the CPU."""
    step = make_step()
    with FlopCounterMode(display=False) as counter:
        step(*batch)
    return counter.get_total_flops()


def gpt_variants(config: GPTConfig, batch_size: int, which: tuple[str, ...]) -> tuple[dict, Callable, tuple]:
    """name -> step closure for each variant, plus a CPU step factory and the CPU batch."""
    torch.manual_seed(0)
    model = GPT(config)
    x, y = gpt_batch(config, batch_size)
    tx, ty = x.to("tpu"), y.to("tpu")

    def cpu_step():
        return AdamWTrainStep(copy.deepcopy(model))

    def tpu_step():
        return AdamWTrainStep(copy.deepcopy(model).to("tpu"))

    builders = {
        "torch CPU eager": lambda: (lambda s: lambda: s(x, y))(cpu_step()),
        "torch CPU Inductor": lambda: (lambda s: lambda: s(x, y))(
            torch.compile(cpu_step(), backend="inductor", fullgraph=True)),
        "tpu eager": lambda: (lambda s: lambda: s(tx, ty))(tpu_step()),
        "tpu compiled": lambda: (lambda s: lambda: s(tx, ty))(
            torch.compile(tpu_step(), backend="tpu", fullgraph=True)),
        "tpu whole-step": lambda: (lambda m: (lambda s: lambda: s(tx, ty))(
            whole_step(m, torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01))))(copy.deepcopy(model).to("tpu")),
        # the step as users write it (loss.backward(), opt.step()) under torch.compile: graph breaks
        "torch CPU Inductor, canonical step": lambda: (lambda m: (lambda s: lambda: s(x, y))(torch.compile(
            canonical_step(m, torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)), backend="inductor")))(
            copy.deepcopy(model)),
        "tpu compiled, canonical step": lambda: (lambda m: (lambda s: lambda: s(tx, ty))(torch.compile(
            canonical_step(m, torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)), backend="tpu")))(
            copy.deepcopy(model).to("tpu")),
    }
    return {name: builders[name]() for name in which}, cpu_step, (x, y)


def canonical_step(loss_fn, opt):
    """The step as users write it: forward, ``loss.backward()``, ``optimizer.step()``, ``zero_grad()``."""

    def step(*batch):
        loss = loss_fn(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def whole_step(loss_fn, opt):
    """The canonical step as one captured XLA program per step (``torch.tpu.compile_step``)."""
    return torch.tpu.compile_step(canonical_step(loss_fn, opt))


class MLPStep:
    """Forward, backward and SGD for the MLP, as one traceable function."""

    def __init__(self, model: MLP, lr: float = 0.01):
        self.model, self.lr = model, lr
        self.params = list(model.parameters())

    def __call__(self, x, y):
        loss = F.mse_loss(self.model(x), y)
        grads = torch.autograd.grad(loss, self.params)
        with torch.no_grad():
            for p, g in zip(self.params, grads):
                p.sub_(self.lr * g)
        return loss.detach()


def mlp_variants() -> dict:
    torch.manual_seed(0)
    model = MLP(512, 2048, 512)
    x, y = torch.randn(64, 512), torch.randn(64, 512)
    tx, ty = x.to("tpu"), y.to("tpu")
    inductor = torch.compile(MLPStep(copy.deepcopy(model)), backend="inductor", fullgraph=True)
    tpu = torch.compile(MLPStep(copy.deepcopy(model).to("tpu")), backend="tpu", fullgraph=True)
    tpu_model = copy.deepcopy(model).to("tpu")
    whole = whole_step(lambda x, y: F.mse_loss(tpu_model(x), y), torch.optim.SGD(tpu_model.parameters(), lr=0.01))
    return {"torch CPU Inductor": lambda: inductor(x, y), "tpu compiled": lambda: tpu(tx, ty),
            "tpu whole-step": lambda: whole(tx, ty)}


def table(title: str, header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([f"\n{title}", line(header), sep] + [line(r) for r in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation happens here)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of --steps steps per variant")
    args = parser.parse_args()

    jax_peak, torch_peak = matmul_peak()
    peak = max(jax_peak, torch_peak)
    print(f"matmul peak (2048^2 fp32): XLA:CPU {jax_peak / 1e9:.1f} GFLOP/s, torch {torch_peak / 1e9:.1f} GFLOP/s; "
          f"MFU against {peak / 1e9:.1f}")

    config = GPTConfig(vocab_size=1024, block_size=128, n_layer=4, n_head=4, d_model=256)
    variants, cpu_step, batch = gpt_variants(config, 8, ("torch CPU eager", "torch CPU Inductor", "tpu eager",
                                                         "tpu compiled", "tpu whole-step"))
    flops = step_flops(cpu_step, batch)
    rows = []
    rates = interleaved_rates(variants, args.steps, args.warmup, args.rounds)
    for name in variants:
        rows.append([name, f"{rates[name]:.2f}", f"{100 * flops * rates[name] / peak:.1f}%"])
    for name in rates:
        rows[list(rates).index(name)].append(f"{rates[name] / rates['torch CPU Inductor']:.2f}x")
    print(table(f"GPT train step (4 layers, d 256, seq 128, vocab 1024, batch 8; {flops / 1e9:.2f} GFLOP/step)",
                ["variant", "steps/s", "MFU", "vs Inductor"], rows))

    small = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, d_model=64)
    variants, _, _ = gpt_variants(small, 1, ("torch CPU Inductor", "torch CPU Inductor, canonical step", "tpu eager",
                                             "tpu compiled", "tpu compiled, canonical step", "tpu whole-step"))
    small_rates = interleaved_rates(variants, args.steps * 3, args.warmup, args.rounds)
    ratio = small_rates["tpu compiled"] / small_rates["tpu eager"]
    whole = small_rates["tpu whole-step"]
    print(table("Small GPT train step (d 64, 2 layers, seq 32, batch 1, vocab 256): dispatch-bound",
                ["variant", "steps/s"], [[n, f"{r:.1f}"] for n, r in small_rates.items()])
          + f"\ntpu compiled / tpu eager: {ratio:.2f}x (target >= 5x)\nwhole-step / compiled canonical step: "
          f"{whole / small_rates['tpu compiled, canonical step']:.2f}x (target >= 1.5x); whole-step / compiled "
          f"fullgraph step: {whole / small_rates['tpu compiled']:.2f}x; whole-step / Inductor canonical step: "
          f"{whole / small_rates['torch CPU Inductor, canonical step']:.2f}x (target >= 1.0x); whole-step / "
          f"Inductor fullgraph step: {whole / small_rates['torch CPU Inductor']:.2f}x")

    mlp_rates = interleaved_rates(mlp_variants(), args.steps * 3, args.warmup, args.rounds * 3)
    ratio = mlp_rates["tpu compiled"] / mlp_rates["torch CPU Inductor"]
    print(table("MLP train step (batch 64, 512 -> 2048 -> 512, ReLU, MSE, SGD)",
                ["variant", "steps/s"], [[n, f"{r:.1f}"] for n, r in mlp_rates.items()])
          + f"\ntpu compiled / Inductor: {ratio:.2f}x (target >= 1.25x); whole-step / Inductor: "
          f"{mlp_rates['tpu whole-step'] / mlp_rates['torch CPU Inductor']:.2f}x (target >= 1.15x)")


if __name__ == "__main__":
    main()
