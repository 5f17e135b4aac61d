"""Translating XLA runtime errors into the exceptions PyTorch users know."""

from __future__ import annotations

import re

import jax
import torch

from torchtpu.runtime import memory, platform

_BYTES = re.compile(r"allocat\w*\s+(\d+)\s*bytes")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def out_of_memory(exc: BaseException, device_index: int | None, what: str) -> torch.OutOfMemoryError:
    """A ``torch.OutOfMemoryError`` for an XLA RESOURCE_EXHAUSTED error, with the sizes involved."""
    match = _BYTES.search(str(exc))
    asked = f"Tried to allocate {_gib(int(match.group(1)))}" if match else "An allocation failed"
    detail = ""
    if device_index is not None:
        try:
            stats = memory.memory_stats(device_index)
            limit = (platform.pjrt_stats(device_index) or {}).get("bytes_limit")
            total = f"{_gib(limit)} total capacity; " if limit else ""
            detail = f" (tpu:{device_index}; {total}{_gib(stats['allocated_bytes.all.current'])} already allocated)"
        except Exception:
            detail = f" (tpu:{device_index})"
    return torch.OutOfMemoryError(
        f"tpu out of memory in {what}. {asked}{detail}. Free tensors you no longer need (del, "
        f"torch.tpu.empty_cache()), reduce the batch size, or use torch.compile so XLA can reuse buffers. "
        f"XLA said: {str(exc).splitlines()[0]}")


def device_error(exc: BaseException, device_index: int | None, what: str) -> Exception:
    """The exception to raise for an XLA runtime error in ``what``: ``torch.OutOfMemoryError``
    for an exhausted device, else a RuntimeError that names ``what`` (the op or program)."""
    if is_out_of_memory(exc):
        return out_of_memory(exc, device_index, what)
    return RuntimeError(f"tpu: {what} failed: {exc}")


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(exc)
