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

- ``jax_compilation_cache_max_size = TORCHTPU_CACHE_MAX_SIZE`` (default 1 GiB; JAX's default:
  unlimited). Every eager kernel of every new shape is an entry, so without a bound the directory
  only grows; beyond the bound the least recently used entries are deleted.

``jax_persistent_cache_min_entry_size_bytes`` is left alone: JAX's default (0) already keeps
entries of any size. torch.compile graphs are written whatever the thresholds (``compile_lowered``
sets both to their minimum for its own compilations only, thread-locally).

**The cache on disk is shared**: torchrun ranks, engine replicas and pytest workers use one
directory at once. ``install()`` has JAX keep it with ``SharedDiskCache``, JAX's own LRU file cache
(the same files, the same lock, the same least-recently-used policy) with what sharing needs:
entries appear whole (written to a temporary file and renamed: JAX wrote them in place, and
another process could read half an entry: measured, 1580 of 2594 reads of an 8 MiB entry that
another process rewrote), the lock is taken whatever the bound (JAX takes it only when bounded),
a file vanishing under a reader or a measurement (evicted by another process, deleted by hand) is
skipped, and the directory is measured once per eviction, not once per write (JAX lists it and
reads every entry's access time at each write, holding the lock every process waits on: 0.1 s
with 1,000 entries, 1-2 s with 10,000).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import warnings
import weakref
from typing import Any, Iterator

import filelock
import jax

from torchtpu import metrics
from torchtpu.config import config
from torchtpu.runtime.compat import JAX_ATIME_SUFFIX, JAX_CACHE_SUFFIX, JaxLRUCache
from torchtpu.runtime.compat import jax_compilation_cache as _jax_cache, jax_config as _jax_config

# JAX's monitoring events for its persistent cache (jax/_src/compiler.py).
_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_MISS_EVENT = "/jax/compilation_cache/cache_misses"
_UNREADABLE_WARNING = "Error reading persistent compilation cache entry"
# JAX's default for jax_persistent_cache_min_compile_time_secs, and the variable that sets it.
_JAX_MIN_COMPILE_TIME_DEFAULT = 1.0
_MIN_COMPILE_TIME_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
_MAX_SIZE_ENV = "JAX_COMPILATION_CACHE_MAX_SIZE"  # JAX's default, -1, is no limit

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
        _bound_the_cache()
        _jax_cache.get_file_cache = _file_cache
        _jax_cache.reset_cache()  # made by _file_cache from now on, even if JAX made one already
        metrics.register_source("persistent_cache", persistent_cache_usage)
    jax.monitoring.register_event_listener(_on_event)


def _keep_small_programs() -> None:
    """Persist programs however fast they compiled (eager kernels), unless the user set a threshold."""
    if os.environ.get(_MIN_COMPILE_TIME_ENV) is not None:
        return
    if _jax_config.persistent_cache_min_compile_time_secs.value != _JAX_MIN_COMPILE_TIME_DEFAULT:
        return
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def _bound_the_cache() -> None:
    """JAX's cache size limit from ``TORCHTPU_CACHE_MAX_SIZE``, unless the user set JAX's."""
    if os.environ.get(_MAX_SIZE_ENV) is not None or _jax_config.compilation_cache_max_size.value != -1:
        return
    # Our 0 is "no limit", as for every TORCHTPU_*_SIZE; JAX's 0 would turn the cache off.
    jax.config.update("jax_compilation_cache_max_size", config.cache_max_size or -1)


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


# ---------------------------------------------------------------- the cache on disk, shared

_USAGE_FILE = ".torchtpu-usage"  # bytes and entries in the directory, evictions so far (JSON)
_LOW_WATER = 0.9  # an eviction frees down to 90% of the bound: the next one is 10% of it away
_LOCK_TIMEOUT = 60  # seconds; a measurement (the lock held) takes about 0.2 s per 10,000 entries
_STALE_TMP_SECONDS = 600  # a temporary entry this old was left by a writer that was killed


class SharedDiskCache(JaxLRUCache):
    """JAX's LRU file cache, safe and cheap for processes that share its directory.

    The files are JAX's (``<key>-cache``; ``<key>-atime``, rewritten at every read: its time is the
    entry's last use; ``.lockfile``), so a JAX process of your own can share the directory. Every
    read and write holds the lock, as in JAX's bounded cache; entries are written whole (renamed
    into place). A ``.torchtpu-usage`` file
    keeps the directory's bytes and entries, so a write only measures the directory (and evicts)
    when the total would pass the bound; it is re-measured then, whatever wrote or deleted
    entries without it. Files vanishing under a measurement (deleted by hand) are skipped.
    """

    def __init__(self, path: str, *, max_size: int):
        super().__init__(path, max_size=max_size, lock_timeout_secs=_LOCK_TIMEOUT)
        self.directory = os.fspath(path)
        if not self.eviction_enabled:  # JAX made no lock (unbounded): the usage file needs one
            self.lock = filelock.FileLock(os.path.join(self.directory, ".lockfile"))
            self.lock_timeout_secs = _LOCK_TIMEOUT

    def _locked(self):
        return self.lock.acquire(timeout=self.lock_timeout_secs)

    def _file(self, key: str, suffix: str) -> str:
        if not key:
            raise ValueError("key cannot be empty")
        return os.path.join(self.directory, key + suffix)

    def get(self, key: str) -> bytes | None:
        path = self._file(key, JAX_CACHE_SUFFIX)
        with self._locked():
            try:
                with open(path, "rb") as f:
                    value = f.read()
            except FileNotFoundError:
                return None
            _touch(self._file(key, JAX_ATIME_SUFFIX))
        return value

    def put(self, key: str, value: bytes) -> None:
        path = self._file(key, JAX_CACHE_SUFFIX)
        if self.eviction_enabled and len(value) > self.max_size:
            warnings.warn(f"tpu: an XLA executable of {len(value)} bytes is larger than the whole persistent "
                          f"cache ({self.max_size} bytes, TORCHTPU_CACHE_MAX_SIZE): not written", RuntimeWarning)
            return
        evicted: list[str] = []
        with self._locked():
            if os.path.exists(path):  # another process wrote it meanwhile
                return
            usage = self._read_usage()
            if usage is None or (self.eviction_enabled and usage["bytes"] + len(value) > self.max_size):
                usage, evicted = self._measure(incoming=len(value))
            _write_atomic(path, value)
            _touch(self._file(key, JAX_ATIME_SUFFIX))
            usage["bytes"] += len(value)
            usage["entries"] += 1
            self._write_usage(usage)
        # Deleted once the lock is released: unlinking thousands of files can take seconds (with
        # the file system's online discard, 2.5 ms a file was measured) and nobody needs to wait.
        # Until then a reader may still load an evicted entry, which is whole: no harm.
        for key in evicted:
            for suffix in (JAX_CACHE_SUFFIX, JAX_ATIME_SUFFIX):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._file(key, suffix))
        if evicted:
            metrics.count_eviction("persistent_cache", len(evicted))

    def _measure(self, incoming: int) -> tuple[dict[str, int], list[str]]:
        """Measure the directory (the lock held); if ``incoming`` more bytes would pass the bound,
        choose the least recently used entries to evict down to the low-water mark. Returns the
        usage without them, and their keys (for the caller to delete)."""
        entries = _scan(self.directory, migrate=True)
        total = sum(size for size, _ in entries.values())
        evicted: list[str] = []
        if self.eviction_enabled and total + incoming > self.max_size:
            target = int(self.max_size * _LOW_WATER) - incoming
            for key in sorted(entries, key=lambda k: entries[k][1]):
                if total <= target:
                    break
                total -= entries[key][0]
                evicted.append(key)
        before = self._read_usage() or {}
        usage = {"bytes": total, "entries": len(entries) - len(evicted),
                 "evictions": before.get("evictions", 0) + len(evicted)}
        return usage, evicted

    def _read_usage(self) -> dict[str, int] | None:
        return _read_usage(self.directory)

    def _write_usage(self, usage: dict[str, int]) -> None:
        _write_atomic(os.path.join(self.directory, _USAGE_FILE), json.dumps(usage).encode())


def _write_atomic(path: str, data: bytes) -> None:
    """Write ``path`` so that a reader sees the old file, or none, or the new one whole."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.{threading.get_ident()}.{os.urandom(4).hex()}.tmp")
    try:
        # os.open, not mkstemp: its 0600 would keep other users sharing the directory out
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _touch(path: str, when: int | None = None) -> None:
    """Record a use of an entry in its access-time file: the time in its bytes (what JAX reads) and
    as its modification time (what ``_scan`` reads: a stat, not an open and a read). The lock is
    held: nothing reads the file meanwhile, so it is written in place. An evicting process may
    delete it meanwhile (it deletes after releasing the lock): the next measurement tidies up."""
    when = time.time_ns() if when is None else when
    with open(path, "wb", buffering=0) as f:  # unbuffered: no write after the utime
        f.write(when.to_bytes(8, "little"))
        os.utime(f.fileno(), ns=(when, when))  # the open file: it may have been unlinked since


def _read_usage(path: str) -> dict[str, int] | None:
    try:
        with open(os.path.join(path, _USAGE_FILE), "rb") as f:
            usage = json.loads(f.read())
        return {k: int(usage[k]) for k in ("bytes", "entries", "evictions")}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _scan(path: str, migrate: bool = False) -> dict[str, tuple[int, int]]:
    """Every entry under ``path``: key -> (bytes, last use in ns). One pass, a stat per file.

    ``migrate`` (the lock held) also tidies: entries written before the cache was bounded get the
    access-time file JAX's own eviction requires (their write time), and access-time files without
    an entry and temporary files of killed writers are deleted."""
    cache, atime = JAX_CACHE_SUFFIX, JAX_ATIME_SUFFIX
    sizes: dict[str, tuple[int, int]] = {}
    used: dict[str, int] = {}
    stale = time.time() - _STALE_TMP_SECONDS
    with os.scandir(path) as it:
        for entry in it:
            try:
                st = entry.stat()
            except FileNotFoundError:  # deleted meanwhile
                continue
            if entry.name.endswith(cache):
                sizes[entry.name[:-len(cache)]] = (st.st_size, st.st_mtime_ns)
            elif entry.name.endswith(atime):
                used[entry.name[:-len(atime)]] = st.st_mtime_ns
            elif migrate and entry.name.endswith(".tmp") and st.st_mtime < stale:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
    if migrate:
        for key in used.keys() - sizes.keys():
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(path, key + atime))
        for key in sizes.keys() - used.keys():
            with contextlib.suppress(OSError):
                _touch(os.path.join(path, key + atime), when=sizes[key][1])
    return {key: (size, used.get(key, written)) for key, (size, written) in sizes.items()}


_JAX_FILE_CACHE = _jax_cache.get_file_cache


def _file_cache(path: str):
    """JAX's ``get_file_cache``, with a ``SharedDiskCache`` for a local directory."""
    if "://" in path:  # a remote file system (etils): JAX's own
        return _JAX_FILE_CACHE(path)
    cache = SharedDiskCache(path, max_size=_jax_config.compilation_cache_max_size.value)
    if _jax_config.compilation_cache_check_contents.value:
        return _jax_cache.VerificationCache(cache), path
    return cache, path


def persistent_cache_usage(exact: bool = False) -> dict[str, Any]:
    """The persistent cache: ``directory``, ``bytes`` and ``entries`` in it, ``max_bytes`` (0: no
    limit) and ``evictions`` (by every process since the directory was made; this process's are
    ``metrics.snapshot()["cache_evictions"]["persistent_cache"]``). ``bytes``/``entries`` come from
    the usage file (kept by every write), or, ``exact`` or without one, from listing the directory."""
    path = persistent_cache_dir()
    limit = _jax_config.compilation_cache_max_size.value
    usage = {"directory": path, "bytes": 0, "entries": 0, "max_bytes": max(limit, 0), "evictions": 0}
    if not path or not os.path.isdir(path):
        return usage
    recorded = _read_usage(path)
    if recorded:
        usage.update(recorded)
    if exact or not recorded:
        entries = _scan(path)
        usage.update(bytes=sum(size for size, _ in entries.values()), entries=len(entries))
    return usage
