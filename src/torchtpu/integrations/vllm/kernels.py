"""Torch versions of the Triton kernels vLLM's model runner launches, registered for ``tpu``.

vLLM routes a platform's replacements through ``vllm.triton_utils.dispatcher.register_kernels``;
a replacement is called with the kernel's launch arguments in the kernel's parameter order.
"""

from __future__ import annotations

import torch

SLOT_MAPPING_KERNEL = "vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel"


def compute_slot_mapping(num_tokens: int, max_num_tokens: int, query_start_loc: torch.Tensor,
                         positions: torch.Tensor, block_table: torch.Tensor,
                         block_table_stride: int, slot_mapping: torch.Tensor,
                         KV_CACHE_BLOCK_SIZE: int, TOTAL_CP_WORLD_SIZE: int = 1,  # noqa: N803
                         TOTAL_CP_RANK: int = 0, CP_KV_CACHE_INTERLEAVE_SIZE: int = 1,  # noqa: N803
                         PAD_ID: int = -1, BLOCK_SIZE: int = 1024) -> None:  # noqa: N803
    """slot_mapping[t] = block_table[request of t, pos // block] * block + pos % block; PAD_ID after."""
    if TOTAL_CP_WORLD_SIZE != 1:
        raise NotImplementedError("tpu: context parallelism is not supported by torchtpu's vLLM "
                                  "slot mapping (TOTAL_CP_WORLD_SIZE must be 1).")
    device = positions.device
    tokens = torch.arange(num_tokens, device=device)
    # A token belongs to the request whose [start, end) range holds it: count the ends it passed.
    request = (tokens[:, None] >= query_start_loc[None, 1:].long()).sum(dim=1)
    pos = positions[:num_tokens].long()
    flat_index = request * block_table_stride + torch.div(pos, KV_CACHE_BLOCK_SIZE, rounding_mode="floor")
    blocks = block_table.reshape(-1).index_select(0, flat_index).long()
    slot_mapping[:num_tokens].copy_(blocks * KV_CACHE_BLOCK_SIZE + pos % KV_CACHE_BLOCK_SIZE)
    if max_num_tokens > num_tokens:
        slot_mapping[num_tokens:max_num_tokens].fill_(PAD_ID)


def register() -> None:
    """Register the torch kernels in place of vLLM's Triton ones (vLLM calls it once per worker)."""
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({SLOT_MAPPING_KERNEL: compute_slot_mapping})
