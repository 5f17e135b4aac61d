"""Run under torchrun: Diffusers' own parallelism hooks (``model.enable_parallelism``) on a tiny
Flux transformer on tpu, against the same model in one process on CPU.

    torchrun --standalone --nproc-per-node 2 tests/distributed/diffusers_tp.py [--context ulysses] [--compile]
    torchrun --standalone --nproc-per-node 2 tests/distributed/diffusers_tp.py --from-pretrained DIR

Every rank builds the same seeded model and inputs, computes the reference in one process on CPU
(no parallelism), then moves the model to ``tpu:LOCAL_RANK`` and lets Diffusers parallelise it:

* default, tensor parallel (``TensorParallelConfig``): Diffusers shards the model's ``_tp_plan``
  (column-wise q/k/v and MLP-in, row-wise out projections, the packed row-wise ``proj_out`` of the
  single-stream blocks) into DTensors over a one-dimensional ``tp`` DeviceMesh;
* ``--from-pretrained DIR``: the same plan applied while loading (``from_pretrained(DIR,
  parallel_config=TensorParallelConfig(...))``): rank 0 saves the model, each rank reads only its
  slice of each planned weight from the safetensors file, straight to its tpu device;
* ``--context ulysses`` (``ContextParallelConfig(ulysses_degree=N)``): Diffusers' ``_cp_plan``
  hooks split the sequence across ranks, attention exchanges heads for sequence with all-to-all,
  and the output is all-gathered. (Ring attention is not run: Diffusers' ring needs an attention
  backend that returns the log-sum-exp; its ``native`` backend raises "does not support
  return_lse=True" on any device, and ``_native_flash`` calls ``aten._scaled_dot_product_flash_attention``,
  a CUDA-only op that torchtpu does not lower.)

It then runs two flow-matching Euler steps with the parallel model and compares every step's
prediction with CPU's. Each rank prints "rank N parity ok" or exits non-zero with the differences.
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist

import diffusers
from diffusers.models._modeling_parallel import TensorParallelConfig

ATOL = 1e-5  # as tests/test_diffusers.py; measured differences are about 1e-6
STEPS = 2


def tiny_flux() -> diffusers.FluxTransformer2DModel:
    """Two heads (one per rank), one double- and one single-stream block; seeded weights."""
    torch.manual_seed(0)
    return diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8)).eval()


def inputs(batch: int = 2, height: int = 4, width: int = 4, text: int = 8) -> dict:
    """Packed latents, text states, pooled text and the RoPE ids that FluxPipeline would pass."""
    g = torch.Generator().manual_seed(1)
    img_ids = torch.zeros(height, width, 3)
    img_ids[..., 1] = torch.arange(height)[:, None]
    img_ids[..., 2] = torch.arange(width)[None, :]
    return {"hidden_states": torch.randn(batch, height * width, 4, generator=g),
            "encoder_hidden_states": torch.randn(batch, text, 32, generator=g),
            "pooled_projections": torch.randn(batch, 32, generator=g),
            "img_ids": img_ids.reshape(-1, 3), "txt_ids": torch.zeros(text, 3)}


def denoise(model, feeds: dict, device: str) -> list[torch.Tensor]:
    """``STEPS`` flow-matching Euler steps from t=1; returns each step's prediction on CPU."""
    feeds = {k: v.to(device) for k, v in feeds.items()}
    latents, predictions = feeds.pop("hidden_states"), []
    sigmas = torch.linspace(1.0, 0.0, STEPS + 1)
    with torch.no_grad():
        for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
            timestep = torch.full((latents.shape[0],), float(sigma), device=device)
            velocity = model(hidden_states=latents, timestep=timestep, return_dict=False, **feeds)[0]
            latents = latents + (sigma_next - sigma) * velocity
            predictions.append(velocity.cpu())
    return predictions


def scramble_planned_weights(model, rank: int) -> None:
    """Make every ``_tp_plan`` weight differ on this rank, so only rank 0's values can give CPU's result.

    Diffusers shards each planned weight from ``src_data_rank`` 0 (a scatter over the mesh): a model
    randomly initialised on several ranks still ends up as rank 0's.
    """
    from diffusers.hooks.tensor_parallel import resolve_tp_shard_specs

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in resolve_tp_shard_specs(model, model._tp_plan, dist.get_world_size()):
            params[name].add_(rank)


def compiled_calls() -> int:
    """Graphs the tpu torch.compile backend compiled or found cached so far."""
    import torchtpu

    return sum(c["compilations"] + c["cache_hits"] for c in torchtpu.metrics.snapshot()["compiles"].values())


def check_sharded(model, world: int) -> None:
    """Diffusers sharded the planned Linears: DTensors on tpu holding 1/world of each weight."""
    from torch.distributed.tensor import DTensor, Shard

    q = model.transformer_blocks[0].attn.to_q.weight
    out = model.single_transformer_blocks[0].proj_out.weight
    for weight, dim in ((q, 0), (out, 1)):
        assert isinstance(weight, DTensor) and weight.placements == (Shard(dim),), weight
        local = weight.to_local()
        assert local.device.type == "tpu" and local.shape[dim] * world == weight.shape[dim], local.shape


def tensor_parallel(model, rank: int, world: int) -> None:
    """Diffusers' TP over all ranks, from rank 0's weights only."""
    scramble_planned_weights(model, rank)
    model.enable_parallelism(config=TensorParallelConfig(tp_degree=world))
    check_sharded(model, world)


def tensor_parallel_from_pretrained(directory: str, rank: int, world: int):
    """Diffusers' sharded load: rank 0 saves the model; each rank reads only its slices onto tpu."""
    if rank == 0:
        tiny_flux().save_pretrained(directory)  # safetensors, which the sharded load requires
    dist.barrier()
    model = diffusers.FluxTransformer2DModel.from_pretrained(
        directory, parallel_config=TensorParallelConfig(tp_degree=world)).eval()
    check_sharded(model, world)
    return model


def ulysses_parallel(model, world: int) -> list[int]:
    """Diffusers' Ulysses context parallelism; returns the image sequence lengths the first block sees."""
    from diffusers.models._modeling_parallel import ContextParallelConfig

    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
    seen = []
    model.transformer_blocks[0].register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["hidden_states"].shape[1]), with_kwargs=True)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", choices=["ulysses"], help="context parallelism instead of tensor parallel")
    parser.add_argument("--from-pretrained", metavar="DIR", help="tensor parallel through a sharded load from DIR")
    parser.add_argument("--compile", action="store_true", help="torch.compile the parallel model (backend tpu)")
    args = parser.parse_args()
    dist.init_process_group("tpu_dist", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.tpu.set_device(int(os.environ["LOCAL_RANK"]))

    feeds = inputs()
    expected = denoise(tiny_flux(), feeds, "cpu")

    seen = None
    if args.from_pretrained:
        model = tensor_parallel_from_pretrained(args.from_pretrained, rank, world)
    else:
        model = tiny_flux().to("tpu")
        seen = ulysses_parallel(model, world) if args.context else tensor_parallel(model, rank, world)
    if args.compile:
        model = torch.compile(model, backend="tpu")
    before = compiled_calls()
    with torch.tpu.cpu_fallback_enabled(False):
        got = denoise(model, feeds, "tpu")
    if args.compile and compiled_calls() - before < STEPS:
        raise SystemExit(f"rank {rank}: the parallel model did not run through the tpu torch.compile backend")
    # each rank's blocks must see its share of the image tokens, not all of them
    if args.context and set(seen) != {feeds["hidden_states"].shape[1] // world}:
        raise SystemExit(f"rank {rank}: the first block saw image sequence lengths {seen}, not a 1/{world} split")

    errors = [float((g - e).abs().max()) for g, e in zip(got, expected)]
    if max(errors) > ATOL:
        raise SystemExit(f"rank {rank}: max |tpu - cpu| per step {errors} exceeds {ATOL}")
    print(f"rank {rank} parity ok (max |tpu - cpu| per step {errors})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
