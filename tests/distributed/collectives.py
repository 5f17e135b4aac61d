"""Run under torchrun: every collective of the ``tpu`` backend on tpu tensors, checked against
gloo running the same collective on CPU tensors (exact for integers, assert_close for floats).

    torchrun --standalone --nproc-per-node 4 tests/distributed/collectives.py

Each check prints ``ok <name>`` on rank 0; any mismatch raises (the process exits non-zero).
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

dist.init_process_group("cpu:gloo,tpu:tpu", timeout=datetime.timedelta(seconds=60))
RANK, WORLD = dist.get_rank(), dist.get_world_size()
LOCAL = int(os.environ["LOCAL_RANK"])
torch.tpu.set_device(LOCAL)
DEV = torch.device("tpu", LOCAL)
FLOATS = (torch.float32, torch.float64, torch.bfloat16)
INTS = (torch.int64, torch.int32, torch.uint8)


def data(shape, dtype, salt=0):
    """Rank-dependent values, the same on every run."""
    g = torch.Generator().manual_seed(1000 * RANK + salt)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(0, 7, shape, generator=g).to(dtype)


def same(name, tpu_result, cpu_result):
    got = tpu_result.cpu() if isinstance(tpu_result, torch.Tensor) else [t.cpu() for t in tpu_result]
    if isinstance(cpu_result, torch.Tensor):
        got, cpu_result = [got], [cpu_result]
    for a, b in zip(got, cpu_result, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, a.shape, b.dtype, b.shape)
        if a.dtype == torch.bfloat16:  # a sum of n bfloat16s may round differently in another order
            torch.testing.assert_close(a, b, atol=1e-2, rtol=3e-2, msg=lambda m: f"{name}: {m}")
        elif a.dtype.is_floating_point:
            torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")
        else:
            assert torch.equal(a, b), (name, a, b)


def done(name):
    if RANK == 0:
        print("ok", name, flush=True)


def both(fn, *cpu_tensors):
    """Run ``fn`` on copies of the CPU tensors moved to tpu, and on the CPU tensors (gloo)."""
    tpu_tensors = [t.to(DEV) if isinstance(t, torch.Tensor) else [u.to(DEV) for u in t] for t in cpu_tensors]
    fn(*tpu_tensors)
    fn(*cpu_tensors)
    return tpu_tensors, cpu_tensors


# ---------------------------------------------------------------- all_reduce
for dtype in FLOATS + INTS:
    ops = [dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT]
    if not dtype.is_floating_point:
        ops += [dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR]
    for op in ops:
        if dtype == torch.bfloat16 and op == dist.ReduceOp.PRODUCT:
            continue  # gloo's bfloat16 product rounds per step; the order of rounding differs
        (t,), (c,) = both(lambda x: dist.all_reduce(x, op=op), data((3, 5), dtype))
        same(f"all_reduce {op} {dtype}", t, c)
done("all_reduce: sum, max, min, product, band, bor, bxor x 6 dtypes")

x = data((7,), torch.float32)
t = x.to(DEV)
dist.all_reduce(t, op=dist.ReduceOp.AVG)
c = x.clone()
dist.all_reduce(c)  # gloo has no AVG: compare with SUM / n
same("all_reduce avg", t, c / WORLD)
scalar = torch.tensor(float(RANK + 1)).to(DEV)
dist.all_reduce(scalar)
assert scalar.shape == () and scalar.item() == WORLD * (WORLD + 1) / 2
flags = (torch.arange(4) == RANK).to(DEV)
dist.all_reduce(flags, op=dist.ReduceOp.MAX)
assert flags.cpu().tolist() == [i < WORLD for i in range(4)]
done("all_reduce: avg, 0-d, bool")

# A non-contiguous view is reduced in place, the rest of its storage untouched.
base = data((4, 6), torch.float32)
t = base.to(DEV)
dist.all_reduce(t[:, 1:3])
expected = base.clone()
total = base[:, 1:3].contiguous()
dist.all_reduce(total)
expected[:, 1:3] = total
same("all_reduce of a view", t, expected)
done("all_reduce of a non-contiguous view")

# ---------------------------------------------------------------- broadcast and reduce
for root in range(WORLD):
    for dtype in (torch.float32, torch.int64, torch.bool, torch.bfloat16):
        (t,), (c,) = both(lambda x: dist.broadcast(x, src=root), data((2, 3), dtype, salt=root))
        same(f"broadcast from {root} {dtype}", t, c)
neg_zero = torch.tensor([-0.0, float("nan"), float("inf")])
t = (neg_zero if RANK == 0 else torch.zeros(3)).to(DEV)
dist.broadcast(t, src=0)
assert torch.equal(t.cpu().view(torch.int32), neg_zero.view(torch.int32)), "broadcast is not bit-exact"
done("broadcast: every root, 4 dtypes, bit-exact")

for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
    (t,), (c,) = both(lambda x: dist.reduce(x, dst=WORLD - 1, op=op), data((4,), torch.float32))
    if RANK == WORLD - 1:
        same(f"reduce {op}", t, c)
    else:
        same("reduce leaves non-roots unchanged", t, data((4,), torch.float32))
done("reduce")

# ---------------------------------------------------------------- all_gather
for dtype in (torch.float32, torch.int64):
    x = data((2, 3), dtype)
    outs_t = [torch.empty(2, 3, dtype=dtype, device=DEV) for _ in range(WORLD)]
    outs_c = [torch.empty(2, 3, dtype=dtype) for _ in range(WORLD)]
    dist.all_gather(outs_t, x.to(DEV))
    dist.all_gather(outs_c, x)
    same(f"all_gather {dtype}", outs_t, outs_c)

    out_t = torch.empty(WORLD * 2, 3, dtype=dtype, device=DEV)
    out_c = torch.empty(WORLD * 2, 3, dtype=dtype)
    dist.all_gather_into_tensor(out_t, x.to(DEV))
    dist.all_gather_into_tensor(out_c, x)
    same(f"all_gather_into_tensor {dtype}", out_t, out_c)
    stacked = torch.empty(WORLD, 2, 3, dtype=dtype, device=DEV)
    dist.all_gather_into_tensor(stacked, x.to(DEV))
    same("all_gather_into_tensor stacked", stacked, out_c.view(WORLD, 2, 3))
done("all_gather, all_gather_into_tensor")

# ---------------------------------------------------------------- reduce_scatter
for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN):
    x = data((WORLD * 4, 3), torch.float32)
    out_t = torch.empty(4, 3, device=DEV)
    out_c = torch.empty(4, 3)
    dist.reduce_scatter_tensor(out_t, x.to(DEV), op=op)
    dist.reduce_scatter_tensor(out_c, x, op=op)
    same(f"reduce_scatter_tensor {op}", out_t, out_c)
x = data((WORLD * 2,), torch.float32)
out_t = torch.empty(2, device=DEV)
dist.reduce_scatter_tensor(out_t, x.to(DEV), op=dist.ReduceOp.AVG)
full = x.clone()
dist.all_reduce(full)
same("reduce_scatter_tensor avg", out_t, (full / WORLD)[RANK * 2:(RANK + 1) * 2])
ins = [data((3,), torch.int64, salt=j) for j in range(WORLD)]
out_t = torch.empty(3, dtype=torch.int64, device=DEV)
dist.reduce_scatter(out_t, [i.to(DEV) for i in ins])
totals = [i.clone() for i in ins]
for total in totals:
    dist.all_reduce(total)  # block j summed over the ranks (gloo), for rank j
expected = totals[RANK]
same("reduce_scatter (list)", out_t, expected)
x = data((WORLD * 2, 3), torch.float32)
full = x.clone()
dist.all_reduce(full)  # gloo has no PREMUL_SUM: compare with factor * SUM
for factor in (0.25, torch.tensor(0.25).to(DEV)):  # FSDP2's gradient divide factor: a float or a tensor
    out_t = torch.empty(2, 3, device=DEV)
    dist.reduce_scatter_tensor(out_t, x.to(DEV), op=dist._make_nccl_premul_sum(factor))
    same("reduce_scatter_tensor premul_sum", out_t, (full * 0.25)[RANK * 2:(RANK + 1) * 2])
t = x.to(DEV)
dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0))
same("all_reduce premul_sum", t, full * 2.0)
done("reduce_scatter_tensor (sum, max, min, avg, premul_sum), reduce_scatter, all_reduce premul_sum")

# ---------------------------------------------------------------- all_to_all
x = data((WORLD * 3, 2), torch.float32)
out_t = torch.empty(WORLD * 3, 2, device=DEV)
out_c = torch.empty(WORLD * 3, 2)
dist.all_to_all_single(out_t, x.to(DEV))
dist.all_to_all_single(out_c, x)
same("all_to_all_single", out_t, out_c)
# Uneven: rank r sends (r + j + 1) rows to rank j.
in_splits = [RANK + j + 1 for j in range(WORLD)]
out_splits = [i + RANK + 1 for i in range(WORLD)]
x = data((sum(in_splits), 2), torch.float32)
out_t = torch.empty(sum(out_splits), 2, device=DEV)
out_c = torch.empty(sum(out_splits), 2)
dist.all_to_all_single(out_t, x.to(DEV), out_splits, in_splits)
dist.all_to_all_single(out_c, x, out_splits, in_splits)
same("all_to_all_single uneven", out_t, out_c)
ins = [data((j + 1,), torch.int64, salt=j) for j in range(WORLD)]
outs_t = [torch.empty(RANK + 1, dtype=torch.int64, device=DEV) for _ in range(WORLD)]
dist.all_to_all(outs_t, [i.to(DEV) for i in ins])
flat_c = torch.empty(WORLD * (RANK + 1), dtype=torch.int64)  # gloo has no list all_to_all: the flat one
dist.all_to_all_single(flat_c, torch.cat(ins), [RANK + 1] * WORLD, [j + 1 for j in range(WORLD)])
same("all_to_all (list, uneven)", outs_t, list(flat_c.split(RANK + 1)))
done("all_to_all_single (even, uneven), all_to_all")

# ---------------------------------------------------------------- scatter and gather
for root in (0, WORLD - 1):
    src = [data((2, 2), torch.float32, salt=j) for j in range(WORLD)]
    out_t = torch.empty(2, 2, device=DEV)
    out_c = torch.empty(2, 2)
    dist.scatter(out_t, [s.to(DEV) for s in src] if RANK == root else None, src=root)
    dist.scatter(out_c, src if RANK == root else None, src=root)
    same(f"scatter from {root}", out_t, out_c)
    x = data((3,), torch.int64)
    outs_t = [torch.empty(3, dtype=torch.int64, device=DEV) for _ in range(WORLD)] if RANK == root else None
    outs_c = [torch.empty(3, dtype=torch.int64) for _ in range(WORLD)] if RANK == root else None
    dist.gather(x.to(DEV), outs_t, dst=root)
    dist.gather(x, outs_c, dst=root)
    if RANK == root:
        same(f"gather to {root}", outs_t, outs_c)
done("scatter, gather")

# ---------------------------------------------------------------- point to point
if RANK == 0:
    dist.send(torch.arange(5.0).to(DEV), dst=WORLD - 1)
elif RANK == WORLD - 1:
    got = torch.zeros(5, device=DEV)
    dist.recv(got, src=0)
    assert got.cpu().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
nxt, prv = (RANK + 1) % WORLD, (RANK - 1) % WORLD
if WORLD > 1:
    send_t = torch.full((3,), float(RANK), device=DEV)
    recv_t = torch.empty(3, device=DEV)
    recv_c = torch.empty(3)
    # Receive listed first on purpose: the order within a batch must not matter.
    works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, recv_t, prv), dist.P2POp(dist.isend, send_t, nxt)])
    for w in works:
        w.wait()
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((3,), float(RANK)), nxt),
                                    dist.P2POp(dist.irecv, recv_c, prv)])
    for w in works:
        w.wait()
    same("batch_isend_irecv ring", recv_t, recv_c)
    if RANK in (0, 1):
        peer = 1 - RANK
        out = torch.full((2,), float(RANK), device=DEV)
        inp = torch.empty(2, device=DEV)
        reqs = [dist.isend(out, peer), dist.irecv(inp, peer)] if RANK == 0 else \
            [dist.irecv(inp, peer), dist.isend(out, peer)]
        for r in reqs:
            r.wait()
        assert inp.cpu().tolist() == [float(peer)] * 2
done("send/recv, isend/irecv, batch_isend_irecv ring")

# ---------------------------------------------------------------- async ops, barrier
x = data((64,), torch.float32)
t = x.to(DEV)
work = dist.all_reduce(t, async_op=True)
work.wait()
y = t * 2  # ordered after the collective
c = x.clone()
dist.all_reduce(c)
same("async all_reduce then compute", y, c * 2)
fut = dist.all_reduce(x.to(DEV), async_op=True).get_future()
same("async future value", fut.wait()[0], c)
dist.barrier()
done("async_op=True, futures, barrier")

# ---------------------------------------------------------------- subgroups
if WORLD >= 2:
    evens = [r for r in range(WORLD) if r % 2 == 0]
    odds = [r for r in range(WORLD) if r % 2 == 1]
    g_even = dist.new_group(evens)
    g_odd = dist.new_group(odds)
    mine, group = (evens, g_even) if RANK % 2 == 0 else (odds, g_odd)
    t = torch.tensor([float(RANK)], device=DEV)
    dist.all_reduce(t, group=group)
    assert t.item() == sum(mine), (t.item(), mine)
    # A group only some ranks create (use_local_synchronization): the others never call it.
    if RANK < 2:
        pair = dist.new_group([0, 1], use_local_synchronization=True)
        t = torch.tensor([RANK + 1.0], device=DEV)
        dist.all_reduce(t, group=pair)
        assert t.item() == 3.0
        out = torch.empty(2, device=DEV)
        dist.all_gather_into_tensor(out, torch.tensor([RANK * 10.0], device=DEV), group=pair)
        assert out.cpu().tolist() == [0.0, 10.0]
    dist.barrier()
done("subgroups: new_group, concurrent disjoint groups, locally synchronised group")

# ---------------------------------------------------------------- functional collectives (eager)
x = data((WORLD * 2, 3), torch.float32)
ref = x.clone()
dist.all_reduce(ref)
same("funcol all_reduce", funcol.all_reduce(x.to(DEV), "sum", dist.group.WORLD), ref)
gathered = torch.empty(WORLD * WORLD * 2, 3)
dist.all_gather_into_tensor(gathered, x)
same("funcol all_gather_tensor", funcol.all_gather_tensor(x.to(DEV), 0, dist.group.WORLD), gathered)
scattered = torch.empty(2, 3)
dist.reduce_scatter_tensor(scattered, x)
same("funcol reduce_scatter_tensor", funcol.reduce_scatter_tensor(x.to(DEV), "sum", 0, dist.group.WORLD),
     scattered)
done("functional collectives in eager mode")

# ---------------------------------------------------------------- no host round trip
from torchtpu import metrics  # noqa: E402

metrics.reset()
t = data((1024,), torch.float32).to(DEV)
before = metrics.snapshot()["transfers"]
for _ in range(3):
    dist.all_reduce(t)
    out = torch.empty(WORLD * 1024, device=DEV)
    dist.all_gather_into_tensor(out, t)
after = metrics.snapshot()
assert after["transfers"] == before, (before, after["transfers"])
assert after["collectives"]["all_reduce"] >= 3, after["collectives"]
done("collectives: no host transfers")

# ---------------------------------------------------------------- a CPU tensor to the tpu backend
tpu_only = dist.new_group(backend="tpu")
try:
    dist.all_reduce(torch.ones(2), group=tpu_only)
except (ValueError, RuntimeError) as exc:
    assert "Tensors must be tpu and dense" in str(exc) or "No backend type associated" in str(exc), exc
else:
    raise AssertionError("a CPU tensor reached the tpu backend without an error")
done("a CPU tensor on the tpu backend raises")

dist.barrier()
dist.destroy_process_group()
if RANK == 0:
    print("all collectives passed", flush=True)
