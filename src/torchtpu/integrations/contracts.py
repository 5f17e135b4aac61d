"""What torchtpu's engine integrations rely on inside vLLM and SGLang: one list per engine.

The vLLM worker and model runner subclass vLLM's GPU classes and override private methods; the
SGLang allocator and KV pool subclass SGLang's and replace private methods; both platforms
override hooks of the engines' platform interfaces and read engine objects' attributes. None of
that is a public API: an engine release may rename a method (then torchtpu's override is
silently never called) or change its parameters (then it fails mid-request). Each entry below
names one such member, with the parameter names torchtpu's code expects, and
``tests/test_engine_contracts.py`` checks every entry against the installed (pinned) release,
in the engine's venv (``tools/integration_tests.sh``): an upgrade fails there, at import.

Entries:

- ``Member(owner, name, params)``: ``owner`` is ``"module:Qualname"`` (a class) or ``"module"``;
  ``name`` its attribute (``None``: the owner itself, called). ``params``: the parameter names,
  in order, without ``self``/``cls``, ``*args``/``**kwargs`` written so: the signature must
  be exactly that. ``params=None`` with ``accepts``: the names torchtpu passes must be
  parameters (others may be added). Neither: an attribute that must exist (a class attribute, a
  dataclass or struct field, or one that a method of the class or of an engine base class assigns
  to ``self``).
- ``SUBCLASSES``: each torchtpu class that subclasses an engine class, with the names it defines
  that are its own (not overrides). Every other name it defines must be in the contract for its
  base, so a new override cannot be added without listing it here.

This module imports no engine.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from typing import Any


@dataclasses.dataclass(frozen=True)
class Member:
    owner: str
    name: str | None = None
    params: tuple[str, ...] | None = None
    accepts: tuple[str, ...] = ()
    why: str = ""

    @property
    def id(self) -> str:
        return self.owner + ("" if self.name is None else f".{self.name}")


def _methods(owner: str, why: str, **signatures: tuple[str, ...]) -> list[Member]:
    return [Member(owner, name, params, why=why) for name, params in signatures.items()]


def _attributes(owner: str, why: str, *names: str) -> list[Member]:
    return [Member(owner, name, why=why) for name in names]


# ------------------------------------------------------------------------------------ vLLM 0.33

_WORKER = "vllm.v1.worker.gpu_worker:Worker"
_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
_PLATFORM = "vllm.platforms.interface:Platform"
_ATTN = "vllm.v1.attention.backend"
_SCHED_OUT = "vllm.v1.core.sched.output"

VLLM: list[Member] = [
    # TpuWorker (integrations/vllm/worker.py) overrides these of the GPU worker ...
    *_methods(_WORKER, "TpuWorker overrides it",
              init_device=(), load_model=("load_dummy_weights",), determine_available_memory=(),
              compile_or_warm_up_model=(), _maybe_get_memory_pool_context=("tag",), sleep=("level",)),
    # ... and reads these of its own state
    *_attributes(_WORKER, "TpuWorker reads it",
                 "parallel_config", "rank", "local_rank", "device", "model_config", "vllm_config",
                 "distributed_init_method", "cache_config", "scheduler_config", "compilation_config",
                 "model_runner"),
    Member("vllm.v1.worker.gpu_worker", "init_worker_distributed_environment",
           ("vllm_config", "rank", "distributed_init_method", "local_rank", "backend"),
           why="TpuWorker.init_device calls it positionally"),
    Member("vllm.v1.worker.workspace", "init_workspace_manager", accepts=("device", "num_ubatches"),
           why="TpuWorker.init_device calls it"),
    Member("vllm.v1.worker.worker_base:CompilationTimes", None, accepts=("language_model", "encoder"),
           why="TpuWorker.compile_or_warm_up_model returns one"),
    Member("vllm.utils.torch_utils", "set_random_seed", accepts=("seed",), why="TpuWorker calls it"),
    Member("vllm.config", "set_current_vllm_config", accepts=("vllm_config",), why="TpuWorker calls it"),
    # TpuModelRunner (integrations/vllm/model_runner.py) overrides these of the GPU model runner ...
    Member(_RUNNER, "__init__", ("vllm_config", "device"), why="TpuModelRunner.__init__ calls it"),
    Member(_RUNNER, "_determine_batch_execution_and_padding", accepts=("num_tokens",),
           why="TpuModelRunner overrides it, passes everything on, and pads the batch descriptor "
               "(second item of the result) to its token bucket"),
    Member("vllm.forward_context:BatchDescriptor", "num_tokens",
           why="TpuModelRunner._determine_batch_execution_and_padding replaces it (a dataclass field)"),
    *_methods(_RUNNER, "TpuModelRunner overrides it",
              initialize_kv_cache_tensors=("kv_cache_config", "kernel_block_sizes", "kv_cache_allocation_context"),
              _init_kv_zero_meta=(), _zero_block_ids=("block_ids",), _sync_device=(),
              _to_list=("sampled_token_ids",)),
    # ... calls these (TpuWorker) ...
    Member(_RUNNER, "_dummy_run", accepts=("num_tokens", "uniform_decode", "skip_eplb", "cudagraph_runtime_mode"),
           why="TpuWorker.compile_or_warm_up_model calls it"),
    Member("vllm.model_executor.models.interfaces_base:VllmModelForTextGeneration", "compute_logits",
           accepts=("hidden_states",), why="TpuWorker.compile_or_warm_up_model calls the loaded model's"),
    Member(_RUNNER, "_dummy_sampler_run", ("hidden_states",), why="TpuWorker.compile_or_warm_up_model calls it"),
    Member(_RUNNER, "profile_run", accepts=(), why="TpuWorker.determine_available_memory calls it"),
    # ... and runs whole steps through the runner in its warm-up (_warm_steps)
    Member(_RUNNER, "execute_model", accepts=("scheduler_output",), why="TpuWorker's warm-up steps call it"),
    Member(_RUNNER, "sample_tokens", ("grammar_output",), why="TpuWorker's warm-up steps call it"),
    Member(_RUNNER, "kv_cache_config", why="TpuWorker's warm-up reads its kv_cache_groups"),
    Member(_RUNNER, "is_pooling_model", why="TpuWorker's warm-up steps sample, so skip pooling models"),
    Member("vllm.config:ParallelConfig", "pipeline_parallel_size", why="TpuWorker's warm-up reads it"),
    Member("vllm.v1.kv_cache_interface:KVCacheConfig", "kv_cache_groups", why="TpuWorker's warm-up reads it"),
    Member(_SCHED_OUT + ":SchedulerOutput", "make_empty", (), why="TpuWorker's warm-up builds its steps from it"),
    Member(_SCHED_OUT + ":SchedulerOutput", None,
           accepts=("scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens",
                    "total_num_scheduled_tokens", "finished_req_ids", "kv_connector_metadata"),
           why="TpuWorker's warm-up sets these fields (dataclasses.replace)"),
    Member(_SCHED_OUT + ":NewRequestData", None,
           accepts=("req_id", "prompt_token_ids", "mm_features", "sampling_params", "pooling_params", "block_ids",
                    "num_computed_tokens", "lora_request"), why="TpuWorker's warm-up builds its requests"),
    Member(_SCHED_OUT + ":CachedRequestData", None,
           accepts=("req_ids", "resumed_req_ids", "new_token_ids", "all_token_ids", "new_block_ids",
                    "num_computed_tokens", "num_output_tokens"), why="TpuWorker's warm-up decodes its requests"),
    Member("vllm.sampling_params:SamplingParams", None, accepts=("temperature", "max_tokens"),
           why="TpuWorker's warm-up requests are greedy"),
    Member("vllm.distributed.kv_transfer", "has_kv_transfer_group", (), why="TpuWorker's warm-up calls it"),
    Member("vllm.distributed.kv_transfer", "get_kv_transfer_group", (), why="TpuWorker's warm-up calls it"),
    Member(_RUNNER, "load_model", accepts=("load_dummy_weights",), why="TpuWorker.load_model calls it"),
    # ... and reads or sets these of its state
    *_attributes(_RUNNER, "TpuModelRunner reads or sets it",
                 "compilation_config", "model_config", "max_num_tokens", "shared_kv_cache_layers",
                 "kv_caches", "cache_config", "device", "model"),
    Member("vllm.v1.worker.utils", "bind_kv_cache", accepts=("kv_caches", "forward_context", "runner_kv_caches",
                                                             "kv_cache_groups"),
           why="TpuModelRunner.initialize_kv_cache_tensors calls it"),
    # TpuPlatform (integrations/vllm/platform.py): the platform interface's hooks it overrides
    *_methods(_PLATFORM, "TpuPlatform overrides it",
              pre_register_and_update=("parser",),
              get_attn_backend_cls=("selected_backend", "attn_selector_config", "num_heads"),
              get_device_name=("device_id",), get_device_uuid=("device_id",),
              get_device_capability=("device_id",), get_device_total_memory=("device_id",),
              get_current_memory_usage=("device",), set_device=("device",), manual_seed_all=("seed",),
              check_if_supports_dtype=("dtype",), inference_mode=(), is_pin_memory_available=(),
              import_kernels=(), register_triton_kernel_overrides=(), get_compile_backend=(),
              opaque_attention_op=(), get_punica_wrapper=(), get_device_communicator_cls=(),
              support_hybrid_kv_cache=(), check_and_update_config=("vllm_config",)),
    *_attributes(_PLATFORM, "TpuPlatform sets it",
                 "_enum", "device_name", "device_type", "dispatch_key", "ray_device_key",
                 "device_control_env_var", "dist_backend", "simple_compile_backend", "supported_quantization"),
    Member("vllm.platforms.interface:PlatformEnum", "OOT", why="TpuPlatform._enum"),
    # TpuCompiler (integrations/vllm/compiler.py)
    Member("vllm.compilation.compiler_interface:CompilerInterface", "compile",
           ("graph", "example_inputs", "compiler_config", "compile_range", "key"), why="TpuCompiler overrides it"),
    Member("vllm.compilation.compiler_interface:CompilerInterface", "name", why="TpuCompiler sets it"),
    # the attention backend (integrations/vllm/attention.py)
    Member(f"{_ATTN}:AttentionImpl", "__init__",
           ("num_heads", "head_size", "scale", "num_kv_heads", "alibi_slopes", "sliding_window",
            "kv_cache_dtype", "logits_soft_cap", "attn_type", "kv_sharing_target_layer_name"),
           why="vLLM builds TpuPagedAttentionImpl with these"),
    Member(f"{_ATTN}:AttentionImpl", "forward",
           ("layer", "query", "key", "value", "kv_cache", "attn_metadata", "output", "output_scale",
            "output_block_scale"), why="TpuPagedAttentionImpl overrides it"),
    # do_kv_cache_update is duck-typed: vLLM calls impl.do_kv_cache_update(layer, key, value,
    # kv_cache, slot_mapping) when the backend says forward_includes_kv_cache_update = False
    Member(f"{_ATTN}:AttentionBackend", "forward_includes_kv_cache_update",
           why="TpuPagedAttentionBackend sets it False: vLLM then calls do_kv_cache_update"),
    Member("vllm.model_executor.layers.attention.attention", "unified_kv_cache_update", accepts=(),
           why="calls impl.do_kv_cache_update (checked by source below)"),
    *_methods(f"{_ATTN}:AttentionMetadataBuilder", "TpuPagedAttentionMetadataBuilder overrides it",
              __init__=("kv_cache_spec", "layer_names", "vllm_config", "device"),
              build=("common_prefix_len", "common_attn_metadata", "fast_build")),
    *_attributes(f"{_ATTN}:CommonAttentionMetadata", "TpuPagedAttentionMetadataBuilder.build reads it",
                 "seq_lens_cpu_upper_bound", "seq_lens", "num_reqs", "query_start_loc_cpu",
                 "block_table_tensor", "max_seq_len", "slot_mapping", "num_actual_tokens"),
    *_methods(f"{_ATTN}:AttentionBackend", "TpuPagedAttentionBackend overrides it",
              get_name=(), get_impl_cls=(), get_builder_cls=(), get_supported_head_sizes=(),
              supports_sliding_window=(), supports_attn_type=("attn_type",), supported_kv_cache_layouts=()),
    *_attributes(f"{_ATTN}:AttentionBackend", "TpuPagedAttentionBackend sets it",
                 "supported_dtypes", "supported_kv_cache_dtypes"),
    Member("vllm.v1.kv_cache_interface:KVCacheLayout", "LBNHC", why="TpuPagedAttentionBackend's layout"),
    # the slot-mapping kernel's replacement (integrations/vllm/kernels.py) takes its launch
    # arguments in the Triton kernel's parameter order
    Member("vllm.v1.worker.block_table:ComputeSlotMappingKernel", "kernel",
           ("num_tokens", "max_num_tokens", "query_start_loc_ptr", "positions_ptr", "block_table_ptr",
            "block_table_stride", "slot_mapping_ptr", "KV_CACHE_BLOCK_SIZE", "TOTAL_CP_WORLD_SIZE",
            "TOTAL_CP_RANK", "CP_KV_CACHE_INTERLEAVE_SIZE", "PAD_ID", "BLOCK_SIZE"),
           why="compute_slot_mapping replaces it, argument for argument"),
    Member("vllm.triton_utils.dispatcher", "register_kernels", ("overrides",), why="kernels.register calls it"),
]

# Beyond signatures: source that must still say what torchtpu relies on (a regular expression).
VLLM_SOURCE: list[tuple[str, str, str]] = [
    ("vllm.model_executor.layers.attention.attention:unified_kv_cache_update",
     r"\.do_kv_cache_update\((\s*#[^\n]*)?\s*attn_layer,\s*key,\s*value,\s*kv_cache,\s*layer_slot_mapping,?\s*\)",
     "TpuPagedAttentionImpl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)"),
]

VLLM_SUBCLASSES: list[tuple[str, str, tuple[str, ...]]] = [
    ("torchtpu.integrations.vllm.worker:TpuWorker", _WORKER, ()),
    ("torchtpu.integrations.vllm.model_runner:TpuModelRunner", _RUNNER, ()),
    ("torchtpu.integrations.vllm.platform:TpuPlatform", _PLATFORM, ("_configure_compilation",)),
    ("torchtpu.integrations.vllm.compiler:TpuCompiler", "vllm.compilation.compiler_interface:CompilerInterface", ()),
    ("torchtpu.integrations.vllm.attention:TpuPagedAttentionImpl", f"{_ATTN}:AttentionImpl",
     ("do_kv_cache_update",)),  # duck-typed: VLLM_SOURCE
    ("torchtpu.integrations.vllm.attention:TpuPagedAttentionMetadataBuilder",
     f"{_ATTN}:AttentionMetadataBuilder", ()),
    ("torchtpu.integrations.vllm.attention:TpuPagedAttentionBackend", f"{_ATTN}:AttentionBackend", ()),
]

# ---------------------------------------------------------------------------------- SGLang 0.5.23

_ALLOCATOR = "sglang.srt.mem_cache.allocator.token:TokenToKVPoolAllocator"
_POOL = "sglang.srt.mem_cache.memory_pool:MHATokenToKVPool"
_SRT = "sglang.srt.platforms.interface:SRTPlatform"
_BACKEND = "sglang.srt.layers.attention.base_attn_backend:AttentionBackend"
_BATCH = "sglang.srt.model_executor.forward_batch_info:ForwardBatch"
_COORDINATOR = "sglang.srt.distributed.parallel_state:GroupCoordinator"

SGLANG: list[Member] = [
    # HostTokenAllocator (integrations/sglang/allocator.py) replaces the free list's methods ...
    *_methods(_ALLOCATOR, "HostTokenAllocator overrides it",
              clear=(), merge_and_sort_free=(), alloc=("need_size",), free=("free_index",),
              _copy_for_free_group=("free_index",)),
    # ... and the state they keep
    *_attributes(_ALLOCATOR, "HostTokenAllocator sets or reads it",
                 "free_pages", "free_group", "release_pages", "size", "device"),
    # TpuMHATokenToKVPool (integrations/sglang/kv_pool.py) replaces the buffers and the writer
    *_methods(_POOL, "TpuMHATokenToKVPool overrides it",
              _create_buffers_normal=(), _init_data_ptrs_and_strides=(),
              _store_kv_layer=("layer_idx", "loc", "cache_k", "cache_v")),
    Member(_POOL, "_kv_buffer_shapes", (), why="TpuMHATokenToKVPool._create_buffers_normal calls it"),
    Member(_POOL, "set_kv_buffer", accepts=("layer", "loc_info", "cache_k", "cache_v"),
           why="TpuAttnBackend calls it with a KVWriteLoc"),
    Member("sglang.srt.mem_cache.memory_pool:KVWriteLoc", None, accepts=(), why="TpuAttnBackend builds one"),
    *_attributes(_POOL, "TpuMHATokenToKVPool sets or reads it",
                 "use_hnd", "kv_cache_layout", "store_dtype", "device", "layer_num", "k_buffer", "v_buffer",
                 "k_data_ptrs", "v_data_ptrs", "data_ptrs", "data_strides"),
    # TpuSRTPlatform (integrations/sglang/platform.py): the platform interface's hooks
    *_methods(_SRT, "TpuSRTPlatform overrides it",
              get_device=("device_id",), set_device=("device",), get_device_name=("device_id",),
              get_device_uuid=("device_id",), get_device_capability=("device_id",), empty_cache=(),
              synchronize=(), get_available_memory=("device_id",), get_device_total_memory=("device_id",),
              get_current_memory_usage=("device",), get_default_attention_backend=(),
              get_kv_pool_cls=("kind",), get_graph_runner_cls=(), get_compile_backend=("mode",),
              get_dispatch_key_name=(), get_torch_distributed_backend_str=(),
              get_group_coordinator_device=("local_rank",), apply_server_args_defaults=("server_args",),
              get_torch_profiler_activity_str=(), get_torch_profiler_activity=()),
    *_attributes(_SRT, "TpuSRTPlatform sets it", "_enum", "device_name", "device_type", "capabilities"),
    Member("sglang.srt.platforms.device_mixin:PlatformEnum", "OOT", why="TpuSRTPlatform._enum"),
    Member("sglang.srt.platforms.interface:PlatformCapabilities", None, accepts=("graph_capture",),
           why="TpuSRTPlatform.capabilities"),
    Member("sglang.srt.arg_groups.choices", "QUANTIZATION_CHOICES", why="platform.py appends tpu_int8 to it"),
    *_attributes("sglang.srt.server_args:ServerArgs", "apply_server_args_defaults reads or sets it",
                 "enable_deterministic_inference", "pp_size", "dp_size", "tp_size",
                 "disable_overlap_schedule", "max_total_tokens"),
    # TpuAttnBackend (integrations/sglang/attention.py)
    *_methods(_BACKEND, "TpuAttnBackend overrides it",
              init_forward_metadata=("forward_batch",), support_triton=()),
    Member(_BACKEND, "forward_extend", accepts=("q", "k", "v", "layer", "forward_batch", "save_kv_cache"),
           why="TpuAttnBackend overrides it"),
    Member(_BACKEND, "forward_decode", accepts=("q", "k", "v", "layer", "forward_batch", "save_kv_cache"),
           why="TpuAttnBackend overrides it"),
    *_attributes(_BATCH, "the attention backend and the graph runner read or pad it",
                 "forward_mode", "seq_lens", "seq_lens_cpu", "seq_lens_sum", "extend_seq_lens_cpu",
                 "req_pool_indices", "out_cache_loc", "input_ids", "positions", "batch_size"),
    # the model runner's state that the attention backend's factory and the graph runner read
    *_attributes("sglang.srt.model_executor.model_runner:ModelRunner", "the tpu backend and graph runner read it",
                 "device", "req_to_token_pool", "token_to_kv_pool", "token_to_kv_pool_allocator", "model",
                 "attn_backend"),
    Member("sglang.srt.mem_cache.memory_pool:ReqToTokenPool", "req_to_token", why="read by the graph runner"),
    Member("sglang.srt.mem_cache.memory_pool:ReqToTokenPool", "size", why="read by the graph runner"),
    # TpuGraphRunner (integrations/sglang/graph_runner.py)
    *_attributes("sglang.srt.layers.logits_processor:LogitsProcessorOutput", "TpuGraphRunner builds one",
                 "next_token_logits", "hidden_states"),
    Member("sglang.srt.model_executor.forward_context", "forward_context", accepts=("forward_batch",),
           why="TpuGraphRunner.execute"),
    Member("sglang.srt.model_executor.forward_context", "get_forward_context", (), why="TpuGraphRunner.execute"),
    Member("sglang.srt.runtime_context", "get_exec", (), why="capture_sizes reads get_exec().graph"),
    # the plugin (integrations/sglang/__init__.py, quantization.py, parallel.py)
    Member("sglang.srt.arg_groups.choices", "ATTENTION_BACKEND_CHOICES", why="register adds tpu"),
    Member("sglang.srt.arg_groups.choices", "add_quantization_method_choices", accepts=(),
           why="quantization.register calls it"),
    Member("sglang.srt.layers.attention.attention_registry", "ATTENTION_BACKENDS", why="register adds tpu"),
    Member("sglang.srt.layers.quantization", "QUANTIZATION_METHODS", why="quantization.register adds tpu_int8"),
    Member("sglang.srt.plugins.hook_registry:HookRegistry", "register", accepts=(),
           why="parallel.register_hooks calls it"),
    Member("sglang.srt.plugins.hook_registry:HookType", "BEFORE", why="parallel.register_hooks"),
    Member("sglang.srt.plugins.hook_registry:HookType", "AROUND", why="parallel.register_hooks"),
    Member("sglang.srt.distributed.bootstrap", "init_parallel_runtime", accepts=(),
           why="parallel.join_ranks runs before it (a hook on its name)"),
    Member(_COORDINATOR, "all_reduce", ("input_",), why="parallel.all_reduce wraps it (a hook on its name)"),
    Member(_COORDINATOR, "all_gather_into_tensor", ("output", "input"),
           why="parallel.all_gather_into_tensor wraps it (a hook on its name)"),
    Member("sglang.srt.runtime_context", "get_parallel", (), why="parallel.join_ranks"),
    Member("sglang.srt.runtime_context", "get_device", (), why="parallel.join_ranks"),
]

SGLANG_SOURCE: list[tuple[str, str, str]] = []

SGLANG_SUBCLASSES: list[tuple[str, str, tuple[str, ...]]] = [
    ("torchtpu.integrations.sglang.allocator:HostTokenAllocator", _ALLOCATOR, ("adopt",)),
    ("torchtpu.integrations.sglang.kv_pool:TpuMHATokenToKVPool", _POOL, ()),
    ("torchtpu.integrations.sglang.platform:TpuSRTPlatform", _SRT, ()),
    ("torchtpu.integrations.sglang.attention:TpuAttnBackend", _BACKEND,
     ("__init__", "_check_layer", "_attend")),  # built by register's factory, not by SGLang
]

CONTRACTS = {"vllm": VLLM, "sglang": SGLANG}
SOURCES = {"vllm": VLLM_SOURCE, "sglang": SGLANG_SOURCE}
SUBCLASSES = {"vllm": VLLM_SUBCLASSES, "sglang": SGLANG_SUBCLASSES}


# ------------------------------------------------------------------------------------ checking

def resolve(path: str) -> Any:
    """``"module:Qual.name"`` or ``"module"``: the object."""
    module, _, qualname = path.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split(".") if qualname else ():
        obj = getattr(obj, part)
    return obj


def parameter_names(fn: Any) -> tuple[str, ...]:
    """``fn``'s parameter names in order, ``*args``/``**kwargs`` so written, without self/cls."""
    if isinstance(fn, (classmethod, staticmethod)):
        fn = fn.__func__
    target = fn.__init__ if inspect.isclass(fn) and "__init__" in vars(fn) else fn
    names = []
    for p in inspect.signature(target).parameters.values():
        names.append({p.VAR_POSITIONAL: f"*{p.name}", p.VAR_KEYWORD: f"**{p.name}"}.get(p.kind, p.name))
    if names and names[0] in ("self", "cls") and not inspect.isclass(fn):
        names = names[1:]
    elif inspect.isclass(fn) and target is not fn and names and names[0] == "self":
        names = names[1:]
    return tuple(names)


def _declared(cls: type, name: str) -> bool:
    """``name`` is a class attribute, a field (dataclass, msgspec, annotations), or assigned to
    ``self.name`` by a method of ``cls`` or of a base class."""
    if inspect.getattr_static(cls, name, None) is not None or name in getattr(cls, "__dataclass_fields__", {}):
        return True
    if name in getattr(cls, "__struct_fields__", ()) or name in getattr(cls, "_fields", ()):
        return True
    assigned = re.compile(rf"\bself\.{re.escape(name)}\s*(:[^=\n]+)?=[^=]")
    for base in inspect.getmro(cls):
        if name in getattr(base, "__annotations__", {}):
            return True
        if base.__module__ in ("builtins", "typing", "abc"):
            continue
        try:
            if assigned.search(inspect.getsource(base)):
                return True
        except (OSError, TypeError):
            pass
    return False


def check(member: Member) -> str | None:
    """None if ``member`` holds in the installed engine, else what is wrong."""
    try:
        owner = resolve(member.owner)
    except (ImportError, AttributeError) as e:
        return f"{member.owner} is gone ({type(e).__name__}: {e})"
    if member.name is None:
        target = owner
    elif inspect.ismodule(owner):
        if not hasattr(owner, member.name):
            return f"{member.id} is gone"
        target = getattr(owner, member.name)
    else:
        target = inspect.getattr_static(owner, member.name, None)
        if target is None:
            if member.params is None and not member.accepts and _declared(owner, member.name):
                return None
            return f"{member.id} is gone"
    if member.params is None and not member.accepts and member.name is not None:
        return None  # an attribute: it exists
    try:
        names = parameter_names(target)
    except (TypeError, ValueError) as e:
        return f"{member.id}: no signature ({e})"
    if member.params is not None and names != member.params:
        return f"{member.id}: parameters {names}, torchtpu expects {member.params}"
    missing = [n for n in member.accepts if n not in names]
    if missing and not any(n.startswith("**") for n in names):
        return f"{member.id}: parameters {names} lack {missing}, which torchtpu passes"
    return None


def check_source(path: str, pattern: str) -> str | None:
    try:
        source = inspect.getsource(resolve(path))
    except (ImportError, AttributeError, OSError, TypeError) as e:
        return f"{path}: source not found ({e})"
    return None if re.search(pattern, source) else f"{path} no longer matches {pattern!r}"


def unlisted_overrides(engine: str) -> list[str]:
    """Names torchtpu's subclasses define that are neither their own nor in the engine's contract."""
    listed = {(m.owner, m.name) for m in CONTRACTS[engine]}
    problems = []
    for ours, base, own in SUBCLASSES[engine]:
        cls = resolve(ours)
        for name in vars(cls):
            if (name.startswith("__") and name != "__init__") or name in own or name.startswith("_abc"):
                continue
            if (base, name) not in listed:
                problems.append(f"{ours}.{name} (base {base}) is not in the {engine} contract")
    return problems
