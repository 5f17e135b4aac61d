"""``TpuModelRunner``: vLLM's GPU model runner, with CUDA streams mapped to tpu and a paged KV cache.

The GPU runner builds its per-step inputs on the host and copies them to the device
(``CpuGpuBuffer``), which is what tpu wants too; what differs is the KV cache (one typed tensor
per layer, laid out ``[(num_blocks + 1) * block_size, num_kv_heads, 2 * head_size]`` as
:mod:`.attention` reads it, instead of byte views carved out of one int8 buffer) and the
CUDA-only helpers (stream-ordered copies, Triton block zeroing). When the forward is compiled,
each step's token count is padded up to a bucket (:func:`torchtpu.serving.buckets.token_buckets`), as vLLM pads to its
CUDA-graph sizes, so each piece of the forward has a bounded number of XLA programs.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from functools import partial

import torch
from vllm.config import CompilationMode
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.utils import bind_kv_cache

from torchtpu.serving import paged_kv
from torchtpu.serving.buckets import padded_size, token_buckets


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


def kv_cache_shape(spec, num_blocks: int) -> tuple[int, int, int]:
    """One layer's cache shape for vLLM's KV cache spec (see :func:`torchtpu.serving.paged_kv.kv_cache_shape`)."""
    return paged_kv.kv_cache_shape(spec.block_size, spec.num_kv_heads, spec.head_size, num_blocks,
                                   getattr(spec, "head_size_v", None))


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
            batch = dataclasses.replace(batch, num_tokens=padded_size(self.token_buckets, batch.num_tokens))
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
        index = paged_kv.block_slots(block_ids, self.cache_config.block_size).to(self.device)
        seen = set()
        for cache in self.kv_caches:
            if id(cache) not in seen:
                seen.add(id(cache))
                cache.index_fill_(0, index, 0)

    def _sync_device(self) -> None:
        torch.tpu.synchronize()

    def _to_list(self, sampled_token_ids: torch.Tensor) -> list[list[int]]:
        return sampled_token_ids.cpu().tolist()  # one blocking read; no CUDA event needed
