"""``torch_tpu``: the import name that libraries integrating TorchTPU use, served by ``torchtpu``.

What they touch (nothing more is promised here):

* Transformers up to 5.19: ``importlib.util.find_spec("torch_tpu")``, then ``import torch_tpu``
  and ``torch.tpu.is_available()`` / ``torch.tpu.device_count()``.
* Ray Train's TPU device manager: ``torch_tpu._loader.load()`` before its ``"tpu_dist"`` process
  group; older releases ``torch_tpu.api.tpu_device()``.
* VeRL and others: ``import torch_tpu``, then ``hasattr(torch, "tpu")``.

Importing it imports ``torchtpu``, which registers the ``tpu`` device (``torch.tpu``) and the
``tpu`` / ``tpu_dist`` c10d backends, even with ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``; it starts no
runtime and imports no JAX. Module attributes other than the ones below are ``torch.tpu``'s.
"""

from __future__ import annotations

import torch

from torchtpu import __version__  # importing torchtpu registers the device and the backends
from torchtpu.tpu_module import current_device, device_count, is_available, set_device


def __getattr__(name: str):
    """Everything else ``torch.tpu`` has (``torch_tpu.synchronize``, ``torch_tpu.memory_allocated``)."""
    if name.startswith("__"):
        raise AttributeError(f"module 'torch_tpu' has no attribute {name!r}")
    try:
        return getattr(torch.tpu, name)
    except AttributeError:
        raise AttributeError(f"module 'torch_tpu' has no attribute {name!r}") from None


__all__ = ["__version__", "current_device", "device_count", "is_available", "set_device"]
