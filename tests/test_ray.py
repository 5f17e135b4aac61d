"""Ray on ``tpu`` (``examples/ray_workflow.py``): a CPU task feeding a task that asks for ``TPU``
and trains on ``tpu``, and Ray Train with ``ScalingConfig(use_tpu=True)``: 2 workers, the
``tpu_dist`` backend, DDP on ``tpu`` (one XLA:CPU device per worker process). Each must match the
same training on the CPU within 1e-4 relative.

Each case starts its own local Ray (a few CPUs, the ``TPU`` resources declared) in a fresh
process with a short timeout. Ray's workers start their own sessions, so a process-group kill
would miss them: every process of the run carries a marker in its environment, and whatever
still carries it when the case ends is killed by its id.
"""

import ast
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

pytest.importorskip("ray.train", reason="Ray Train is not installed (pip install 'torchtpu[ray]'); CI does "
                                        "not install it")

EXAMPLE = Path(__file__).parents[1] / "examples" / "ray_workflow.py"
MARKER = "TORCHTPU_RAY_TEST_RUN"


def _marked(run: str) -> list[int]:
    """Ids of the live processes whose environment carries this run's marker."""
    needle = f"{MARKER}={run}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if needle in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                found.append(int(entry))
        except OSError:
            pass
    return found


def _kill_run(run: str, grace: float = 10.0) -> None:
    """Wait ``grace`` seconds for the run's processes to exit, then SIGKILL what is left."""
    deadline = time.monotonic() + grace
    while _marked(run) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in _marked(run):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _run_example(part: str, tmp_path: Path, timeout: float = 400) -> str:
    """``examples/ray_workflow.py --part part`` on XLA:CPU; its output (it fails on a mismatch)."""
    run = uuid.uuid4().hex
    env = {**os.environ, MARKER: run, "TORCHTPU_PLATFORM": "cpu", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("XLA_FLAGS", None)  # one XLA:CPU device per process
    proc = subprocess.Popen([sys.executable, str(EXAMPLE), "--part", part, "--storage", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # lets ray.shutdown() run
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"ray_workflow.py --part {part} did not finish within {timeout}s:\n{out[-4000:]}")
    finally:
        _kill_run(run)
    assert proc.returncode == 0, out[-6000:]
    return out


def _losses(line_start: str, out: str) -> tuple[list[float], list[float]]:
    match = re.search(re.escape(line_start) + r".*?losses (\[[^\]]*\]), cpu (\[[^\]]*\])", out)
    assert match, out[-4000:]
    return ast.literal_eval(match.group(1)), ast.literal_eval(match.group(2))


def test_cpu_task_feeds_a_tpu_task(tmp_path):
    out = _run_example("workflow", tmp_path)
    tpu, cpu = _losses("workflow on tpu:0:", out)
    assert len(tpu) == 5 and tpu[-1] < tpu[0] / 2  # it trained
    torch.testing.assert_close(tpu, cpu, rtol=1e-4, atol=1e-6)


def test_ray_train_use_tpu_ddp_on_tpu_dist(tmp_path):
    out = _run_example("train", tmp_path)
    tpu, cpu = _losses("Ray Train, 2 workers, tpu_dist on tpu:", out)
    assert len(tpu) == 5 and tpu[-1] < tpu[0] / 2
    torch.testing.assert_close(tpu, cpu, rtol=1e-4, atol=1e-6)
    # rank 0's checkpoint: the DDP-trained weights, saved through Ray Train
    assert list(tmp_path.glob("tpu_ddp/checkpoint_*/model.pt"))
