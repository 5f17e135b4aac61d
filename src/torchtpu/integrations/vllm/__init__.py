"""vLLM on ``tpu``: an out-of-tree platform, a worker, a model runner and a paged attention backend.

vLLM finds the platform through the ``vllm.platform_plugins`` entry point (``pyproject.toml``):
``tpu = torchtpu.integrations.vllm:activate``. vLLM calls it in every process that resolves
its platform; it returns the platform class's name when ``VLLM_PLATFORM=tpu`` (or, unset, when
``tpu`` is the accelerator and CUDA is not there). The platform is ``PlatformEnum.OOT``, never
``PlatformEnum.TPU``: vLLM's own TPU path loads a different, JAX-only stack.

Nothing here imports vLLM at torchtpu's import time.
"""

from __future__ import annotations

import os

# The vLLM releases this integration was written and tested against; the worker and model
# runner subclass vLLM's GPU classes, whose internals change between minor releases.
TESTED_VLLM = ((0, 33, 0), (0, 34, 0))  # [low, high)
PLATFORM_CLASS = "torchtpu.integrations.vllm.platform.TpuPlatform"


def _release(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string such as '0.33.0' or '0.33.0+cpu'."""
    parts = version.split("+")[0].split(".")[:3]
    return tuple(int("".join(c for c in part if c.isdigit()) or 0) for part in parts)


def check_vllm_version(installed: str | None = None) -> str:
    """The installed vLLM version (or ``installed``); raise if it is outside the tested range."""
    from importlib.metadata import version

    installed = installed or version("vllm")
    low, high = TESTED_VLLM
    if not low <= _release(installed) < high:
        raise RuntimeError(
            f"torchtpu's vLLM platform supports vllm>={'.'.join(map(str, low))},"
            f"<{'.'.join(map(str, high))}, but vllm {installed} is installed. "
            f"Install a supported release (pip install -e '.[vllm]' or tools/vllm_env.sh)."
        )
    return installed


def _wanted() -> bool:
    """Whether this process should serve on tpu: asked for by name, or tpu is the only accelerator."""
    if os.environ.get("VLLM_PLATFORM"):
        return os.environ["VLLM_PLATFORM"] == "tpu"
    import torch

    # Auto-selection must not take a CUDA machine away from vLLM's own CUDA platform.
    accelerator = torch.accelerator.current_accelerator()
    return accelerator is not None and accelerator.type == "tpu" and not torch.cuda.is_available()


def activate() -> str | None:
    """Entry point of ``vllm.platform_plugins``: the platform class's name, or None to decline."""
    if not _wanted():
        return None
    check_vllm_version()
    return PLATFORM_CLASS
