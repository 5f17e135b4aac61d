"""Train a small character-level GPT on ``tpu`` with ``torch.compile``.

    python examples/train_gpt_compiled.py [--steps 300] [--batch-size 16]

``torch.compile(..., backend="tpu")`` turns the forward and (through aot_autograd) the backward
pass into XLA programs; compiling ``optimizer.step`` too makes a training step a few programs.
The text is torchtpu's built-in corpus; any string works: ``CharData(open("my.txt").read())``.
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtpu.demo import CharData


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, context: int = 64, d: int = 64, heads: int = 4, layers: int = 2):
        super().__init__()
        self.context = context
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, vocab))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        return self.head(self.blocks(x))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args()

    torch.manual_seed(0)
    data = CharData.builtin()
    model = GPT(data.vocab_size).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)

    @torch.compile(backend="tpu", fullgraph=True)
    def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    step_fn = torch.compile(opt.step, backend="tpu")

    gen = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for step in range(args.steps):
        x, y = data.batch(args.batch_size, model.context, gen)
        loss = loss_fn(x.to("tpu"), y.to("tpu"))
        loss.backward()
        step_fn()
        opt.zero_grad(set_to_none=True)
        if step == 0:
            print(f"step 0  loss {loss.item():.4f}  (compiled in {time.perf_counter() - start:.1f} s)")
            start = time.perf_counter()
        elif step % 50 == 0 or step == args.steps - 1:
            print(f"step {step}  loss {loss.item():.4f}")  # .item() waits for the device
    torch.tpu.synchronize()
    print(f"{(args.steps - 1) / (time.perf_counter() - start):.1f} steps/s after the first step")

    # Generate in eager mode, always from a full context so every step has the same shape.
    model.eval()
    ids = data.ids[-model.context:].view(1, -1)
    sampler = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(200):
            logits = model(ids[:, -model.context:].to("tpu"))[0, -1].cpu()
            ids = torch.cat([ids, torch.multinomial((logits / 0.8).softmax(-1), 1, generator=sampler).view(1, 1)], 1)
    print(data.decode(ids[0, model.context:]))


if __name__ == "__main__":
    main()
