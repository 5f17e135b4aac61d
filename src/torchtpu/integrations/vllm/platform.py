"""``TpuPlatform``: what vLLM asks of a device, answered for ``tpu``.

No Triton, no CUDA graphs: fused layers (RMSNorm, rotary, SiLU-and-mul) dispatch to
``forward_oot`` and then their ``forward_native`` bodies, which run as ordinary torch ops on
tpu tensors. The one Triton kernel the model runner needs (the block table's slot mapping)
is replaced by torch ops (:mod:`.kernels`); attention is :mod:`.attention`.

Without ``--enforce-eager`` the forward is compiled in vLLM's ``VLLM_COMPILE`` mode: Dynamo
traces it once, the graph is split at the attention ops (kept opaque, run eagerly), and each
piece goes to :class:`.compiler.TpuCompiler`; the model runner pads the tokens to buckets.
"""

from __future__ import annotations

import logging
import os

import torch
from vllm.platforms.interface import Platform, PlatformEnum

from torchtpu.integrations import DIST_BACKEND, choose_rank_coordinator, memory_info

logger = logging.getLogger(__name__)

ATTENTION_BACKEND = "torchtpu.integrations.vllm.attention.TpuPagedAttentionBackend"
WORKER_CLASS = "torchtpu.integrations.vllm.worker.TpuWorker"
COMPILER_CLASS = "torchtpu.integrations.vllm.compiler.TpuCompiler"
# vLLM's graph-fusion passes match CUDA kernels' custom ops (quantisation, all-reduce, AITER):
# none exists on tpu, and configuring them imports CUDA-only modules.
FUSION_PASSES = ("fuse_norm_quant", "fuse_act_quant", "fuse_allreduce_rms", "fuse_attn_quant",
                 "fuse_act_padding", "fuse_mla_dual_rms_norm", "fuse_rope_kvcache",
                 "fuse_qk_norm_rope_kvcache", "enable_qk_norm_rope_fusion",
                 "fuse_rope_kvcache_cat_mla")


class TpuPlatform(Platform):
    """vLLM platform for torchtpu's ``tpu`` device (TPU, GPU or CPU through XLA)."""

    _enum = PlatformEnum.OOT  # never PlatformEnum.TPU: that selects vLLM's JAX-only stack
    device_name = "tpu"
    device_type = "tpu"
    dispatch_key = "PrivateUse1"
    ray_device_key = ""  # no Ray placement for tpu yet
    device_control_env_var = "TORCHTPU_VISIBLE_DEVICES"
    # Host metadata through gloo; activations (tensor-parallel all-reduces and gathers) through
    # torchtpu's tpu backend, as XLA collectives across the ranks' devices.
    dist_backend = DIST_BACKEND
    simple_compile_backend = "tpu"
    supported_quantization: list[str] = []

    @classmethod
    def pre_register_and_update(cls, parser=None) -> None:
        """Before vLLM parses its arguments: register ``--quantization tpu_int8``."""
        import torchtpu.integrations.vllm.quantization  # noqa: F401  (registers on import)

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
        index = torch.tpu.current_device() if device is None or torch.device(device).index is None else torch.device(device).index
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
        return COMPILER_CLASS  # what VLLM_COMPILE hands each piece of the forward to

    @classmethod
    def opaque_attention_op(cls) -> bool:
        # Attention must stay one opaque op in the Dynamo graph: inlined (vLLM's default for
        # out-of-tree platforms), it reads the step's metadata from the forward context while
        # Dynamo traces, and vLLM keeps that one trace (no guards) for every later step.
        return True

    @classmethod
    def get_punica_wrapper(cls) -> str:
        raise NotImplementedError("tpu: LoRA is not supported by torchtpu's vLLM platform yet.")

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        # torch.distributed on the device group (the tpu backend); traced by Dynamo into
        # functional collectives, which the tpu compiler lowers into the step's program.
        return "vllm.distributed.device_communicators.base_device_communicator.DeviceCommunicatorBase"

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return False

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        """Pick the tpu worker; turn off what needs CUDA (graphs, async scheduling); set up TP ranks."""
        from torchtpu.integrations.vllm import check_vllm_version

        check_vllm_version()
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1 or parallel.data_parallel_size > 1:
            raise NotImplementedError(
                "tpu: pipeline and data parallelism are not supported by torchtpu's vLLM platform "
                f"yet (--pipeline-parallel-size {parallel.pipeline_parallel_size}, --data-parallel-size "
                f"{parallel.data_parallel_size}); tensor parallelism is (--tensor-parallel-size)."
            )
        if parallel.world_size > 1:
            # The workers join jax.distributed before their first tpu op: started fresh (a forked
            # child cannot use a runtime its parent started), with a coordinator chosen here.
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
            choose_rank_coordinator()
        if parallel.worker_cls == "auto":
            parallel.worker_cls = WORKER_CLASS
        # The GPU runner's async scheduling overlaps steps with CUDA streams and events.
        vllm_config.scheduler_config.async_scheduling = False
        cls._configure_compilation(vllm_config.compilation_config)
        if vllm_config.lora_config is not None:
            raise NotImplementedError("tpu: LoRA is not supported by torchtpu's vLLM platform yet.")

    @classmethod
    def _configure_compilation(cls, compilation) -> None:
        """No CUDA graphs; VLLM_COMPILE's pieces go to the tpu backend; other modes refused."""
        from vllm.config import CompilationMode, CUDAGraphMode

        compilation.cudagraph_mode = CUDAGraphMode.NONE
        # The model runner pads each step's tokens to a bucket instead (see model_runner.py).
        compilation.cudagraph_capture_sizes = []
        for name in FUSION_PASSES:
            setattr(compilation.pass_config, name, False)
        if compilation.compile_sizes is None:
            compilation.compile_sizes = []  # one piecewise program set for every bucket
        # vLLM's "mega" AOT artifact bundles Inductor's compiled pieces and cannot reload ours
        # (every restart warned and traced again); its plain AOT artifact reloads the traced
        # graph and hands the pieces to TpuCompiler again (torch.compile: 4.1 s -> 1.1 s on a
        # restart of the tiny Llama). An environment default, as vLLM's CPU platform sets its own.
        os.environ.setdefault("VLLM_USE_MEGA_AOT_ARTIFACT", "0")
        if compilation.mode in (CompilationMode.STOCK_TORCH_COMPILE,
                                CompilationMode.DYNAMO_TRACE_ONCE):
            raise NotImplementedError(
                f"tpu: compilation mode {compilation.mode.name} is not supported by torchtpu's "
                "vLLM platform (the attention op cannot run inside one XLA program); use the "
                "default VLLM_COMPILE mode, or --enforce-eager."
            )
        if compilation.mode == CompilationMode.VLLM_COMPILE and compilation.backend == "inductor":
            raise NotImplementedError(
                "tpu: Inductor cannot compile for tpu; leave the compilation backend unset "
                "(torchtpu's tpu backend) or set it to 'eager'."
            )
