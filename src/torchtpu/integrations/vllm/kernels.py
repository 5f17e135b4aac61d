"""Torch versions of the Triton kernels vLLM's model runner launches, registered for ``tpu``.

vLLM routes a platform's replacements through ``vllm.triton_utils.dispatcher.register_kernels``;
a replacement is called with the kernel's launch arguments in the kernel's parameter order.
The replacements themselves import no engine (:mod:`torchtpu.serving.paged_kv`).
"""

from __future__ import annotations

from torchtpu.serving.paged_kv import compute_slot_mapping

SLOT_MAPPING_KERNEL = "vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel"


def register() -> None:
    """Register the torch kernels in place of vLLM's Triton ones (vLLM calls it once per worker)."""
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({SLOT_MAPPING_KERNEL: compute_slot_mapping})
