"""``--quantization tpu_int8`` for SGLang: weight-only int8 linear layers (see :mod:`torchtpu.integrations.int8`).

``register`` (SGLang's plugin hook, :func:`torchtpu.integrations.sglang.register`) adds the
method to SGLang's quantization registry and to ``--quantization``'s choices.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.layers.linear import LinearBase
from sglang.srt.layers.quantization.base_config import QuantizationConfig
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

from torchtpu.integrations.int8 import NAME, int8_linear, quantize_layer


class TpuInt8LinearMethod(UnquantizedLinearMethod):
    """Loads float weights as SGLang's unquantized method does, then keeps them as int8 rows."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        quantize_layer(layer)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return int8_linear(x, layer.weight, layer.weight_scale, bias)


class TpuInt8Config(QuantizationConfig):
    """Weight-only int8 for every linear layer, quantized from the float checkpoint as it loads."""

    def get_name(self) -> str:
        return NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "TpuInt8Config":
        return cls()

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        return TpuInt8LinearMethod() if isinstance(layer, LinearBase) else None

    def get_scaled_act_names(self) -> list[str]:
        return []


def register() -> None:
    """Make ``--quantization tpu_int8`` known to SGLang (idempotent)."""
    from sglang.srt.arg_groups.choices import QUANTIZATION_CHOICES, add_quantization_method_choices
    from sglang.srt.layers.quantization import QUANTIZATION_METHODS

    QUANTIZATION_METHODS.setdefault(NAME, TpuInt8Config)
    if NAME not in QUANTIZATION_CHOICES:
        add_quantization_method_choices([NAME])
