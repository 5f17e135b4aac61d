"""``TpuWorker``: vLLM's GPU worker on one ``tpu`` device, with the KV cache sized for it.

vLLM's GPU worker measures free memory with CUDA's allocator around a profiling forward; on
tpu the profiling forward still runs (it also compiles the largest batch shape), and the KV
cache gets ``--kv-cache-memory-bytes`` when given, else ``--gpu-memory-utilization`` of the
device less what is in use. On XLA:CPU (host memory shared with the whole machine) the
default is :data:`HOST_DEFAULT_KV_CACHE_BYTES`.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from contextlib import nullcontext

import torch
from vllm.config import CUDAGraphMode, set_current_vllm_config
from vllm.platforms import current_platform
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm.v1.worker.worker_base import CompilationTimes
from vllm.v1.worker.workspace import init_workspace_manager

from torchtpu.integrations import host_backed, join_ranks, memory_info, serving_process_defaults
from torchtpu.integrations.vllm import quantization  # noqa: F401  (registers tpu_int8 where the model loads)
from torchtpu.integrations.vllm.model_runner import TpuModelRunner

logger = logging.getLogger(__name__)

# XLA:CPU's memory is the host's, shared with every other process: a modest default. (A step's
# cache write costs its tokens, not the cache: the eager in-place write donates the buffer.)
HOST_DEFAULT_KV_CACHE_BYTES = 64 * 2**20

# Decode batches of up to this many requests are compiled at start-up (``compile_or_warm_up_model``).
DECODE_WARMUP_MAX = 16


class TpuWorker(Worker):
    """vLLM worker for one ``tpu`` device."""

    def init_device(self) -> None:
        """Join the other ranks (tensor parallel), bind tpu:local_rank, set up vLLM's groups,
        build the model runner."""
        parallel = self.parallel_config
        if parallel.world_size > 1:
            join_ranks(rank=self.rank, world_size=parallel.world_size, local_rank=self.local_rank,
                       nnodes=getattr(parallel, "nnodes", 1) or 1)
        self.device = torch.device(f"tpu:{self.local_rank}")
        torch.tpu.set_device(self.device)
        serving_process_defaults()
        current_platform.check_if_supports_dtype(self.model_config.dtype)
        init_worker_distributed_environment(
            self.vllm_config, self.rank, self.distributed_init_method, self.local_rank,
            current_platform.dist_backend,
        )
        set_random_seed(self.model_config.seed)
        gc.collect()
        init_workspace_manager(self.device, 1)
        self.model_runner = TpuModelRunner(self.vllm_config, self.device)

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.load_model(load_dummy_weights=load_dummy_weights)

    @torch.inference_mode()
    def determine_available_memory(self) -> int:
        """Bytes for the KV cache, after one profiling forward at the largest batch."""
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.profile_run()
        torch.tpu.synchronize()
        if self.cache_config.kv_cache_memory_bytes:
            return self.cache_config.kv_cache_memory_bytes
        index = self.device.index or 0
        if host_backed():
            logger.info("tpu is XLA:CPU (host memory): KV cache capped at %d MiB; set "
                        "--kv-cache-memory-bytes to change it.", HOST_DEFAULT_KV_CACHE_BYTES >> 20)
            return HOST_DEFAULT_KV_CACHE_BYTES
        free, total = memory_info(index)
        available = int(total * self.cache_config.gpu_memory_utilization) - (total - free)
        if available <= 0:
            raise RuntimeError(
                f"tpu: no memory left for the KV cache ({(total - free) / 2**30:.2f} GiB of "
                f"{total / 2**30:.2f} GiB in use); raise --gpu-memory-utilization or set "
                "--kv-cache-memory-bytes."
            )
        return available

    def compile_or_warm_up_model(self) -> CompilationTimes:
        """Run (and so compile) whole engine steps of 1 to ``DECODE_WARMUP_MAX`` requests (and of
        the largest batch), then the sampler once.

        The GPU worker's version warms Triton kernels and captures CUDA graphs for its batch
        sizes; tpu has neither, and XLA compiles each new shape on first use: the forward is
        padded to token buckets, but a step's input preparation (vLLM copies ``[:num_reqs]`` of
        its host buffers), logits and sampling follow its number of requests, and a step with a
        number not seen before traced and compiled (or loaded) 20-30 programs, 0.4-1 s, while
        its running decodes waited. So each request count runs as requests do, through the
        runner's ``execute_model`` and ``sample_tokens``: ``n`` one-token requests are added
        (a prefill step), decode one token (a decode step) and finish. They write the reserved
        null block only; no request is left behind. With a KV connector other than torchtpu's
        (whose empty per-step metadata is not known here), a pooling model (no sampler) or
        pipeline parallelism (a step's result is another stage's input), the forward, logits and
        greedy pick of each decode batch are warmed instead (``_dummy_run``), not the input
        preparation.
        """
        max_num_reqs = min(self.scheduler_config.max_num_seqs,
                           self.scheduler_config.max_num_batched_tokens)
        counts = sorted({*range(1, min(max_num_reqs, DECODE_WARMUP_MAX) + 1), max_num_reqs})
        runner = self.model_runner
        metadata = _empty_connector_metadata()
        if runner.is_pooling_model or self.parallel_config.pipeline_parallel_size > 1:
            metadata = False
        for num_reqs in counts:
            if metadata is not False:
                _warm_steps(runner, num_reqs, metadata)
            else:
                _, last_hidden = runner._dummy_run(num_tokens=num_reqs, uniform_decode=True, skip_eplb=True,
                                                   cudagraph_runtime_mode=CUDAGraphMode.NONE)
                runner.model.compute_logits(last_hidden).argmax(dim=-1).cpu()  # the greedy sampler's pick
        _, last_hidden = runner._dummy_run(num_tokens=counts[-1], uniform_decode=True, skip_eplb=True,
                                           cudagraph_runtime_mode=CUDAGraphMode.NONE)
        runner._dummy_sampler_run(hidden_states=last_hidden)
        set_random_seed(self.model_config.seed)
        return CompilationTimes(language_model=self.compilation_config.compilation_time,
                                encoder=self.compilation_config.encoder_compilation_time)

    def _maybe_get_memory_pool_context(self, tag: str):
        return nullcontext()  # no CuMem pools: XLA owns tpu memory

    def sleep(self, level: int = 1) -> None:
        raise NotImplementedError("tpu: sleep mode is not supported by torchtpu's vLLM worker.")


def _empty_connector_metadata():
    """The per-step KV connector metadata of a step that moves nothing: None without a
    connector, torchtpu's connector's empty metadata, or False (another connector's, not known)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    from torchtpu.integrations.vllm.kv_connector import TpuTcpConnector, TpuTcpConnectorMetadata

    if isinstance(get_kv_transfer_group(), TpuTcpConnector):
        return TpuTcpConnectorMetadata()
    logger.info("tpu: warming decode batches without vLLM's input preparation: the KV connector %s's "
                "empty step metadata is not known to torchtpu", type(get_kv_transfer_group()).__name__)
    return False


def _warm_steps(runner, num_reqs: int, metadata) -> None:
    """Run ``num_reqs`` one-token requests through the runner: a prefill step, a decode step, and
    the step that finishes them (module docstring of ``compile_or_warm_up_model``)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    ids = [f"torchtpu-warm-up-{num_reqs}-{i}" for i in range(num_reqs)]
    null_block = ([0],) * len(runner.kv_cache_config.kv_cache_groups)  # vLLM's reserved null block
    params = SamplingParams(temperature=0.0, max_tokens=2)
    one_each = {r: 1 for r in ids}

    def step(**fields) -> None:
        output = dataclasses.replace(SchedulerOutput.make_empty(), kv_connector_metadata=metadata, **fields)
        if runner.execute_model(output) is None:
            result = runner.sample_tokens(None)
            get_output = getattr(result, "get_output", None)  # async scheduling: wait for the tokens
            if get_output is not None:
                get_output()

    step(scheduled_new_reqs=[NewRequestData(req_id=r, prompt_token_ids=[0], mm_features=[], sampling_params=params,
                                            pooling_params=None, block_ids=null_block, num_computed_tokens=0,
                                            lora_request=None) for r in ids],
         num_scheduled_tokens=one_each, total_num_scheduled_tokens=num_reqs)
    step(scheduled_cached_reqs=CachedRequestData(req_ids=ids, resumed_req_ids=set(), new_token_ids=[[] for _ in ids],
                                                 all_token_ids={}, new_block_ids=[None] * num_reqs,
                                                 num_computed_tokens=[1] * num_reqs,
                                                 num_output_tokens=[1] * num_reqs),
         num_scheduled_tokens=one_each, total_num_scheduled_tokens=num_reqs)
    step(finished_req_ids=set(ids))
