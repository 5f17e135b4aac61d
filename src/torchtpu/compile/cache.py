"""Compilation caches: the in-memory executables' statistics and JAX's persistent cache on disk.

Every compiled graph keeps its executables per input signature in memory (``executable.py``);
this module counts their lookups and compilations. ``install()`` (called once, when the runtime
starts, before anything compiles) makes JAX's persistent compilation cache serve torchtpu, so a
second process loads executables instead of compiling them: torch.compile graphs and eager
programs (each eager kernel, per op and input shapes) alike. Persistent-cache hits are counted
from JAX's monitoring events.

**The JAX settings torchtpu changes** (JAX settings are global to the process, so they apply to
JAX programs of your own in the same process too). Each is set once, by ``install()``, and only
where you have not chosen a value yourself (an environment variable such as
``JAX_COMPILATION_CACHE_DIR``, or ``jax.config.update`` before the runtime starts):

- ``jax_enable_x64 = True`` (set by the runtime, not here): torch's int64/float64 need it.
- ``jax_compilation_cache_dir = $TORCHTPU_CACHE_DIR/xla``: where executables are kept. An empty
  ``TORCHTPU_CACHE_DIR`` leaves the cache off (and the thresholds below untouched).
- ``jax_persistent_cache_min_compile_time_secs = 0`` (JAX's default: 1 s). JAX writes only
  programs that took at least this long to compile; an eager kernel compiles in 5-100 ms, so
  with the default none was written and every process compiled every kernel again (a decode
  loop: all of them, in every process). At 0 every program is written: on XLA:CPU an entry is
  about 4 KiB and writing it takes about 1.5 ms, against about 100 ms to compile it.

``jax_persistent_cache_min_entry_size_bytes`` is left alone: JAX's default (0) already keeps
entries of any size. torch.compile graphs are written whatever the thresholds (``compile_lowered``
sets both to their minimum for its own compilations only, thread-locally). The cache is never
evicted (JAX's ``jax_compilation_cache_max_size`` stays unlimited): delete the directory to
reclaim the space.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
import weakref
from typing import Any, Iterator

import jax
from jax._src import compilation_cache as _jax_cache
from jax._src import config as _jax_config

from torchtpu import metrics
from torchtpu.config import config

# JAX's monitoring events for its persistent cache (jax/_src/compiler.py).
_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_MISS_EVENT = "/jax/compilation_cache/cache_misses"
_UNREADABLE_WARNING = "Error reading persistent compilation cache entry"
# JAX's default for jax_persistent_cache_min_compile_time_secs, and the variable that sets it.
_JAX_MIN_COMPILE_TIME_DEFAULT = 1.0
_MIN_COMPILE_TIME_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"

_lock = threading.Lock()
_local = threading.local()
_stats = {"requests": 0, "hits": 0, "misses": 0, "compilations": 0, "compile_seconds": 0.0, "trace_seconds": 0.0,
          "persistent_hits": 0, "persistent_writes": 0, "persistent_errors": 0,
          "donated_buffers": 0,
          "warm_hits": 0, "warm_misses": 0, "warm_bypasses": 0, "warm_writes": 0, "warm_loads": 0,
          "warm_errors": 0}
_options: dict[str, Any] = {}
_graphs: "weakref.WeakSet" = weakref.WeakSet()  # every live compiled graph (each has .executables)
_installed = False


def count(name: str, amount: float = 1) -> None:
    with _lock:
        _stats[name] += amount


def cache_stats() -> dict[str, float]:
    """Counters of the compile cache: requests, hits, misses, compilations, compile_seconds, ...

    ``requests`` is every executable lookup (one per compiled-graph call), ``hits`` found one in
    memory, ``misses`` did not; each miss is either a ``persistent_hits`` (loaded from disk) or a
    ``compilations`` (XLA compiled it). ``compile_seconds`` is the time spent in both;
    ``trace_seconds`` the time spent turning graphs into XLA programs before that.
    ``donated_buffers`` counts mutated inputs whose buffers XLA reused for their new values.
    ``warm_*`` count the graphs looked up in PyTorch's AOTAutograd cache (``warm.py``): found
    (``warm_hits``: aot_autograd did not trace them), not found (``warm_misses``), not cacheable
    (``warm_bypasses``), stored (``warm_writes``); ``warm_loads`` counts graphs rebuilt from an entry
    (of the AOTAutograd cache or, with ``TORCHTPU_WARM_START=dynamo``, of PyTorch's Dynamo cache)
    and ``warm_errors`` entries that could not be used (a warning says why; the graph is traced).
    """
    with _lock:
        return dict(_stats)


def reset_stats() -> None:
    """Zero every counter (the caches themselves are kept)."""
    with _lock:
        for key in _stats:
            _stats[key] = type(_stats[key])(0)


def clear_cache() -> None:
    """Drop every in-memory executable (graphs recompile, or reload from disk, on their next call)."""
    for graph in list(_graphs):
        graph.executables.clear()


def track(graph) -> None:
    """Let ``clear_cache()`` reach ``graph``'s executables (held weakly)."""
    _graphs.add(graph)


def custom_compiler_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """Set XLA compiler options for every later compilation (``{}`` or None clears); returns the old ones."""
    global _options
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"custom_compiler_options expects a dict of XLA options, got {type(options).__name__}")
    previous, _options = _options, dict(options or {})
    return previous


def compiler_options(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The XLA options for one compilation: the global ones, overridden by ``extra``."""
    return {**_options, **(extra or {})}


def persistent_cache_dir() -> str | None:
    """The directory of JAX's persistent compilation cache (None if disabled)."""
    return _jax_config.compilation_cache_dir.value


def install() -> None:
    """Make JAX's persistent cache serve torchtpu (see the module docstring) and listen to it.

    Call it once, when the runtime starts and before anything compiles; later calls do nothing.
    Where the user chose the cache directory or the threshold, their choice is kept.
    """
    global _installed
    if _installed:
        return
    _installed = True
    if _jax_config.compilation_cache_dir.value is None and config.cache_dir:
        path = os.path.join(os.path.expanduser(config.cache_dir), "xla")
        jax.config.update("jax_compilation_cache_dir", path)
        # JAX decides once, at its first compilation, whether the cache is used: re-decide.
        _jax_cache.reset_cache()
    if _jax_config.compilation_cache_dir.value is not None and _jax_config.enable_compilation_cache.value:
        _keep_small_programs()
    jax.monitoring.register_event_listener(_on_event)


def _keep_small_programs() -> None:
    """Persist programs however fast they compiled (eager kernels), unless the user set a threshold."""
    if os.environ.get(_MIN_COMPILE_TIME_ENV) is not None:
        return
    if _jax_config.persistent_cache_min_compile_time_secs.value != _JAX_MIN_COMPILE_TIME_DEFAULT:
        return
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def _on_event(event: str, **kwargs) -> None:
    # JAX reports events of every compilation in the process; count only ours.
    if not getattr(_local, "active", False):
        return
    if event == _HIT_EVENT:
        count("persistent_hits")
    elif event == _MISS_EVENT:
        count("persistent_writes")


@contextlib.contextmanager
def _ours() -> Iterator[None]:
    _local.active = True
    try:
        with metrics.compiling_graph():
            yield
    finally:
        _local.active = False


def compile_lowered(lowered: jax.stages.Lowered, options: dict[str, Any], name: str) -> jax.stages.Compiled:
    """Compile ``lowered`` through the persistent cache; an unreadable entry is ignored and recompiled."""
    start = time.perf_counter()
    hits_before = _stats["persistent_hits"]
    # Thresholds at 0 (thread-local) so even small graphs are written to and read from disk.
    with _ours(), _jax_config.persistent_cache_min_compile_time_secs(0), \
            _jax_config.persistent_cache_min_entry_size_bytes(-1), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            compiled = lowered.compile(options or None)
        except Exception as exc:  # noqa: BLE001 - only cache failures are retried, below
            if not _is_cache_error(exc):
                raise
            compiled = _compile_without_cache(lowered, options, name, exc)
    _rewarn(caught, name)
    count("compile_seconds", time.perf_counter() - start)
    if _stats["persistent_hits"] == hits_before:
        count("compilations")
    return compiled


def _is_cache_error(exc: Exception) -> bool:
    return isinstance(exc, _jax_cache.CacheVerificationError) or "compilation cache" in str(exc).lower()


def _compile_without_cache(lowered, options, name: str, exc: Exception) -> jax.stages.Compiled:
    count("persistent_errors")
    warnings.warn(f"tpu: the persistent compilation cache failed for graph {name} ({type(exc).__name__}: "
                  f"{exc}); compiling without it", RuntimeWarning, stacklevel=4)
    with _jax_config.enable_compilation_cache(False):
        return lowered.compile(options or None)


def _rewarn(caught, name: str) -> None:
    for w in caught:
        if _UNREADABLE_WARNING in str(w.message):
            count("persistent_errors")
            warnings.warn(f"tpu: ignored an unreadable persistent compilation cache entry for graph {name} "
                          f"and recompiled it ({w.message})", RuntimeWarning, stacklevel=4)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
