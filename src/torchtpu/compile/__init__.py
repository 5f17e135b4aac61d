"""The ``tpu`` backend of ``torch.compile``, its caches and their statistics.

``install()`` (run once when torchtpu is imported) registers the backend with dynamo as "tpu"
and makes ``torch.compile(fn)`` pick it for tpu tensors; ``cache.install()`` (run when the
runtime starts) points JAX's persistent compilation cache at ``TORCHTPU_CACHE_DIR``.
``compiler`` is ``torch.tpu.compiler``. Importing this package imports no JAX: ``import torch``
runs ``install()``.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

from torchtpu import patches
from torchtpu.compile import routing
from torchtpu.runtime import compat

_installed = False


def backend(gm, example_inputs, **kwargs):
    """The ``tpu`` backend (``torch.compile(fn, backend="tpu")``)."""
    from torchtpu.compile import recompiles
    from torchtpu.compile.backend import backend as tpu_backend

    recompiles.count_new()
    return tpu_backend(gm, example_inputs, **kwargs)


def _compiler() -> SimpleNamespace:
    from torchtpu.compile import cache, introspect, recompiles

    return SimpleNamespace(
        cache_stats=cache.cache_stats,
        reset_stats=cache.reset_stats,
        clear_cache=cache.clear_cache,
        custom_compiler_options=cache.custom_compiler_options,
        persistent_cache_dir=cache.persistent_cache_dir,
        recompile_reasons=recompiles.recompile_reasons,
        clear_recompile_reasons=recompiles.clear_recompile_reasons,
        hlo=introspect.hlo,
        cost_analysis=introspect.cost_analysis,
        explain=introspect.explain,
    )


def __getattr__(name: str):
    if name == "compiler":  # ``torch.tpu.compiler``: its modules import JAX, so built on first use
        global compiler
        compiler = _compiler()
        return compiler
    raise AttributeError(f"module 'torchtpu.compile' has no attribute {name!r}")


_EAGER_LAYERS = ("torchtpu.runtime", "torchtpu.device", "torchtpu.ops", "torchtpu.eager", "torchtpu.compile",
                 "jax", "jaxlib", "ml_dtypes")
_skipped: list[str] = []


def skip_eager_layers() -> bool:
    """Patch ``dynamo.skip_files`` (see ``torchtpu.patches``): dynamo runs our eager kernels.

    They are Python (and JAX) called by the dispatcher: dynamo must run them, not trace them (as it
    does for torch's own Python), or eager ops after a graph break are traced. Only the internal
    layers: user-facing code in torchtpu (the demo's model) stays traceable. (ml_dtypes: jax calls
    into it while compiling an eager kernel after a graph break.)
    """
    trace_rules = compat.dynamo_trace_rules
    before = len(trace_rules.SKIP_DIRS)
    for package in _EAGER_LAYERS:
        trace_rules.add(package)
    _skipped[:] = trace_rules.SKIP_DIRS[before:]
    return True


def trace_eager_layers() -> None:
    """Undo ``skip_eager_layers``."""
    skip_dirs = compat.dynamo_trace_rules.SKIP_DIRS
    for directory in _skipped:
        if directory in skip_dirs:
            skip_dirs.remove(directory)
    _skipped.clear()
    compat.recompile_skip_dirs()


def register_backend() -> bool:
    """Patch ``dynamo.tpu_backend``: ``torch.compile(fn, backend="tpu")``."""
    if "tpu" in compat.COMPILER_FNS:
        return compat.COMPILER_FNS["tpu"] is backend
    compat.dynamo_backends.register_backend(backend, name="tpu")
    return True


def unregister_backend() -> None:
    if compat.COMPILER_FNS.get("tpu") is backend:
        del compat.COMPILER_FNS["tpu"]
        compat.BACKENDS.pop("tpu", None)


def _on_dynamo_import() -> None:
    """What ``torch._dynamo``'s import brings (``torchtpu.patches``, when "dynamo import")."""
    from torchtpu.runtime import state

    patches.forget("dynamo.import_hook")  # the finder left sys.meta_path
    for name in ("dynamo.tpu_backend", "dynamo.default_backend", "dynamo.warm_start"):
        patches.apply(name)  # warm start: before any torch.compile decides whether to use the Dynamo cache
    if state.started():
        patches.apply("dynamo.skip_files")


def _on_first_use() -> None:
    """What the runtime's start brings to compile: the Inductor guard; the skip list once dynamo is there."""
    patches.apply("inductor.tpu_guard")
    if "torch._dynamo" in sys.modules:
        patches.apply("dynamo.skip_files")


def install_import_hook() -> bool:
    """Patch ``dynamo.import_hook``: the "dynamo import" patches when dynamo is imported (now if it is)."""
    return routing.after_import("torch._dynamo", _on_dynamo_import)


def remove_import_hook() -> None:
    routing.cancel_after_import("torch._dynamo")


def install() -> None:
    """Register the backend and the default routing (idempotent; run at ``import torch``).

    Importing dynamo takes seconds, so ``import torch`` does not pay for it: the backend is
    registered when dynamo is first imported (by ``torch.compile``), or now if it already is;
    the rest waits for the first tpu use (``torchtpu.patches`` has the table).
    """
    global _installed
    if _installed:
        return
    from torchtpu.runtime import state

    patches.apply("dynamo.import_hook")
    state.on_start(_on_first_use)
    _installed = True


__all__ = ["backend", "compiler", "install"]
