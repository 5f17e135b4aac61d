"""torchtpu: a native ``tpu`` device for PyTorch, backed by XLA through JAX.

``import torch`` loads it through the ``torch.backends`` entry point (set
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` to turn that off); ``import torchtpu`` works as well.

Importing registers the device and nothing more: no JAX import, no runtime. The runtime starts
at the first ``tpu`` op (or a ``torch.tpu`` call that needs devices); the layers plug in then,
through ``runtime.state.on_start`` below.
"""

from __future__ import annotations

import importlib


def _autoload() -> None:
    """Entry point for PyTorch's device-backend autoload: importing this package registers ``tpu``.

    Defined before anything imports torch: ``import torchtpu`` first imports torch, whose
    autoload then finds this (partially initialised) module and calls this function.
    """


from torchtpu import tpu_module as _tpu_module  # noqa: E402
from torchtpu.compile import install as _install_compile  # noqa: E402
from torchtpu.device import dlpack as _dlpack  # noqa: E402
from torchtpu.device.registration import register as _register  # noqa: E402
from torchtpu.distributed import register as _register_distributed  # noqa: E402
from torchtpu.flex_attention import install as _install_flex_attention  # noqa: E402
from torchtpu.runtime import state as _state  # noqa: E402

__version__ = "0.1.0"


def _start_layers() -> None:
    """What starting the runtime adds above it: the eager kernels, the compile caches, and
    TorchTitan's peak FLOP/s and FLUX autoencoder load where TorchTitan is installed."""
    from torchtpu import patches
    from torchtpu.compile import cache
    from torchtpu.eager import register

    cache.install()  # before anything compiles
    register.install()
    patches.apply("torchtitan.peak_flops")  # where TorchTitan is installed
    patches.apply("torchtitan.flux_autoencoder_load")


_register(_tpu_module.build())
_install_compile()
_register_distributed()
_install_flex_attention()
_dlpack.install()  # at import: names bound later (``from torch.utils.dlpack import to_dlpack``) are these
_state.on_start(_start_layers)

# Public names whose modules import JAX: imported on first access.
_LAZY = {"EagerMode": ("torchtpu.eager.modes", "EagerMode"), "memory_summary": ("torchtpu.memory", "memory_summary"),
         "debug": ("torchtpu.debug", None), "metrics": ("torchtpu.metrics", None),
         "profiler": ("torchtpu.profiler", None), "jax_op": ("torchtpu.jax_ops", "jax_op")}


def __getattr__(name: str):
    try:
        module_name, attribute = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'torchtpu' has no attribute {name!r}") from None
    value = importlib.import_module(module_name)
    return value if attribute is None else getattr(value, attribute)


__all__ = ["EagerMode", "debug", "jax_op", "memory_summary", "metrics", "profiler", "__version__"]
