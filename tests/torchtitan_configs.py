"""TorchTitan configs for the tests: its own debug configs, cut to what 2 shared CPU cores can train.

TorchTitan's ``--module`` takes a fully qualified module as well as its own short names
(``--module torchtitan_configs --config qwen3_moe_small``, with this directory on ``PYTHONPATH``).
Each function here starts from one of TorchTitan 0.3's registered configs and changes sizes
only, with TorchTitan's own builders: the layers, router, experts, token dispatcher and
load balancing are the registered model's.

* ``qwen3_moe_small``: ``qwen3_moe_debug`` (Qwen3 MoE: 8 layers of 64 experts, top 8, 316 M
  parameters, about 2 minutes a step on the CPU here) with 2 layers of 8 experts, top 2, expert
  hidden size 128.
* ``flux_debug_small``: ``flux_debugmodel`` (TorchTitan's ``flux-debug``: 2 double-stream and 2
  single-stream blocks of width 1,536, 250 M parameters, and FLUX.1's 84 M-parameter
  autoencoder; about 4 minutes a step for the CPU reference here) with width 256 (2 heads of
  128, the registered head size), the autoencoder's base channels 32 instead of 128, 64 x 64
  images and 32 T5 tokens (256 x 256 and 256 registered), without its validator, and with the
  training loop's random draws taken from one CPU generator (below). The assets come from
  ``tools/make_tiny_flux_assets.py --autoencoder-channels 32``.

FLUX's training step draws its noise, timesteps and the autoencoder's latent sample on the
device, and ``tpu``'s generator is not the CPU's: the same seed gives other numbers, and with
other noise each step's loss is another number. ``SharedDrawsFluxTrainer`` is TorchTitan's
``FluxTrainer`` whose ``train()`` runs under a function mode that computes every ``rand``,
``randn``, ``randint`` and ``*_like`` of the loop with one CPU generator seeded for the purpose
and moves the result to the device it was asked on: the CPU run and the ``tpu`` run draw the
same numbers in the same order (the data loader's prompt dropout and crop included). Nothing
else in the loop changes.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.overrides import TorchFunctionMode
from torchtitan.models.common.rope import CosSinRoPE
from torchtitan.models.flux import _make_double_block_config, _make_single_block_config
from torchtitan.models.flux.config_registry import flux_debugmodel
from torchtitan.models.flux.trainer import FluxTrainer
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


FLUX_IMAGE_SIZE, FLUX_T5_TOKENS, FLUX_WIDTH, FLUX_HEADS, FLUX_AE_CHANNELS = 64, 32, 256, 2, 32
_LIKE = {torch.rand_like: torch.rand, torch.randn_like: torch.randn, torch.randint_like: torch.randint}
_FACTORIES = {torch.rand, torch.randn, torch.randint, torch.randperm}


class _SharedDraws(TorchFunctionMode):
    """Computes the random factories (and ``*_like``) with ``generator`` on the CPU, then moves
    the result to the device asked for (a ``torch.device`` context's included)."""

    def __init__(self, generator: torch.Generator):
        super().__init__()
        self.generator = generator

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _LIKE and kwargs.get("generator") is None:
            like, *rest = args
            device = kwargs.pop("device", None) or like.device
            dtype = kwargs.pop("dtype", None) or like.dtype
            for unused in ("layout", "memory_format", "pin_memory", "requires_grad"):
                kwargs.pop(unused, None)
            if func is torch.randint_like and len(rest) == 1:
                rest = [0, rest[0]]
            out = _LIKE[func](*rest, like.shape, dtype=dtype, generator=self.generator, device="cpu")
            return out.to(device)
        if func in _FACTORIES and kwargs.get("generator") is None:
            device = kwargs.pop("device", None)
            out = func(*args, **{**kwargs, "device": "cpu", "generator": self.generator})
            return out if device is None else out.to(device)
        return func(*args, **kwargs)


class SharedDrawsFluxTrainer(FluxTrainer):
    """TorchTitan's FluxTrainer; its training loop draws from one CPU generator (module doc)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(FluxTrainer.Config):
        draws_seed: int = 0
        """Seed of the CPU generator the training loop's random draws come from."""

    def train(self):
        with _SharedDraws(torch.Generator().manual_seed(self.config.draws_seed)):
            return super().train()


def flux_debug_small() -> SharedDrawsFluxTrainer.Config:
    """TorchTitan's ``flux_debugmodel`` on 64 x 64 images and 32 T5 tokens, no validator."""
    base = flux_debugmodel()
    config = SharedDrawsFluxTrainer.Config(
        **{f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init})
    model = config.model_spec.model
    # The arguments of TorchTitan's ``_flux_debug`` but for the width (heads of 128 as registered:
    # the position embedding's axes add up to 128) and the autoencoder's channels.
    width, replace = FLUX_WIDTH, dataclasses.replace
    model.hidden_size, model.num_heads = width, FLUX_HEADS
    model.img_in = replace(model.img_in, out_features=width)
    model.txt_in = replace(model.txt_in, out_features=width)
    for name in ("time_in_config", "vector_in_config"):
        mlp = getattr(model, name)
        setattr(model, name, replace(mlp, hidden_dim=width, in_layer=replace(mlp.in_layer, out_features=width),
                                     out_layer=replace(mlp.out_layer, in_features=width, out_features=width)))
    model.double_blocks = [_make_double_block_config(hidden_size=width, num_heads=FLUX_HEADS, mlp_ratio=model.mlp_ratio,
                                                     qkv_bias=model.qkv_bias) for _ in model.double_blocks]
    model.single_blocks = [_make_single_block_config(hidden_size=width, num_heads=FLUX_HEADS, mlp_ratio=model.mlp_ratio)
                           for _ in model.single_blocks]
    last = model.final_layer_config
    model.final_layer_config = replace(last, hidden_size=width, linear=replace(last.linear, in_features=width),
                                       adaln_linear=replace(last.adaln_linear, in_features=width, out_features=2 * width))
    model.autoencoder = replace(model.autoencoder, ch=FLUX_AE_CHANNELS)
    config.model_spec.flavor = "flux-debug-small"
    config.dataloader.img_size = FLUX_IMAGE_SIZE
    config.tokenizer.max_t5_encoding_len = FLUX_T5_TOKENS
    config.validator.enable = False
    return config
