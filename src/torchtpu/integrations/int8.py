"""Weight-only int8 for the serving engines' linear layers (``--quantization tpu_int8``).

Each linear layer's weight is quantized once, after the checkpoint is loaded: per output
channel, symmetric, ``scale = max |w| / 127`` and ``q = round(w / scale)`` in int8, so the
weights take a quarter of their float32 memory (half of bfloat16's). A forward multiplies by
the int8 weight cast to the activations' dtype and scales each output channel after the
matmul, ``(x @ q.T) * scale + bias``: in a compiled forward XLA fuses the cast into the matmul.

The engines' own int8 methods need what tpu does not have: SGLang's ``w8a8_int8`` and vLLM's
int8 schemes call CUDA or CPU-AMX kernels and expect checkpoints quantized ahead of time, and
the torchao path both engines had is gone from SGLang 0.5.23 and needs torchao's CUDA build in
vLLM. This method is plain torch ops, quantizes any float checkpoint as it loads, and plugs into
each engine through its own quantization registry (:mod:`.sglang.quantization`,
:mod:`.vllm.quantization`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "tpu_int8"


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``weight`` [out, in] as int8 per output row, and each row's float32 scale."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight ``q`` and ``scale`` stand for (what a reference model should use)."""
    return (q.float() * scale[:, None]).to(dtype)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ dequantize(q, scale).T + bias``, with the scale applied to the matmul's output."""
    out = F.linear(x, q.to(x.dtype)) * scale.to(x.dtype)
    return out if bias is None else out + bias


def quantize_layer(layer: torch.nn.Module) -> None:
    """Replace ``layer.weight`` (loaded, float) by its int8 rows and add ``layer.weight_scale``."""
    q, scale = quantize_rows(layer.weight.data)
    layer.weight = torch.nn.Parameter(q, requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)


# ---------------------------------------------------------------- the engines' method and config
# SGLang and vLLM have the same quantization interface (vLLM's, which SGLang copied) in
# different modules: each engine's classes put these first and its own base classes after.

class Int8LinearMethod:
    """A linear method that loads float weights as the engine's unquantized method does (the
    base class after this one), then keeps them as int8 rows."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        quantize_layer(layer)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return int8_linear(x, layer.weight, layer.weight_scale, bias)


class Int8Config:
    """Weight-only int8 for every linear layer (``linear_base`` instances, with ``linear_method``),
    quantized from the float checkpoint as it loads."""

    linear_base: type
    linear_method: type

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
    def from_config(cls, config: dict) -> "Int8Config":
        return cls()

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        return self.linear_method() if isinstance(layer, self.linear_base) else None
