"""``TpuModelRunner``: vLLM's GPU model runner, with CUDA streams mapped to tpu and a paged KV cache.

The GPU runner builds its per-step inputs on the host and copies them to the device
(``CpuGpuBuffer``), which is what tpu wants too; what differs is the KV cache (one typed tensor
per layer, laid out ``[(num_blocks + 1) * block_size, num_kv_heads, 2 * head_size]`` as
:mod:`.attention` reads it, instead of byte views carved out of one int8 buffer) and the
CUDA-only helpers (stream-ordered copies, Triton block zeroing). When the forward is compiled,
each step's token count is padded up to a bucket (:func:`token_buckets`), as vLLM pads to its
CUDA-graph sizes, so each piece of the forward has a bounded number of XLA programs.
"""

from __future__ import annotations

import bisect
import dataclasses
from contextlib import contextmanager
from functools import partial

import torch
from vllm.config import CompilationMode
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.utils import bind_kv_cache


@contextmanager
def _tpu_as_cuda():
    """While the GPU runner is built, its ``torch.cuda`` stream and event calls reach tpu's."""
    saved = {name: getattr(torch.cuda, name) for name in
             ("Stream", "Event", "current_stream", "default_stream", "stream")}
    # A partial per callable: Dynamo refuses one object registered under two names.
    torch.cuda.Stream = torch.tpu.Stream
    torch.cuda.Event = lambda *args, blocking=None, external=None, **kw: torch.tpu.Event(*args, **kw)
    torch.cuda.current_stream = partial(torch.tpu.current_stream)
    torch.cuda.default_stream = partial(torch.tpu.default_stream)
    torch.cuda.stream = partial(torch.tpu.stream)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)


def token_buckets(max_tokens: int) -> list[int]:
    """The padded token counts a compiled forward runs at: 1, 2, 4, every 8 to 256, every 16 to
    512 (vLLM's CUDA-graph capture sizes), every 256 beyond, and ``max_tokens`` itself."""
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, 512, 16), *range(512, max_tokens, 256)]
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


def kv_cache_shape(spec, num_blocks: int) -> tuple[int, int, int]:
    """[(num_blocks + 1) * block_size, num_kv_heads, key size + value size] of one layer's cache.

    Slots, not pages, lead: a step's write is one ``index_copy_`` on the whole tensor (see
    .attention). The extra block is the scratch page that padded tokens are written to.
    """
    head_size_v = getattr(spec, "head_size_v", None) or spec.head_size
    return ((num_blocks + 1) * spec.block_size, spec.num_kv_heads, spec.head_size + head_size_v)


def allocate_kv_caches(kv_cache_config, device: torch.device) -> dict[str, torch.Tensor]:
    """One zeroed cache tensor per attention layer, sized from vLLM's KV cache config."""
    specs = {}
    for group in kv_cache_config.kv_cache_groups:
        for name in group.layer_names:
            spec = group.kv_cache_spec
            specs[name] = getattr(spec, "kv_cache_specs", {}).get(name, spec)
    caches = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        num_blocks = kv_cache_config.num_blocks_of(tensor)
        for name in tensor.layers:
            spec = specs[name]
            if not hasattr(spec, "num_kv_heads"):
                raise NotImplementedError(
                    f"tpu: KV cache spec {type(spec).__name__} of layer {name} is not supported "
                    "by torchtpu's vLLM model runner (attention layers only; no Mamba/linear)."
                )
            caches[name] = torch.zeros(kv_cache_shape(spec, num_blocks), dtype=spec.dtype,
                                       device=device)
    return caches


class TpuModelRunner(GPUModelRunner):
    """vLLM's model runner for the ``tpu`` device."""

    def __init__(self, vllm_config, device: torch.device):
        with _tpu_as_cuda():
            super().__init__(vllm_config, device)
        self.use_cuda_graph = False
        compiled = (self.compilation_config.mode != CompilationMode.NONE
                    and not self.model_config.enforce_eager)
        # Each new token count is a new XLA program per piece: pad to a bucket to bound them.
        self.token_buckets = token_buckets(self.max_num_tokens) if compiled else None

    def _determine_batch_execution_and_padding(self, num_tokens: int, *args, **kwargs):
        """vLLM's choice for this step, with the token count padded up to its bucket."""
        mode, batch, *rest = super()._determine_batch_execution_and_padding(num_tokens, *args, **kwargs)
        if self.token_buckets is not None and batch.num_tokens <= self.token_buckets[-1]:
            padded = self.token_buckets[bisect.bisect_left(self.token_buckets, batch.num_tokens)]
            batch = dataclasses.replace(batch, num_tokens=padded)
        return (mode, batch, *rest)

    def initialize_kv_cache_tensors(self, kv_cache_config, kernel_block_sizes,
                                    kv_cache_allocation_context=None) -> dict[str, torch.Tensor]:
        """Allocate the paged KV cache on tpu and bind each layer's tensor to its attention."""
        if any(size != group.kv_cache_spec.block_size
               for size, group in zip(kernel_block_sizes, kv_cache_config.kv_cache_groups)):
            raise NotImplementedError(
                "tpu: kernel block sizes different from the KV cache block size are not "
                f"supported (got {kernel_block_sizes})."
            )
        kv_caches = allocate_kv_caches(kv_cache_config, self.device)
        for layer_name, target_layer_name in self.shared_kv_cache_layers.items():
            kv_caches[layer_name] = kv_caches[target_layer_name]
        bind_kv_cache(kv_caches, self.compilation_config.static_forward_context, self.kv_caches,
                      kv_cache_groups=kv_cache_config.kv_cache_groups)
        return kv_caches

    def _init_kv_zero_meta(self) -> None:
        pass  # the GPU runner's block zeroer is a Triton kernel; _zero_block_ids does it here

    def _zero_block_ids(self, block_ids: list[int]) -> None:
        """Zero freshly allocated blocks, so stale values never meet a zero attention weight."""
        block = self.cache_config.block_size
        slots = (torch.tensor(block_ids, dtype=torch.long)[:, None] * block + torch.arange(block)).reshape(-1)
        index = slots.to(self.device)
        seen = set()
        for cache in self.kv_caches:
            if id(cache) not in seen:
                seen.add(id(cache))
                cache.index_fill_(0, index, 0)

    def _sync_device(self) -> None:
        torch.tpu.synchronize()

    def _to_list(self, sampled_token_ids: torch.Tensor) -> list[list[int]]:
        return sampled_token_ids.cpu().tolist()  # one blocking read; no CUDA event needed
