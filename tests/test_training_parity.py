"""Training on tpu in eager mode matches the same run on the CPU, step by step."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytestmark = pytest.mark.usefixtures("each_eager_mode", "no_fallback")

STEPS = 20
RTOL = 1e-4


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))

    def forward(self, x):
        return self.net(x)


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    def __init__(self, vocab=64, d=32, heads=4, layers=2, seq=16):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def _train(model_fn, batch_fn, loss_fn, device):
    torch.manual_seed(0)
    model = model_fn().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x, y = batch_fn(gen)
        loss = loss_fn(model(x.to(device)), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _assert_parity(cpu, tpu):
    for step, (c, t) in enumerate(zip(cpu, tpu)):
        assert abs(c - t) <= RTOL * abs(c), f"step {step}: cpu {c} vs tpu {t}"
    assert cpu[-1] < cpu[0]


def test_mlp_adamw_matches_cpu():
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(2))

    def batch(gen):  # a learnable task: labels from a fixed linear teacher
        x = torch.randn(16, 32, generator=gen)
        return x, (x @ teacher).argmax(-1)

    args = (MLP, batch, F.cross_entropy)
    _assert_parity(_train(*args, "cpu"), _train(*args, "tpu"))


def test_transformer_adamw_matches_cpu():
    def batch(gen):  # a learnable task: each sequence counts up from a random start
        start = torch.randint(0, 64, (4, 1), generator=gen)
        idx = (start + torch.arange(17)) % 64
        return idx[:, :-1], idx[:, 1:]

    def loss(logits, y):
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    args = (TinyTransformer, batch, loss)
    _assert_parity(_train(*args, "cpu"), _train(*args, "tpu"))
