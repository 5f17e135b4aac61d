"""Run TorchTitan's own trainer on the host CPU: the reference a ``tpu`` run is compared with.

    TORCH_DEVICE_BACKEND_AUTOLOAD=0 python -m torch.distributed.run --standalone --nproc_per_node 1 \\
        tools/torchtitan_cpu.py \\
        --module llama3 --config llama3_debugmodel ...        (TorchTitan's own arguments)

TorchTitan 0.3 has no CPU setting: without an accelerator its device probe falls back to
``cuda``, and PyTorch refuses FlexAttention's backward on CPU. This launcher changes only what
that needs, in its own process, then calls ``torchtitan.train.main()``:

* the device probe (run once, when ``torchtitan.tools.utils`` is imported) answers ``cpu``, with
  ``torch.cpu`` plus the few device-module calls TorchTitan makes that ``torch.cpu`` lacks;
* ``FlexAttention``'s compiled kernel is replaced by the same attention computed densely: the
  BlockMask's ``mask_mod`` as a boolean mask for ``scaled_dot_product_attention``;
* FSDP2 reduces gradients with SUM then scales them (gloo has no ``PREMUL_SUM``);
* FLUX's autoencoder file is read onto ``cpu`` (the trainer's device is ``cpu:0``, a name
  safetensors refuses).

torchtpu must not be loaded here (``TORCH_DEVICE_BACKEND_AUTOLOAD=0``): with ``tpu`` registered,
``torch.distributed`` sends the CPU run's barriers to the ``tpu`` accelerator.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
import types


class _CpuProperties:
    """What TorchTitan reads from ``get_device_properties``: the name and the memory size."""

    def __init__(self) -> None:
        self.name = platform.processor() or platform.machine() or "cpu"
        self.total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cpu_device_module() -> types.ModuleType:
    """``torch.cpu`` with the device-module calls TorchTitan makes and ``torch.cpu`` lacks.

    The host keeps no allocator statistics: ``memory_stats`` is empty, which TorchTitan logs
    as -1 (unknown) rather than as a measurement.
    """
    import torch

    module = types.ModuleType("torchtitan_cpu_device", "torch.cpu for TorchTitan's probes")
    module.__dict__.update({k: v for k, v in vars(torch.cpu).items() if not k.startswith("__")})
    module.current_device = lambda: 0  # an index (barrier(device_ids=...)); torch.cpu says "cpu"
    module.get_device_name = lambda device=None: _CpuProperties().name
    module.get_device_properties = lambda device=None: _CpuProperties()
    module.memory_stats = lambda device=None: {}
    module.reset_peak_memory_stats = lambda device=None: None
    module.empty_cache = lambda: None
    return module


@contextlib.contextmanager
def _probe_answers_cpu():
    """While TorchTitan's device probe runs (once, at its import), answer ``cpu``."""
    import torch._utils

    probe_type, probe_module = torch._utils._get_available_device_type, torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda device_type: _cpu_device_module()
    try:
        yield
    finally:
        torch._utils._get_available_device_type = probe_type
        torch._utils._get_device_module = probe_module


def _dense_flex_attention(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux,
                          kernel_options):
    """FlexAttention's result computed densely: the BlockMask's ``mask_mod`` as a boolean mask
    for ``scaled_dot_product_attention`` (PyTorch has no FlexAttention backward on CPU)."""
    import torch
    from torch.nn.attention.flex_attention import AuxOutput, create_mask

    if score_mod is not None or return_aux.lse or return_aux.max_scores:
        raise NotImplementedError("the CPU reference of TorchTitan's FlexAttention supports a "
                                  "mask_mod only (no score_mod, no lse/max_scores outputs)")
    mask = create_mask(block_mask.mask_mod, q.shape[0], None, q.shape[-2], k.shape[-2], device=q.device)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return out, AuxOutput()


def _fsdp_reduces_with_sum() -> None:
    """Make FSDP2 reduce gradients with SUM and scale them itself, as it does for MTIA: with a
    divide factor set (TorchTitan sets 1.0) it asks for ``PREMUL_SUM``, which gloo lacks."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    choose = collectives._get_gradient_divide_factors

    def sum_only(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type="", factor=None,
                 force_sum_reduction_for_comms=False):
        return choose(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type, factor, True)

    collectives._get_gradient_divide_factors = sum_only


def _flux_autoencoder_loads_on_cpu() -> None:
    """TorchTitan's FLUX trainer calls safetensors' ``load_file(path, device="cpu:0")``, and
    safetensors takes ``cpu`` only without an index. Replaced before FLUX's module binds it."""
    import safetensors.torch

    original = safetensors.torch.load_file

    def load_file(filename, device="cpu"):
        return original(filename, device="cpu" if str(device).startswith("cpu") else device)

    safetensors.torch.load_file = load_file


def main() -> None:
    """Set TorchTitan up for the CPU, then run its entry point with this script's arguments."""
    import torch

    if torch._C._get_privateuse1_backend_name() != "privateuseone":
        sys.exit(f"{torch._C._get_privateuse1_backend_name()!r} is registered in this process: "
                 "run with TORCH_DEVICE_BACKEND_AUTOLOAD=0 so the CPU run does not see it")
    if "torchtitan.tools.utils" in sys.modules:
        sys.exit("torchtitan was imported before its device probe could be pointed at the CPU")
    with _probe_answers_cpu():
        import torchtitan.tools.utils  # noqa: F401  (the probe runs now)
    _flux_autoencoder_loads_on_cpu()  # before torchtitan's FLUX module imports load_file
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.train import main as titan_main

    FlexAttention._compiled_flex_attn = _dense_flex_attention
    _fsdp_reduces_with_sum()
    titan_main()


if __name__ == "__main__":
    main()
