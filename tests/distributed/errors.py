"""Run under torchrun with 2 processes: a collective the ranks disagree on must raise an error
that names the op, the group and the ranks within the group's timeout, never hang.

    torchrun --standalone --nproc-per-node 2 tests/distributed/errors.py {shape|absent|dead|raises}

``raises``: rank 1 stops with an uncaught exception while rank 0 waits in a collective with a
long timeout; the failed rank must exit at once, so that the launcher ends the job.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

case = sys.argv[1]
dist.init_process_group("tpu", timeout=datetime.timedelta(seconds=300 if case == "raises" else 5))
rank = dist.get_rank()
dev = torch.device("tpu", int(os.environ["LOCAL_RANK"]))
ok = torch.ones(3, device=dev)
dist.all_reduce(ok)  # the group works
assert ok.cpu().tolist() == [2.0] * 3
start = time.monotonic()
try:
    if case == "shape":  # the ranks disagree on the shape
        dist.all_reduce(torch.ones(4 if rank == 0 else 8, device=dev))
    elif case == "absent":  # rank 1 never calls the collective
        if rank == 0:
            dist.all_gather_into_tensor(torch.empty(6, device=dev), torch.ones(3, device=dev))
        else:
            time.sleep(10)  # twice the group's 5 s timeout: rank 0 must give up while it is absent
    elif case == "dead":  # rank 1 dies after a collective both ran once
        x = torch.ones(5, device=dev)
        dist.all_reduce(x)
        if rank == 1:
            os._exit(3)
        time.sleep(1)
        dist.all_reduce(x)
        x.cpu()
    elif case == "raises":  # rank 1 fails outside any collective; rank 0 waits in one
        if rank == 1:
            raise ValueError("rank 1 fails on purpose")
        dist.all_reduce(ok)
        ok.cpu()
except RuntimeError as exc:
    print(f"rank {rank} raised after {time.monotonic() - start:.1f}s: {exc}", flush=True)
    sys.exit(7)
print(f"rank {rank} finished without an error", flush=True)
