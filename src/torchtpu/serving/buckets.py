"""Padded sizes: the bounded set of shapes a server's programs run at.

On an XLA device every new shape is a new program, traced and compiled. A server pads each
step's token count, batch size and key length up to one of a few sizes, as CUDA servers pad to
their CUDA-graph capture sizes, so traffic of any mix compiles a bounded set of programs.
"""

from __future__ import annotations

import bisect


def power_of_two_at_least(n: int, minimum: int = 1) -> int:
    """The power of two at or above ``n`` (and at least ``minimum``)."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


def token_buckets(max_tokens: int) -> list[int]:
    """The padded token counts a compiled forward runs at: 1, 2, 4, every 8 to 256, every 16 to
    512 (vLLM's CUDA-graph capture sizes), every 256 beyond, and ``max_tokens`` itself."""
    if max_tokens < 1:
        raise ValueError(f"token_buckets: max_tokens must be at least 1, got {max_tokens}")
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, 512, 16), *range(512, max_tokens, 256)]
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


def padded_size(sizes: list[int], n: int) -> int:
    """The smallest of the sorted ``sizes`` that holds ``n``; ValueError past the largest."""
    i = bisect.bisect_left(sizes, n)
    if i == len(sizes):
        raise ValueError(f"{n} is larger than the largest padded size {sizes[-1]}")
    return sizes[i]
