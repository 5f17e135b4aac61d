"""Every private API of PyTorch and JAX that torchtpu uses, in one table: the one door to them.

PyTorch has no public Python API for much of what a device backend does (its hooks, its dispatch
internals, dynamo's backend table); JAX none for its persistent cache's internals. Each such name
is listed here once, with why it is used, where it lives and the releases it is checked with;
the rest of torchtpu imports it from this module (``from torchtpu.runtime.compat import
OpOverload``, or ``compat.dynamo_config`` at the point of use). ``tests/test_private_api.py``
fails on a private reference anywhere else, so a new one is a visible decision, and checks that
every name below resolves on the installed torch and jax.

Names are resolved on first access (module ``__getattr__``), then kept: this module imports
nothing itself, so ``import torch`` pays nothing for it, and a name that needs ``torch._dynamo``
or ``jax`` (seconds to import) costs that only when used. A module imported at ``import torch``
takes those names at its point of use, not at its top.

Versions: every entry is checked with the releases in ``TESTED`` (``pyproject.toml``'s ranges);
``since`` is the first release that has it, later than the range's start where an older release
lacks it (``optional`` entries then resolve to None, and the caller does without). A name that
does not resolve raises ``PrivateAPIError``, naming it, the installed release and the tested ones.

Not an entry: ``torch.ops.<namespace>.<op>`` names (an op named ``_foo`` is still a public op),
and torchtpu's own attributes on PyTorch objects (the storage's ``_jax``).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable

TESTED = {"torch": ("2.11", "2.14"), "jax": ("0.10", "0.10")}
"""The releases (first, last; major.minor) torchtpu is checked with: pyproject.toml's bounds."""

AUTOGRAD_CALLER_KEY = "context"
"""The key under which ``torch.autograd.graph._engine_run_backward`` stashes the caller's
``contextvars.copy_context()`` in the thread-local state that the autograd engine hands its
device threads (read with ``is_key_in_tls``/``get_obj_in_tls``; ``autograd_caller_context``)."""


class PrivateAPIError(ImportError):
    """A private name torchtpu uses is missing from the installed torch or jax."""


class Private:
    """One private name: ``name`` (what this module calls it), ``target`` (``"module"`` or
    ``"module:attribute.path"``: where it lives), ``why`` (why torchtpu needs it, and why no public
    API does it), ``library``, ``since`` (its first release, where later than
    ``TESTED[library][0]``), ``optional`` (absent before ``since``: resolves to None there) and
    ``adapt`` (turns the object found into what is exported, e.g. a typed ctypes function).
    (A plain class, not a dataclass: the table is built at ``import torch``.)"""

    __slots__ = ("name", "target", "why", "library", "since", "optional", "adapt")

    def __init__(self, name: str, target: str, why: str, library: str = "torch", since: str | None = None,
                 optional: bool = False, adapt: Callable[[Any], Any] | None = None):
        self.name, self.target, self.why, self.library = name, target, why, library
        self.since, self.optional, self.adapt = since, optional, adapt

    def __repr__(self) -> str:
        return f"Private({self.name!r}, {self.target!r}, {self.versions})"

    @property
    def versions(self) -> str:
        first, last = TESTED[self.library]
        return f"{self.library} {self.since or first}-{last}"


def _capsule_new(pythonapi) -> Callable[[int, bytes, None], Any]:
    # A function object of our own: typing ctypes.pythonapi.PyCapsule_New in place would change
    # it for every other user of ctypes in the process.
    import ctypes

    prototype = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
    return prototype(("PyCapsule_New", pythonapi))


_T = "torch"
_DYNAMO_REGISTRY = "torch._dynamo.backends.registry"
_AOT_CACHE = "torch._functorch._aot_autograd.autograd_cache"
_FLEX_HOPS = "torch._higher_order_ops.flex_attention"

TABLE: tuple[Private, ...] = (
    # ---- the device: PyTorch's Python hooks for a PrivateUse1 backend (no public API)
    Private("PrivateUse1Hooks", "torch:_C._acc.PrivateUse1Hooks",
            "the base class of the PrivateUse1 backend's hooks (device count, generators) in Python"),
    Private("DeviceGuard", "torch:_C._acc.DeviceGuard", "the base class of the backend's device guard in Python"),
    Private("register_privateuse1_hooks", "torch:_C._acc.register_python_privateuseone_hook",
            "installs the hooks above"),
    Private("register_privateuse1_device_guard", "torch:_C._acc.register_python_privateuseone_device_guard",
            "installs the device guard above"),
    Private("create_empty_tensor", "torch:_C._acc.create_empty_tensor",
            "a PrivateUse1 tensor on device 0 with no data, the shell every tpu tensor starts as"),
    Private("DeviceType", "torch:_C._autograd.DeviceType",
            "the autograd device-type enum a device guard's type() returns (DeviceType.PrivateUse1)"),
    Private("privateuse1_backend_name", "torch:_C._get_privateuse1_backend_name",
            "whether PrivateUse1 is already renamed (to 'tpu', or by another backend): "
            "torch.utils.rename_privateuse1_backend cannot be asked"),
    Private("register_device_module", "torch:_register_device_module",
            "makes torch.tpu (the route rename_privateuse1_backend's documentation gives a backend)"),
    Private("DispatchKey", "torch:_C.DispatchKey",
            "dispatch keys, for py_impl kernels of higher-order ops and for redispatching"),
    Private("DispatchKeySet", "torch:_C.DispatchKeySet", "the key set a boxed redispatch takes"),
    Private("construct_storage_from_data_pointer", "torch:_C._construct_storage_from_data_pointer",
            "an UntypedStorage of a given size on a tpu device with no host bytes (the array lives on it)"),
    Private("set_storage_below_backend",
            "torch:ops.aten.set_.source_Storage_storage_offset._handle.redispatch_boxed",
            "builds every tpu output: the CPU kernel of set_ reached below PrivateUse1 (a CPU key set) gives "
            "a tensor its storage, sizes and strides in one call, without our own kernel or the "
            "dispatcher's Python layer; OpOverload._handle is its C++ handle"),
    Private("new_capsule", "ctypes:pythonapi",
            "PyCapsule_New through ctypes: a DLPack capsule of a hand-built DLManagedTensor (kDLExtDev, "
            "device N) is the only way to get an empty tensor on tpu:N (N > 0) from Python",
            adapt=_capsule_new),
    Private("from_dlpack_capsule", "torch:_C._from_dlpack",
            "PyTorch's own DLPack importer of a capsule: torch.from_dlpack is replaced by ours "
            "(patch dlpack.exports), which calls this for every other device"),
    Private("set_conj", "torch:_C._set_conj", "marks a tpu view conjugated (conj() is a view, as on CPU)"),
    Private("set_neg", "torch:_C._set_neg", "marks a tpu view negated (the negative bit of conj views)"),
    # ---- dispatch and operators
    Private("OpOverload", "torch._ops:OpOverload",
            "the type of an aten overload (torch.ops.aten.add.Tensor): kernels and lowerings are keyed by it"),
    Private("OpOverloadPacket", "torch._ops:OpOverloadPacket", "the type of torch.ops.aten.add (all overloads)"),
    Private("HigherOrderOperator", "torch._ops:HigherOrderOperator",
            "the type of flex_attention and other higher-order ops in graphs"),
    Private("dispatch_has_kernel_for_dispatch_key", "torch:_C._dispatch_has_kernel_for_dispatch_key",
            "whether an op is CompositeImplicitAutograd (decomposes before it reaches tpu)"),
    Private("dispatch_get_all_op_names", "torch:_C._dispatch_get_all_op_names",
            "every registered op name: the _foreach_* family is registered by enumeration"),
    Private("decomposition_table", "torch._decomp:decomposition_table",
            "PyTorch's Python decompositions: the fallback for ops without a lowering"),
    Private("core_aten_decompositions", "torch._decomp:core_aten_decompositions",
            "the decompositions torch.compile graphs get before lowering (to core aten)"),
    Private("elementwise_dtypes", "torch._prims_common:elementwise_dtypes",
            "PyTorch's type promotion of elementwise ops, reused so results have its dtypes"),
    Private("ELEMENTWISE_TYPE_PROMOTION_KIND", "torch._prims_common:ELEMENTWISE_TYPE_PROMOTION_KIND",
            "the promotion kinds elementwise_dtypes takes"),
    Private("TorchDispatchMode", "torch.utils._python_dispatch:TorchDispatchMode",
            "the base of torchtpu.debug's op tracer (no public base class for dispatch modes)"),
    Private("pytree", "torch.utils._pytree",
            "PyTorch's pytrees (tree_flatten, tree_map, TreeSpec): the structure torch.export and "
            "autograd.Function arguments use"),
    Private("printoptions", "torch:_tensor_str.printoptions",
            "a context manager for print options (torch.set_printoptions changes them for the process)"),
    Private("current_autograd_node", "torch:_C._current_autograd_node",
            "the backward node running now: debug's op tracer names the backward op of each kernel"),
    Private("is_key_in_tls", "torch:_C._is_key_in_tls",
            "with get_obj_in_tls: reads the autograd engine's thread-local stash (AUTOGRAD_CALLER_KEY), "
            "the only way a backward's device thread sees its caller's contextvars"),
    Private("get_obj_in_tls", "torch:_C._get_obj_in_tls", "see is_key_in_tls"),
    Private("float32_matmul_precision", "torch:_C._get_float32_matmul_precision",
            "read at every matmul: the C function, without torch.get_float32_matmul_precision's Python frame"),
    Private("overrideable_sdp_enabled", "torch:_C._get_overrideable_sdp_enabled",
            "whether SDPA's OVERRIDEABLE backend (a device's fused kernel) is enabled; torch.backends.cuda "
            "has functions for the other four only"),
    Private("sdp_priority_order", "torch:_C._get_sdp_priority_order",
            "the order SDPA tries its backends (set by torch.nn.attention.sdpa_kernel(set_priority=True))"),
    Private("flex_attention_hop", f"{_FLEX_HOPS}:flex_attention",
            "the flex_attention higher-order op, to register its tpu kernel (py_impl)"),
    Private("flex_attention_backward_hop", f"{_FLEX_HOPS}:flex_attention_backward",
            "the flex_attention backward higher-order op, to register its tpu kernel (py_impl)"),
    Private("captured_grad_buffer_mask", f"{_FLEX_HOPS}:_captured_grad_buffer_mask",
            "which captured buffers of a score_mod need a gradient (older torch: all of them)",
            since="2.14", optional=True),
    Private("FakeTensorMode", "torch._subclasses:FakeTensorMode", "fake tensors: a graph's shapes without data"),
    Private("unset_fake_temporarily", "torch._subclasses.fake_tensor:unset_fake_temporarily",
            "real tensors while a backend runs under dynamo's fake mode (constants, collective groups)"),
    Private("TorchCompileInductorWrapper", "torch:_TorchCompileInductorWrapper",
            "the Inductor backend object torch.compile builds: the inductor.tpu_guard patch wraps its __call__"),
    Private("disable_dynamo", "torch:_disable_dynamo",
            "keeps dynamo out of a function without importing it (torch.compiler.disable imports dynamo)"),
    Private("sympy_int_oo", "torch.utils._sympy.numbers:int_oo", "symbolic shapes' integer infinity (export)"),
    Private("SympyFloorDiv", "torch.utils._sympy.functions:FloorDiv", "symbolic shapes' floor division (export)"),
    Private("SympyMod", "torch.utils._sympy.functions:Mod", "symbolic shapes' C modulo (export)"),
    Private("SympyPythonMod", "torch.utils._sympy.functions:PythonMod", "symbolic shapes' Python modulo (export)"),
    # ---- distributed
    Private("resolve_process_group", "torch.distributed.distributed_c10d:_resolve_process_group",
            "a process group from the name functional collectives carry in graphs"),
    Private("C10dBackend", "torch._C._distributed_c10d:Backend",
            "the C++ process-group backend base class a Python backend subclasses"),
    Private("create_work_from_future", "torch._C._distributed_c10d:_create_work_from_future",
            "a Work of a Python future, which a Python backend's collectives return"),
    Private("functional_collectives", "torch.distributed._functional_collectives",
            "the functional collectives (all_reduce returning a tensor) graphs trace"),
    # ---- torch.compile: dynamo, AOTAutograd, Inductor (imported on use: seconds)
    Private("dynamo_config", "torch._dynamo.config", "dynamo's settings (caching_precompile, patch())"),
    Private("functorch_config", "torch._functorch.config", "AOTAutograd's settings (bundled cache, patch())"),
    Private("inductor_config", "torch._inductor.config",
            "Inductor's settings: which torch.compile options are Inductor's"),
    Private("dynamo_trace_rules", "torch._dynamo.trace_rules",
            "trace_rules.add/SKIP_DIRS: dynamo runs torchtpu's eager layers instead of tracing them"),
    Private("recompile_skip_dirs", "torch._dynamo.trace_rules:_recompile_re",
            "rebuilds dynamo's skip pattern after SKIP_DIRS shrinks (undoing trace_rules.add)"),
    Private("dynamo_backends", _DYNAMO_REGISTRY, "dynamo's backend registry (register_backend)"),
    Private("COMPILER_FNS", f"{_DYNAMO_REGISTRY}:_COMPILER_FNS",
            "dynamo's table of registered backends: whether 'tpu' is ours, and unregistering it"),
    Private("BACKENDS", f"{_DYNAMO_REGISTRY}:_BACKENDS", "dynamo's table of backend entry points (unregistering)"),
    Private("get_default_backend", f"{_DYNAMO_REGISTRY}:get_default_backend",
            "torch.compile's default backend", since="2.13", optional=True),
    Private("set_default_backend", f"{_DYNAMO_REGISTRY}:set_default_backend",
            "makes tpu's router torch.compile's default backend", since="2.13", optional=True),
    Private("aot_autograd", "torch._dynamo.backends.common:aot_autograd",
            "the tpu backend is an AOTAutograd backend (forward and backward graphs)"),
    Private("SerializableAOTDispatchCompiler", "torch._functorch.aot_autograd:SerializableAOTDispatchCompiler",
            "marks the backend's compilers cacheable by AOTAutograd's cache"),
    Private("min_cut_rematerialization_partition", "torch._functorch.partitioners:min_cut_rematerialization_partition",
            "the forward/backward partitioner Inductor uses"),
    Private("TransformGetItemToIndex", "torch._dynamo._trace_wrapped_higher_order_op:TransformGetItemToIndex",
            "traces flex_attention's score_mod/mask_mod as flex_attention's own lowering does"),
    Private("OutputCode", "torch._inductor.output_code:OutputCode",
            "the base of compiled code AOTAutograd's cache stores"),
    Private("BypassAOTAutogradCache", f"{_AOT_CACHE}:BypassAOTAutogradCache",
            "raised to keep a graph out of AOTAutograd's cache"),
    Private("AOTAutogradCache", f"{_AOT_CACHE}:AOTAutogradCache",
            "AOTAutograd's cache (the warm start clears it, then counts its hits)"),
    Private("aot_autograd_cache_dir", f"{_AOT_CACHE}:AOTAutogradCache._get_tmp_dir",
            "the directory AOTAutograd's cache writes to (the warm start's own cache directory)"),
    Private("GraphPickler", "torch.fx._graph_pickler:GraphPickler", "pickles FX graphs for the compile cache"),
    Private("GraphPicklerOptions", "torch.fx._graph_pickler:Options", "GraphPickler's options"),
    Private("ExplainWithBackend", "torch._dynamo.backends.debugging:ExplainWithBackend",
            "torch.tpu.compiler.explain: dynamo's explain() with the tpu backend"),
    Private("guard_failures", "torch._dynamo.utils:guard_failures", "why dynamo recompiled (recompile reasons)"),
    Private("dynamo_counters", "torch._dynamo.utils:counters", "dynamo's counters (graph breaks, cache hits)"),
    # ---- JAX
    Private("ArrayImpl", "jax._src.array:ArrayImpl",
            "the concrete jax.Array type: `type(x) is ArrayImpl` on the hot path (isinstance(x, jax.Array) "
            "goes through an ABC)", library="jax"),
    Private("jax_config", "jax._src.config",
            "the persistent cache's settings as JAX's State objects (read .value, and as context "
            "managers); jax.config only sets them", library="jax"),
    Private("jax_compilation_cache", "jax._src.compilation_cache",
            "JAX's persistent compilation cache: get_file_cache (replaced by the shared on-disk cache), "
            "reset_cache, VerificationCache, CacheVerificationError", library="jax"),
    Private("JaxLRUCache", "jax._src.lru_cache:LRUCache",
            "the base class of the shared on-disk cache (JAX's file cache)", library="jax"),
    Private("JAX_CACHE_SUFFIX", "jax._src.lru_cache:_CACHE_SUFFIX",
            "the file name suffix of a JAX cache entry (the shared cache keeps JAX's layout)", library="jax"),
    Private("JAX_ATIME_SUFFIX", "jax._src.lru_cache:_ATIME_SUFFIX",
            "the file name suffix of a JAX cache entry's access time", library="jax"),
    Private("jax_exit_clean_up", "jax._src.api:clean_up",
            "JAX's atexit handler (the multi-process shutdown barrier) a failing rank unregisters",
            library="jax"),
    Private("pallas_flash_attention_forward", "jax.experimental.pallas.ops.tpu.flash_attention:_flash_attention",
            "the Pallas TPU flash attention's forward with its residuals (logsumexp): its public "
            "flash_attention returns the output only", library="jax"),
)

_BY_NAME = {entry.name: entry for entry in TABLE}


def _release(library: str) -> tuple[int, int]:
    version = getattr(sys.modules.get(library) or importlib.import_module(library), "__version__", "0.0")
    major, minor = (version.split("+")[0].split(".") + ["0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _parse(release: str) -> tuple[int, int]:
    major, minor = release.split(".")
    return int(major), int(minor)


def available(name: str) -> bool:
    """Whether ``name``'s release gate holds here (the installed release is at least ``since``)."""
    entry = _BY_NAME[name]
    return entry.since is None or _release(entry.library) >= _parse(entry.since)


def _load(target: str) -> Any:
    module, _, path = target.partition(":")
    value = importlib.import_module(module)
    for part in path.split(".") if path else ():
        value = getattr(value, part)
    return value


def resolve(name: str) -> Any:
    """The object ``name`` stands for (None for an optional one its release lacks)."""
    entry = _BY_NAME[name]
    try:
        value = _load(entry.target)
    except (ImportError, AttributeError) as exc:
        if entry.optional and not available(name):
            return None
        first, last = TESTED[entry.library]
        installed = ".".join(map(str, _release(entry.library)))
        raise PrivateAPIError(
            f"torchtpu needs {entry.target.replace(':', '.')} ({entry.why}), which {entry.library} {installed} "
            f"does not have. torchtpu is tested with {entry.library} {first} to {last}: install one of "
            f"those (pip install torchtpu resolves them), or report this with both versions.") from exc
    return entry.adapt(value) if entry.adapt is not None else value


def __getattr__(name: str) -> Any:
    if name not in _BY_NAME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = resolve(name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_BY_NAME))


def autograd_caller_context():
    """In an autograd device thread running a backward pass: the contextvars of the thread that
    called ``backward()`` (``AUTOGRAD_CALLER_KEY``); else None."""
    module = sys.modules[__name__]
    if module.is_key_in_tls(AUTOGRAD_CALLER_KEY):
        return module.get_obj_in_tls(AUTOGRAD_CALLER_KEY)
    return None
