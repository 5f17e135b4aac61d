"""Eager programs across processes (the persistent compilation cache), their counters in
``torchtpu.metrics``, ``.item()`` as a transfer, and the error for sparse tensors."""

import io
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from cache_dirs import fresh_cache_dir
from torchtpu import metrics

STEPS = 5  # each step compiles ~8 new programs cold; 5 steps show the per-step pattern

# A child process: an attention decode loop whose sequence grows by one each step (every step has
# new shapes), in eager mode; prints the generated values and its metrics as JSON.
CHILD = textwrap.dedent("""
    import json
    import torch
    from torchtpu import metrics

    torch.manual_seed(0)
    d = 8
    wq, wk, wv = (torch.randn(d, d).to("tpu") for _ in range(3))
    x = torch.randn(4, d).to("tpu")
    metrics.reset()
    out = []
    for _ in range({steps}):
        q = x[-1:] @ wq                                           # a view of the last row
        k, v = x @ wk, x @ wv
        att = ((q @ k.t()) * d ** -0.5).softmax(-1)               # k.t(): a view
        nxt = torch.tanh(att @ v)
        x = torch.cat([x, nxt])
        out.append(nxt.sum().item())
        metrics.end_step()
    snap = metrics.snapshot()
    print("RESULT" + json.dumps({{"out": out, "eager": snap["eager_compiles"], "steps": snap["steps"],
                                  "transfers": snap["transfers"]}}))
""").format(steps=STEPS)


def run_child(cache_dir) -> dict:
    env = {**os.environ, "TORCHTPU_CACHE_DIR": str(fresh_cache_dir(cache_dir)), "TORCHTPU_PLATFORM": "cpu"}
    for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                 "TORCHTPU_DEFER_AND_FUSE", "TORCHTPU_LAUNCH_BLOCKING"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def test_second_process_loads_the_eager_programs_of_a_decode_loop(tmp_path):
    first = run_child(tmp_path)
    second = run_child(tmp_path)
    assert second["out"] == first["out"]
    compiled = first["eager"]["compilations"]
    assert first["eager"]["persistent_hits"] == 0  # a fresh cache directory
    assert compiled >= STEPS  # every step has new shapes
    assert second["eager"]["compilations"] <= 0.2 * compiled, (first["eager"], second["eager"])
    assert second["eager"]["persistent_hits"] >= 0.8 * compiled
    # per step: the first process compiles each step's new programs, the second loads them
    assert len(first["steps"]) == len(second["steps"]) == STEPS
    assert all(s["eager_compiled"] >= 1 for s in first["steps"][1:])
    assert all(s["eager_loaded"] >= 1 for s in second["steps"][1:])
    assert sum(s["eager_compiled"] for s in first["steps"]) == compiled
    # a view read is part of its op's program: one program per op and new shape, no gathers
    per_step = first["steps"][-1]["eager_compiled"]
    assert per_step <= 8, first["steps"]
    assert first["transfers"]["to_host"] == STEPS  # the .item() of every step


def test_report_shows_programs_per_step():
    metrics.reset()
    x = torch.randn(3, 5, device="tpu")
    for n in (11, 12, 13):  # shapes no other test uses
        (x.new_ones(n, 7, 3)[1:].exp() * 2).sum().item()
        metrics.end_step()
    snap = metrics.snapshot()
    assert [s["step"] for s in snap["steps"]] == [0, 1, 2]
    # each step built its programs: compiled, or loaded from the persistent cache of an earlier run
    assert all(s["eager_compiled"] + s["eager_loaded"] >= 1 for s in snap["steps"])
    assert all(s["graph_compiled"] + s["graph_loaded"] == 0 for s in snap["steps"])
    eager = snap["eager_compiles"]
    assert eager["compilations"] + eager["persistent_hits"] == sum(
        s["eager_compiled"] + s["eager_loaded"] for s in snap["steps"])
    text = metrics.report(file=io.StringIO())
    assert re.search(r"XLA programs per step: 3 steps", text)
    assert re.search(r"eager programs\s+\d+", text)
    metrics.reset()
    assert metrics.snapshot()["steps"] == [] and metrics.snapshot()["eager_compiles"]["compilations"] == 0


def test_graph_programs_are_counted_apart_from_eager_ones():
    x = torch.randn(6, 19, device="tpu")
    g = torch.compile(lambda t: t.cos() + 2, backend="tpu")
    metrics.reset()
    torch.testing.assert_close(g(x).cpu(), x.cpu().cos() + 2)
    snap = metrics.snapshot()
    graphs = snap["graph_compiles"]
    built = {name: s["compilations"] for name, s in snap["xla_compiles"].items()}
    graph_built = sum(n for name, n in built.items() if name.startswith("jit(torchtpu_"))
    assert graph_built >= 1, built
    assert graphs["compilations"] + graphs["persistent_hits"] == graph_built
    eager = snap["eager_compiles"]
    assert eager["compilations"] + eager["persistent_hits"] == sum(built.values()) - graph_built


def test_item_is_a_transfer_to_host():
    x = torch.arange(6.0, dtype=torch.float64).reshape(2, 3).to("tpu")
    metrics.reset()
    assert x[1, 2].item() == 5.0
    assert (x.sum() > 3).item() is True
    t = metrics.snapshot()["transfers"]
    assert (t["to_host"], t["to_host_bytes"]) == (2, 8 + 1)  # a float64 and a bool


@pytest.mark.parametrize("value", [[True], [False], [0.0], [2.5], [], [1, 1]])
@pytest.mark.parametrize("msg", [None, "rope positions out of range"])
def test_assert_async_checks_like_cpu_without_fallback(no_fallback, value, msg):
    """``torch._assert_async`` (TorchTitan's RoPE calls it every forward) runs on tpu with the
    CPU's outcome and message, not through the CPU fallback."""
    cpu = torch.tensor(value).reshape(()) if len(value) == 1 else torch.tensor(value)
    args = (cpu,) if msg is None else (cpu, msg)
    try:
        torch._assert_async(*args)
        expected = None
    except RuntimeError as e:
        expected = str(e)
    if expected is None:
        torch._assert_async(cpu.to("tpu"), *args[1:])
    else:
        with pytest.raises(RuntimeError, match=re.escape(expected)):
            torch._assert_async(cpu.to("tpu"), *args[1:])


SPARSE = "sparse tensors are not supported on tpu"


@pytest.mark.parametrize("make", [
    lambda: torch.randn(3, 3).to_sparse().to("tpu"),
    lambda: torch.sparse_coo_tensor(torch.tensor([[0], [1]]), torch.tensor([1.0]), (2, 2), device="tpu",
                                    check_invariants=False),
    lambda: torch.empty(2, 2, layout=torch.sparse_coo, device="tpu"),
    lambda: torch.ones(3, 3, device="tpu") + torch.randn(3, 3).to_sparse(),
    lambda: torch.ones(3, 3, device="tpu").to_sparse(),
    lambda: torch.ones(3, 3, device="tpu").to_sparse_csr(),
], ids=["to", "sparse_coo_tensor", "empty", "mixed_add", "to_sparse", "to_sparse_csr"])
def test_sparse_tensors_fail_clearly(make):
    torch.ones(1, device="tpu")  # the runtime (and its kernels) started
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "running it on the CPU" warning first: it fails at once
        with pytest.raises(NotImplementedError, match=SPARSE):
            make()
