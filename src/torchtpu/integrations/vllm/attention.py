"""vLLM's attention backend on ``tpu``: the paged cache and attention of :mod:`torchtpu.serving.paged_kv`.

The cache layout, the host-side plan of a step and the attention itself are engine-free (and
tested without vLLM); this module is the vLLM side: the metadata builder that plans each step
from vLLM's common metadata, the attention implementation the model's layers call, and the
backend class vLLM selects.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import KVCacheLayout

from torchtpu.serving.buckets import power_of_two_at_least  # noqa: F401  (re-exported)
from torchtpu.serving.paged_kv import PagedStepPlan, RequestGroup, paged_attention, plan_step, write_kv  # noqa: F401

TpuPagedAttentionMetadata = PagedStepPlan  # what the builder hands every layer of a step


class TpuPagedAttentionMetadataBuilder(AttentionMetadataBuilder[TpuPagedAttentionMetadata]):
    """Builds :class:`TpuPagedAttentionMetadata` once per step from vLLM's common metadata."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        self.speculative = vllm_config.speculative_config is not None

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TpuPagedAttentionMetadata:
        m = common_attn_metadata
        # The host's sequence lengths are exact unless drafts are speculated (then read the device's).
        exact_on_host = m.seq_lens_cpu_upper_bound is not None and not self.speculative
        seq_lens = (m.seq_lens_cpu_upper_bound if exact_on_host else m.seq_lens.cpu())[: m.num_reqs]
        return plan_step(m.query_start_loc_cpu.numpy()[: m.num_reqs + 1], seq_lens.numpy().astype(np.int64),
                         m.block_table_tensor, self.block_size, m.max_seq_len,
                         max(m.slot_mapping.shape[0], m.num_actual_tokens), self.device)


class TpuPagedAttentionImpl(AttentionImpl[TpuPagedAttentionMetadata]):
    """Decoder self-attention over the paged cache (multi-head and grouped-query)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks=None, **kwargs) -> None:
        if alibi_slopes is not None or sinks is not None:
            raise NotImplementedError("tpu: ALiBi and attention sinks are not supported by "
                                      "torchtpu's vLLM attention backend yet.")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"tpu: attention type {attn_type} is not supported by "
                                      "torchtpu's vLLM attention backend (decoder only).")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.kv_sharing_target_layer_name is None:
            write_kv(kv_cache, key, value, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("tpu: fused output quantization is not supported by "
                                      "torchtpu's vLLM attention backend.")
        if attn_metadata is None:  # profiling run: no cache bound yet
            return output.fill_(0)
        rows = attn_metadata.token_rows.shape[0]
        if rows == query.shape[0] == output.shape[0]:  # the step's padded tokens: whole tensors
            out = paged_attention(query, kv_cache, attn_metadata, self.scale, self.head_size,
                                  self.sliding_window, self.logits_soft_cap)
            output.copy_(out.reshape(output.shape))
            return output
        out = paged_attention(query[:rows], kv_cache, attn_metadata, self.scale, self.head_size,
                              self.sliding_window, self.logits_soft_cap)
        output[:rows].copy_(out.reshape(output[:rows].shape))
        return output


class TpuPagedAttentionBackend(AttentionBackend):
    """vLLM attention backend: paged KV cache in tpu memory, read and written with torch ops."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16"]
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[TpuPagedAttentionImpl]:
        return TpuPagedAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TpuPagedAttentionMetadataBuilder]:
        return TpuPagedAttentionMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBNHC,)  # each layer's tensor is [blocks x tokens, heads, k|v]
