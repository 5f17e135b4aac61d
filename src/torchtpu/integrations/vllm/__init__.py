"""vLLM on ``tpu``: an out-of-tree platform, a worker, a model runner and a paged attention backend.

vLLM finds the platform through the ``vllm.platform_plugins`` entry point (``pyproject.toml``):
``tpu = torchtpu.integrations.vllm:activate``. vLLM calls it in every process that resolves
its platform; it returns the platform class's name when ``VLLM_PLATFORM=tpu`` (or, unset, when
``tpu`` is the accelerator and CUDA is not there). The platform is ``PlatformEnum.OOT``, never
``PlatformEnum.TPU``: vLLM's own TPU path loads a different, JAX-only stack.

Nothing here imports vLLM at torchtpu's import time.
"""

from __future__ import annotations

from torchtpu.integrations import check_version, serving_on_tpu

# The vLLM releases this integration was written and tested against; the worker and model
# runner subclass vLLM's GPU classes, whose internals change between minor releases.
TESTED_VLLM = ((0, 33, 0), (0, 34, 0))  # [low, high)
PLATFORM_CLASS = "torchtpu.integrations.vllm.platform.TpuPlatform"


def check_vllm_version(installed: str | None = None) -> str:
    """The installed vllm version (or ``installed``); raise if it is outside the tested range."""
    return check_version("vllm", TESTED_VLLM, installed)


def activate() -> str | None:
    """Entry point of ``vllm.platform_plugins``: the platform class's name, or None to decline."""
    if not serving_on_tpu("VLLM_PLATFORM"):
        return None
    check_vllm_version()
    return PLATFORM_CLASS
