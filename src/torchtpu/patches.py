"""Every process-wide change torchtpu makes to PyTorch, Python or a serving engine, in one table.

``import torch`` imports torchtpu in every program of the environment (the ``torch.backends``
autoload), CPU-only ones too, so each change here is made at the latest point that works and
through the library's own hook where it has one. ``TABLE`` says, for each: what it changes
(``targets``, dotted names), why (and why no public hook does it), the versions it applies to,
``when`` it is made, and the functions that make and undo it. ``apply(name)``/``undo(name)`` run
them; ``applied()`` lists what this process has applied (``torchtpu info`` prints it).

When a change is made (``when``):

- ``import``: at ``import torch``. Only what cannot wait: a hook that notices ``torch._dynamo``
  being imported (``torch.compile`` reads its default backend and resolves ``backend="tpu"`` when
  it is called, which can be before any tpu tensor exists).
- ``dynamo import``: when ``torch._dynamo`` is imported (``torch.compile``), before it is used.
- ``first tpu use``: when the runtime starts (the first ``tpu`` op or device query): a program
  that never touches ``tpu`` never gets them. A target imported later gets it on its import.
- ``trace``, ``multi-process start``, ``engine start``: only inside a ``torchtpu.profiler.trace``,
  after joining a multi-process runtime, or inside a serving engine that loaded our plugin.

Not listed, because they are PyTorch's extension points and reach ``tpu`` tensors only: the
device registration (``torch.utils.rename_privateuse1_backend``, ``torch._register_device_module``,
the PrivateUse1 hooks and guard), ``torch.library`` kernels for the PrivateUse1 and
AutocastPrivateUse1 keys, ``torch.serialization.register_package``, ``torch.distributed``'s
``Backend.register_backend``, and the new names they add (``torch.tpu``, ``Tensor.tpu``).

This module is at the bottom of the layers: it imports nothing of torchtpu; the functions that
make a change live next to the code they serve, named here as ``"module:function"``.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass

IMPORT = "import"
DYNAMO_IMPORT = "dynamo import"
FIRST_USE = "first tpu use"
TRACE = "trace"
MULTIPROCESS = "multi-process start"
ENGINE = "engine start"


@dataclass(frozen=True)
class Patch:
    name: str
    targets: tuple[str, ...]
    """What changes, as dotted names (``module.attr``; ``name[key]`` for an entry of a mapping)."""
    why: str
    versions: str
    when: str
    apply: str | None
    """``"module:function"`` that makes the change (returns False where there is nothing to do);
    None where the engine's plugin code makes it at its own site (it calls ``record``)."""
    undo: str | None
    """``"module:function"`` that restores the targets; None: see ``why``."""


_DYNAMO_REGISTRY = "torch._dynamo.backends.registry"

TABLE: tuple[Patch, ...] = (
    Patch("dynamo.import_hook", ("sys.meta_path",),
          "Notices torch._dynamo's import (a finder that wraps its loader, then leaves sys.meta_path) to "
          "apply the 'dynamo import' changes. torch.compile resolves backend='tpu' and reads the default "
          "backend when it is called, which can be before any tpu tensor exists (a module-level "
          "@torch.compile), and PyTorch runs no hook when dynamo is imported; importing dynamo at "
          "import torch would cost seconds. Gone from sys.meta_path once dynamo is imported.",
          "all", IMPORT, "torchtpu.compile:install_import_hook", "torchtpu.compile:remove_import_hook"),
    Patch("dlpack.exports",
          ("torch.utils.dlpack.to_dlpack", "torch.to_dlpack", "torch.utils.dlpack.from_dlpack", "torch.from_dlpack",
           "torch.asarray", "torch.Tensor.__dlpack__", "torch.Tensor.__dlpack_device__"),
          "A tpu tensor's data_ptr() is a fake address: PyTorch's DLPack exporter hands it out and its "
          "importer reads zeros from it, so these export and import tpu tensors (device/dlpack.py) and "
          "call PyTorch's own for every other device. Python's DLPack protocol and PyTorch's functions "
          "have no per-device hook. Made at import, so that names bound before the first tpu use "
          "(`from torch.utils.dlpack import to_dlpack`) are these; the runtime's start applies it "
          "again (a no-op). No undo function yet (device/dlpack.py keeps the originals in _installed).",
          "all", IMPORT, "torchtpu.device.dlpack:install", None),
    Patch("dynamo.tpu_backend", (f"{_DYNAMO_REGISTRY}._COMPILER_FNS[tpu]",),
          "torch.compile(backend='tpu'), through dynamo's public register_backend. (The "
          "torch_dynamo_backends entry point would find it without the import hook, but the default "
          "backend below needs the hook anyway.)",
          "all", DYNAMO_IMPORT, "torchtpu.compile:register_backend", "torchtpu.compile:unregister_backend"),
    Patch("dynamo.default_backend", (f"{_DYNAMO_REGISTRY}._default_backend",),
          "torch.compile(fn) routes graphs on tpu to the tpu backend and every other graph to Inductor "
          "as before, through PyTorch's public set_default_backend (torch >= 2.13). A default the user "
          "set is kept. torch 2.11/2.12 have no such hook: there inductor.tpu_guard routes instead.",
          "torch >= 2.13", DYNAMO_IMPORT, "torchtpu.compile.routing:set_default",
          "torchtpu.compile.routing:reset_default"),
    Patch("dynamo.warm_start", ("torch._dynamo.config.caching_precompile", "atexit"),
          "TORCHTPU_WARM_START=dynamo only: turns on PyTorch's Dynamo cache (its own config switch) and "
          "saves it at exit (PyTorch writes it only from save_cache_artifacts()).",
          "all", DYNAMO_IMPORT, "torchtpu.compile.warm:install", "torchtpu.compile.warm:uninstall"),
    Patch("dynamo.skip_files", ("torch._dynamo.trace_rules.SKIP_DIRS",),
          "Dynamo runs torchtpu's eager kernels (and jax, jaxlib, ml_dtypes, which they call) instead of "
          "tracing them, as it does for torch's own Python, through trace_rules.add; they run only on "
          "tpu tensors. No public API: trace_rules.add is dynamo's own.",
          "all", FIRST_USE, "torchtpu.compile:skip_eager_layers", "torchtpu.compile:trace_eager_layers"),
    Patch("inductor.tpu_guard", ("torch._TorchCompileInductorWrapper.__call__",),
          "A graph on tpu given to Inductor is compiled by the tpu backend instead of failing in "
          "Inductor's code generation (libraries hard-code backend='inductor': TorchTitan's "
          "--compile.enable), with one log line where the choice was explicit (torch >= 2.13; on "
          "2.11/2.12 torch.compile(fn) cannot be told from backend='inductor', so silently). "
          "PyTorch has no hook for a backend handing one device's graphs to another: the wrapper's __call__ is wrapped, "
          "and calls the original for every graph not on tpu.",
          "all", FIRST_USE, "torchtpu.compile.routing:guard_inductor", "torchtpu.compile.routing:unguard_inductor"),
    Patch("flex_attention.kernels",
          ("torch._higher_order_ops.flex_attention.flex_attention.py_kernels[DispatchKey.PrivateUse1]",
           "torch._higher_order_ops.flex_attention.flex_attention_backward.py_kernels[DispatchKey.PrivateUse1]"),
          "The tpu kernels of the flex_attention higher-order ops, through the ops' py_impl (the way "
          "PyTorch registers a device's kernel for a HOP).",
          "torch >= 2.11", FIRST_USE, "torchtpu.flex_attention:register_kernels",
          "torchtpu.flex_attention:unregister_kernels"),
    Patch("flex_attention.validate_device", ("torch.nn.attention.flex_attention._validate_device",),
          "flex_attention's frontend refuses devices outside {cuda, cpu, xpu, hpu, mps} before any "
          "dispatch, with no plugin point: the replacement lets tpu tensors through and calls the "
          "original for every other device.",
          "torch >= 2.11", FIRST_USE, "torchtpu.flex_attention:allow_tpu", "torchtpu.flex_attention:disallow_tpu"),
    Patch("torchtitan.peak_flops", ("torchtitan.tools.utils.get_peak_flops",),
          "TorchTitan's MFU divides by get_peak_flops(device name), a table of GPU/TPU names that misses "
          "PJRT's TPU names (TPU v5 lite, TPU v5, TPU v6 lite, TPU7x) and has no XLA:CPU figure (it falls "
          "back to an A100's). For device type tpu the wrapper answers get_device_properties().peak_flops "
          "(runtime/chips.py; XLA:CPU measured), and TorchTitan's own answer otherwise. TorchTitan has no "
          "hook for a device's peak. Applied only where TorchTitan is installed (at its utils' import).",
          "torchtitan 0.3", FIRST_USE, "torchtpu.integrations.torchtitan:use_device_peak",
          "torchtpu.integrations.torchtitan:restore_peak"),
    Patch("torchtitan.flux_autoencoder_load", ("torchtitan.models.flux.model.autoencoder.load_sft",),
          "TorchTitan's FLUX trainer loads its autoencoder with safetensors' load_file(path, "
          "device=<the trainer's device>), and safetensors accepts only the device names it knows "
          "('device tpu:0 is invalid'). For a tpu device the wrapper reads the file on the CPU and "
          "moves the tensors; every other device calls load_file as before. Applied only where "
          "TorchTitan is installed (at that module's import).",
          "torchtitan 0.3", FIRST_USE, "torchtpu.integrations.torchtitan:load_flux_autoencoder_on_tpu",
          "torchtpu.integrations.torchtitan:restore_flux_autoencoder_load"),
    Patch("multiprocess.excepthook", ("sys.excepthook", "atexit"),
          "A rank whose program raised exits without JAX's exit-time shutdown barrier (it would wait "
          "for ranks that will not come): the hook prints the traceback as before, then unregisters "
          "JAX's atexit clean_up. Python has no other per-exception hook.",
          "jax with jax._src.api.clean_up", MULTIPROCESS, "torchtpu.runtime.multiprocess:install_excepthook",
          "torchtpu.runtime.multiprocess:uninstall_excepthook"),
    Patch("profiler.record_function",
          ("torch.autograd.profiler.record_function.__enter__", "torch.autograd.profiler.record_function.__exit__"),
          "record_function blocks also open a JAX span of their name in the trace. PyTorch's "
          "RecordFunction callbacks are C++ only: the methods are replaced for the trace's duration.",
          "all", TRACE, "torchtpu.profiler:patch_record_function", "torchtpu.profiler:unpatch_record_function"),
    Patch("vllm.cuda_streams",
          tuple(f"torch.cuda.{n}" for n in ("Stream", "Event", "current_stream", "default_stream", "stream")),
          "While vLLM's GPU model runner is built (TpuModelRunner.__init__), its CUDA stream and event "
          "calls reach tpu's; vLLM has no platform hook for them. Restored when the runner is built.",
          "vllm (integrations.vllm.TESTED_VLLM)", ENGINE, None, None),
    Patch("sglang.attention_backend",
          ("sglang.srt.layers.attention.attention_registry.ATTENTION_BACKENDS[tpu]",
           "sglang.srt.arg_groups.choices.ATTENTION_BACKEND_CHOICES"),
          "--attention-backend tpu, from SGLang's sglang.srt.plugins entry point (its plugin point; "
          "the choices list has no registration function). Not undone: the engine process owns it.",
          "sglang (integrations.sglang.TESTED_SGLANG)", ENGINE, None, None),
    Patch("sglang.quantization_choice", ("sglang.srt.arg_groups.choices.QUANTIZATION_CHOICES",),
          "--quantization tpu_int8 must be a choice when SGLang parses its command line, before plugins "
          "load: appended when the platform (sglang.srt.platforms entry point) is imported.",
          "sglang (integrations.sglang.TESTED_SGLANG)", ENGINE, None, None),
    Patch("sglang.host_free_list", ("sglang TokenToKVPoolAllocator instance __class__",),
          "The model runner's plain token allocator becomes HostTokenAllocator (a subclass) in place, "
          "before first use: SGLang builds it inside ModelRunner with no allocator hook for page size 1 "
          "and no platform method to choose its class, so no plugin point can build the subclass.",
          "sglang (integrations.sglang.TESTED_SGLANG)", ENGINE, None, None),
)

_BY_NAME = {p.name: p for p in TABLE}
_applied: dict[str, None] = {}  # insertion-ordered set
_lock = threading.RLock()


def _function(spec: str):
    module, _, attribute = spec.partition(":")
    return getattr(importlib.import_module(module), attribute)


def get(name: str) -> Patch:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no patch named {name!r}; the table has {sorted(_BY_NAME)}") from None


def apply(name: str) -> bool:
    """Make the change ``name`` (idempotent); True if it is applied afterwards."""
    patch = get(name)
    with _lock:
        if name in _applied:
            return True
        if patch.apply is None:
            raise ValueError(f"{name} is made by the engine's plugin code, not by apply()")
        if _function(patch.apply)() is False:  # nothing to change in this process
            return False
        _applied[name] = None
        return True


def undo(name: str) -> None:
    """Restore what ``name`` changed (a no-op if it is not applied)."""
    patch = get(name)
    with _lock:
        if name not in _applied:
            return
        if patch.undo is None:
            raise ValueError(f"{name} cannot be undone here: {patch.why}")
        _function(patch.undo)()
        del _applied[name]


def record(name: str) -> None:
    """Note that the engine-side change ``name`` was made (by its own site)."""
    get(name)
    _applied[name] = None


def forget(name: str) -> None:
    """Note that ``name`` no longer holds (a hook that removed itself, an engine site that restored)."""
    _applied.pop(name, None)


def applied() -> list[str]:
    """The names of the changes in effect in this process, in the order they were made."""
    return list(_applied)


def pending_at(when: str) -> list[Patch]:
    return [p for p in TABLE if p.when == when]


__all__ = ["TABLE", "Patch", "applied", "apply", "forget", "get", "record", "undo"]
