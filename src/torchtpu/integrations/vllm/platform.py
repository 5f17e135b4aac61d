"""``TpuPlatform``: what vLLM asks of a device, answered for ``tpu``.

No Triton, no CUDA graphs: fused layers (RMSNorm, rotary, SiLU-and-mul) dispatch to
``forward_oot`` and then their ``forward_native`` bodies, which run as ordinary torch ops on
tpu tensors. The one Triton kernel the model runner needs (the block table's slot mapping)
is replaced by torch ops (:mod:`.kernels`); attention is :mod:`.attention`.
"""

from __future__ import annotations

import logging

import psutil
import torch
from vllm.platforms.interface import Platform, PlatformEnum

logger = logging.getLogger(__name__)

ATTENTION_BACKEND = "torchtpu.integrations.vllm.attention.TpuPagedAttentionBackend"
WORKER_CLASS = "torchtpu.integrations.vllm.worker.TpuWorker"


def host_backed(device_id: int = 0) -> bool:
    """Whether the tpu device is XLA:CPU, whose memory is the host's."""
    return torch.tpu.get_device_name(device_id).startswith("XLA:CPU")


def memory_info(device_id: int = 0) -> tuple[int, int]:
    """(free, total) bytes of a tpu device; on XLA:CPU, free is also bounded by the host's."""
    free, total = torch.tpu.mem_get_info(device_id)
    if host_backed(device_id):
        # XLA:CPU's free figure counts only tpu tensors; other processes use the host too.
        free = min(free, psutil.virtual_memory().available)
    return free, total


class TpuPlatform(Platform):
    """vLLM platform for torchtpu's ``tpu`` device (TPU, GPU or CPU through XLA)."""

    _enum = PlatformEnum.OOT  # never PlatformEnum.TPU: that selects vLLM's JAX-only stack
    device_name = "tpu"
    device_type = "tpu"
    dispatch_key = "PrivateUse1"
    ray_device_key = ""  # no Ray placement for tpu yet
    device_control_env_var = "TORCHTPU_VISIBLE_DEVICES"
    # vLLM's group coordinators also keep a CPU group; one device needs no collectives.
    dist_backend = "gloo"
    simple_compile_backend = "tpu"
    supported_quantization: list[str] = []

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        if attn_selector_config.use_mla or attn_selector_config.use_sparse:
            raise NotImplementedError(
                "tpu: MLA and sparse attention are not supported by torchtpu's vLLM "
                "attention backend (multi-head and grouped-query attention only)."
            )
        if selected_backend is not None:
            logger.warning("tpu: attention backend %s ignored; using torchtpu's paged "
                           "attention.", selected_backend)
        return ATTENTION_BACKEND

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return torch.tpu.get_device_name(device_id)

    @classmethod
    def get_device_uuid(cls, device_id: int = 0) -> str:
        return f"tpu:{device_id}"

    @classmethod
    def get_device_capability(cls, device_id: int = 0):
        return None

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return memory_info(device_id)[1]

    @classmethod
    def get_current_memory_usage(cls, device: torch.device | None = None) -> float:
        index = 0 if device is None or torch.device(device).index is None else torch.device(device).index
        free, total = memory_info(index)
        return float(total - free)

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        torch.tpu.set_device(device)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.tpu.manual_seed_all(seed)

    @classmethod
    def check_if_supports_dtype(cls, dtype: torch.dtype) -> None:
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"tpu: model dtype {dtype} is not supported; use float32, "
                             "bfloat16 or float16 (--dtype).")

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False  # host → tpu copies go through jax.device_put, not pinned pages

    @classmethod
    def import_kernels(cls) -> None:
        pass  # no vllm._C: every op is a torch op on tpu

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        from torchtpu.integrations.vllm.kernels import register

        register()

    @classmethod
    def get_compile_backend(cls) -> str:
        return "tpu"

    @classmethod
    def get_punica_wrapper(cls) -> str:
        raise NotImplementedError("tpu: LoRA is not supported by torchtpu's vLLM platform yet.")

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return "vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator"

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return False

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        """Pick the tpu worker; turn off what needs CUDA (graphs, async scheduling, TP > 1)."""
        from vllm.config import CompilationMode, CUDAGraphMode

        from torchtpu.integrations.vllm import check_vllm_version

        check_vllm_version()
        parallel = vllm_config.parallel_config
        if parallel.world_size > 1:
            raise NotImplementedError(
                "tpu: tensor/pipeline parallelism is not supported by torchtpu's vLLM platform "
                f"yet (world size {parallel.world_size}); use --tensor-parallel-size 1."
            )
        if parallel.worker_cls == "auto":
            parallel.worker_cls = WORKER_CLASS
        # The GPU runner's async scheduling overlaps steps with CUDA streams and events.
        vllm_config.scheduler_config.async_scheduling = False
        compilation = vllm_config.compilation_config
        compilation.cudagraph_mode = CUDAGraphMode.NONE
        compilation.cudagraph_capture_sizes = []
        if compilation.mode != CompilationMode.NONE:
            # Every compiled path tried gives tokens that differ from Hugging Face's: one trace
            # of the forward with the tpu backend (6x faster), and vLLM's piecewise pipeline
            # (attention and KV writes split out, run eagerly) with the tpu backend or with
            # vLLM's own "eager" one. So the fault is upstream of the compiler (the Dynamo-traced
            # forward on tpu, or the split-out ops called through torch.ops). Eager until found.
            logger.warning("tpu: torch.compile of the model forward is not supported yet; "
                           "running eagerly (as with --enforce-eager).")
            compilation.mode = CompilationMode.NONE
        if vllm_config.lora_config is not None:
            raise NotImplementedError("tpu: LoRA is not supported by torchtpu's vLLM platform yet.")
