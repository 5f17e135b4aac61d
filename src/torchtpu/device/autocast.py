"""``torch.autocast("tpu")``: PyTorch's CUDA cast policy, and bfloat16 as the default dtype.

The policy itself is C++ (``csrc/autocast.cpp``): PyTorch's own autocast wrappers and op lists,
registered on the AutocastPrivateUse1 dispatch key, so an op under autocast costs no Python
(``docs/design.md`` says why not ``torch.library`` kernels). ``install`` registers it when the
device is registered, and makes bfloat16 the default dtype of ``torch.autocast("tpu")`` (the
MXU's type; PyTorch's default for a PrivateUse1 device is float16). PyTorch keeps that default
per thread: ``install`` sets it in the importing thread; another thread that enters
``torch.autocast("tpu")`` without a ``dtype`` gets PyTorch's float16, so pass ``dtype=`` there.

Without the C++ extension (no compiler) there is no policy: an op under ``torch.autocast("tpu")``
then raises an error saying so, instead of PyTorch's "Could not run ... 'Autocasttpu' backend".
This module imports no JAX.
"""

from __future__ import annotations

import torch

DEFAULT_DTYPE = torch.bfloat16
_libs: list[torch.library.Library] = []


def install() -> bool:
    """Register the autocast kernels and the default dtype (idempotent); True if the policy is
    registered, False if ops under ``torch.autocast("tpu")`` will raise (no C++ extension)."""
    from torchtpu.runtime import native

    torch.set_autocast_dtype("tpu", DEFAULT_DTYPE)
    if native.autocast_registered():
        return True
    if native.register_autocast():
        return True
    if not _libs:
        lib = torch.library.Library("_", "IMPL")
        lib.fallback(_unavailable, "AutocastPrivateUse1")
        _libs.append(lib)
    return False


def _unavailable(op, *args, **kwargs):
    from torchtpu.runtime import native

    raise RuntimeError(f"tpu: torch.autocast('tpu') needs torchtpu's C++ extension, which is unavailable "
                       f"({native.unavailable_reason()}); {op} cannot run under it. Install a C++ compiler "
                       f"(the one PyTorch extensions use) and import torch again, or run without autocast")
