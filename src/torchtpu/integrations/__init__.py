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


def host_backed() -> bool:
    """Whether this process's tpu device is XLA:CPU, whose memory is the host's."""
    import torch

    return torch.tpu.get_device_name().startswith("XLA:CPU")


def memory_info(device_id: int) -> tuple[int, int]:
    """(free, total) bytes of ``tpu:device_id`` for an engine sizing its KV cache; on XLA:CPU free
    is also bounded by the host's available memory (XLA:CPU counts only tpu tensors, and the
    other processes use the host too)."""
    import psutil
    import torch

    free, total = torch.tpu.mem_get_info(device_id)
    if host_backed():
        free = min(free, psutil.virtual_memory().available)
    return free, total


def serving_on_tpu(variable: str) -> bool:
    """Whether an engine's process should serve on tpu: asked for by name in ``variable``
    (``SGLANG_PLATFORM=tpu``), or, unset, tpu is the accelerator and CUDA is absent (auto-selection
    must not take a CUDA machine away from the engine's own CUDA platform)."""
    if os.environ.get(variable):
        return os.environ[variable] == "tpu"
    import torch

    accelerator = torch.accelerator.current_accelerator()
    return accelerator is not None and accelerator.type == "tpu" and not torch.cuda.is_available()


# ---------------------------------------------------------------- tensor-parallel rank processes

COORDINATOR_VARIABLE = "TORCHTPU_COORDINATOR"
_chosen_coordinator: str | None = None  # the value this process last put in COORDINATOR_VARIABLE


def choose_rank_coordinator() -> str:
    """In the process that starts an engine's rank processes, before it starts them: the
    ``jax.distributed`` coordinator (``host:port``) that they will share, passed to them in
    ``TORCHTPU_COORDINATOR``.

    Engines start one process per tensor-parallel rank with the ranks as arguments (not
    torchrun's variables); each joins the others' devices through ``jax.distributed``, whose
    coordinator rank 0 serves. A value the user set is kept; otherwise a free port of this host
    is chosen for each engine started (one host: for several, set the variable to rank 0's
    ``host:port``).
    """
    global _chosen_coordinator
    from torchtpu.runtime.multiprocess import free_port

    current = os.environ.get(COORDINATOR_VARIABLE, "")
    if current and current != _chosen_coordinator:
        return current
    _chosen_coordinator = f"127.0.0.1:{free_port()}"
    os.environ[COORDINATOR_VARIABLE] = _chosen_coordinator
    return _chosen_coordinator


def join_ranks(rank: int, world_size: int, local_rank: int, nnodes: int = 1) -> None:
    """In an engine's rank process, before its first tpu op: become rank ``rank`` of
    ``world_size`` (spread evenly over ``nnodes`` hosts) owning ``tpu:local_rank``, so that the
    ``tpu`` process group (``"tpu"`` in the engine's ``torch.distributed`` backend) runs its
    collectives as XLA programs across the ranks' devices."""
    coordinator = os.environ.get(COORDINATOR_VARIABLE, "")
    if not coordinator:
        raise RuntimeError(
            f"tpu: rank {rank} of {world_size} has no jax.distributed coordinator: the engine's launching "
            f"process did not choose one. Set {COORDINATOR_VARIABLE}=host:port (a free port on the host of "
            f"rank 0) for every rank.")
    from torchtpu.runtime import multiprocess

    multiprocess.declare(rank, world_size, local_rank, world_size // max(1, nnodes), coordinator)


# ``torch.distributed`` backend of the engines' groups: host tensors (the schedulers' metadata)
# through gloo, tpu tensors (activations) through torchtpu's ``tpu`` backend.
DIST_BACKEND = "cpu:gloo,tpu:tpu"
