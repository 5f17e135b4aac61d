"""Models shared by the benchmarks, the compile tests and the CLI demo: a small GPT and an MLP."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 1024
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 256
    dropout: float = 0.0
    tie_weights: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(nn.Linear(config.d_model, 4 * config.d_model), nn.GELU(),
                                 nn.Linear(4 * config.d_model, config.d_model), nn.Dropout(config.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A decoder-only transformer: token + position embeddings, pre-LN blocks, linear head."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab_size, config.d_model)
        self.pos = nn.Embedding(config.block_size, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_weights:
            self.head.weight = self.tok.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


class MLP(nn.Module):
    """``d_in -> d_hidden -> d_out`` with ReLU."""

    def __init__(self, d_in: int = 512, d_hidden: int = 2048, d_out: int = 512):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


def gpt_batch(config: GPTConfig, batch: int, generator: torch.Generator | None = None):
    """A random (tokens, targets) batch on the CPU."""
    idx = torch.randint(0, config.vocab_size, (batch, config.block_size + 1), generator=generator)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


class AdamWTrainStep:
    """One training step: forward, backward and AdamW, traceable as one graph (``fullgraph=True``).

    Dynamo cannot trace ``loss.backward()`` followed by ``optimizer.step()`` into one graph, so the
    gradients come from ``torch.autograd.grad`` (needs ``torch._dynamo.config.trace_autograd_ops``)
    and the update is PyTorch's own functional AdamW on state tensors kept here.
    """

    def __init__(self, model: nn.Module, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01):
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.exp_avgs = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sqs = [torch.zeros_like(p) for p in self.params]
        self.steps = [torch.zeros((), dtype=torch.float32, device=p.device) for p in self.params]
        self.hyper = dict(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay)

    def __call__(self, *batch) -> torch.Tensor:
        from torch.optim.adam import adam

        loss = self.model(*batch)
        grads = torch.autograd.grad(loss, self.params)
        with torch.no_grad():
            adam(self.params, list(grads), self.exp_avgs, self.exp_avg_sqs, [], self.steps, foreach=False,
                 capturable=False, differentiable=False, fused=None, grad_scale=None, found_inf=None,
                 has_complex=False, decoupled_weight_decay=True, amsgrad=False, maximize=False, **self.hyper)
        return loss.detach()


def eager_adamw_losses(model: nn.Module, batches, lr: float = 1e-3, weight_decay: float = 0.01) -> list[float]:
    """Reference: losses of ``torch.optim.AdamW`` steps with ``loss.backward()``, eagerly."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, foreach=False)
    losses = []
    for batch in batches:
        loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
