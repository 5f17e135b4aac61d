"""One rank of a launch whose ranks come as arguments, as a serving engine starts its
tensor-parallel processes (no torchrun variables): ``python declared.py RANK WORLD INIT_PORT``
with ``TORCHTPU_COORDINATOR`` set by the launching process (``choose_rank_coordinator``).

The rank joins through ``torchtpu.integrations.join_ranks`` before its first tpu op, selects its
own device, builds the engines' ``cpu:gloo,tpu:tpu`` process group, and checks an all-reduce
on tpu, one on the host (gloo), and that a second, different declaration is refused. (Compiled
collectives are the same programs under any launch: ``test_distributed_compile.py``.)"""

import sys

import torch
import torch.distributed as dist

from torchtpu.integrations import DIST_BACKEND, join_ranks
from torchtpu.runtime import multiprocess

rank, world, port = (int(a) for a in sys.argv[1:4])
join_ranks(rank=rank, world_size=world, local_rank=rank)
torch.tpu.set_device(rank)  # its own device, as an engine selects tpu:gpu_id
dist.init_process_group(DIST_BACKEND, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
assert torch.tpu.device_count() == world and torch.tpu.current_device() == rank

x = torch.full((4,), rank + 1.0, device="tpu")
dist.all_reduce(x)
assert x.device == torch.device("tpu", rank) and x.cpu().tolist() == [world * (world + 1) / 2] * 4, x
host = torch.ones(2)
dist.all_reduce(host)  # the host tensor goes through gloo
assert host.tolist() == [float(world)] * 2

try:
    multiprocess.declare((rank + 1) % world, world, rank, world, "127.0.0.1:1")
except RuntimeError as exc:
    assert "already started" in str(exc), exc
else:
    raise AssertionError("a different declaration after the runtime started was accepted")
multiprocess.declare(rank, world, rank, world, "127.0.0.1:1")  # the same place: nothing to do

dist.destroy_process_group()
print(f"rank {rank} ok", flush=True)
