"""Run under torchrun: train a small GPT for 10 AdamW steps on tpu with DDP, FSDP2, tensor
parallel or FSDP x TP, and compare every step's global loss with the same model trained in one
process on CPU on the whole batch (relative difference <= 1e-4).

    torchrun --standalone --nproc-per-node 4 tests/distributed/train.py fsdp [--compile] ...
    torchrun --standalone --nproc-per-node 4 tests/distributed/train.py fsdp --save DIR
    torchrun --standalone --nproc-per-node 2 tests/distributed/train.py fsdp --load DIR

Every rank computes the loss of the global batch (each data-parallel rank trains on its shard
of it, the mean over ranks is the global mean). Rank 0 prints the loss table and "parity ok",
or exits non-zero with the table. ``--save DIR`` writes a ``torch.distributed.checkpoint`` of
the sharded model and optimizer after step 5 (and the run's losses); ``--load DIR`` resumes from
it, with any number of processes, and checks steps 6-10 against the saved run too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

VOCAB, DIM, HEADS, SEQ, BATCH, STEPS, SAVE_AT, LR = 64, 32, 4, 16, 8, 10, 5, 1e-2
TOLERANCE = 1e-4


# ---------------------------------------------------------------- the model
class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        b, t = q.shape[:2]  # local heads under tensor parallel: the head count is the shard's
        q, k, v = (z.view(b, t, -1, DIM // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = nn.LayerNorm(DIM), Attention(), nn.LayerNorm(DIM), MLP()

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, tied: bool = True, recompute: bool = False):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.tok.weight
        self.recompute = recompute  # activation checkpointing of each block

    def forward(self, idx):
        positions = torch.arange(idx.shape[1], device=idx.device).unsqueeze(0)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.recompute else block(x)
        return self.head(self.norm(x))


def build(args) -> GPT:
    """The same initial weights in every process: built on CPU from one seed."""
    torch.manual_seed(0)
    return GPT(tied=not (args.sp or args.loss_parallel), recompute=args.recompute)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (1-based), the same in every process and run."""
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1000 + step))
    return tokens[:, :-1], tokens[:, 1:]


# ---------------------------------------------------------------- the CPU reference
def reference_losses(args) -> list[float]:
    """One process, CPU, the whole batch: the losses every setup must reproduce."""
    model = build(args)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(1, STEPS + 1):
        x, y = batch(step)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# ---------------------------------------------------------------- parallelising on tpu
def tensor_parallel(model: GPT, mesh, args) -> None:
    """Megatron-style: column-parallel q, k, v and MLP up, row-parallel o and MLP down; with
    ``--sp`` the norms and the residual stream are sharded along the sequence too."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    sp = args.sp
    residual = Shard(1) if sp else Replicate()
    for block in model.blocks:
        plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                "attn.o": RowwiseParallel(output_layouts=residual),
                "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel(output_layouts=residual)}
        if sp:
            plan.update({"norm1": SequenceParallel(), "norm2": SequenceParallel(),
                         "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                         "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))})
        parallelize_module(block, mesh, plan)
    if sp or args.loss_parallel:
        plan = {"head": ColwiseParallel(input_layouts=residual,
                                        output_layouts=Shard(-1) if args.loss_parallel else Replicate(),
                                        use_local_output=not args.loss_parallel)}
        if sp:  # the embeddings' sum enters the blocks sharded along the sequence
            plan.update({"tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                         "pos": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                         "norm": SequenceParallel()})
        parallelize_module(model, mesh, plan)


def fully_shard_model(model: GPT, mesh, args) -> None:
    """FSDP2: each block, then the root (embeddings, final norm, head)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    options = {"mesh": mesh, "reshard_after_forward": not args.no_reshard}
    policy = {}
    if args.mp:  # gathered and computed in float64, gradients reduced in float64: exact enough to
        # compare with the float32 reference (bfloat16 would need a bfloat16 reference)
        policy = {"param_dtype": torch.float64, "reduce_dtype": torch.float64}
        options["mp_policy"] = MixedPrecisionPolicy(**policy)
    for block in model.blocks:
        fully_shard(block, **options)
    if args.mp:  # the logits come back in float32
        options["mp_policy"] = MixedPrecisionPolicy(**policy, output_dtype=torch.float32)
    fully_shard(model, **options)


def parallelize(args, device):
    """The model on tpu under ``args.setup``; returns (model, data-parallel rank, its size)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    model = build(args).to(device)
    if args.setup == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model), dist.get_rank(), world
    if args.setup == "fsdp":
        mesh = init_device_mesh("tpu", (world,), mesh_dim_names=("dp",))
        fully_shard_model(model, mesh, args)
        return model, dist.get_rank(), world
    if args.setup == "tp":
        tensor_parallel(model, init_device_mesh("tpu", (world,), mesh_dim_names=("tp",)), args)
        return model, 0, 1
    mesh = init_device_mesh("tpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))  # fsdp_tp
    tensor_parallel(model, mesh["tp"], args)
    fully_shard_model(model, mesh["dp"], args)
    return model, mesh["dp"].get_local_rank(), mesh["dp"].size()


# ---------------------------------------------------------------- training
def train_step(model, opt, x, y, args) -> torch.Tensor:
    """One AdamW step on this rank's shard; returns the global batch's loss (every rank)."""
    logits = model(x)
    if args.loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
        loss = loss.full_tensor()
    else:
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.AVG)  # tensor-parallel ranks hold the same loss
    return total


def state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, opt)
    return {"model": model_state, "optim": optim_state}


def load(model, opt, directory: str) -> None:
    """Resume from a checkpoint written by any number of processes (DCP reshards it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    loaded = state(model, opt)
    dcp.load(loaded, checkpoint_id=directory)
    set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])


def train(args, device) -> list[float]:
    model, dp_rank, dp_size = parallelize(args, device)
    if args.compile:
        model = torch.compile(model, backend="tpu")
    # Tensor parallel alone leaves plain parameters next to DTensors: a foreach step cannot mix
    # them (on CUDA either), so it steps them one by one.
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False if args.setup == "tp" else None)
    first = 1
    if args.load:
        load(model, opt, args.load)
        first = SAVE_AT + 1
    rows = slice(dp_rank * BATCH // dp_size, (dp_rank + 1) * BATCH // dp_size)
    losses = []
    for step in range(first, STEPS + 1):
        x, y = batch(step)
        losses.append(train_step(model, opt, x[rows].to(device), y[rows].to(device), args))
        if args.save and step == SAVE_AT:
            import torch.distributed.checkpoint as dcp

            dcp.save(state(model, opt), checkpoint_id=args.save)
    return [loss.item() for loss in losses]


def compare(args, losses: list[float]) -> None:
    """Rank 0: the table, then "parity ok" or SystemExit."""
    expected = reference_losses(args)
    first = STEPS - len(losses) + 1
    saved = None
    if args.load:
        saved = json.loads((Path(args.load) / "losses.json").read_text())
    elif args.save:
        (Path(args.save) / "losses.json").write_text(json.dumps(losses))
    lines = [f"{'step':>4} {'cpu (1 process)':>16} {'tpu':>12} {'rel diff':>9}" + ("  saved run" if saved else "")]
    worst = 0.0
    for step, got in enumerate(losses, start=first):
        ref = expected[step - 1]
        diff = abs(got - ref) / abs(ref)
        if saved:
            diff = max(diff, abs(got - saved[step - 1]) / abs(saved[step - 1]))
        worst = max(worst, diff)
        row = f"{step:>4} {ref:>16.7f} {got:>12.7f} {diff:>9.1e}"
        lines.append(row + (f"  {saved[step - 1]:.7f}" if saved else ""))
    table = "\n".join(lines)
    print(table, flush=True)
    if not worst <= TOLERANCE:
        raise SystemExit(f"parity FAILED: relative difference {worst:.2e} > {TOLERANCE:.0e}\n{table}")
    if args.compile:  # the model really ran as compiled graphs
        from torch._dynamo.utils import counters

        graphs = counters["stats"]["unique_graphs"]
        print(f"compiled graphs: {graphs}", flush=True)
        if not graphs:
            raise SystemExit("--compile: dynamo compiled no graph")
    print(f"parity ok ({describe(args)}, {dist.get_world_size()} processes)", flush=True)


def describe(args) -> str:
    names = ("compile", "recompute", "mp", "no_reshard", "sp", "loss_parallel")
    flags = [name for name in names if getattr(args, name)]
    return " ".join([args.setup, *flags, *(["resumed"] if args.load else [])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("setup", choices=("ddp", "fsdp", "tp", "fsdp_tp"))
    parser.add_argument("--compile", action="store_true", help='torch.compile(model, backend="tpu")')
    parser.add_argument("--recompute", action="store_true", help="activation checkpointing of each block")
    parser.add_argument("--mp", action="store_true", help="FSDP2 MixedPrecisionPolicy (float64 compute)")
    parser.add_argument("--no-reshard", action="store_true", help="FSDP2 reshard_after_forward=False")
    parser.add_argument("--sp", action="store_true", help="sequence parallel (TP setups)")
    parser.add_argument("--loss-parallel", action="store_true", help="loss parallel (TP setups)")
    parser.add_argument("--save", metavar="DIR", help=f"DCP checkpoint after step {SAVE_AT}")
    parser.add_argument("--load", metavar="DIR", help=f"resume from the checkpoint at step {SAVE_AT + 1}")
    args = parser.parse_args()
    dist.init_process_group("tpu", timeout=datetime.timedelta(seconds=120))
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.tpu.set_device(local_rank)
    try:
        losses = train(args, torch.device("tpu", local_rank))
        if dist.get_rank() == 0:
            compare(args, losses)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
