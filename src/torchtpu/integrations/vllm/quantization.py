"""``--quantization tpu_int8`` for vLLM: weight-only int8 linear layers (see :mod:`torchtpu.integrations.int8`).

Registered with vLLM's own hook for out-of-tree methods, ``register_quantization_config``,
when this module is imported: by the platform before vLLM parses its arguments
(``pre_register_and_update``) and by the worker before it loads the model.
"""

from __future__ import annotations

from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from torchtpu.integrations.int8 import NAME, Int8Config, Int8LinearMethod


class TpuInt8LinearMethod(Int8LinearMethod, UnquantizedLinearMethod):
    """vLLM's unquantized loading, int8 rows after it."""


@register_quantization_config(NAME)
class TpuInt8Config(Int8Config, QuantizationConfig):
    """``--quantization tpu_int8`` in vLLM."""

    linear_base = LinearBase
    linear_method = TpuInt8LinearMethod
