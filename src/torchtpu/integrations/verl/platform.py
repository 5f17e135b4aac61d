"""VeRL's platform for ``tpu``: what VeRL asks of a device through ``verl.plugin.platform``.

Importing this module registers ``PlatformTPU`` under the name ``tpu`` with VeRL's
``PlatformRegistry`` (VeRL imports it through the ``verl.plugins`` entry point when ``verl`` is
imported). ``VERL_PLATFORM=tpu`` selects it; unset, VeRL's auto-detection picks it where ``tpu``
is the accelerator and CUDA is absent (VeRL asks its CUDA platform first).

What VeRL then sees: device ``tpu`` (``torch.tpu``), the ``tpu_dist`` c10d backend for its
process groups (FSDP2's collectives run as XLA programs across the workers' devices), Ray's
``TPU`` resource for its workers and rollout replicas, Ray's ``TPU_VISIBLE_CHIPS`` as the
visible-devices variable, no CUDA IPC (weights reach the rollout through a checkpoint engine,
never through shared device memory).

It also puts a loader under ``vllm`` in VeRL's ``RolloutReplicaRegistry`` (``vllm_replica_class``):
on ``tpu``, VeRL's vLLM server with its one call that vLLM 0.33 changed adapted
(``vllm_rollout.py``); elsewhere VeRL's own.
"""

from __future__ import annotations

import logging
import math
import os
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry, get_platform

from torchtpu.integrations.verl.names import (
    COMMUNICATION_BACKEND,
    DEVICE,
    PLATFORM_NAME,
    RAY_RESOURCE,
    VISIBLE_DEVICES_VARIABLE,
)

logger = logging.getLogger(__name__)


class _TpuDeviceModule(ModuleType):
    """``torch.tpu`` as VeRL's ``get_torch_device()`` uses it, plus ``max_memory_reserved`` (the
    peak of ``memory_stats()["reserved_bytes.all.peak"]``, as ``torch.cuda`` has it; VeRL's
    workers log it after every forward), which this torchtpu's ``torch.tpu`` does not have yet.
    Everything else is ``torch.tpu``'s own."""

    def __init__(self):
        super().__init__("torch.tpu")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.tpu, name)

    @staticmethod
    def max_memory_reserved(device: Any = None) -> int:
        return torch.tpu.memory_stats(device)["reserved_bytes.all.peak"]


_DEVICE_MODULE = _TpuDeviceModule()


@PlatformRegistry.register(platform=PLATFORM_NAME)
class PlatformTPU(PlatformBase):
    """torchtpu's ``tpu`` device (TPU, GPU or CPU through XLA) as a VeRL platform."""

    @property
    def device_name(self) -> str:
        return DEVICE

    @property
    def vendor_name(self) -> str:
        return "google"

    @property
    def device_module(self) -> ModuleType:
        if hasattr(torch.tpu, "max_memory_reserved"):
            return torch.tpu
        return _DEVICE_MODULE

    def is_available(self) -> bool:
        return torch.tpu.is_available()

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        """Whether VeRL should pick ``tpu`` by itself: torchtpu's device is the accelerator and
        CUDA is absent. Asks nothing of the device runtime (Ray's CPU-only driver stays free of it)."""
        accelerator = torch.accelerator.current_accelerator()
        return accelerator is not None and accelerator.type == DEVICE and not torch.cuda.is_available()

    def current_device(self) -> int:
        return torch.tpu.current_device()

    def device_count(self) -> int:
        return torch.tpu.device_count()

    def set_device(self, device_index: int) -> None:
        torch.tpu.set_device(device_index)

    def synchronize(self, device_index: int | None = None) -> None:
        torch.tpu.synchronize(device_index)

    def manual_seed(self, seed: int) -> None:
        torch.tpu.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.tpu.manual_seed_all(seed)

    def set_allocator_settings(self, settings: str) -> None:
        """XLA's allocator has no PyTorch caching-allocator settings (``expandable_segments``):
        there is nothing to configure, as on VeRL's platforms whose allocator lacks them."""

    def empty_cache(self) -> None:
        torch.tpu.empty_cache()

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        # No CUDA compute capability: VeRL reads (None, None) as "not a CUDA device"
        return None, None

    def communication_backend_name(self) -> str:
        return COMMUNICATION_BACKEND

    def visible_devices_envvar(self) -> str:
        return VISIBLE_DEVICES_VARIABLE

    def ray_resource_name(self) -> str:
        return RAY_RESOURCE

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        """Whole chips: Ray accepts ``TPU`` only in counts of 1, 2, 4 or 8 per actor, while VeRL asks
        for ``1 / max_colocate_count`` of a device per worker. A fraction becomes one chip, so one
        VeRL worker holds each placement-group bundle (as FSDP's fused actor-rollout-ref worker does)."""
        return {"resources": {RAY_RESOURCE: max(1, math.ceil(num_gpus))}}

    def ray_noset_envvars(self) -> list[str]:
        return [f"RAY_EXPERIMENTAL_NOSET_{VISIBLE_DEVICES_VARIABLE}"]

    def is_ipc_supported(self) -> bool:
        return False  # no CUDA IPC handles: weights move through a checkpoint engine

    def rollout_env_vars(self) -> dict[str, str]:
        """The rollout engine's processes serve on tpu (vLLM's and SGLang's tpu platforms)."""
        env = {"VLLM_PLATFORM": DEVICE, "SGLANG_PLATFORM": DEVICE}
        if "TORCHTPU_PLATFORM" in os.environ:
            env["TORCHTPU_PLATFORM"] = os.environ["TORCHTPU_PLATFORM"]
        return env

    @contextmanager
    def nvtx_range(self, msg: str):
        """A named span: in PyTorch's profiler, and in JAX's trace while ``torchtpu.profiler.trace`` runs."""
        with torch.profiler.record_function(msg):
            yield

    def profiler_start(self) -> None:
        """Nothing to start: traces are taken with ``torchtpu.profiler.trace(logdir)`` (JAX's profiler)."""

    def profiler_stop(self) -> None:
        """See ``profiler_start``."""

    def cudart(self) -> Any:
        return None


def vllm_replica_class() -> type:
    """VeRL's ``RolloutReplicaRegistry`` loader for ``rollout.name=vllm``: on the ``tpu`` platform,
    ``vllm_rollout.TpuvLLMReplica`` (VeRL's vLLM replica, its server adapted to vLLM 0.33's
    ``pause_generation``); on any other, VeRL's own ``vLLMReplica``."""
    if isinstance(get_platform(), PlatformTPU):
        from torchtpu.integrations.verl.vllm_rollout import TpuvLLMReplica

        return TpuvLLMReplica
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMReplica

    return vLLMReplica


def _register_rollout() -> None:
    # VeRL swallows an entry point's exception (logged at DEBUG): a failure here is said aloud
    # and leaves the platform registered
    try:
        from verl.workers.rollout.replica import RolloutReplicaRegistry

        RolloutReplicaRegistry.register("vllm", vllm_replica_class)
    except Exception as error:  # noqa: BLE001
        logger.warning("torchtpu: VeRL's vLLM rollout for tpu not registered (%s: %s); "
                       "VeRL's own vLLM server is used", type(error).__name__, error)


_register_rollout()
