"""Run a Diffusers pipeline on ``tpu``, eager then with ``torch.compile``, and compare with CPU.

The pipeline is a DDPM over a tiny random UNet2DModel built from a config: nothing is downloaded.
The noise comes from a CPU generator, so the CPU and tpu runs denoise the same latents and their
images can be compared value by value.

    pip install 'torchtpu[diffusers]'
    python examples/diffusers_pipeline.py [--steps 10] [--size 32] [--batch 4]
"""

from __future__ import annotations

import argparse
import time

import torch  # `import torch` loads torchtpu

try:
    from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel
except ImportError as error:
    raise SystemExit(f"{error}. This example needs the diffusers extra: pip install 'torchtpu[diffusers]'") from None


def build(size: int) -> DDPMPipeline:
    """A two-level UNet (attention at the lower level) with seeded random weights."""
    torch.manual_seed(0)
    unet = UNet2DModel(sample_size=size, in_channels=3, out_channels=3, layers_per_block=1,
                       block_out_channels=(32, 64), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                       up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8,
                       attention_head_dim=8).eval()
    pipe = DDPMPipeline(unet=unet, scheduler=DDPMScheduler(num_train_timesteps=1000))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def sample(pipe: DDPMPipeline, args) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    images = pipe(batch_size=args.batch, num_inference_steps=args.steps, output_type="np",
                  generator=torch.Generator("cpu").manual_seed(args.seed)).images
    return torch.from_numpy(images), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"device: tpu ({torch.tpu.get_device_name()}); {args.batch} images {args.size}x{args.size}, "
          f"{args.steps} denoising steps")

    reference, seconds = sample(build(args.size), args)
    print(f"{'cpu':24s}{seconds:7.2f} s")

    pipe = build(args.size).to("tpu")
    for label in ("eager (first run)", "eager"):
        images, seconds = sample(pipe, args)
        print(f"tpu {label:20s}{seconds:7.2f} s   max |tpu - cpu| = {(images - reference).abs().max():.2e}")

    pipe.unet = torch.compile(pipe.unet, backend="tpu")
    for label in ("compiled (compiles)", "compiled"):
        images, seconds = sample(pipe, args)
        print(f"tpu {label:20s}{seconds:7.2f} s   max |tpu - cpu| = {(images - reference).abs().max():.2e}")


if __name__ == "__main__":
    main()
