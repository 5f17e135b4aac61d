"""The ``tpu`` backend of ``torch.compile``, its caches and their statistics.

``install()`` (run once when torchtpu is imported) registers the backend with dynamo as "tpu"
and makes ``torch.compile(fn)`` pick it for tpu tensors; ``cache.install()`` (run when the
runtime starts) points JAX's persistent compilation cache at ``TORCHTPU_CACHE_DIR``.
``compiler`` is ``torch.tpu.compiler``. Importing this package imports no JAX: ``import torch``
runs ``install()``.
"""

from __future__ import annotations

from types import SimpleNamespace

from torchtpu.compile import routing

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


def _register_with_dynamo() -> None:
    from torch._dynamo import trace_rules
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    # Our eager kernels are Python (and JAX) called by the dispatcher: dynamo must run them, not
    # trace them (as it does for torch's own Python), or eager ops after a graph break are traced.
    # Only the internal layers: user-facing code in torchtpu (the demo's model) stays traceable.
    # (ml_dtypes: jax calls into it while compiling an eager kernel after a graph break.)
    for package in ("torchtpu.runtime", "torchtpu.device", "torchtpu.ops", "torchtpu.eager",
                    "torchtpu.compile", "jax", "jaxlib", "ml_dtypes"):
        trace_rules.add(package)
    if "tpu" not in _COMPILER_FNS:
        register_backend(backend, name="tpu")
    routing.set_default()
    from torchtpu.config import config

    if config.warm_start == "dynamo":  # before any torch.compile: it decides whether to use the Dynamo cache
        from torchtpu.compile import warm

        warm.install()


def install() -> None:
    """Register the backend and the default routing (idempotent).

    Importing dynamo takes seconds, so ``import torch`` does not pay for it: the backend is
    registered when dynamo is first imported (by ``torch.compile``), or now if it already is.
    """
    global _installed
    if _installed:
        return
    routing.guard_inductor()
    routing.after_import("torch._dynamo", _register_with_dynamo)
    _installed = True


__all__ = ["backend", "compiler", "install"]
