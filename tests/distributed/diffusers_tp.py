"""Run under torchrun: Diffusers' own parallelism hooks (``model.enable_parallelism``) on a tiny
Flux transformer on tpu, against the same model in one process on CPU.

    torchrun --standalone --nproc-per-node 2 tests/distributed/diffusers_tp.py [--context ulysses|ring] [--compile]
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
  and the output is all-gathered;
* ``--context ring`` (``ContextParallelConfig(ring_degree=N)``): the same split, but each rank keeps
  its queries and attends to every rank's keys/values (all-gathered), merging the partial results
  by their log-sum-exp. Ring attention needs a backend that returns it: the ``_native_flash``
  backend (``aten._scaled_dot_product_flash_attention``), which takes bf16/fp16 only, so this mode
  runs the model in bf16 and compares it with the float32 model on CPU within ``RING_ATOL``; it
  also prints how far CPU's own bf16 model (``_native_flash`` there runs SDPA's flash kernel for
  CPU) is from float32, the yardstick for that tolerance. Its attention scores are scaled by
  ``RING_SCORE_GAIN`` so that a wrong merge fails (checked: a zero log-sum-exp gives 9e-2).

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
RING_SCORE_GAIN = 4.0  # the ring merges partial attentions by their log-sum-exp: make the weights matter
RING_ATOL = 0.03  # bf16 ring vs float32 CPU: measured 1.1e-2 (CPU's own bf16 model too); a wrong merge 9e-2
STEPS = 2


def tiny_flux(score_gain: float = 1.0) -> diffusers.FluxTransformer2DModel:
    """Two heads (one per rank), one double- and one single-stream block; seeded weights.

    ``score_gain`` scales every attention score (through the q/k RMSNorm weights): the initial
    model's attention is nearly uniform, so merging partial attentions with wrong weights would
    barely show.
    """
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8)).eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
                module.weight.fill_(score_gain ** 0.5)
    return model


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


def denoise(model, feeds: dict, device: str, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """``STEPS`` flow-matching Euler steps from t=1; returns each step's prediction on CPU (float32).

    ``dtype``: the model's; the states are cast to it, the RoPE position ids stay float32.
    """
    feeds = {k: v.to(device, v.dtype if k.endswith("_ids") else dtype) for k, v in feeds.items()}
    latents, predictions = feeds.pop("hidden_states"), []
    sigmas = torch.linspace(1.0, 0.0, STEPS + 1)
    with torch.no_grad():
        for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
            timestep = torch.full((latents.shape[0],), float(sigma), device=device, dtype=dtype)
            velocity = model(hidden_states=latents, timestep=timestep, return_dict=False, **feeds)[0]
            latents = latents + (sigma_next - sigma) * velocity
            predictions.append(velocity.float().cpu())
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


def context_parallel(model, world: int, kind: str) -> list[int]:
    """Diffusers' Ulysses or ring context parallelism; returns the image sequence lengths the first block sees."""
    from diffusers.models._modeling_parallel import ContextParallelConfig

    if kind == "ring":  # the one backend whose forward returns the log-sum-exp the ring merges by
        model.set_attention_backend("_native_flash")
    model.enable_parallelism(config=ContextParallelConfig(**{f"{kind}_degree": world}))
    seen = []
    model.transformer_blocks[0].register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["hidden_states"].shape[1]), with_kwargs=True)
    return seen


def max_errors(got: list[torch.Tensor], expected: list[torch.Tensor]) -> list[float]:
    return [float((g - e).abs().max()) for g, e in zip(got, expected)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", choices=["ulysses", "ring"], help="context parallelism instead of tensor parallel")
    parser.add_argument("--from-pretrained", metavar="DIR", help="tensor parallel through a sharded load from DIR")
    parser.add_argument("--compile", action="store_true", help="torch.compile the parallel model (backend tpu)")
    args = parser.parse_args()
    dist.init_process_group("tpu_dist", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.tpu.set_device(int(os.environ["LOCAL_RANK"]))

    feeds = inputs()
    ring = args.context == "ring"
    gain = RING_SCORE_GAIN if ring else 1.0
    expected = denoise(tiny_flux(gain), feeds, "cpu")
    dtype, atol = (torch.bfloat16, RING_ATOL) if ring else (torch.float32, ATOL)

    seen = None
    if args.from_pretrained:
        model = tensor_parallel_from_pretrained(args.from_pretrained, rank, world)
    else:
        model = tiny_flux(gain).to("tpu", dtype)
        seen = context_parallel(model, world, args.context) if args.context else tensor_parallel(model, rank, world)
    if args.compile:
        model = torch.compile(model, backend="tpu")
    before = compiled_calls()
    with torch.tpu.cpu_fallback_enabled(False):
        got = denoise(model, feeds, "tpu", dtype)
    if args.compile and compiled_calls() - before < STEPS:
        raise SystemExit(f"rank {rank}: the parallel model did not run through the tpu torch.compile backend")
    # each rank's blocks must see its share of the image tokens, not all of them
    if args.context and set(seen) != {feeds["hidden_states"].shape[1] // world}:
        raise SystemExit(f"rank {rank}: the first block saw image sequence lengths {seen}, not a 1/{world} split")

    errors = max_errors(got, expected)
    if max(errors) > atol:
        raise SystemExit(f"rank {rank}: max |tpu - cpu| per step {errors} exceeds {atol}")
    yardstick = ""
    if ring:
        cpu_bf16 = tiny_flux(gain).to(dtype)
        cpu_bf16.set_attention_backend("_native_flash")
        yardstick = f"; CPU's own bf16 model {max_errors(denoise(cpu_bf16, feeds, 'cpu', dtype), expected)}"
    print(f"rank {rank} parity ok (max |tpu - cpu float32| per step {errors}{yardstick})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
