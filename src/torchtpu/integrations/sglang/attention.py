"""``TpuAttnBackend``: SGLang attention over the paged KV pool (see :mod:`torchtpu.serving.token_pool`).

The whole batch is one padded problem planned once per forward on the host from the lengths
SGLang already keeps there (:func:`~torchtpu.serving.token_pool.plan_batch`), and every layer
runs one batched attention over the pool
(:func:`~torchtpu.serving.token_pool.paged_attention`); both are engine-free.
"""

from __future__ import annotations

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from torchtpu.serving.token_pool import BatchPlan, paged_attention, plan_batch  # noqa: F401  (re-exported)


class TpuAttnBackend(AttentionBackend):
    """SGLang attention backend for ``tpu``: batched, padded, made of torch ops."""

    def __init__(self, model_runner):
        super().__init__()
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.forward_metadata: BatchPlan | None = None

    def init_forward_metadata(self, forward_batch):
        """Plan the padded problem of this batch once; every layer reuses it."""
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.forward_metadata = None
            return
        seq_lens = [int(n) for n in forward_batch.seq_lens_cpu.tolist()]
        if mode.is_decode():
            q_lens = [1] * len(seq_lens)
        elif mode.is_extend() or mode.is_mixed():
            q_lens = [int(n) for n in forward_batch.extend_seq_lens_cpu]
        else:
            raise NotImplementedError(f"The tpu attention backend does not support forward mode {mode.name}.")
        req_to_token = self.req_to_token_pool.req_to_token
        rows = req_to_token.index_select(0, forward_batch.req_pool_indices)
        self.forward_metadata = plan_batch(q_lens, seq_lens, rows, req_to_token.shape[1], self.device)

    def _check_layer(self, layer) -> None:
        if layer.is_cross_attention or layer.attn_type == AttentionType.ENCODER_ONLY:
            raise NotImplementedError("The tpu attention backend supports decoder self-attention only.")
        if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
            raise NotImplementedError("The tpu attention backend does not support sliding-window attention yet.")
        if getattr(layer, "logit_cap", 0) and layer.logit_cap > 0:
            raise NotImplementedError("The tpu attention backend does not support attention logit capping yet.")

    def _attend(self, q, k, v, layer, forward_batch, save_kv_cache):
        self._check_layer(layer)
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v)
        query = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        return paged_attention(query, self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                               self.token_to_kv_pool.get_value_buffer(layer.layer_id),
                               self.forward_metadata, layer.scaling)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache)

    def support_triton(self):
        return False
