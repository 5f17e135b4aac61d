"""TorchTitan 0.3 trains on ``tpu`` through its own entry point and matches its CPU run.

``torchrun -m torchtitan.train --module llama3 --config llama3_debugmodel`` (and qwen3's
debugmodel) runs 5 steps on ``tpu`` (torchtpu autoloaded, nothing patched) and
``tools/torchtitan_cpu.py`` runs the same config on the CPU (without torchtpu). Both start from one seed checkpoint written by TorchTitan
on the CPU (``--checkpoint.create_seed_checkpoint``), since ``tpu`` and the CPU draw different
random numbers for the initial weights; the debug tokenizer and dataset are generated
(``torchtpu.integrations.torchtitan``): the wheel ships neither.

The losses TorchTitan logs (5 decimals) must agree within 2e-4 relative per step: both runs are
float32, and what differs is the order of XLA's and ATen's sums, FlexAttention on ``tpu`` against
the same masked attention computed densely on the CPU, and the fused AdamW; measured, the worst
step differs by about 6e-5.

Each run is a ``torchrun --standalone`` child in its own session with a timeout; the session is
killed if it overruns, so nothing is left behind. Needs the venv of ``tools/torchtitan_env.sh``;
about 18 minutes on 2 shared cores, hence ``slow``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from processes import kill_tree

pytest.importorskip("torchtitan", reason="TorchTitan is not installed (tools/torchtitan_env.sh builds "
                                         "its venv; pip install 'torchtpu[torchtitan]'); CI does not install it")

from torchtpu.integrations.torchtitan import write_debug_assets  # noqa: E402

pytestmark = pytest.mark.slow

CPU_LAUNCHER = Path(__file__).resolve().parents[1] / "tools" / "torchtitan_cpu.py"
STEPS = 5
RTOL = 2e-4
# A small slice of the debug config: sequences of 256 tokens (the default 8 x 2048 tokens a step
# would cost minutes per step on 2 CPU cores); the model itself is TorchTitan's debugmodel.
SHORT_STEPS = ["--training.seq_len", "256", "--debug.seed", "0"]
_STEP_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.]+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _torchrun(target: list[str], nproc: int, args: list[str], env: dict, timeout: float) -> str:
    """``torchrun --standalone`` of ``target`` with ``args``; its output. Kills the session on timeout."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               *target, *args]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)  # torchrun and its workers, each in a session of its own
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(target)} did not finish within {timeout}s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-6000:]
    return _ANSI.sub("", out)


def _losses(out: str) -> list[float]:
    """The loss of each step as TorchTitan logs it (rank 0's line when several ranks log)."""
    by_step = {}
    for step, loss in _STEP_LINE.findall(out):
        by_step.setdefault(int(step), float(loss))
    assert sorted(by_step) == list(range(1, STEPS + 1)), out[-4000:]
    return [by_step[s] for s in sorted(by_step)]


class _Titan:
    """Runs one TorchTitan config on tpu or on the CPU, from one seed checkpoint, on the debug assets."""

    def __init__(self, root: Path, module: str, config: str):
        self.root, self.model = root, ["--module", module, "--config", config]
        assets = write_debug_assets(root / "assets")
        self.data = ["--hf_assets_path", assets["hf_assets_path"],
                     "--dataloader.dataset_path", assets["dataset_path"]]
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                    "HF_DATASETS_CACHE": str(root / "hf_datasets"), "OMP_NUM_THREADS": "1"}
        self.env.pop("XLA_FLAGS", None)  # one XLA:CPU device per process
        self._runs = 0
        self.cpu([], "seed", seed_args=["--checkpoint.create_seed_checkpoint"])
        self.seed = str(root / "seed" / "checkpoint" / "step-0")

    def _args(self, extra: list[str], folder: str) -> list[str]:
        return [*self.model, *SHORT_STEPS, *self.data, "--dump_folder", str(self.root / folder), *extra]

    def _from_seed(self, extra: list[str]) -> list[str]:
        return ["--training.steps", str(STEPS), "--checkpoint.enable", "--checkpoint.load_only",
                "--checkpoint.initial_load_path", self.seed, *extra]

    def cpu(self, extra: list[str], folder: str, nproc: int = 1, seed_args: list[str] | None = None) -> str:
        args = (["--checkpoint.enable", *seed_args] if seed_args else self._from_seed(extra))
        env = {**self.env, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
        return _torchrun([str(CPU_LAUNCHER)], nproc, self._args(args, folder), env, timeout=400)

    def tpu(self, extra: list[str], folder: str, nproc: int = 1) -> str:
        return _torchrun(["-m", "torchtitan.train"], nproc, self._args(self._from_seed(extra), folder),
                         self.env, timeout=500)


@pytest.fixture(scope="module")
def titan(tmp_path_factory) -> _Titan:
    return _Titan(tmp_path_factory.mktemp("llama3"), "llama3", "llama3_debugmodel")


@pytest.fixture(scope="module")
def cpu_single(titan) -> list[float]:
    """The single-process CPU reference: 2 sequences a step."""
    return _losses(titan.cpu(["--training.local_batch_size", "2"], "cpu_single"))


def _assert_trained_like(tpu: list[float], cpu: list[float]) -> None:
    assert tpu[-1] < tpu[0] - 1.0, tpu  # it trained (8.2 -> 5.6 on the debug data)
    torch.testing.assert_close(tpu, cpu, rtol=RTOL, atol=0.0)


def test_llama3_debugmodel_single_device_matches_cpu(titan, cpu_single):
    out = titan.tpu(["--training.local_batch_size", "2"], "tpu_single")
    assert "Building llama3 debugmodel" in out and "TPU capacity" in out, out[-4000:]
    assert "has no lowering" not in out, out[-4000:]  # no op fell back to the CPU
    _assert_trained_like(_losses(out), cpu_single)


def test_llama3_debugmodel_tensor_parallel_matches_cpu(titan, cpu_single):
    """TP over 2 processes (data parallel 1: both ranks see the single run's batches)."""
    out = titan.tpu(["--training.local_batch_size", "2", "--parallelism.tensor_parallel_degree", "2"],
                    "tpu_tp", nproc=2)
    _assert_trained_like(_losses(out), cpu_single)


def test_llama3_debugmodel_fsdp2_matches_cpu_fsdp2(titan):
    """FSDP2 over 2 processes; each rank reads its own half of the data, so the reference is
    TorchTitan's same 2-process run on the CPU (gloo)."""
    extra = ["--training.local_batch_size", "1", "--parallelism.data_parallel_shard_degree", "2"]
    cpu = _losses(titan.cpu(extra, "cpu_fsdp", nproc=2))
    out = titan.tpu(extra, "tpu_fsdp", nproc=2)
    assert "Applied FSDP to the model" in out, out[-4000:]
    _assert_trained_like(_losses(out), cpu)


def test_qwen3_debugmodel_single_device_matches_cpu(tmp_path):
    qwen = _Titan(tmp_path, "qwen3", "qwen3_debugmodel")
    batch = ["--training.local_batch_size", "2"]
    cpu = _losses(qwen.cpu(batch, "cpu_single"))
    out = qwen.tpu(batch, "tpu_single")
    assert "Building qwen3 debugmodel" in out and "has no lowering" not in out, out[-4000:]
    _assert_trained_like(_losses(out), cpu)
