"""TorchTitan 0.3's Qwen3 mixture-of-experts model trains on ``tpu`` and matches its CPU run.

The model is TorchTitan's ``qwen3_moe_debug`` (router with softmax top-k scores, expert bias for
auxiliary-loss-free load balancing updated before each optimizer step, tokens sorted by expert
and scattered back, SwiGLU experts through ``torch._grouped_mm`` in bf16) at a size 2 shared
CPU cores can train: 2 layers of 8 experts, top 2 (``torchtitan_configs.qwen3_moe_small``: the
registered 8 x 64-expert model takes about 2 minutes a step on the CPU reference alone).

On ``tpu`` the grouped products are JAX's ``ragged_dot`` (``torchtpu.ops.grouped_mm``). Expert
parallel over 2 processes (``--parallelism.expert_parallel_degree 2``: each rank holds 4 experts;
TorchTitan's ``AllToAllTokenDispatcher`` exchanges the token counts, then the tokens, with
``all_to_all_single`` of uneven splits on the ``tpu`` process group) is compared with the same
2-process run on the CPU (gloo): each rank reads its own data, as in the FSDP2 test. The CPU run
takes TorchTitan's DTensor path (``--parallelism.spmd_backend partial_dtensor``: the same tokens
through ``all_to_all_single``), since gloo's list ``all_to_all`` of its default path refuses uneven
sizes; ``tpu`` runs TorchTitan's default.
``--training.disable_cuda_graphs`` is what TorchTitan itself asks for with this dispatcher (it
synchronizes with the host for the split sizes).

The losses must agree within 2e-4 relative per step, as the dense models do; the experts compute
in bf16 on both sides. Measured (seq_len 256): one device, the worst step 5.9e-5; expert parallel,
4.1e-5 (7.64166 -> 6.30257 on tpu, 7.64144 -> 6.30251 on the CPU).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan", reason="TorchTitan is not installed (tools/torchtitan_env.sh builds "
                                         "its venv; pip install 'torchtpu[torchtitan]'); CI does not install it")

from test_torchtitan import CPU_LAUNCHER, RTOL, _losses, _Titan, _torchrun

pytestmark = pytest.mark.slow

TESTS = str(Path(__file__).resolve().parent)  # torchtitan_configs, for TorchTitan's --module
EXPERT_PARALLEL = ["--training.local_batch_size", "1", "--parallelism.expert_parallel_degree", "2",
                   "--training.disable_cuda_graphs"]


# Expert parallel recompiles as the split sizes change (the routed token counts are shapes):
# measured about 5 minutes for the first step and 1 for each later one at a load of 20.
TIMEOUT = 1500


class _MoeTitan(_Titan):
    """``_Titan`` with the longer timeouts the MoE runs need."""

    def cpu(self, extra: list[str], folder: str, nproc: int = 1, seed_args: list[str] | None = None) -> str:
        args = ["--checkpoint.enable", *seed_args] if seed_args else self._from_seed(extra)
        env = {**self.env, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
        return _torchrun([str(CPU_LAUNCHER)], nproc, self._args(args, folder), env, timeout=TIMEOUT)

    def tpu(self, extra: list[str], folder: str, nproc: int = 1) -> str:
        return _torchrun(["-m", "torchtitan.train"], nproc, self._args(self._from_seed(extra), folder),
                         self.env, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> _MoeTitan:
    """TorchTitan's processes find ``torchtitan_configs`` (their --module) on PYTHONPATH."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")])))
        yield _MoeTitan(tmp_path_factory.mktemp("qwen3_moe"), "torchtitan_configs", "qwen3_moe_small")


def _assert_matches(tpu: list[float], cpu: list[float]) -> None:
    assert tpu[-1] < tpu[0] - 0.5, tpu  # it trained (7.7 -> 6.3 on the debug data)
    torch.testing.assert_close(tpu, cpu, rtol=RTOL, atol=0.0)


def test_qwen3_moe_single_device_matches_cpu(moe):
    batch = ["--training.local_batch_size", "2"]
    cpu = _losses(moe.cpu(batch, "cpu_single"))
    out = moe.tpu(batch, "tpu_single")
    assert "Building qwen3 debugmodel_moe_small" in out, out[-4000:]
    assert "has no lowering" not in out, out[-4000:]  # _grouped_mm and the dispatch ran on tpu
    _assert_matches(_losses(out), cpu)


# gloo's list all_to_all (TorchTitan's default spmd_types path) refuses uneven sizes; TorchTitan's
# DTensor path sends the same tokens with all_to_all_single, which gloo splits unevenly
GLOO_ALL_TO_ALL = ["--parallelism.spmd_backend", "partial_dtensor"]


def test_qwen3_moe_expert_parallel_matches_cpu(moe):
    cpu = _losses(moe.cpu([*EXPERT_PARALLEL, *GLOO_ALL_TO_ALL], "cpu_ep", nproc=2))
    out = moe.tpu(EXPERT_PARALLEL, "tpu_ep", nproc=2)
    assert "has no lowering" not in out, out[-4000:]
    _assert_matches(_losses(out), cpu)
