"""Run under torchrun: ``_c10d_functional`` collectives inside ``torch.compile(backend="tpu")``
graphs, lowered to XLA collectives in the graph's own program.

    torchrun --standalone --nproc-per-node 2 tests/distributed/compiled.py funcol tp
    torchrun --standalone --nproc-per-node 4 tests/distributed/compiled.py funcol mesh2d

Cases (any of them, in order):

* ``funcol``: funcol collectives (all_reduce, all_gather, reduce_scatter, all_to_all_single even
  and uneven, broadcast, coalesced) in one compiled function match the same calls through gloo on
  CPU; each compiled graph is one program over the group; a collective over a group of only some
  ranks (only its members call it); a graph over two different groups runs as two programs.
* ``tp``: a tensor-parallel transformer block (ColwiseParallel/RowwiseParallel on a DeviceMesh of
  every rank) compiled with fullgraph=True matches the single-process CPU block, forward and
  backward, over several steps: one forward and one backward program, compiled in the first step
  only, no graph breaks, no recompilation.
* ``mesh2d`` (4 processes): a function with collectives over both dimensions of a 2x2 DeviceMesh.
* ``mismatch``: ranks that compiled different collectives get an error naming both, not a hang.

Each passing case prints ``ok <case>`` on rank 0; any mismatch raises (the process exits non-zero).
"""

from __future__ import annotations

import copy
import datetime
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F

import torchtpu.compile as tpu_compile
from torchtpu import metrics
from torchtpu.compile import collectives

warnings.filterwarnings("ignore", category=FutureWarning)  # funcol's older names, used on purpose
dist.init_process_group("cpu:gloo,tpu:tpu", timeout=datetime.timedelta(seconds=60))
RANK, WORLD = dist.get_rank(), dist.get_world_size()
LOCAL = int(os.environ["LOCAL_RANK"])
torch.tpu.set_device(LOCAL)
DEV = torch.device("tpu", LOCAL)
WORLD_GROUP = dist.group.WORLD


def data(shape, dtype=torch.float32, salt=0):
    """Rank-dependent values, the same on every run."""
    g = torch.Generator().manual_seed(1000 * RANK + salt)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 7, shape, generator=g).to(dtype)


def same(name, got, want):
    got = [got] if isinstance(got, torch.Tensor) else list(got)
    want = [want] if isinstance(want, torch.Tensor) else list(want)
    for a, b in zip(got, want, strict=True):
        a = a.cpu()
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, a.shape, b.dtype, b.shape)
        if a.dtype.is_floating_point:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
        else:
            assert torch.equal(a, b), (name, a, b)


def compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="tpu", fullgraph=True)


def on_tpu(*tensors):
    return [t.to(DEV) for t in tensors]


def graph_programs() -> int:
    return metrics.programs["graph"]["compiled"] + metrics.programs["graph"]["loaded"]


def done(case):
    dist.barrier()
    if RANK == 0:
        print("ok", case, flush=True)


# ---------------------------------------------------------------- funcol

def every_collective(x, ints, s, rows):
    """Each funcol collective on the world group (x: [2*WORLD, 3] floats, ints: [WORLD, 2]
    integers, s: a 0-d float, rows: this rank's uneven all_to_all input)."""
    g = WORLD_GROUP
    y = funcol.all_reduce(x * 2, "sum", g)
    out = [y,
           funcol.all_reduce(x, "max", g),
           funcol.all_reduce(x, "avg", g),
           funcol.all_reduce(ints, "product", g),
           funcol.all_reduce(ints, "bxor", g),
           funcol.all_reduce(s, "sum", g) + 1,  # 0-d in, 0-d out
           funcol.all_gather_tensor(y, 0, g),
           funcol.all_gather_single(x, 0, g),  # the newer name
           funcol.all_gather_tensor(x, 1, g),  # another dimension: a gather plus a local reshuffle
           funcol.reduce_scatter_tensor(x, "sum", 0, g),
           funcol.reduce_scatter_single(x, "avg", 0, g),
           funcol.reduce_scatter_tensor(ints, "max", 0, g),
           funcol.all_to_all_single(x, None, None, g),
           funcol.all_to_all_single(rows, _out_splits(), _in_splits(RANK), g),
           funcol.broadcast(x, 1, g),
           *funcol.all_reduce_coalesced([x, x * 3], "sum", g),
           *funcol.all_gather_into_tensor_coalesced([x, ints], g),
           *funcol.reduce_scatter_tensor_coalesced([x, x + 1], "sum", [0, 0], g)]
    return out


def _in_splits(rank):
    """Rank ``rank`` sends rank+j+1 rows to rank j (a different split on every pair)."""
    return [rank + j + 1 for j in range(WORLD)]


def _out_splits():
    return [_in_splits(i)[RANK] for i in range(WORLD)]


def check_funcol():
    x, ints, s = data((2 * WORLD, 3)), data((WORLD, 2), torch.int64, 1), data((), salt=2)
    rows = data((sum(_in_splits(RANK)), 2), salt=3)
    before = dict(collectives.counts)
    got = compiled(every_collective)(*on_tpu(x, ints, s, rows))
    want = every_collective(x, ints, s, rows)  # the same funcol calls on CPU tensors: gloo
    same("funcol collectives", got, want)
    # one graph, one program over the world's devices
    assert collectives.counts["one_program"] == before.get("one_program", 0) + 1, dict(collectives.counts)
    assert collectives.counts["split"] == before.get("split", 0), dict(collectives.counts)
    # again: no new program
    programs = graph_programs()
    fn = torch.compile(every_collective, backend="tpu", fullgraph=True)
    same("funcol collectives, second call", fn(*on_tpu(x, ints, s, rows)), want)
    same("funcol collectives, third call", fn(*on_tpu(x, ints, s, rows)), want)
    assert graph_programs() == programs, "a second call compiled again"
    check_partial_group()
    check_two_groups()
    check_training_step()
    check_mutation_and_random_ops()
    done("funcol")


def check_mutation_and_random_ops():
    """An input mutated in the program (its buffer donated) and a random op (the program's key
    comes in as a per-rank scalar) next to a collective."""
    def f(x, buf):
        buf.add_(funcol.all_reduce(x, "sum", WORLD_GROUP))
        return buf * 2, funcol.all_reduce(x, "sum", WORLD_GROUP) + torch.rand_like(x)

    x, buf = data((3, 4), salt=10), data((3, 4), salt=11)
    tpu_buf = buf.to(DEV)
    donated = tpu_compile.compiler.cache_stats()["donated_buffers"]
    out, noisy = compiled(f)(x.to(DEV), tpu_buf)
    assert tpu_compile.compiler.cache_stats()["donated_buffers"] == donated + 1
    want_buf = buf.clone()
    want_out, _ = f(x, want_buf)
    same("mutated input", tpu_buf, want_buf)
    same("output after the mutation", out, want_out)
    noise = noisy.cpu() - funcol.all_reduce(x, "sum", WORLD_GROUP)
    assert bool(((noise >= -1e-6) & (noise < 1 + 1e-6)).all()) and noise.std() > 0.01, noise


def check_partial_group():
    """A collective over a group that only some ranks belong to: only its members call it."""
    members = [r for r in range(WORLD) if r % 2 == 1] if WORLD > 2 else [1]
    sub = dist.new_group(members)

    def f(x):
        scattered = funcol.reduce_scatter_tensor(funcol.all_reduce(x, "sum", sub) * 2, "sum", 0, sub).sin()
        return scattered, funcol.broadcast(x, len(members) - 1, sub)  # src: a rank within the group

    if RANK in members:
        x = data((2 * len(members), 4), salt=4)
        same("subgroup", compiled(f)(*on_tpu(x)), f(x))
    dist.barrier()


def check_two_groups():
    """Collectives of two groups in one graph: run as two programs in sequence, counted."""
    evens = dist.new_group([r for r in range(WORLD) if r % 2 == 0])
    odds = dist.new_group([r for r in range(WORLD) if r % 2 == 1])
    mine = evens if RANK % 2 == 0 else odds

    def f(x):
        y = funcol.all_reduce(x, "sum", WORLD_GROUP) * 3
        z = funcol.all_reduce(y, "max", mine)
        return funcol.all_gather_tensor(z + x, 0, WORLD_GROUP), y

    x = data((2, 3), salt=5)
    before = dict(collectives.counts)
    same("two groups", compiled(f)(*on_tpu(x)), f(x))
    assert collectives.counts["split"] == before.get("split", 0) + 1, dict(collectives.counts)
    assert collectives.counts["pieces"] == before.get("pieces", 0) + 3, dict(collectives.counts)


def check_training_step():
    """Data parallel by hand: gradients all-reduced in the compiled backward (aot_autograd's
    forward and backward graphs, each one program)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    copy_ = copy.deepcopy(model).to(DEV)
    x, y = data((4, 6), salt=6), data((4, 1), salt=7)

    def loss(m, x, y):
        out = funcol.all_reduce(m(x), "avg", WORLD_GROUP)
        gathered = funcol.all_gather_tensor_autograd(out, 0, WORLD_GROUP)  # differentiable: its backward
        back = funcol.reduce_scatter_tensor_autograd(gathered, "sum", 0, WORLD_GROUP)  # is a collective too
        return F.mse_loss(back / WORLD, y)

    ref = loss(model, x, y)
    ref.backward()
    got = compiled(loss)(copy_, *on_tpu(x, y))
    got.backward()
    same("data-parallel loss", got, ref)
    for (name, a), b in zip(copy_.named_parameters(), model.parameters()):
        same(f"grad {name}", a.grad, b.grad)


# ---------------------------------------------------------------- tensor parallel

class Block(nn.Module):
    """A pre-norm transformer block; heads as ``-1`` so each rank's shard holds whole heads."""

    def __init__(self, dim=32, heads=4, hidden=64):
        super().__init__()
        self.head_dim = dim // heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim)
        self.w1, self.w2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = (w(h).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        scores = (q @ k.transpose(-2, -1)) / self.head_dim ** 0.5
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        attn = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + self.wo((attn @ v).transpose(1, 2).reshape(b, t, -1))
        return x + self.w2(F.gelu(self.w1(self.norm2(x))))


def check_tp(steps=4):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    reference = Block()
    model = copy.deepcopy(reference).to(DEV)
    mesh = init_device_mesh("tpu", (WORLD,))
    plan = {name: ColwiseParallel() for name in ("wq", "wk", "wv", "w1")}
    plan.update({name: RowwiseParallel() for name in ("wo", "w2")})
    parallelize_module(model, mesh, plan)
    torch._dynamo.reset()
    step_fn = torch.compile(model, backend="tpu", fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, foreach=False)  # DTensor and plain (norm) params mixed
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    torch._dynamo.utils.counters.clear()
    before = dict(collectives.counts)
    metrics.end_step()
    for step in range(steps):
        x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(step))  # the same on every rank
        x_tpu = x.to(DEV)
        eager_collectives = dict(metrics.snapshot()["collectives"])
        out = step_fn(x_tpu)
        out.square().mean().backward()
        # forward and backward ran no eager collective: theirs are inside the programs
        assert metrics.snapshot()["collectives"] == eager_collectives, (eager_collectives, metrics.snapshot())
        ref = reference(x)
        same(f"tp forward, step {step}", out, ref)
        ref.square().mean().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            same(f"tp grad {name}, step {step}", grad, q.grad)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        programs = metrics.end_step()
        if step == 0:  # forward and backward: one program each, both over the mesh
            assert programs["graph_compiled"] + programs["graph_loaded"] == 2, programs
        else:
            assert programs["graph_compiled"] == programs["graph_loaded"] == 0, (step, programs)
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    assert not breaks, breaks
    assert collectives.counts["one_program"] == before.get("one_program", 0) + 2, dict(collectives.counts)
    assert collectives.counts["split"] == before.get("split", 0), dict(collectives.counts)
    calls = {name: c["cache_hits"] + c["compilations"] for name, c in metrics.compiles.items()
             if name.startswith("torchtpu_")}
    forward = [n for n in calls if n.startswith("torchtpu_forward_")]
    assert len(forward) >= 1 and calls[forward[-1]] == steps, calls  # the newest forward graph: once per step
    assert not metrics.recompiles, dict(metrics.recompiles)
    if RANK == 0:
        print("tp programs per step:", metrics.steps[-steps:], "\ncalls per graph:", calls,
              "\ncompiled_collectives:", metrics.snapshot()["compiled_collectives"], flush=True)
    done("tp")


# ---------------------------------------------------------------- 2-D mesh

def check_mesh2d():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("tpu", (2, WORLD // 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_group("dp"), mesh.get_group("tp")

    def f(x):
        y = funcol.all_reduce(x, "sum", tp)
        z = funcol.reduce_scatter_tensor(y * 2, "sum", 0, dp)
        return funcol.all_gather_tensor(z.cos(), 0, tp)

    x = data((4, 3), salt=8)
    before = dict(collectives.counts)
    same("2-D mesh", compiled(f)(*on_tpu(x)), f(x))
    assert collectives.counts["split"] == before.get("split", 0) + 1, dict(collectives.counts)
    done("mesh2d")


# ---------------------------------------------------------------- ranks that disagree

def check_mismatch():
    """Ranks whose graphs run different collectives get an error naming them, not a hang."""
    def f(x):
        return funcol.all_reduce(x if RANK == 0 else x[:2], "sum", WORLD_GROUP)

    try:
        compiled(f)(*on_tpu(data((4, 3), salt=9)))
    except Exception as exc:  # noqa: BLE001 - dynamo may wrap it
        message = str(exc)
        assert "compiled different collectives" in message and "all_reduce(float32[" in message, message
    else:
        raise AssertionError("ranks that compiled different collectives ran without an error")
    done("mismatch")


CASES = {"funcol": check_funcol, "tp": check_tp, "mesh2d": check_mesh2d, "mismatch": check_mismatch}
tpu_compile.install()
for case in sys.argv[1:]:
    CASES[case]()
dist.destroy_process_group()
