"""``torch_tpu.api.tpu_device()``: the device older Ray Train releases ask for."""

from __future__ import annotations

import torch

from torchtpu.tpu_module import current_device


def tpu_device() -> torch.device:
    """This process's current ``tpu`` device (``tpu:LOCAL_RANK`` under torchrun); starts nothing."""
    return torch.device("tpu", current_device())
