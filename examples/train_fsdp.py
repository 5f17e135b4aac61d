"""Train a small character-level transformer on ``tpu`` with FSDP2, one process per device.

    torchrun --standalone --nproc-per-node 4 examples/train_fsdp.py [--steps 60]
    python examples/train_fsdp.py            # one process

Each process drives ``tpu:LOCAL_RANK`` and trains on its own batches; ``fully_shard`` splits every
block's parameters, gradients and optimizer state across the processes, gathering a block's
parameters just before it runs. This is the CUDA recipe with ``"cuda"`` -> ``"tpu"`` and
``"nccl"`` -> ``"tpu"``.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

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


class Transformer(nn.Module):
    def __init__(self, vocab: int, context: int = 64, d: int = 64, heads: int = 4, layers: int = 2):
        super().__init__()
        self.context = context
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.layers = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean next-token loss (returned from inside: FSDP2 warns when the root returns a view)."""
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), targets.flatten())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per process and step")
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args()

    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("tpu")
    else:  # a plain `python` run: a group of one
        dist.init_process_group("tpu", store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.tpu.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # "tpu" now means this process's device

    torch.manual_seed(0)  # the same initial weights on every process
    data = CharData.builtin()
    model = Transformer(data.vocab_size).to("tpu")
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)  # the rest: embeddings, final norm, head
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    gen = torch.Generator().manual_seed(rank)  # each process its own batches
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = data.batch(args.batch_size, model.context, gen)
        loss = model(x.to("tpu"), y.to("tpu"))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if step % args.log_every == 0 or step == args.steps:
            mean = loss.detach().clone()
            dist.all_reduce(mean, op=dist.ReduceOp.AVG)  # the loss over every process's batch
            if rank == 0:  # .item() waits for the device
                print(f"step {step:4d}  loss {mean.item():.4f}  ({time.perf_counter() - start:.1f} s)", flush=True)
    if rank == 0:
        print(f"trained on {world} process{'es' if world > 1 else ''}, {args.batch_size * world} sequences per step")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
