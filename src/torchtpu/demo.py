"""``torchtpu demo``: train a small character-level GPT on the built-in text, eager then compiled.

The model and data helpers are public so examples can reuse them::

    from torchtpu.demo import CharGPT, GPTConfig, CharData
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

CORPUS = "tiny_corpus.txt"


# ---------------------------------------------------------------- data

class CharData:
    """A text as a tensor of character ids, with random training windows."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.ids = torch.tensor([self.index[c] for c in text], dtype=torch.long)

    @classmethod
    def builtin(cls) -> "CharData":
        """The corpus shipped with torchtpu (``torchtpu/data/tiny_corpus.txt``)."""
        return cls(resources.files("torchtpu.data").joinpath(CORPUS).read_text(encoding="utf-8"))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text if c in self.index], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def batch(self, batch_size: int, block: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-character targets, ``(batch_size, block)`` each, on the CPU."""
        starts = torch.randint(len(self.ids) - block - 1, (batch_size,), generator=generator)
        x = torch.stack([self.ids[s:s + block] for s in starts.tolist()])
        y = torch.stack([self.ids[s + 1:s + block + 1] for s in starts.tolist()])
        return x, y


# ---------------------------------------------------------------- model

@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 64
    n_embd: int = 64
    n_head: int = 4
    n_layer: int = 2


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention that only looks backwards, written out with plain ops."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, cfg.block_size, cfg.block_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        shape = (b, t, self.n_head, c // self.n_head)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~self.mask[:, :, :t, :t], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    """A GPT-2-shaped decoder, small enough to train on a laptop CPU in seconds."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.Sequential(*[Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        return self.head(self.ln_f(self.blocks(x)))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, generator: torch.Generator,
                 temperature: float = 0.8) -> torch.Tensor:
        """Sample ``new_tokens`` characters after ``idx`` (1, t); sampling itself runs on the CPU."""
        out = idx.cpu()
        for _ in range(new_tokens):
            context = out[:, -self.cfg.block_size:].to(idx.device)
            logits = self(context)[0, -1].float().cpu() / temperature
            nxt = torch.multinomial(logits.softmax(-1), 1, generator=generator)
            out = torch.cat([out, nxt.view(1, 1)], dim=1)
        return out


# ---------------------------------------------------------------- training

@dataclass
class Phase:
    """What one training phase measured."""

    name: str
    losses: list[float] = field(default_factory=list)
    warmup_s: float = 0.0  # time of the first steps, which include tracing/compiling
    timed_steps: int = 0
    timed_s: float = 0.0
    error: str | None = None

    @property
    def steps_per_s(self) -> float:
        return self.timed_steps / self.timed_s if self.timed_s > 0 else float("nan")


WARMUP_STEPS = 2  # excluded from steps/s: the first steps trace and compile


def synchronize(device: torch.device) -> None:
    if device.type == "tpu":
        torch.tpu.synchronize()
    elif device.type == "cuda":
        torch.cuda.synchronize()


def train_phase(name: str, loss_fn: Callable, step_fn: Callable, model: nn.Module,
                opt: torch.optim.Optimizer, data: CharData, steps: int, batch_size: int,
                device: torch.device, generator: torch.Generator, log_every: int = 10,
                progress: bool = True) -> Phase:
    """Run ``steps`` training steps; read the loss every ``log_every`` steps (a host sync)."""
    from tqdm import tqdm

    phase = Phase(name)
    bar = tqdm(range(steps), desc=f"{name:>8}", unit="step", disable=not progress,
               file=sys.stderr, dynamic_ncols=True, leave=True)
    start = time.perf_counter()
    for step in bar:
        x, y = data.batch(batch_size, model.cfg.block_size, generator)
        x, y = x.to(device), y.to(device)
        loss = loss_fn(x, y)
        loss.backward()
        step_fn()
        opt.zero_grad(set_to_none=True)
        last = step == steps - 1
        if step % log_every == 0 or last or step < WARMUP_STEPS:
            phase.losses.append(loss.item())
            bar.set_postfix(loss=f"{phase.losses[-1]:.3f}")
        if step == WARMUP_STEPS - 1 or (steps <= WARMUP_STEPS and last):
            synchronize(device)
            phase.warmup_s = time.perf_counter() - start
            start = time.perf_counter()
    synchronize(device)
    if steps > WARMUP_STEPS:
        phase.timed_steps = steps - WARMUP_STEPS
        phase.timed_s = time.perf_counter() - start
    bar.close()
    return phase


def compile_backend(device: torch.device) -> str:
    """The torch.compile backend for ``device``: ``tpu`` for tpu, inductor elsewhere."""
    if device.type != "tpu":
        return "inductor"
    import torchtpu.compile

    torchtpu.compile.install()  # idempotent; registers "tpu" with dynamo
    return "tpu"


# ---------------------------------------------------------------- the demo

@dataclass
class DemoResult:
    eager: Phase
    compiled: Phase | None
    sample: str

    @property
    def losses(self) -> list[float]:
        """Every loss read, eager phase first."""
        return self.eager.losses + (self.compiled.losses if self.compiled is not None else [])

    @property
    def first_loss(self) -> float:
        return self.losses[0] if self.losses else float("nan")

    @property
    def last_loss(self) -> float:
        return self.losses[-1] if self.losses else float("nan")

    @property
    def speedup(self) -> float:
        if self.compiled is None or self.compiled.error:
            return float("nan")
        return self.compiled.steps_per_s / self.eager.steps_per_s


def run(steps: int = 300, eager_steps: int = 40, device: str = "tpu", seed: int = 0,
        batch_size: int = 16, lr: float = 3e-3, sample_chars: int = 240, progress: bool = True,
        out=print) -> DemoResult:
    """Train eagerly for ``eager_steps``, then compiled for ``steps``, then sample some text."""
    dev = torch.device(device)
    torch.manual_seed(seed)
    data = CharData.builtin()
    # initialised on the CPU, then moved: the same weights on every device
    model = CharGPT(GPTConfig(vocab_size=data.vocab_size)).to(dev)
    # foreach=False: the per-parameter update is what torch.compile turns into one program
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    gen = torch.Generator().manual_seed(seed)
    n_params = sum(p.numel() for p in model.parameters())
    out(f"model: CharGPT, {n_params / 1e3:.1f}K parameters, {model.cfg.n_layer} layers, "
        f"context {model.cfg.block_size}, vocab {data.vocab_size}; corpus {len(data.ids)} characters")
    out(f"device: {dev} ({_device_name(dev)}), batch {batch_size}, AdamW lr {lr}")

    out(f"\n[1/3] eager mode: {eager_steps} steps")
    eager = train_phase("eager", model.loss, opt.step, model, opt, data, eager_steps, batch_size, dev, gen,
                        progress=progress)

    compiled = None
    if steps > 0:
        out(f"\n[2/3] compiled mode (torch.compile of the loss and of the optimizer step): {steps} steps")
        compiled = _compiled_phase(model, opt, data, steps, batch_size, dev, gen, progress, out)

    out("\n[3/3] sample (temperature 0.8):")
    model.eval()
    # a full-length prompt keeps every generation step at one shape: one compilation, not one per length
    prompt = data.ids[-model.cfg.block_size:].view(1, -1).to(dev)
    sample = data.decode(model.generate(prompt, sample_chars, torch.Generator().manual_seed(seed))[0, prompt.size(1):])
    model.train()
    out(_indent(sample))
    return DemoResult(eager, compiled, sample)


def _compiled_phase(model, opt, data, steps, batch_size, dev, gen, progress, out) -> Phase:
    backend = dev.type
    try:
        backend = compile_backend(dev)
        # fullgraph: the loss must become one graph (forward and, through aot_autograd, backward);
        # a silent fall back to eager would make the speed ratio meaningless
        loss_fn = torch.compile(model.loss, backend=backend, fullgraph=True)
        step_fn = torch.compile(opt.step, backend=backend)  # Optimizer.step has a deliberate graph break
        return train_phase("compiled", loss_fn, step_fn, model, opt, data, steps, batch_size, dev, gen,
                           progress=progress)
    except Exception as exc:  # the demo still reports the eager phase; main() exits 1
        msg = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        out(f"compiled mode FAILED: {msg}")
        out(f"  torch.compile (backend {backend!r}) could not train this model; the eager results "
            "follow. Run `torchtpu doctor` to check the backend.")
        return Phase("compiled", error=msg)


def _device_name(dev: torch.device) -> str:
    if dev.type == "tpu":
        return torch.tpu.get_device_name(dev)
    return dev.type.upper()


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def summary(result: DemoResult) -> str:
    """The loss and speed lines printed at the end of the demo."""
    e, c = result.eager, result.compiled
    lines = [f"loss: first {result.first_loss:.4f} -> last {result.last_loss:.4f}"
             + (" (went down)" if result.last_loss < result.first_loss else " (DID NOT go down)")]
    lines.append(f"eager:    {e.steps_per_s:8.2f} steps/s  (first {WARMUP_STEPS} steps {e.warmup_s:.2f} s)")
    if c is not None and c.error is None:
        lines.append(f"compiled: {c.steps_per_s:8.2f} steps/s  (first {WARMUP_STEPS} steps, "
                     f"including compilation, {c.warmup_s:.2f} s)")
        lines.append(f"speed ratio compiled/eager: {result.speedup:.2f}x")
    elif c is not None:
        lines.append(f"compiled: FAILED ({c.error})")
        lines.append("speed ratio compiled/eager: n/a")
    return "\n".join(lines)


def main(steps: int = 300, eager_steps: int = 40, device: str = "tpu", seed: int = 0,
         batch_size: int = 16, sample_chars: int = 240, progress: bool = True) -> int:
    """Run the demo and print its report; 1 when compiled mode failed or the loss is not finite."""
    from torchtpu import metrics

    start = time.perf_counter()
    result = run(steps=steps, eager_steps=eager_steps, device=device, seed=seed,
                 batch_size=batch_size, sample_chars=sample_chars, progress=progress)
    print("\nmetrics:")
    metrics.report()
    print()
    print(summary(result))
    print(f"total time: {time.perf_counter() - start:.1f} s")
    failed = (result.compiled is not None and result.compiled.error is not None) \
        or not math.isfinite(result.last_loss)
    return 1 if failed else 0
