"""``_c10d_functional`` collectives inside ``torch.compile(backend="tpu")`` graphs: lowered to XLA
collectives in the graph's own program (``compile/collectives.py``).

The multi-process cases run ``tests/distributed/compiled.py`` under torchrun (see its docstring);
a world of one process runs here, in the test process.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from test_distributed import torchrun


@pytest.fixture(scope="module")
def two_processes():
    """One 2-process launch for the cases below (each launch costs ~15 s of start-up on 2 cores):
    its exit code and output. A case that fails stops the cases after it."""
    return torchrun("compiled.py", 2, "funcol", "tp", "mismatch", timeout=240)


def test_funcol_collectives_in_one_program_match_gloo(two_processes):
    """Every funcol collective, a subgroup of some ranks, two groups in one graph, a compiled
    data-parallel backward (2 processes)."""
    code, out = two_processes
    assert "ok funcol" in out, out[-6000:]


def test_tensor_parallel_block_is_one_program_per_step(two_processes):
    """ColwiseParallel/RowwiseParallel block, compiled: matches CPU forward and backward; one forward
    and one backward program, compiled in the first step only; no graph break (2 processes)."""
    code, out = two_processes
    assert "ok tp" in out, out[-6000:]


def test_ranks_that_compiled_different_collectives_get_an_error(two_processes):
    """A graph whose collective differs by rank raises an error naming both, not a hang."""
    code, out = two_processes
    assert code == 0 and "ok mismatch" in out, out[-6000:]


@pytest.mark.slow  # 31-62 s on 2 shared cores, with the 2-process tests covering the same paths in CI
def test_four_processes_subgroups_and_a_2d_mesh():
    """Every funcol collective on 4 ranks, a group of ranks 1 and 3 only, and a graph over both
    dimensions of a 2x2 DeviceMesh (split into one program per piece)."""
    code, out = torchrun("compiled.py", 4, "funcol", "mesh2d", timeout=300)
    assert code == 0 and "ok funcol" in out and "ok mesh2d" in out, out[-6000:]


@pytest.fixture
def world_of_one():
    dist.init_process_group("tpu", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    torch._dynamo.reset()
    try:
        yield dist.group.WORLD
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()


def test_world_of_one_process(world_of_one):
    from torchtpu.compile import collectives

    def f(x):
        y = funcol.all_reduce(x.sin(), "sum", world_of_one)
        return funcol.all_gather_tensor(y, 0, world_of_one) + funcol.reduce_scatter_tensor(y, "avg", 0, world_of_one)

    def g(x):
        return x.sin() * 2

    x = torch.randn(4, 3)
    before = collectives.counts["one_program"]
    out = torch.compile(f, backend="tpu", fullgraph=True)(x.to("tpu"))
    torch.testing.assert_close(out.cpu(), x.sin() * 2)
    assert collectives.counts["one_program"] == before + 1
    torch.compile(g, backend="tpu", fullgraph=True)(x.to("tpu"))  # no collectives: a plain program
    assert collectives.counts["one_program"] == before + 1
