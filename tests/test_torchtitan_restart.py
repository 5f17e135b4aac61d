"""A TorchTitan job on ``tpu`` survives a lost rank: torchrun restarts it from its last checkpoint.

TorchTitan's llama3 debug model trains 6 steps with FSDP2 over 2 processes on ``tpu``,
checkpointing every 2 steps, under ``torchrun --max-restarts 1``. When rank 0 has logged step 3,
rank 1 is killed with SIGKILL. What must follow, with nothing hanging: rank 0 stops (the
collective it waits in fails or torchrun ends it), torchrun starts the group again, TorchTitan
loads its latest checkpoint (step 2) and trains steps 3 to 6, and those losses equal the losses
of the same job run without the kill (both on ``tpu``: the same programs, the same data order
from the data loader's checkpointed state), to the 5 decimals TorchTitan logs.

Needs the venv of ``tools/torchtitan_env.sh``; several minutes on 2 shared cores, hence ``slow``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan", reason="TorchTitan is not installed (tools/torchtitan_env.sh builds "
                                         "its venv; pip install 'torchtpu[torchtitan]'); CI does not install it")

from processes import descendants, kill_tree
from test_torchtitan import _ANSI, _STEP_LINE, _Titan, _torchrun

pytestmark = pytest.mark.slow

STEPS, INTERVAL, KILL_AFTER = 6, 2, 3
TIMEOUT = 1500  # two starts of 2 processes (compiles included) at a load of 10-20
FSDP = ["--training.local_batch_size", "1", "--parallelism.data_parallel_shard_degree", "2"]


def _job_args(titan: _Titan, folder: str) -> list[str]:
    """6 steps from the seed checkpoint, a checkpoint every 2 steps in ``folder``."""
    return titan._args([*FSDP, "--training.steps", str(STEPS), "--checkpoint.enable",
                        "--checkpoint.interval", str(INTERVAL), "--checkpoint.initial_load_path", titan.seed],
                       folder)


def _rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(v.split(b"=", 1)[1]) for v in environ if v.startswith(b"RANK=")]
    return ranks[0] if ranks else None


RESTART = "will restart worker group"  # torchrun's log line (at LOGLEVEL=INFO) when it restarts


def _losses_by_attempt(out: str) -> list[dict[int, float]]:
    """The losses logged by each start of the job (torchrun's restart line separates them); each
    rank logs the same global loss, the first line of a step is kept."""
    attempts = []
    for part in out.split(RESTART):
        by_step: dict[int, float] = {}
        for step, loss in _STEP_LINE.findall(part):
            by_step.setdefault(int(step), float(loss))
        attempts.append(by_step)
    return attempts


def _run_and_kill_rank_1(titan: _Titan, folder: str) -> str:
    """The job under ``torchrun --max-restarts 1``; SIGKILL to rank 1 once step 3 is logged."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "--max-restarts", "1", "-m", "torchtitan.train", *_job_args(titan, folder)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**titan.env, "LOGLEVEL": "INFO"}, start_new_session=True)
    lines: list[str] = []
    killed: list[int] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if not killed and re.search(rf"step:\s*{KILL_AFTER}\s+loss", _ANSI.sub("", line)):
                workers = [p for p in descendants(proc.pid) if _rank_of(p) == 1]
                for pid in workers:
                    os.kill(pid, signal.SIGKILL)
                killed.extend(workers or [-1])

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + TIMEOUT
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(1)
    if proc.poll() is None:
        kill_tree(proc.pid)
        proc.wait()
        reader.join(10)
        pytest.fail(f"the job did not finish within {TIMEOUT}s (a hang?):\n{''.join(lines)[-6000:]}")
    reader.join(30)
    out = _ANSI.sub("", "".join(lines))
    assert killed and killed != [-1], f"no rank 1 worker was found to kill:\n{out[-4000:]}"
    assert proc.returncode == 0, out[-6000:]
    return out


@pytest.fixture(scope="module")
def titan(tmp_path_factory) -> _Titan:
    return _Titan(tmp_path_factory.mktemp("llama3_restart"), "llama3", "llama3_debugmodel")


def test_lost_rank_restarts_from_the_last_checkpoint(titan):
    plain = _torchrun(["-m", "torchtitan.train"], 2, _job_args(titan, "plain"), titan.env, timeout=TIMEOUT)
    (uninterrupted,) = _losses_by_attempt(plain)
    assert sorted(uninterrupted) == list(range(1, STEPS + 1)), plain[-4000:]

    out = _run_and_kill_rank_1(titan, "killed")
    attempts = _losses_by_attempt(out)
    assert len(attempts) == 2, out[-6000:]
    first, resumed = attempts
    assert max(first) >= KILL_AFTER, out[-6000:]
    # the second start resumed from the last checkpoint (step 2), not from the seed
    assert f"checkpoint/step-{INTERVAL}" in out and "Finished loading the checkpoint" in out, out[-6000:]
    assert sorted(resumed) == list(range(INTERVAL + 1, STEPS + 1)), out[-6000:]
    # before the kill the job was the uninterrupted one; after the restart it is again
    torch.testing.assert_close([first[s] for s in sorted(first)], [uninterrupted[s] for s in sorted(first)],
                               rtol=0, atol=0)
    torch.testing.assert_close([resumed[s] for s in sorted(resumed)], [uninterrupted[s] for s in sorted(resumed)],
                               rtol=0, atol=0)
