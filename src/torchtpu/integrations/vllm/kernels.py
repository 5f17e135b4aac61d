"""Torch versions of the Triton kernels vLLM's model runner launches, registered for ``tpu``.

vLLM routes a platform's replacements through ``vllm.triton_utils.dispatcher.register_kernels``;
a replacement is called with the kernel's launch arguments in the kernel's parameter order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SLOT_MAPPING_KERNEL = "vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel"


def _whole_buffer(t: torch.Tensor) -> torch.Tensor:
    """The 1-D buffer ``t`` was sliced from, from ``t``'s first element to the storage's end."""
    return t.as_strided((t.untyped_storage().nbytes() // t.element_size() - t.storage_offset(),), (1,))


def compute_slot_mapping(num_tokens: int, max_num_tokens: int, query_start_loc: torch.Tensor,
                         positions: torch.Tensor, block_table: torch.Tensor,
                         block_table_stride: int, slot_mapping: torch.Tensor,
                         KV_CACHE_BLOCK_SIZE: int, TOTAL_CP_WORLD_SIZE: int = 1,  # noqa: N803
                         TOTAL_CP_RANK: int = 0, CP_KV_CACHE_INTERLEAVE_SIZE: int = 1,  # noqa: N803
                         PAD_ID: int = -1, BLOCK_SIZE: int = 1024) -> None:  # noqa: N803
    """slot_mapping[t] = block_table[request of t, pos // block] * block + pos % block; PAD_ID after.

    Every step runs the same program: like the Triton kernel, which reads the runner's buffers
    through pointers, this reads them whole (``positions`` and ``query_start_loc`` are slices of
    the runner's persistent buffers) and writes ``slot_mapping`` up to ``max_num_tokens``. The runner pads
    ``query_start_loc`` past the last request with the token count, so it gives both which
    request a token belongs to and where the real tokens end; slicing to ``num_tokens`` instead
    made one program per token count.
    """
    if TOTAL_CP_WORLD_SIZE != 1:
        raise NotImplementedError("tpu: context parallelism is not supported by torchtpu's vLLM "
                                  "slot mapping (TOTAL_CP_WORLD_SIZE must be 1).")
    ends = _whole_buffer(query_start_loc)[1:].long()
    n = min(max_num_tokens, slot_mapping.shape[0])
    pos = _whole_buffer(positions)[:n].long()
    pos = F.pad(pos, (0, n - pos.shape[0]))  # (the runner's buffer is never shorter; a caller's may be)
    tokens = torch.arange(n, device=positions.device)
    # A token belongs to the request whose [start, end) range holds it: count the ends it passed.
    request = (tokens[:, None] >= ends[None, :]).sum(dim=1)
    real = tokens < ends[-1:]
    flat_index = torch.where(real, request * block_table_stride + torch.div(pos, KV_CACHE_BLOCK_SIZE,
                                                                             rounding_mode="floor"), 0)
    blocks = _whole_buffer(block_table).index_select(0, flat_index).long()
    slot_mapping[:n].copy_(torch.where(real, blocks * KV_CACHE_BLOCK_SIZE + pos % KV_CACHE_BLOCK_SIZE, PAD_ID))


def register() -> None:
    """Register the torch kernels in place of vLLM's Triton ones (vLLM calls it once per worker)."""
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({SLOT_MAPPING_KERNEL: compute_slot_mapping})
