"""``--quantization tpu_int8`` for vLLM: weight-only int8 linear layers (see :mod:`torchtpu.integrations.int8`).

Registered with vLLM's own hook for out-of-tree methods, ``register_quantization_config``,
when this module is imported: by the platform before vLLM parses its arguments
(``pre_register_and_update``) and by the worker before it loads the model.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from torchtpu.integrations.int8 import NAME, int8_linear, quantize_layer


class TpuInt8LinearMethod(UnquantizedLinearMethod):
    """Loads float weights as vLLM's unquantized method does, then keeps them as int8 rows."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        quantize_layer(layer)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return int8_linear(x, layer.weight, layer.weight_scale, bias)


@register_quantization_config(NAME)
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
