"""``TpuSRTPlatform``: what SGLang asks of a device, answered for ``tpu``.

No Triton: SGLang then takes its torch-native allocator and request-to-token writers, and fused
layers (RMSNorm, rotary, SiLU-and-mul) their ``forward_native`` bodies, which run as ordinary
torch ops on tpu tensors. Attention is :mod:`.attention`; the KV pool is :mod:`.kv_pool`; decode
runs through :mod:`.graph_runner` (compiled, padded to SGLang's capture sizes) where CUDA would
replay CUDA graphs: by default, and eager with ``--disable-cuda-graph``.
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform

from torchtpu.integrations import DIST_BACKEND, choose_rank_coordinator, host_backed, memory_info
from torchtpu.integrations.int8 import NAME as INT8_NAME
from torchtpu.integrations.sglang.names import BACKEND_NAME

# SGLang parses its command line before it loads plugins (where `register` adds the method
# itself), so `--quantization tpu_int8` must be a choice as soon as the platform is resolved.
from sglang.srt.arg_groups.choices import QUANTIZATION_CHOICES  # noqa: E402  (a plain list)

if INT8_NAME not in QUANTIZATION_CHOICES:
    QUANTIZATION_CHOICES.append(INT8_NAME)

logger = logging.getLogger(__name__)

# On XLA:CPU the KV pool is carved from host memory that the rest of the machine shares;
# SGLang's GPU rule (most of the free memory) would take the host. Without an explicit
# --max-total-tokens the pool gets this many tokens there.
HOST_DEFAULT_MAX_TOTAL_TOKENS = 65536

# Server options that cannot work on tpu yet: (is it set?, why not). Refused when the server
# starts rather than failing deep inside SGLang (or, for the seed, being silently ignored).
UNSUPPORTED_OPTIONS = (
    (lambda args: args.enable_deterministic_inference,
     "--enable-deterministic-inference (which is also what makes SGLang honour a request's "
     "`seed`) is not supported on tpu: SGLang's seeded sampler hashes with a Triton kernel "
     "(or sgl_kernel's CPU op) and its batch-invariant mode replaces matmuls with Triton "
     "kernels; neither runs on tpu. Without it, `seed` is accepted and ignored, as on any "
     "SGLang device without that flag."),
    (lambda args: args.pp_size > 1 or args.dp_size > 1,
     "--pp and --dp above 1 (pipeline and data parallelism) are not supported on tpu yet: the "
     "decode graph runner does not pass pipeline stages' tensors, and data-parallel replicas "
     "would each need their own jax.distributed launch. Tensor parallelism (--tp) is supported."),
)


def refuse_unsupported_options(server_args) -> None:
    """Raise NotImplementedError naming the first option set that tpu cannot serve with."""
    for is_set, reason in UNSUPPORTED_OPTIONS:
        if is_set(server_args):
            raise NotImplementedError(reason)


class TpuSRTPlatform(SRTPlatform):
    """SGLang platform for torchtpu's ``tpu`` device (TPU, GPU or CPU through XLA)."""

    _enum = PlatformEnum.OOT
    device_name = "tpu"
    device_type = "tpu"
    # No Triton. "Graph capture" is the decode graph runner, which SGLang builds where CUDA
    # graphs would be (by default; --disable-cuda-graph keeps decode eager).
    capabilities = PlatformCapabilities(graph_capture=True)

    # ---- device
    def get_device(self, device_id: int | None = None) -> str:
        return "tpu" if device_id is None else f"tpu:{device_id}"

    def set_device(self, device: torch.device) -> None:
        torch.tpu.set_device(device)

    def get_device_name(self, device_id: int = 0) -> str:
        return torch.tpu.get_device_name(device_id)

    def get_device_uuid(self, device_id: int = 0) -> str:
        return f"tpu:{device_id}"

    def get_device_capability(self, device_id: int = 0):
        return None

    def empty_cache(self) -> None:
        torch.tpu.empty_cache()

    def synchronize(self) -> None:
        torch.tpu.synchronize()

    # ---- memory: SGLang sizes the KV pool from total - usage
    def get_available_memory(self, device_id: int = 0) -> tuple[int, int]:
        return memory_info(device_id)

    def get_device_total_memory(self, device_id: int = 0) -> int:
        return self.get_available_memory(device_id)[1]

    def get_current_memory_usage(self, device: torch.device | None = None) -> float:
        index = torch.tpu.current_device() if device is None or torch.device(device).index is None else torch.device(device).index
        free, total = self.get_available_memory(index)
        return float(total - free)

    # ---- SGLang subsystems
    def get_default_attention_backend(self) -> str:
        return BACKEND_NAME

    def get_kv_pool_cls(self, *, kind: str):
        if kind != "mha":
            # SGLang asks for every kind while configuring; models that use MLA/DSA pools are
            # refused by the attention backend, which supports multi-head/grouped-query only.
            return None
        from torchtpu.integrations.sglang.kv_pool import TpuMHATokenToKVPool

        return TpuMHATokenToKVPool

    def get_graph_runner_cls(self):
        from torchtpu.integrations.sglang.graph_runner import TpuGraphRunner

        return TpuGraphRunner

    def get_compile_backend(self, mode: str | None = None) -> str:
        return "tpu"

    def get_dispatch_key_name(self) -> str:
        return "native"

    def get_torch_distributed_backend_str(self) -> str:
        # Metadata on the host through gloo; activations (tensor-parallel all-reduces and
        # gathers) through torchtpu's tpu backend, as XLA collectives across the ranks' devices.
        return DIST_BACKEND

    def get_group_coordinator_device(self, local_rank: int) -> torch.device:
        return torch.device(f"tpu:{local_rank}")

    def apply_server_args_defaults(self, server_args) -> None:
        """Defaults SGLang's GPU rules would get wrong on tpu (graph capture, host memory)."""
        refuse_unsupported_options(server_args)
        if server_args.tp_size * server_args.pp_size > 1:
            choose_rank_coordinator()  # before SGLang starts the rank processes, which inherit it
        # Overlap scheduling runs the scheduler on a second CUDA stream; XLA already dispatches
        # asynchronously, on one stream.
        server_args.disable_overlap_schedule = True
        if server_args.max_total_tokens is None and host_backed():
            server_args.max_total_tokens = HOST_DEFAULT_MAX_TOTAL_TOKENS
            logger.info(
                "tpu is XLA:CPU (host memory): KV pool capped at %d tokens; "
                "set --max-total-tokens to change it.", HOST_DEFAULT_MAX_TOTAL_TOKENS,
            )

    def get_torch_profiler_activity_str(self) -> str:
        return "CPU"

    def get_torch_profiler_activity(self) -> torch.profiler.ProfilerActivity:
        return torch.profiler.ProfilerActivity.CPU
