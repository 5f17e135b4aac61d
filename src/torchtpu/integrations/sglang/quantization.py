"""``--quantization tpu_int8`` for SGLang: weight-only int8 linear layers (see :mod:`torchtpu.integrations.int8`).

``register`` (SGLang's plugin hook, :func:`torchtpu.integrations.sglang.register`) adds the
method to SGLang's quantization registry and to ``--quantization``'s choices.
"""

from __future__ import annotations

from sglang.srt.layers.linear import LinearBase
from sglang.srt.layers.quantization.base_config import QuantizationConfig
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

from torchtpu.integrations.int8 import NAME, Int8Config, Int8LinearMethod


class TpuInt8LinearMethod(Int8LinearMethod, UnquantizedLinearMethod):
    """SGLang's unquantized loading, int8 rows after it."""


class TpuInt8Config(Int8Config, QuantizationConfig):
    """``--quantization tpu_int8`` in SGLang."""

    linear_base = LinearBase
    linear_method = TpuInt8LinearMethod

    def get_scaled_act_names(self) -> list[str]:
        return []


def register() -> None:
    """Make ``--quantization tpu_int8`` known to SGLang (idempotent)."""
    from sglang.srt.arg_groups.choices import QUANTIZATION_CHOICES, add_quantization_method_choices
    from sglang.srt.layers.quantization import QUANTIZATION_METHODS

    QUANTIZATION_METHODS.setdefault(NAME, TpuInt8Config)
    if NAME not in QUANTIZATION_CHOICES:
        add_quantization_method_choices([NAME])
