"""``HostTokenAllocator``: SGLang's KV-slot free list kept on the host.

SGLang's token allocator keeps its free slots in a device tensor and edits it every step
(``free_pages[:n]``, ``torch.cat((free_pages, freed))``). On CUDA each is one tiny kernel; on an
XLA device every new pair of lengths is a new program, traced, lowered and compiled: in a
server under load the free list takes a new length almost every step, so the scheduler spends
most of its time compiling bookkeeping (measured: 20 % of a loaded server's time in ``free``
alone). Here the free list is a host tensor: allocating hands the slots to the device in one
transfer, freeing brings the freed slots back in one; nothing is compiled. ``device`` stays the
pool's device, which SGLang's radix tree reads to place the slots it keeps.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator


class HostTokenAllocator(TokenToKVPoolAllocator):
    """``TokenToKVPoolAllocator`` whose free list lives on the host; slots it hands out are on ``device``."""

    @classmethod
    def adopt(cls, allocator: TokenToKVPoolAllocator) -> "HostTokenAllocator":
        """Turn SGLang's (still unused) device allocator into this one, in place."""
        allocator.__class__ = cls
        allocator.clear()
        return allocator

    def clear(self):
        # Slot 0 stays reserved, as in SGLang: padded tokens write their dummy KV there.
        self.free_pages = torch.arange(1, self.size + 1, dtype=torch.int64)
        self.free_group = None
        self.release_pages = torch.empty((0,), dtype=torch.int64)

    def merge_and_sort_free(self):
        if len(self.release_pages) > 0:
            self.free_pages = torch.sort(torch.cat((self.free_pages, self.release_pages)))[0]
            self.release_pages = torch.empty((0,), dtype=torch.int64)

    def alloc(self, need_size: int):
        slots = super().alloc(need_size)
        return None if slots is None else slots.to(self.device)

    def free(self, free_index: torch.Tensor):
        super().free(free_index.cpu())

    @staticmethod
    def _copy_for_free_group(free_index: torch.Tensor) -> torch.Tensor:
        # A grouped free holds its slots until the group ends: a host copy, so that the
        # group's final concatenation is a host op too.
        return free_index.to("cpu", copy=True)


def host_free_list(model_runner) -> None:
    """Give ``model_runner``'s token allocator a host free list, if it is SGLang's plain one.

    Other allocators (paged with ``--page-size`` above 1, sliding-window, hybrid) keep theirs on
    the device, as SGLang made them: correct, with the compile cost described above.
    """
    allocator = getattr(model_runner, "token_to_kv_pool_allocator", None)
    if type(allocator) is TokenToKVPoolAllocator:
        HostTokenAllocator.adopt(allocator)
