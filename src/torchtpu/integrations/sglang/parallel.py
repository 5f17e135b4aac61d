"""Tensor parallelism (``--tp N``) for SGLang on ``tpu``, through SGLang's plugin hooks.

SGLang starts one scheduler process per rank and passes each its rank as arguments. On tpu:

- **Joining.** Before SGLang selects the device and builds its process groups
  (``bootstrap.init_parallel_runtime``), each rank process declares its place in the launch, so
  that its runtime joins the others through ``jax.distributed`` (the coordinator was chosen by
  the launching process, see ``TpuSRTPlatform.apply_server_args_defaults``). The groups'
  backend is ``cpu:gloo,tpu:tpu``: host metadata through gloo, activations through torchtpu's
  ``tpu`` backend.
- **Collectives in the compiled decode step.** Eager all-reduces and gathers reach the ``tpu``
  process group through ``torch.distributed``. Inside ``torch.compile`` SGLang wraps them in
  its own opaque custom ops (kept out of CUDA graphs); on tpu they become
  ``torch.distributed._functional_collectives`` calls instead, which the ``tpu`` compiler
  lowers into the step's own XLA program.
"""

from __future__ import annotations

import torch


def register_hooks() -> None:
    """Register the hooks with SGLang (from the ``sglang.srt.plugins`` entry point, in every
    process SGLang starts)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.distributed.bootstrap.init_parallel_runtime", join_ranks, HookType.BEFORE)
    coordinator = "sglang.srt.distributed.parallel_state.GroupCoordinator"
    HookRegistry.register(f"{coordinator}.all_reduce", all_reduce, HookType.AROUND)
    HookRegistry.register(f"{coordinator}.all_gather_into_tensor", all_gather_into_tensor, HookType.AROUND)


def _on_tpu() -> bool:
    from sglang.srt.platforms import current_platform

    from torchtpu.integrations.sglang.platform import TpuSRTPlatform

    return isinstance(current_platform, TpuSRTPlatform)


def join_ranks(*args, **kwargs):
    """Before ``init_parallel_runtime`` in a scheduler process on tpu: with several ranks, make
    this process its rank of the launch (:func:`torchtpu.integrations.join_ranks`)."""
    if not _on_tpu():
        return None
    from sglang.srt.runtime_context import get_device, get_parallel

    from torchtpu.integrations import join_ranks as join

    parallel = get_parallel()
    world = parallel.tp_size * parallel.pp_size
    if world > 1:
        join(rank=parallel.tp_size * parallel.pp_rank + parallel.tp_rank, world_size=world,
             local_rank=get_device().gpu_id, nnodes=getattr(parallel, "nnodes", 1) or 1)
    return None


def _traced_on_tpu(group, tensor: torch.Tensor) -> bool:
    return group.world_size > 1 and tensor.device.type == "tpu" and torch.compiler.is_compiling()


def all_reduce(original, group, input_: torch.Tensor) -> torch.Tensor:
    """``GroupCoordinator.all_reduce``: in a graph on tpu, the functional all-reduce."""
    if _traced_on_tpu(group, input_):
        from torchtpu.runtime.compat import functional_collectives as funcol

        return funcol.all_reduce(input_, "sum", group.device_group)
    return original(group, input_)


def all_gather_into_tensor(original, group, output: torch.Tensor, input_: torch.Tensor) -> None:
    """``GroupCoordinator.all_gather_into_tensor``: in a graph on tpu, the functional gather."""
    if _traced_on_tpu(group, input_):
        from torchtpu.runtime.compat import functional_collectives as funcol

        output.copy_(funcol.all_gather_tensor(input_, 0, group.device_group))
        return None
    return original(group, output, input_)
