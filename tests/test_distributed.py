"""torch.distributed on tpu: the c10d backend under torchrun (2 and 4 processes on XLA:CPU),
its errors, and the multi-process start-up.

The multi-process tests launch ``torchrun --standalone`` on localhost with short timeouts; the
whole process group is killed when one overruns, so nothing is left behind.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from processes import kill_tree

HERE = Path(__file__).resolve().parent
WORKERS = HERE / "distributed"


def torchrun(script: str, nproc: int, *args: str, timeout: float = 300, env: dict | None = None):
    """Run ``script`` under torchrun; returns (exit code, output). Kills the group on timeout."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(WORKERS / script), *args]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)  # torchrun and its workers, each in a session of its own
        out, _ = proc.communicate()
        # the head holds the first traceback; the tail, how the processes ended
        shown = out if len(out) <= 8000 else f"{out[:4000]}\n[...]\n{out[-4000:]}"
        pytest.fail(f"{script} on {nproc} processes did not finish within {timeout}s:\n{shown}")
    return proc.returncode, out


# 4 processes (uneven groups, more peers) in the slow sweep: ~40 s of CI on 2 cores
@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_every_collective_matches_gloo(nproc):
    code, out = torchrun("collectives.py", nproc)
    assert code == 0 and "all collectives passed" in out, out[-6000:]


def test_default_backend_and_object_collectives():
    code, out = torchrun("default_backend.py", 2, timeout=120)
    assert code == 0 and "rank 0 ok" in out and "rank 1 ok" in out, out[-4000:]


# CI runs the mismatch; a rank that never calls (30 s) and a rank that dies are in the slow sweep
@pytest.mark.parametrize("case", ["shape", *(pytest.param(c, marks=pytest.mark.slow) for c in ("absent", "dead"))])
def test_disagreeing_ranks_raise_within_the_timeout(case):
    code, out = torchrun("errors.py", 2, case, timeout=90)
    assert code != 0, out[-3000:]
    assert "rank 0 finished without an error" not in out
    if case == "shape":  # both ranks see the mismatch at the check
        assert "called different collectives" in out or "did not call a matching collective" in out, out[-3000:]
        assert "all_reduce" in out and "global ranks [0, 1]" in out, out[-3000:]
    elif case == "absent":
        assert "all_gather_into_tensor" in out and "did not call a matching collective" in out, out[-3000:]
        assert "group ranks [1]" in out, out[-3000:]
    else:  # the survivor errors: gloo sees the closed connection, or jax.distributed the dead
        # task, or our watchdog the collective that never completes; whichever comes first
        assert any(sign in out for sign in ("Connection closed by peer", "another task died", "watchdog")), \
            out[-3000:]


def test_a_rank_that_raises_ends_the_job_at_once():
    """An uncaught exception on one rank while another waits in a collective (300 s timeout):
    the failed rank skips JAX's exit barrier, so torchrun ends the job well within the test's
    timeout, with the traceback and a non-zero exit code."""
    code, out = torchrun("errors.py", 2, "raises", timeout=90)
    assert code != 0, out[-3000:]
    assert "ValueError: rank 1 fails on purpose" in out and "rank 1 failed; it exits without waiting" in out, \
        out[-3000:]
    assert "finished without an error" not in out


@pytest.mark.parametrize("name", ["tpu", "tpu_dist"])
def test_single_process_group_without_a_launcher(name):
    """world_size 1: no jax.distributed needed; every collective is the identity."""
    store = dist.HashStore()
    dist.init_process_group(name, store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        x = torch.arange(4.0, device="tpu")
        dist.all_reduce(x)
        out = torch.empty(4, device="tpu")
        dist.all_gather_into_tensor(out, x)
        dist.broadcast(x, src=0)
        assert out.cpu().tolist() == x.cpu().tolist() == [0.0, 1.0, 2.0, 3.0]
        assert dist.get_backend() == name
    finally:
        dist.destroy_process_group()


def test_backend_names_registered_for_tpu():
    assert "tpu" in dist.Backend.backend_list and "tpu_dist" in dist.Backend.backend_list
    assert dist.Backend.default_device_backend_map["tpu"] == "tpu"


def test_launch_environment(monkeypatch):
    from torchtpu.runtime import multiprocess

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert multiprocess.launch() is None
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.2")
    monkeypatch.setenv("MASTER_PORT", "29500")
    info = multiprocess.launch()
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (3, 4, 1, 2)
    assert multiprocess.coordinator_address() == "10.0.0.2:29501"
    monkeypatch.setenv("TORCHTPU_COORDINATOR", "host0:1234")
    from torchtpu.config import config

    monkeypatch.setattr(config, "coordinator", "host0:1234")
    assert multiprocess.coordinator_address() == "host0:1234"
    env = multiprocess.launch_env(1, 4, platform="tpu")
    assert env["TPU_VISIBLE_CHIPS"] == "1" and env["TPU_PROCESS_BOUNDS"] == "4,1,1"
    assert multiprocess.launch_env(1, 4, platform="cpu") == {}


def test_busy_coordinator_port_is_a_clear_error(monkeypatch):
    """Rank 0 checks the port after MASTER_PORT before jax.distributed would crash on it."""
    import socket

    from torchtpu.runtime import multiprocess

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": str(taken - 1)}.items():
            monkeypatch.setenv(name, value)
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
        with pytest.raises(RuntimeError, match=f"coordinator port {taken} .* is in use"):
            multiprocess.coordinator_address()


def test_ranks_given_as_arguments_join_like_an_engines_tensor_parallel_processes(monkeypatch):
    """Two processes started with their ranks as arguments (as SGLang and vLLM start tensor-parallel
    ranks) and a coordinator chosen by the launching process: collectives on tpu and on the host."""
    from torchtpu.integrations import choose_rank_coordinator
    from torchtpu.runtime.multiprocess import free_port

    monkeypatch.delenv("TORCHTPU_COORDINATOR", raising=False)  # restored after the test
    coordinator = choose_rank_coordinator()
    assert os.environ["TORCHTPU_COORDINATOR"] == coordinator
    assert choose_rank_coordinator() != coordinator  # its own choice: a fresh port per engine
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKERS / "declared.py"), str(rank), "2", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True, env=env) for rank in range(2)]
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=120)[0])
    except subprocess.TimeoutExpired:
        pytest.fail("the declared ranks did not finish within 120 s")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    for rank, (proc, out) in enumerate(zip(procs, outs)):
        assert proc.returncode == 0 and f"rank {rank} ok" in out, out[-4000:]


def test_a_launch_cannot_be_declared_once_the_runtime_runs_alone():
    from torchtpu.runtime import multiprocess

    torch.ones(1, device="tpu")  # this process's runtime has started, alone
    with pytest.raises(RuntimeError, match="already started .*alone"):
        multiprocess.declare(1, 2, 1, 2, "127.0.0.1:1")
    with pytest.raises(ValueError, match="not a valid place"):
        multiprocess.declare(2, 2, 0, 2, "127.0.0.1:1")
    assert multiprocess.launch() is None
