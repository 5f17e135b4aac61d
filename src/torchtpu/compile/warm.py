"""Warm start: a new process skips aot_autograd's tracing, through PyTorch's own AOTAutograd cache.

PyTorch's AOTAutogradCache stores what aot_autograd made of a dynamo graph (the forward and
backward graphs after decomposition and partitioning, and the metadata its runtime wrappers need:
input mutations, output aliases, which activations the backward reads) and, on a hit, rebuilds
the wrappers around the stored graphs without tracing anything. It stores a backend's work only
when the backend's compilers return ``OutputCode`` objects it can pickle: ``GraphCode`` is ours,
a compiled graph that pickles as its aten graph and is rebuilt in the process that loads it
(lowered to JAX on its first call, its XLA executable loaded from JAX's persistent cache). It
lives in ``graph_code.py``: it subclasses an Inductor class, and this module must import without
Inductor (``install()`` runs while dynamo is being imported, Inductor half-way through its own).

The key is PyTorch's (the dynamo graph, its inputs' shapes, dtypes, strides and symbolic sizes
with their guards, the torch version, grad mode, autocast and the functorch settings) plus ours
(``key()``: torchtpu's and JAX's versions, the source of the modules that decide what is stored,
the decomposition table, the XLA options and the platform), which the backend hands over as an
attribute of the dynamo graph (PyTorch hashes the graph module's ``__dict__``).

Entries live in PyTorch's cache directory (``TORCHINDUCTOR_CACHE_DIR``, default
``/tmp/torchinductor_$USER``), under ``aotautograd/``; after each write the least recently
written entries beyond ``TORCHTPU_WARM_CACHE_SIZE`` are deleted. An unreadable entry, or one that
cannot be rebuilt, is skipped with a warning and the graph is traced again.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import logging
import os
import shutil
import warnings
from typing import Any, Iterator

import torch

from torchtpu import metrics
from torchtpu.compile import cache
from torchtpu.config import config
from torchtpu.runtime import compat

# The dynamo graph attribute that carries our part of the key: AOTAutogradCache hashes the graph
# module's ``__dict__`` (``AOTAutogradCachePickler._reduce_graph_module_for_cache_key``).
KEY_ATTR = "_torchtpu_warm_key"
_FORMAT = 1  # bump when what an entry holds changes meaning
# PyTorch's counters (torch._dynamo.utils.counters["aot_autograd"]) -> ours (cache_stats()).
_COUNTERS = {"autograd_cache_hit": "warm_hits", "autograd_cache_miss": "warm_misses",
             "autograd_cache_bypass": "warm_bypasses", "autograd_cache_saved": "warm_writes"}
# PyTorch skips an entry it cannot unpickle with this warning, on this logger (GuardedCache).
_UNREADABLE = "unable to load compiled graph"
_CODECACHE_LOGGER = "torch._inductor.codecache"


def enabled() -> bool:
    """Whether compiled graphs go through PyTorch's AOTAutograd cache (``TORCHTPU_WARM_START``)."""
    # An empty TORCHTPU_CACHE_DIR means no compilation caches on disk: this one too.
    return config.warm_start != "off" and bool(config.cache_dir) and not torch.compiler.config.force_disable_caches


def install() -> bool:
    """``TORCHTPU_WARM_START=dynamo``: turn on PyTorch's Dynamo cache, saved when the process exits.

    Called when dynamo is imported, before any ``torch.compile``. PyTorch's own switch
    (``TORCH_CACHING_PRECOMPILE``) wins where it is set. PyTorch writes its Dynamo cache only
    from ``torch.compiler.save_cache_artifacts()``: we call it at exit.
    """
    if config.warm_start != "dynamo" or not enabled():
        return False
    if os.environ.get("TORCH_CACHING_PRECOMPILE", "1") != "1":
        return False
    compat.dynamo_config.caching_precompile = True
    atexit.register(_save_dynamo_cache)
    return True


def uninstall() -> None:
    """Undo ``install`` (patch ``dynamo.warm_start`` in ``torchtpu.patches``)."""
    compat.dynamo_config.caching_precompile = False
    atexit.unregister(_save_dynamo_cache)


def _save_dynamo_cache() -> None:
    try:
        torch.compiler.save_cache_artifacts()
    except Exception as exc:  # noqa: BLE001 - at exit, a cache that cannot be written is only reported
        warnings.warn(f"tpu: could not write PyTorch's Dynamo cache ({type(exc).__name__}: {exc})", RuntimeWarning)


def key(options: dict[str, Any], decompositions: dict) -> str:
    """Our part of the cache key: everything of torchtpu's that shapes a stored graph."""
    import jax

    from torchtpu import __version__
    from torchtpu.runtime import platform

    parts = (_FORMAT, __version__, _sources_digest(), jax.__version__, platform.platform(),
             _names_digest(tuple(sorted(map(str, decompositions)))), repr(sorted(options.items())))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


@functools.cache
def _sources_digest() -> str:
    # The modules that decide what aot_autograd is asked for and what an entry holds.
    here = os.path.dirname(__file__)
    digest = hashlib.sha256()
    for name in ("backend.py", "warm.py", "graph_code.py"):
        with open(os.path.join(here, name), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


@functools.cache
def _names_digest(names: tuple[str, ...]) -> str:
    return hashlib.sha256("\n".join(names).encode()).hexdigest()


def cache_dir() -> str:
    """The directory of PyTorch's AOTAutograd cache, where the warm-start entries live."""
    return compat.aot_autograd_cache_dir()


@contextlib.contextmanager
def caching() -> Iterator[None]:
    """Around one aot_autograd call: store entries whole (our ``GraphCode``s, not keys into
    Inductor's FX graph cache), count hits and misses, warn of unreadable entries, keep the bound."""
    counters = compat.dynamo_counters
    before = dict(counters["aot_autograd"])
    unreadable = _Unreadable()
    logger = logging.getLogger(_CODECACHE_LOGGER)
    logger.addHandler(unreadable)
    try:
        # The backward graph is made now, not at the first backward(): the entry is written
        # once both exist, and only while this call's settings hold.
        with compat.functorch_config.patch(bundled_autograd_cache=True, force_non_lazy_backward_lowering=True):
            yield
    finally:
        logger.removeHandler(unreadable)
    after = counters["aot_autograd"]
    deltas = {ours: after.get(theirs, 0) - before.get(theirs, 0) for theirs, ours in _COUNTERS.items()}
    for name, delta in deltas.items():
        if delta:
            cache.count(name, delta)
    if deltas["warm_writes"]:
        prune(config.warm_cache_size)


class _Unreadable(logging.Handler):
    """Turns PyTorch's log line about an entry it could not unpickle into a warning of ours."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        if _UNREADABLE in record.getMessage():
            cache.count("warm_errors")
            detail = f" ({record.exc_info[1]!r})" if record.exc_info else ""
            warnings.warn(f"tpu: skipped an unreadable entry of the AOTAutograd cache in {cache_dir()}{detail} "
                          f"and traced the graph again; delete the directory if this repeats", RuntimeWarning,
                          stacklevel=2)


def prune(limit: int) -> int:
    """Delete the least recently written entries beyond ``limit`` (0: no limit); returns how many."""
    root = cache_dir()
    if limit <= 0 or not os.path.isdir(root):
        return 0
    entries = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        with contextlib.suppress(OSError):
            entries.append((os.path.getmtime(path), path))
    entries.sort()
    stale = entries[:max(len(entries) - limit, 0)]
    for _, path in stale:
        shutil.rmtree(path, ignore_errors=True)
    if stale:
        metrics.count_eviction("warm_start", len(stale))
    return len(stale)
