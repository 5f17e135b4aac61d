"""TorchTitan configs for the tests: its own debug configs, cut to what 2 shared CPU cores can train.

TorchTitan's ``--module`` takes a fully qualified module as well as its own short names
(``--module torchtitan_configs --config qwen3_moe_small``, with this directory on ``PYTHONPATH``).
Each function here starts from one of TorchTitan 0.3's registered configs and changes sizes
only, with TorchTitan's own builders: the layers, router, experts, token dispatcher and
load balancing are the registered model's.

* ``qwen3_moe_small``: ``qwen3_moe_debug`` (Qwen3 MoE: 8 layers of 64 experts, top 8, 316 M
  parameters, about 2 minutes a step on the CPU here) with 2 layers of 8 experts, top 2, expert
  hidden size 128.
"""

from __future__ import annotations

from torchtitan.models.common.rope import CosSinRoPE
from torchtitan.models.qwen3 import _build_qwen3_moe_layers, model_registry
from torchtitan.models.qwen3.config_registry import qwen3_moe_debug
from torchtitan.trainer import Trainer

MOE_LAYERS, MOE_EXPERTS, MOE_TOP_K, MOE_HIDDEN = 2, 8, 2, 128


def qwen3_moe_small() -> Trainer.Config:
    """TorchTitan's ``qwen3_moe_debug`` with 2 layers of 8 experts (top 2, hidden 128)."""
    config = qwen3_moe_debug()
    spec = model_registry("debugmodel_moe")
    model = spec.model
    # The arguments of TorchTitan's ``_debugmodel_moe`` but for the layer and expert counts.
    model.layers = _build_qwen3_moe_layers(
        fuse_qkv=True, n_layers=MOE_LAYERS, dim=model.dim, n_heads=16, n_kv_heads=8, head_dim=128,
        moe_hidden_dim=MOE_HIDDEN, num_experts=MOE_EXPERTS, top_k=MOE_TOP_K, attn_backend="flex",
        rope=CosSinRoPE.Config(dim=128, max_seq_len=4096, theta=1000000.0), moe_comm_backend="standard")
    spec.flavor = "debugmodel_moe_small"
    config.model_spec = spec
    return config
