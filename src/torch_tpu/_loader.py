"""``torch_tpu._loader.load()``: what Ray Train's TPU device manager calls before it creates a
``"tpu_dist"`` process group."""

from __future__ import annotations

import torchtpu.distributed


def load() -> None:
    """Make the ``tpu`` device and the ``tpu`` / ``tpu_dist`` c10d backends available.

    Importing this module has registered them already (through ``torchtpu``); calling it again
    is harmless. It starts no runtime: under a multi-process launch the runtime must start after
    the process group exists, at the first ``tpu`` op.
    """
    torchtpu.distributed.register()  # idempotent


def _init_device(device_type: str = "tpu") -> None:
    """``load()`` for the one device type there is (the spelling some TorchTPU tools call)."""
    if device_type != "tpu":
        raise ValueError(f"torch_tpu provides the 'tpu' device only, not {device_type!r}")
    load()
