"""torchtpu: a native ``tpu`` device for PyTorch, backed by XLA through JAX.

``import torch`` loads it through the ``torch.backends`` entry point (set
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` to turn that off); ``import torchtpu`` works as well.
"""

from __future__ import annotations


def _autoload() -> None:
    """Entry point for PyTorch's device-backend autoload: importing this package registers ``tpu``.

    Defined before anything imports torch: ``import torchtpu`` first imports torch, whose
    autoload then finds this (partially initialised) module and calls this function.
    """


import jax  # noqa: E402

# torch's int64/float64 semantics need JAX's 64-bit mode: the one JAX setting torchtpu changes.
jax.config.update("jax_enable_x64", True)

from torchtpu.device.registration import register as _register  # noqa: E402

__version__ = "0.1.0"

_register()

import torch  # noqa: E402

from torchtpu import compile as _compile  # noqa: E402
from torchtpu import debug, metrics, profiler  # noqa: E402
from torchtpu.eager.modes import EagerMode  # noqa: E402
from torchtpu.memory import memory_summary  # noqa: E402

# The layers above the device plug into torch.tpu here, so nothing below reaches up.
_compile.install()
torch.tpu.compiler = _compile.compiler
torch.tpu.debug = debug
torch.tpu.profiler = profiler
torch.tpu.memory_summary = memory_summary


__all__ = ["EagerMode", "debug", "memory_summary", "metrics", "profiler", "__version__"]
