"""Eager modes side by side: the same training loops in DEFER_NEVER, DEFER_NEVER_AND_LAUNCH_BLOCKING,
DEFER_AND_FUSE, torch.compile(backend="tpu") and a captured step replayed as one program
(``torch.tpu.compile_step``), in one run.

Two loops: an elementwise-heavy MLP with a hand-written optimizer update (dispatch-bound, where
fusing pays most) and the GPT train step of the compile benchmark. Each step reads the loss with
``.item()``, as a training loop that logs does. A third table runs GPT loops (the small GPT, and
the full-size one) that read the loss every step or only at the end, in DEFER_NEVER and
DEFER_AND_FUSE: the loop users write when they log every hundred steps, where the fused mode must
find the step boundary without a read. The modes are timed in interleaved rounds; prints
steps/s (median per mode) and the ratios the fused mode is judged by, the fused program-cache hit
rate after warm-up, and the bound on the fused speedup that the per-op cost of a Python device
kernel sets (the dispatcher and a new tensor per op, measured in the same run).

    python benchmarks/eager_modes.py            # full size (GPT d_model 256, 4 layers, seq 128)
    python benchmarks/eager_modes.py --quick    # smaller models, for a fast look
    python benchmarks/eager_modes.py --tables reads    # only the read-every-step / read-at-the-end table
    python benchmarks/eager_modes.py --tables feeds    # where the batch is transferred (same / in-loop / before)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import GPT, GPTConfig  # noqa: E402

from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402

from torchtpu.eager import fused  # noqa: E402

MODES = ["DEFER_NEVER", "DEFER_NEVER_AND_LAUNCH_BLOCKING", "DEFER_AND_FUSE", "compiled", "captured"]


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


# ---------------------------------------------------------------- where the batch is transferred

FEEDS = ("same batch", "in-loop .to", "on device first", "device batch list")
DATA_MODELS = ("small GPT", "TransformerEncoder")


class EncoderLM(torch.nn.Module):
    """A 2-layer ``nn.TransformerEncoderLayer`` model as users write it (PyTorch's defaults:
    dim_feedforward 2048, dropout 0.1), with token embeddings and a linear head."""

    def __init__(self, vocab: int = 256, d_model: int = 64, n_layer: int = 2, dropout: float = 0.1):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d_model)
        layer = torch.nn.TransformerEncoderLayer(d_model, nhead=4, dropout=dropout, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d_model, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.tok(idx)))


def make_data_loop(model_name: str, feed: str, batch: int = 1, seq: int = 32, batches: int = 64,
                   dropout: float | None = None):
    """A training loop (AdamW) whose step takes its batch as ``feed`` says: the same device batch
    every step; a new host batch each step, moved with ``.to("tpu")`` inside the step; a new
    batch each step sliced from the whole data set moved to ``tpu`` before the loop
    (``X = X.to("tpu")``, then ``X[i:i + batch]``); or one from a list of batches each moved to
    ``tpu`` before the loop. ``dropout``: the model's (None: its default)."""
    if model_name not in DATA_MODELS or feed not in FEEDS:
        raise ValueError(f"make_data_loop: model_name one of {DATA_MODELS}, feed one of {FEEDS}")
    torch.manual_seed(0)
    vocab = 256
    if model_name == "small GPT":
        config = GPTConfig(vocab_size=vocab, block_size=seq, n_layer=2, n_head=4, d_model=64,
                           dropout=dropout or 0.0)
        model = GPT(config).to("tpu")
    else:
        model = EncoderLM(vocab, 64, 2, **({} if dropout is None else {"dropout": dropout})).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data = torch.randint(0, vocab, (batches * batch, seq + 1))  # on the host
    on_device = data.to("tpu") if feed == "on device first" else None
    first = data[:batch].to("tpu") if feed == "same batch" else None
    listed = [data[i:i + batch].to("tpu") for i in range(0, len(data), batch)] if feed == "device batch list" else None
    count = [0]

    def step():
        i = count[0] % batches * batch
        count[0] += 1
        if feed == "same batch":
            idx = first
        elif feed == "in-loop .to":
            idx = data[i:i + batch].to("tpu")
        elif feed == "on device first":
            idx = on_device[i:i + batch]
        else:
            idx = listed[i // batch]
        x, y = idx[:, :-1], idx[:, 1:]
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def feeds_table(title: str, model_name: str, steps: int, rounds: int, warmup: int) -> dict:
    """Steps/s of every feed in DEFER_NEVER and DEFER_AND_FUSE (loss read only after the last
    step), a fresh model per variant, timed in interleaved rounds, and the fused programs compiled
    during the timed rounds (0 once the program structure has settled)."""
    print(f"\n## {title}\n")
    variants = [(feed, mode) for feed in FEEDS for mode in ("DEFER_NEVER", "DEFER_AND_FUSE")]
    runners = {}
    for feed, mode in variants:
        runners[feed, mode] = make_data_loop(model_name, feed)
        _run(runners[feed, mode], mode, False, warmup)
    times: dict = {v: [] for v in variants}
    compiled: Counter = Counter()
    for _ in range(rounds):
        for v in variants:
            before = fused.stats()["programs_compiled"]
            times[v].append(_run(runners[v], v[1], False, steps) / steps)
            compiled[v[0]] += fused.stats()["programs_compiled"] - before
    rates = {v: 1 / statistics.median(t) for v, t in times.items()}
    print("| batch | DEFER_NEVER steps/s | DEFER_AND_FUSE steps/s | fused / never | fused programs compiled in "
          "timed rounds |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for feed in FEEDS:
        never, fuse = rates[feed, "DEFER_NEVER"], rates[feed, "DEFER_AND_FUSE"]
        print(f"| {feed} | {never:.1f} | {fuse:.1f} | {fuse / never:.2f}x | {compiled[feed]} |")
    fused_rates = [rates[feed, "DEFER_AND_FUSE"] for feed in FEEDS]
    print(f"\nDEFER_AND_FUSE: slowest feed / fastest = {min(fused_rates) / max(fused_rates):.2f} (target >= 0.90); "
          f"lowest fused / never = {min(r / rates[f, 'DEFER_NEVER'] for f, r in zip(FEEDS, fused_rates)):.2f}x "
          f"(target >= 1.3x)")
    return rates


# ---------------------------------------------------------------- timing

def _context(mode: str):
    # compiled and captured steps run with eager ops in the default mode (there are none inside them)
    return torch.tpu.set_eager_mode(getattr(torch.tpu.EagerMode, "DEFER_NEVER" if mode in ("compiled", "captured")
                                            else mode))


def interleaved_runs(make_step, variants: dict[str, tuple[str, bool]], steps: int, rounds: int,
                     warmup: int) -> tuple[dict, float, float]:
    """Seconds per step of every variant (label -> (mode, whether each step reads its loss with
    ``.item()``; otherwise only the last step's loss is read, after the loop)), timed in ``rounds``
    interleaved rounds (this machine drifts between runs; interleaving makes every variant see the
    same drift): the median per variant, the fused program-cache hit rate after warm-up and the
    fused ops recorded per step."""
    runners = {}
    for label, (mode, read_every) in variants.items():
        step = make_step()
        runners[label] = torch.compile(step, backend="tpu") if mode == "compiled" else \
            torch.tpu.compile_step(step) if mode == "captured" else step
        _run(runners[label], mode, read_every, warmup)
    before = fused.stats()
    times: dict[str, list[float]] = {label: [] for label in variants}
    for _ in range(rounds):
        for label, (mode, read_every) in variants.items():
            times[label].append(_run(runners[label], mode, read_every, steps) / steps)
    after = fused.stats()
    hits = after["program_cache_hits"] - before["program_cache_hits"]
    misses = after["programs_compiled"] - before["programs_compiled"]
    ops = (after["ops_recorded"] - before["ops_recorded"]) / (rounds * steps)
    return {label: statistics.median(t) for label, t in times.items()}, hits / max(hits + misses, 1), ops


def _run(step, mode: str, read_every: bool, steps: int) -> float:
    """Seconds for ``steps`` steps in ``mode``, reading the loss every step or once at the end."""
    with _context(mode):
        start = time.perf_counter()
        for _ in range(steps):
            loss = step()
            if read_every:
                loss.item()
        loss.item()
        torch.tpu.synchronize()
        return time.perf_counter() - start


def interleaved_steps(make_step, steps: int, rounds: int, warmup: int) -> tuple[dict, float, float]:
    """``interleaved_runs`` of every mode, each step reading its loss."""
    return interleaved_runs(make_step, {mode: (mode, True) for mode in MODES}, steps, rounds, warmup)


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


def _native_recorded() -> int:
    """Calls the native eager kernel has recorded into DEFER_AND_FUSE graphs so far."""
    from torchtpu.eager import native_kernels

    return sum(v[8] for v in native_kernels.stats().values())


def table(title: str, make_step, steps: int, rounds: int, warmup: int, floor: float) -> dict[str, float]:
    print(f"\n## {title}\n")
    recorded = _native_recorded(), fused.stats()["ops_recorded"]
    seconds, hit_rate, ops = interleaved_steps(make_step, steps, rounds, warmup)
    native_share = (_native_recorded() - recorded[0]) / max(fused.stats()["ops_recorded"] - recorded[1], 1)
    print("| mode | steps/s | vs DEFER_NEVER | fused cache hit rate |")
    print("| --- | ---: | ---: | ---: |")
    results = {mode: 1 / s for mode, s in seconds.items()}
    for mode, rate in results.items():
        hit = f"{hit_rate:.1%}" if mode == "DEFER_AND_FUSE" else ""
        print(f"| {mode} | {rate:.2f} | {rate / results['DEFER_NEVER']:.2f}x | {hit} |")
    print(f"\nDEFER_AND_FUSE / DEFER_NEVER = {results['DEFER_AND_FUSE'] / results['DEFER_NEVER']:.2f}x; "
          f"DEFER_AND_FUSE / compiled = {results['DEFER_AND_FUSE'] / results['compiled']:.0%}; "
          f"captured (torch.tpu.compile_step: one replayed program per step) / DEFER_NEVER = "
          f"{results['captured'] / results['DEFER_NEVER']:.2f}x (target >= 4x on the MLP loop)")
    # The best any Python-kernel recording could do: every op at least costs the dispatcher and a
    # new tensor, and the step's XLA work (the compiled step's time) still has to run.
    bound = ops * floor + seconds["compiled"]
    print(f"{ops:.0f} ops recorded per step: {(seconds['DEFER_AND_FUSE'] - seconds['compiled']) / ops * 1e6:.1f} us "
          f"per op above the compiled step; the Python-kernel floor is {floor * 1e6:.1f} us per op, so "
          f"DEFER_AND_FUSE / DEFER_NEVER <= {seconds['DEFER_NEVER'] / bound:.2f}x for any design that records in "
          f"Python kernels; {native_share:.0%} of the recorded ops were recorded by the native kernel "
          f"(csrc/eager.cpp), below that floor")
    return results


READS = {f"{mode}, {when}": (mode, when == "every step") for mode in ("DEFER_NEVER", "DEFER_AND_FUSE")
         for when in ("every step", "at the end")}


def reads_table(title: str, make_step, steps: int, rounds: int, warmup: int, reads: str = "") -> dict[str, float]:
    """The same loop reading its loss every step or only after the last step, in DEFER_NEVER and
    DEFER_AND_FUSE: the fused mode must find the step boundary itself when nothing is read.
    ``reads``: only the variants that read this way ("every step" or "at the end")."""
    print(f"\n## {title}\n")
    variants = {label: v for label, v in READS.items() if label.endswith(reads)}
    seconds, hit_rate, _ = interleaved_runs(make_step, variants, steps, rounds, warmup)
    rates = {label: 1 / s for label, s in seconds.items()}
    print("| mode | loss read | steps/s | vs DEFER_NEVER, same reads |")
    print("| --- | --- | ---: | ---: |")
    for label, rate in rates.items():
        mode, when = label.split(", ")
        print(f"| {mode} | {when} | {rate:.2f} | {rate / rates['DEFER_NEVER, ' + when]:.2f}x |")
    if len(rates) < len(READS):
        return rates
    at_end, every = rates["DEFER_AND_FUSE, at the end"], rates["DEFER_AND_FUSE, every step"]
    print(f"\nRead at the end: DEFER_AND_FUSE / DEFER_NEVER = {at_end / rates['DEFER_NEVER, at the end']:.2f}x; "
          f"DEFER_AND_FUSE read at the end / read every step = {at_end / every:.2f}x; fused cache hit rate "
          f"{hit_rate:.1%} after warm-up")
    return rates


BOUNDARIES = ("optimizer step", "repeated ops", "both (default)")


def _fused_run(step, boundary: str, steps: int) -> float:
    """Seconds for ``steps`` DEFER_AND_FUSE steps read only at the end, the step boundary found by
    ``boundary`` alone (the other mechanism switched off for this run)."""
    with _context("DEFER_AND_FUSE"):
        if boundary == "optimizer step":
            fused.current_executor().find_periods = False
        elif boundary == "repeated ops":  # the hook is process-wide: off only while this run records
            fused._step_hook.remove()
        try:
            start = time.perf_counter()
            for _ in range(steps):
                loss = step()
            loss.item()
            torch.tpu.synchronize()
            return time.perf_counter() - start
        finally:
            if boundary == "repeated ops":
                fused._step_hook = register_optimizer_step_post_hook(fused._optimizer_step_ended)


def boundary_table(title: str, make_step, steps: int, rounds: int, warmup: int) -> None:
    """Which step-boundary mechanism works: each alone and both, on a loop that reads at the end."""
    print(f"\n## {title}\n")
    runners, counts = {}, {}
    for boundary in BOUNDARIES:
        runners[boundary] = make_step()
        before = fused.stats()
        _fused_run(runners[boundary], boundary, warmup)  # the first step differs (AdamW makes its state) ...
        _fused_run(runners[boundary], boundary, steps)  # ... so programs that span steps repeat from the next run
        after = fused.stats()
        counts[boundary] = {k: after[k] - before[k] for k in ("programs_compiled", "program_cache_hits")}
    times: dict[str, list[float]] = {b: [] for b in BOUNDARIES}
    for _ in range(rounds):
        for boundary in BOUNDARIES:
            before = fused.stats()["programs_compiled"]
            times[boundary].append(_fused_run(runners[boundary], boundary, steps) / steps)
            counts[boundary]["timed"] = counts[boundary].get("timed", 0) + fused.stats()["programs_compiled"] - before
    print("| step boundary found by | steps/s | programs compiled in warm-up | in timed rounds |")
    print("| --- | ---: | ---: | ---: |")
    for boundary in BOUNDARIES:
        c = counts[boundary]
        rate = 1 / statistics.median(times[boundary])
        print(f"| {boundary} | {rate:.2f} | {c['programs_compiled']} | {c['timed']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller models and fewer steps")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of every mode")
    parser.add_argument("--tables", default="mlp,gpt,reads,boundary,feeds", help="which tables, comma-separated")
    parser.add_argument("--reads", default="", choices=["", "every step", "at the end"],
                        help="the reads table's loops: only those that read this way (default: both)")
    args = parser.parse_args()
    quick, tables = args.quick, args.tables.split(",")
    floor = python_kernel_floor()
    print(f"torch {torch.__version__}, device {torch.tpu.get_device_name()}, "
          f"{'quick' if quick else 'full'} sizes, median of {args.rounds} interleaved rounds")
    width, depth, batch = (128, 4, 32) if quick else (256, 6, 64)
    if "mlp" in tables:
        table(f"Elementwise-heavy MLP ({depth} layers of {width}, batch {batch}, hand-written SGD update)",
              lambda: make_mlp_loop(width, depth, batch), steps=10 if quick else 20, rounds=args.rounds, warmup=3,
              floor=floor)
    small = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, d_model=64)
    config = small if quick else GPTConfig()
    gpt_batch = 4 if quick else 8
    if "gpt" in tables:
        table(f"GPT train step (d_model {config.d_model}, {config.n_layer} layers, seq {config.block_size}, "
              f"batch {gpt_batch})", lambda: make_gpt_loop(config, gpt_batch),
              steps=3 if quick else 5, rounds=args.rounds, warmup=2, floor=floor)
    if "reads" in tables:
        reads_table("Small GPT (d_model 64, 2 layers, seq 32, batch 1, AdamW): loss read every step or at the end",
                    lambda: make_gpt_loop(small, 1), steps=10 if quick else 20, rounds=args.rounds, warmup=3,
                    reads=args.reads)
        reads_table(f"Elementwise-heavy MLP ({depth} layers of {width}, batch {batch}, hand-written SGD update, no "
                    f"optimizer): loss read every step or at the end", lambda: make_mlp_loop(width, depth, batch),
                    steps=10 if quick else 20, rounds=args.rounds, warmup=12, reads=args.reads)
        if not quick:
            reads_table(f"GPT (d_model {config.d_model}, {config.n_layer} layers, seq {config.block_size}, "
                        f"batch {gpt_batch}, AdamW): loss read every step or at the end",
                        lambda: make_gpt_loop(config, gpt_batch), steps=5, rounds=args.rounds, warmup=3,
                        reads=args.reads)
    if "feeds" in tables:
        for model_name, what in (("small GPT", "small GPT (d_model 64, 2 layers, seq 32, batch 1, AdamW)"),
                                 ("TransformerEncoder", "2-layer nn.TransformerEncoderLayer model (d_model 64, "
                                  "PyTorch's defaults: dim_feedforward 2048, dropout 0.1; seq 32, batch 1, AdamW)")):
            feeds_table(f"Where the batch is transferred: {what}, loss read at the end", model_name,
                        steps=10 if quick else 20, rounds=args.rounds, warmup=6)
    if "boundary" in tables:
        boundary_table("Small GPT read at the end in DEFER_AND_FUSE: which mechanism finds the step boundary",
                       lambda: make_gpt_loop(small, 1), steps=20, rounds=args.rounds, warmup=12)


if __name__ == "__main__":
    main()
