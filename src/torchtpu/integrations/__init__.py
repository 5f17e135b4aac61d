"""Integrations with libraries that drive PyTorch models (serving engines, trainers).

Each lives in its own module or package and imports its library only when used, so importing
torchtpu never pulls them in.
"""

from __future__ import annotations

import os
import re


def release(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string: '0.5.23', '0.33.0rc1', '0.5.23.post1', '0.33.0+cpu'."""
    return tuple(int(n) for n in re.findall(r"\d+", version.split("+")[0])[:3])


def check_version(package: str, tested: tuple, installed: str | None = None) -> str:
    """``package``'s installed version (or ``installed``); raise if it is outside ``tested``
    ([low, high) release tuples): an engine's plugin interface changes between minor releases,
    so an untested one is refused rather than left half-working."""
    from importlib.metadata import version

    installed = installed or version(package)
    low, high = tested
    if not low <= release(installed) < high:
        name = {"sglang": "SGLang", "vllm": "vLLM"}.get(package, package)
        raise RuntimeError(
            f"torchtpu's {name} platform supports {package}>={'.'.join(map(str, low))},"
            f"<{'.'.join(map(str, high))}, but {package} {installed} is installed. "
            f"Install a supported release (pip install -e '.[{package}]' or tools/{package}_env.sh)."
        )
    return installed


# Eager kernels a server keeps per op (see ``serving_process_defaults``).
SERVER_KERNEL_CACHE_SIZE = 8192


def serving_process_defaults() -> None:
    """Settings for an engine's model process, where the user has not set them.

    A server runs its scheduler's bookkeeping (a batch filtered from 32 requests to 27, a
    sampling-parameter column gathered, a prompt's slots written) as eager ops whose shapes
    follow every batch composition, so one op meets thousands of shapes over a run. Each is
    compiled once; with the default 1024 programs per op the hot ones are evicted and compiled
    again (measured, SGLang at concurrency 32: 355 to 553 tok/s from pass to pass with 1024,
    582 steady with a higher limit). Servers keep ``SERVER_KERNEL_CACHE_SIZE`` programs per op
    unless ``TORCHTPU_KERNEL_CACHE_SIZE`` is set.
    """
    from torchtpu.config import config

    if "TORCHTPU_KERNEL_CACHE_SIZE" not in os.environ and 0 < config.kernel_cache_size < SERVER_KERNEL_CACHE_SIZE:
        config.kernel_cache_size = SERVER_KERNEL_CACHE_SIZE


def serving_on_tpu(variable: str) -> bool:
    """Whether an engine's process should serve on tpu: asked for by name in ``variable``
    (``SGLANG_PLATFORM=tpu``), or, unset, tpu is the accelerator and CUDA is absent (auto-selection
    must not take a CUDA machine away from the engine's own CUDA platform)."""
    if os.environ.get(variable):
        return os.environ[variable] == "tpu"
    import torch

    accelerator = torch.accelerator.current_accelerator()
    return accelerator is not None and accelerator.type == "tpu" and not torch.cuda.is_available()
