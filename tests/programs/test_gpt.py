"""A small GPT trained nanoGPT-style, then used for greedy generation.

Token embedding tied to the LM head (checked after ``.to(device)``, with the parameter count);
``F.scaled_dot_product_attention`` with a causal mask; gradient accumulation over two
micro-batches; AdamW with weight-decay and no-decay parameter groups; linear warm-up then
cosine decay (``LambdaLR``); ``clip_grad_norm_``; ``DataLoader(num_workers=2, pin_memory=True)``
with ``.to(device, non_blocking=True)``; the loss logged with ``.item()``; an eval loop under
``model.eval()``/``torch.no_grad()``; a checkpoint per epoch, resumed into a fresh model;
greedy autoregressive decoding, the sequence growing by one token per step (the window
cropped to ``block_size``, as nanoGPT does). Dropout is 0 during the comparison: dropout masks
drawn on the device differ from the CPU's.
"""

import math
import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from program_harness import (
    TIGHT,
    assert_greedy_choices_are_robust,
    assert_histories_match,
    assert_resumes_identically,
    assert_value_close,
    run_on_cpu_and_tpu,
)

LOG_EVERY = 5
GRAD_ACCUM = 2


@dataclass
class GPTConfig:
    vocab_size: int = 32
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.dropout = config.n_head, config.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(),
            nn.Linear(4 * config.n_embd, config.n_embd), nn.Dropout(config.dropout),
        )

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95))

    @torch.no_grad()
    def generate(self, idx, max_new_tokens):
        """Greedy decoding; returns the tokens and the logits each one was chosen from."""
        chosen_from = []
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size :])
            logits = logits[:, -1, :]
            chosen_from.append(logits)
            idx = torch.cat((idx, logits.argmax(-1, keepdim=True)), dim=1)
        return idx, torch.stack(chosen_from, 1)


def sequences(n: int, config: GPTConfig, generator: torch.Generator) -> TensorDataset:
    """Sequences counting up mod vocab_size from a random start with a random stride in 1..3."""
    start = torch.randint(0, config.vocab_size, (n, 1), generator=generator)
    stride = torch.randint(1, 4, (n, 1), generator=generator)
    seq = (start + stride * torch.arange(config.block_size + 1)) % config.vocab_size
    return TensorDataset(seq[:, :-1], seq[:, 1:])


def lr_lambda(warmup, total):
    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return factor


def run(device, steps, workdir, resume_from=None, batch_size=16, new_tokens=6):
    torch.manual_seed(0)
    config = GPTConfig()
    data_gen = torch.Generator().manual_seed(1)
    train_set, val_set = sequences(8 * batch_size, config, data_gen), sequences(2 * batch_size, config, data_gen)
    shuffle_gen = torch.Generator().manual_seed(2)  # the sampler's own (see test_cnn_classifier)
    sampler = RandomSampler(train_set, generator=shuffle_gen)
    train_loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler, drop_last=True,
                              num_workers=2, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=batch_size // GRAD_ACCUM, pin_memory=True)  # the micro-batch shape
    steps_per_epoch = len(train_loader)

    model = GPT(config)
    n_params = sum(p.numel() for p in model.parameters())
    model = model.to(device)
    tied = model.lm_head.weight is model.transformer.wte.weight
    assert tied, "the weights came untied"
    assert sum(p.numel() for p in model.parameters()) == n_params
    print(f"number of parameters: {n_params / 1e3:.1f}K")

    optimizer = model.configure_optimizers(weight_decay=0.1, learning_rate=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(warmup=4, total=steps))
    start = 0
    if resume_from is not None:
        checkpoint = torch.load(resume_from, map_location=device)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        shuffle_gen.set_state(checkpoint["shuffle_rng"].cpu())  # map_location moved it too
        start = checkpoint["step"]
        tied = model.lm_head.weight is model.transformer.wte.weight
        assert tied, "load_state_dict untied the weights"

    history = {name: {} for name in ("loss", "grad_norm", "lr", "wte", "eval_loss", "tokens", "gen_logits")}
    history["n_params"] = {0: n_params}
    step = start
    model.train()
    while step < steps:
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = 0.0
            for micro_x, micro_y in zip(x.chunk(GRAD_ACCUM), y.chunk(GRAD_ACCUM)):  # gradient accumulation
                _, micro_loss = model(micro_x, micro_y)
                micro_loss = micro_loss / GRAD_ACCUM
                micro_loss.backward()
                loss += micro_loss.detach()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            history["lr"][step] = scheduler.get_last_lr()[0]
            scheduler.step()
            history["loss"][step] = loss.detach()
            history["grad_norm"][step] = grad_norm
            history["wte"][step] = model.transformer.wte.weight[1, :8].detach().clone()
            if step % LOG_EVERY == 0:
                print(f"iter {step}: loss {loss.item():.4f}")
            step += 1
            if step == steps:
                break
        if step % steps_per_epoch == 0:
            model.eval()
            losses = []
            with torch.no_grad():
                for x, y in val_loader:
                    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                    losses.append(model(x, y)[1])
            history["eval_loss"][step - 1] = torch.stack(losses).mean().item()
            model.train()
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "shuffle_rng": shuffle_gen.get_state(), "step": step},
                       os.path.join(workdir, f"ckpt_{step}.pt"))

    model.eval()
    prompt = torch.tensor([[3, 5, 7], [10, 11, 12]], device=device)
    tokens, gen_logits = model.generate(prompt, max_new_tokens=new_tokens)
    assert tokens.shape == (2, 3 + new_tokens)
    history["tokens"][step - 1] = tokens.tolist()
    history["gen_logits"][step - 1] = gen_logits
    return history


def check(cpu, tpu, steps):
    config = GPTConfig()
    d, v, t, n = config.n_embd, config.vocab_size, config.block_size, config.n_layer
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    assert cpu["n_params"][0] == v * d + t * d + n * block + 2 * d  # the tied matrix counted once
    assert_greedy_choices_are_robust(cpu["gen_logits"][steps - 1], tpu["gen_logits"][steps - 1])
    assert_histories_match(cpu, tpu)
    losses = list(tpu["loss"].values())
    assert losses[-1] < 0.6 * losses[0], "the model did not learn"


def generate_on_cpu_from(checkpoint_path, new_tokens):
    """A tpu checkpoint loaded on a machine without the device, for generation there."""
    model = GPT(GPTConfig())
    model.load_state_dict(torch.load(checkpoint_path, map_location="cpu")["model"])
    model.eval()
    return model.generate(torch.tensor([[3, 5, 7], [10, 11, 12]]), max_new_tokens=new_tokens)


@pytest.mark.slow
def test_gpt_matches_cpu_resumes_and_generates(tmp_path):
    steps = 16  # two epochs of 8 batches
    cpu, tpu = run_on_cpu_and_tpu(run, steps, tmp_path)
    check(cpu, tpu, steps)
    assert_resumes_identically(run, "tpu", steps, tmp_path, tpu, from_step=8)
    # The tpu-trained weights, loaded on the CPU, generate what they generated on tpu.
    # Same weights, forward passes only: nothing compounds, the tight tolerance applies.
    tokens, logits = generate_on_cpu_from(tmp_path / "tpu" / f"ckpt_{steps}.pt", new_tokens=6)
    assert_value_close(tpu["gen_logits"][steps - 1], logits, TIGHT, "logits of the tpu checkpoint on cpu")
    assert_greedy_choices_are_robust(logits, tpu["gen_logits"][steps - 1])
    assert tokens.tolist() == tpu["tokens"][steps - 1]


@pytest.mark.slow
def test_gpt_longer_run(tmp_path):
    steps = 64
    cpu, tpu = run_on_cpu_and_tpu(run, steps, tmp_path, new_tokens=12)
    check(cpu, tpu, steps)
    assert_resumes_identically(run, "tpu", steps, tmp_path, tpu, from_step=32, new_tokens=12)


@pytest.mark.slow
def test_gpt_fused_eager_matches_cpu(tmp_path):
    steps = 16
    check(*run_on_cpu_and_tpu(run, steps, tmp_path, tpu_eager_mode="DEFER_AND_FUSE"), steps)
