"""Diffusers pipelines on ``tpu``: a UNet (DDPM) and a DiT transformer pipeline, eager and compiled.

Every model is tiny, random, and built from a config (nothing is downloaded). Each tpu run is
compared with the same pipeline run by PyTorch on CPU from the same seeded noise: the noise comes
from a CPU ``torch.Generator`` (Diffusers' ``randn_tensor`` draws on the generator's device and
moves the noise to the pipeline's), so both runs denoise the same latents. Tolerance: 1e-5
absolute on images in [0, 1] (measured differences are about 5e-7). The tpu runs have the CPU
fallback off, so an op without a lowering fails instead of hiding on the host.

Diffusers' parallelism (``enable_parallelism`` with a ``TensorParallelConfig``, which shards the
model's ``_tp_plan`` with DTensor, or a Ulysses or ring ``ContextParallelConfig``) runs under
``torchrun`` with 2 processes on the ``tpu_dist`` backend; the worker is
``tests/distributed/diffusers_tp.py`` (slow: about 50 s each). Ring attention runs Diffusers'
``_native_flash`` backend (``aten._scaled_dot_product_flash_attention``) in bf16, compared with the
float32 model on CPU within 0.03 (measured about 1e-2, as CPU's own bf16 model). A sharded
``from_pretrained`` (TP applied while reading safetensors) needs Accelerate too.
"""

from __future__ import annotations

import pytest
import torch

import torchtpu
from test_distributed import torchrun

diffusers = pytest.importorskip("diffusers", reason="the diffusers extra is not installed (pip install 'torchtpu[diffusers]')")

ATOL = 1e-5


def tiny_ddpm() -> "diffusers.DDPMPipeline":
    """A two-level UNet2DModel (one attention level) with a 50-step DDPM scheduler; seeded weights."""
    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(
        sample_size=16, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=8, attention_head_dim=8).eval()
    pipe = diffusers.DDPMPipeline(unet=unet, scheduler=diffusers.DDPMScheduler(num_train_timesteps=50))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_dit() -> "diffusers.DiTPipeline":
    """A two-layer class-conditional DiT over a two-level AutoencoderKL, DPM-Solver++ scheduler.

    ``eval()`` matters: in training mode DiT's label embedding drops class labels at random
    (classifier-free guidance training), so even two CPU runs differ.
    """
    torch.manual_seed(0)
    transformer = diffusers.DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2, sample_size=8,
        patch_size=2, norm_num_groups=8, num_embeds_ada_norm=1000).eval()
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=8,
        sample_size=16).eval()
    pipe = diffusers.DiTPipeline(transformer=transformer, vae=vae,
                                 scheduler=diffusers.DPMSolverMultistepScheduler(num_train_timesteps=50))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def sample_ddpm(pipe, generator: torch.Generator) -> torch.Tensor:
    return pipe(batch_size=2, generator=generator, num_inference_steps=4, output_type="np").images


def sample_dit(pipe, generator: torch.Generator) -> torch.Tensor:
    # class_labels: two classes; guidance_scale 4 (the default) runs the unconditional half too
    return pipe(class_labels=[1, 7], generator=generator, num_inference_steps=4, output_type="np").images


PIPELINES = {"ddpm": (tiny_ddpm, sample_ddpm, "unet"), "dit": (tiny_dit, sample_dit, "transformer")}


@pytest.fixture(scope="module")
def cpu_images():
    """Each pipeline's images on CPU, from seed 0 (computed once per module)."""
    out = {}
    for name, (build, sample, _) in PIPELINES.items():
        out[name] = torch.from_numpy(sample(build(), torch.Generator("cpu").manual_seed(0)))
    return out


def run_on_tpu(name: str, compiled: bool) -> torch.Tensor:
    build, sample, denoiser = PIPELINES[name]
    pipe = build().to("tpu")
    assert pipe.device.type == "tpu"
    if compiled:
        setattr(pipe, denoiser, torch.compile(getattr(pipe, denoiser), backend="tpu"))
    with torch.tpu.cpu_fallback_enabled(False):
        return torch.from_numpy(sample(pipe, torch.Generator("cpu").manual_seed(0)))


@pytest.mark.parametrize("name", PIPELINES)
def test_eager_matches_cpu(name, cpu_images):
    images = run_on_tpu(name, compiled=False)
    assert images.shape == cpu_images[name].shape == (2, 16, 16, 3)
    torch.testing.assert_close(images, cpu_images[name], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", PIPELINES)
def test_compiled_matches_cpu(name, cpu_images):
    before = sum(c["compilations"] + c["cache_hits"] for c in torchtpu.metrics.snapshot()["compiles"].values())
    images = run_on_tpu(name, compiled=True)
    after = sum(c["compilations"] + c["cache_hits"] for c in torchtpu.metrics.snapshot()["compiles"].values())
    assert after - before >= 4, "the denoiser did not run through the tpu torch.compile backend at every step"
    torch.testing.assert_close(images, cpu_images[name], atol=ATOL, rtol=0)


def test_tpu_generator_reproducible():
    """A ``torch.Generator("tpu")`` draws the noise on the device: the same seed gives the same images."""
    pipe = tiny_ddpm().to("tpu")
    first = sample_ddpm(pipe, torch.Generator("tpu").manual_seed(3))
    again = sample_ddpm(pipe, torch.Generator("tpu").manual_seed(3))
    other = sample_ddpm(pipe, torch.Generator("tpu").manual_seed(4))
    assert (first == again).all()
    assert abs(first - other).max() > 0.1


PARALLEL_RUNS = {  # id: (parallelism, compiled); ring compiled only (its eager run passes too: ~1 min saved)
    "tensor-eager": ((), False), "tensor-compiled": ((), True),
    "ulysses-eager": (("--context", "ulysses"), False), "ulysses-compiled": (("--context", "ulysses"), True),
    "ring-compiled": (("--context", "ring"), True),
}


# two processes importing torch, JAX and Diffusers cost about 50 s on 2 cores
@pytest.mark.slow
@pytest.mark.parametrize("parallelism, compiled", list(PARALLEL_RUNS.values()), ids=list(PARALLEL_RUNS))
def test_parallelism_under_torchrun_matches_cpu(parallelism, compiled):
    """A tiny Flux transformer parallelised by Diffusers' own hooks over 2 tpu processes matches CPU.

    Tensor parallel: the worker scrambles rank 1's planned weights first, so only the shards
    Diffusers scatters from rank 0 over ``tpu_dist`` give CPU's predictions. Ulysses context
    parallel: each rank's blocks see half the sequence (all-to-all inside attention). Ring: the same
    split, each rank's queries attend to all keys/values, merged by the flash op's log-sum-exp.
    """
    args = (*parallelism, *(["--compile"] if compiled else []))
    code, out = torchrun("diffusers_tp.py", 2, *args, timeout=300)
    assert code == 0 and "rank 0 parity ok" in out and "rank 1 parity ok" in out, out[-6000:]


@pytest.mark.slow
def test_sharded_from_pretrained_under_torchrun_matches_cpu(tmp_path):
    """``from_pretrained(..., parallel_config=TensorParallelConfig(tp_degree=2))``: each of 2 tpu
    processes reads only its slice of each planned weight from the saved safetensors file."""
    # Diffusers initialises the model on the meta device for a sharded load only through Accelerate
    pytest.importorskip("accelerate", reason="Diffusers' sharded from_pretrained needs accelerate (pip install accelerate)")
    code, out = torchrun("diffusers_tp.py", 2, "--from-pretrained", str(tmp_path / "flux"), timeout=300)
    assert code == 0 and "rank 0 parity ok" in out and "rank 1 parity ok" in out, out[-6000:]
