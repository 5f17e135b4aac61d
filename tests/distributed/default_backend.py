"""Run under torchrun with 2 processes: ``init_process_group()`` without a backend picks ``tpu``
(the accelerator's backend, as PyTorch 2.14 picks nccl on CUDA), and object collectives work
through it; ``"tpu_dist"`` is the same backend under the name Transformers and Ray Train use."""

import sys

import torch
import torch.distributed as dist

dist.init_process_group(sys.argv[1] if len(sys.argv) > 1 else None)
rank, world = dist.get_rank(), dist.get_world_size()
assert type(dist.group.WORLD._get_backend(torch.device("tpu"))).__name__ == "ProcessGroupTPU"
objs = [None] * world
dist.all_gather_object(objs, {"rank": rank, "pad": "x" * rank})
assert objs == [{"rank": r, "pad": "x" * r} for r in range(world)], objs
box = [{"from": 0}] if rank == 0 else [None]
dist.broadcast_object_list(box, src=0)
assert box == [{"from": 0}]
t = torch.full((3,), float(rank), device="tpu")
dist.all_reduce(t)
assert t.cpu().tolist() == [float(sum(range(world)))] * 3
dist.destroy_process_group()
print(f"rank {rank} ok", flush=True)
