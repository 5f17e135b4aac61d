"""TorchTitan 0.3's FLUX experiment trains on ``tpu`` and matches its CPU run.

The trainer is TorchTitan's ``FluxTrainer`` (flow matching: the image encoded by FLUX.1's
autoencoder, the caption by a T5 and a CLIP text encoder, noise and a timestep drawn per sample,
the MSE of the predicted velocity) with its ``flux-debug`` model cut to what 2 shared CPU cores can
train (``torchtitan_configs.flux_debug_small``: width 256, the autoencoder's base channels 32,
64 x 64 images, 32 T5 tokens). The encoders, tokenizers, autoencoder weights and image/caption
tars are tiny random local stand-ins written by ``tools/make_tiny_flux_assets.py``: nothing is
downloaded (``HF_HUB_OFFLINE=1``, ``HF_DATASETS_OFFLINE=1``).

``tpu``'s random numbers are not the CPU's, and each step's loss depends on the noise drawn, so
both runs take the training loop's draws from one CPU generator (``SharedDrawsFluxTrainer``, the
config's trainer) and start from one seed checkpoint written on the CPU. The losses TorchTitan logs
must agree within 2e-4 relative per step over 5 steps, as the other TorchTitan models do.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan", reason="TorchTitan is not installed (tools/torchtitan_env.sh builds "
                                         "its venv; pip install 'torchtpu[torchtitan]'); CI does not install it")
pytest.importorskip("transformers", reason="TorchTitan's FLUX encoders need transformers")

from test_torchtitan import CPU_LAUNCHER, RTOL, STEPS, _losses, _torchrun

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TESTS = str(REPO / "tests")  # torchtitan_configs, for TorchTitan's --module
TIMEOUT = 1500


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "HF_DATASETS_CACHE": str(root / "hf_datasets"),
           "PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))}
    env.pop("XLA_FLAGS", None)  # one XLA:CPU device per process
    made = subprocess.run([sys.executable, str(REPO / "tools" / "make_tiny_flux_assets.py"), str(root / "assets"),
                           "--autoencoder-channels", "32"], check=False, capture_output=True, text=True, timeout=600,
                          env={**env, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert made.returncode == 0, made.stderr[-4000:]
    a = root / "assets"
    args = ["--module", "torchtitan_configs", "--config", "flux_debug_small", "--hf_assets_path", str(a / "t5"),
            "--tokenizer.t5_tokenizer_path", str(a / "t5"), "--tokenizer.clip_tokenizer_path", str(a / "clip"),
            "--encoder.t5_encoder", str(a / "t5"), "--encoder.clip_encoder", str(a / "clip"),
            "--encoder.autoencoder_path", str(a / "ae.safetensors"), "--dataloader.dataset_path",
            str(a / "cc12m_test"), "--debug.seed", "0", "--training.local_batch_size", "2"]
    cpu_env = {**env, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    _torchrun([str(CPU_LAUNCHER)], 1, [*args, "--dump_folder", str(root / "seed"), "--checkpoint.enable",
                                       "--checkpoint.create_seed_checkpoint"], cpu_env, timeout=TIMEOUT)
    from_seed = ["--training.steps", str(STEPS), "--checkpoint.enable", "--checkpoint.load_only",
                 "--checkpoint.initial_load_path", str(root / "seed" / "checkpoint" / "step-0")]

    def run(device: str) -> str:
        target = [str(CPU_LAUNCHER)] if device == "cpu" else ["-m", "torchtitan.train"]
        return _torchrun(target, 1, [*args, *from_seed, "--dump_folder", str(root / device)],
                         cpu_env if device == "cpu" else env, timeout=TIMEOUT)

    return run


def test_flux_debug_matches_cpu(flux):
    cpu = _losses(flux("cpu"))
    out = flux("tpu")
    assert "Building flux flux-debug-small" in out or "flux-debug-small" in out, out[-4000:]
    assert "has no lowering" not in out, out[-4000:]  # nothing fell back to the CPU
    tpu = _losses(out)
    assert len(set(tpu)) == STEPS, tpu  # a loss per step, each its own (new noise, new images)
    torch.testing.assert_close(tpu, cpu, rtol=RTOL, atol=0.0)
