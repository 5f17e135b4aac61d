"""The persistent compilation cache on disk: bounded (``TORCHTPU_CACHE_MAX_SIZE``, least recently
used evicted first) and safe for processes that share its directory (``compile/cache.py``'s
``SharedDiskCache``): processes writing, reading and evicting at once see whole entries or none."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from jax._src import lru_cache as jax_lru

from cache_dirs import fresh_cache_dir
from processes import kill_tree
from torchtpu import metrics
from torchtpu.compile import cache
from torchtpu.config import _size

KiB = 1024


def entries(path) -> dict[str, int]:
    """key -> bytes of every entry in a cache directory."""
    return {p.name[:-len("-cache")]: p.stat().st_size for p in Path(path).glob("*-cache")}


def usage_file(path) -> dict:
    return json.loads((Path(path) / ".torchtpu-usage").read_text())


def evictions() -> int:
    return metrics.snapshot()["cache_evictions"].get("persistent_cache", 0)


def test_size_setting_takes_units():
    assert _size("0") == 0
    assert _size("1073741824") == _size("1G") == _size("1GiB") == _size("1024m") == 1 << 30
    assert _size("64K") == 64 * KiB and _size("1.5G") == 3 << 29
    for bad in ("-1", "G", "1Q", "ten"):
        with pytest.raises(ValueError, match="size in bytes"):
            _size(bad)


def test_writes_past_the_bound_evict_the_least_recently_used(tmp_path):
    bound = 64 * KiB
    disk = cache.SharedDiskCache(str(tmp_path), max_size=bound)
    before = evictions()
    for i in range(100):
        disk.put(f"k{i}", bytes([i]) * 4 * KiB)
        assert sum(entries(tmp_path).values()) <= bound
        if i % 8 == 0:
            assert disk.get("k0") == b"\0" * 4 * KiB  # used often: never the least recently used
    kept = entries(tmp_path)
    assert "k0" in kept and "k99" in kept and "k1" not in kept
    assert len(kept) == 16  # 64 KiB of 4 KiB entries
    evicted = evictions() - before
    assert evicted == 100 - 16
    assert usage_file(tmp_path) == {"bytes": sum(kept.values()), "entries": 16, "evictions": evicted}
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    # one atime record per entry, none left over: JAX's own eviction needs exactly that
    assert {p.name[:-len("-atime")] for p in tmp_path.glob("*-atime")} == set(kept)


def test_a_larger_entry_than_the_bound_is_not_written(tmp_path):
    disk = cache.SharedDiskCache(str(tmp_path), max_size=4 * KiB)
    with pytest.warns(RuntimeWarning, match="larger than the whole persistent cache"):
        disk.put("big", b"x" * 5 * KiB)
    assert disk.get("big") is None and not entries(tmp_path)


def test_an_unbounded_cache_still_keeps_its_usage(tmp_path):
    disk = cache.SharedDiskCache(str(tmp_path), max_size=-1)
    for i in range(20):
        disk.put(f"k{i}", b"x" * KiB)
    assert len(entries(tmp_path)) == 20
    assert usage_file(tmp_path) == {"bytes": 20 * KiB, "entries": 20, "evictions": 0}


def test_entries_written_before_the_bound_and_files_vanishing(tmp_path, monkeypatch):
    """A directory JAX filled without a bound has no access-time files (JAX's own bounded cache
    then fails every write: FileNotFoundError); entries deleted meanwhile by another process or
    by hand are skipped; a killed writer's temporary file and stray access-time files go."""
    unbounded = jax_lru.LRUCache(str(tmp_path), max_size=-1)
    for i in range(8):
        unbounded.put(f"old{i}", b"o" * 4 * KiB)
    assert not list(tmp_path.glob("*-atime"))
    (tmp_path / "gone-atime").write_bytes(b"\0" * 8)
    stale = tmp_path / ".old0-cache.x1y2.tmp"
    stale.write_bytes(b"half an entry")
    os.utime(stale, (time.time() - 3600,) * 2)

    real_scandir = os.scandir

    class Vanishing:
        """os.scandir whose listing still names old1-cache after it was deleted."""

        def __init__(self, path):
            self.listed = list(real_scandir(path))
            os.unlink(tmp_path / "old1-cache")

        def __enter__(self):
            return iter(self.listed)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(cache.os, "scandir", Vanishing)
    disk = cache.SharedDiskCache(str(tmp_path), max_size=24 * KiB)
    disk.put("new", b"n" * 4 * KiB)  # no usage file yet: measures (and tidies) the directory
    monkeypatch.undo()

    kept = entries(tmp_path)
    assert "new" in kept and "old1" not in kept and sum(kept.values()) <= 24 * KiB
    assert not stale.exists() and not (tmp_path / "gone-atime").exists()
    assert {p.name[:-len("-atime")] for p in tmp_path.glob("*-atime")} == set(kept)
    assert disk.get("old1") is None  # vanished: a miss, not an error
    # JAX's own bounded cache works on the directory again (it reads every access-time file)
    jax_lru.LRUCache(str(tmp_path), max_size=24 * KiB).put("jax", b"j" * 4 * KiB)
    assert sum(entries(tmp_path).values()) <= 24 * KiB


def test_the_runtime_uses_it_and_reports_it(tmp_path, monkeypatch):
    from jax._src import compilation_cache as jax_cache

    from torchtpu import cli

    assert (torch.arange(3, device="tpu") * 2).tolist() == [0, 2, 4]  # the runtime has started
    if cache.persistent_cache_dir() is None:
        pytest.skip("the persistent cache is off in this session")
    assert isinstance(jax_cache._cache, cache.SharedDiskCache)
    snap = metrics.snapshot()["persistent_cache"]
    assert set(snap) == {"directory", "bytes", "entries", "max_bytes", "evictions"}

    disk = cache.SharedDiskCache(str(tmp_path), max_size=8 * KiB)
    for i in range(4):
        disk.put(f"k{i}", b"x" * 3 * KiB)
    monkeypatch.setattr(cache, "persistent_cache_dir", lambda: str(tmp_path))
    usage = cache.persistent_cache_usage(exact=True)
    assert usage["bytes"] == 6 * KiB and usage["entries"] == 2 and usage["evictions"] == 2
    line = cli.persistent_cache_line()
    assert line.startswith(f"{tmp_path}: 6.0 KiB in 2 entries of at most ") and "2 evicted so far" in line
    assert f"persistent XLA cache: {line}" in cli.info_lines()


# ---------------------------------------------------------------- processes sharing one directory

def run_all(commands: list[list[str]], env: dict, timeout: float) -> list[subprocess.CompletedProcess]:
    """Run the commands at once; kill every one (and its children) still running at ``timeout``."""
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for cmd in commands]
    deadline = time.monotonic() + timeout
    results = []
    try:
        for proc, cmd in zip(procs, commands):
            out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
            results.append(subprocess.CompletedProcess(cmd, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait()
    return results


def child_env(tmp_path, **extra) -> dict:
    env = {**os.environ, "TORCHTPU_CACHE_DIR": str(fresh_cache_dir(tmp_path / "cache")), "TORCHTPU_PLATFORM": "cpu",
           **extra}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env.pop("JAX_COMPILATION_CACHE_MAX_SIZE", None)
    return env


def result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-4000:]}"
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))


# Reads and writes shared and own keys as fast as it can; values of 1-256 KiB name their key in
# every byte, so a reader would notice half an entry (JAX wrote entries in place: measured, 1580
# of 2594 reads of an 8 MiB entry being rewritten by another process came back torn).
CACHE_STRESS = textwrap.dedent("""
    import json, random, sys, time
    from torchtpu import metrics
    from torchtpu.compile.cache import SharedDiskCache

    path, rank, bound, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    disk = SharedDiskCache(path, max_size=bound)
    rng = random.Random(rank)

    def value(key):
        return key.encode().ljust(16, b".") * (64 * (1 + hash(key) % 256))

    counts = {"ops": 0, "hits": 0, "writes": 0, "torn": 0}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        key = f"shared{rng.randrange(12)}" if rng.random() < 0.6 else f"rank{rank}-{rng.randrange(8)}"
        got = disk.get(key)
        if got is None:
            disk.put(key, value(key))
            counts["writes"] += 1
        else:
            counts["hits"] += 1
            counts["torn"] += got != value(key)
        counts["ops"] += 1
    counts["evicted"] = metrics.snapshot()["cache_evictions"].get("persistent_cache", 0)
    print(json.dumps(counts))
""")


def test_processes_reading_writing_and_evicting_one_directory(tmp_path):
    path, bound = tmp_path / "xla", 2 << 20  # about 16 of the values: evictions all the time
    runs = run_all([[sys.executable, "-c", CACHE_STRESS, str(path), str(rank), str(bound), "4"]
                    for rank in range(4)], child_env(tmp_path, PYTHONHASHSEED="0"), timeout=240)
    counts = [result(run) for run in runs]
    assert all(c["torn"] == 0 for c in counts), counts
    assert all(c["hits"] and c["writes"] for c in counts), counts
    assert sum(entries(path).values()) <= bound
    recorded = usage_file(path)
    assert recorded["bytes"] == sum(entries(path).values()) and recorded["entries"] == len(entries(path))
    assert recorded["evictions"] == sum(c["evicted"] for c in counts) > 0
    assert not [p for p in path.iterdir() if p.name.endswith(".tmp")]


# Eager programs of shared and own shapes, compiled (or loaded) through the persistent cache.
EAGER = textwrap.dedent("""
    import json, sys, warnings
    import torch
    from torchtpu import metrics

    rank, shared, own = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    sizes = list(range(1, shared + 1)) + [1000 + 100 * rank + i for i in range(own)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in sizes[::-1] if rank % 2 else sizes:  # half the processes meet the shapes in reverse
            x = torch.arange(n, dtype=torch.float32, device="tpu")
            assert (x * 2 + 1).sum().item() == n * n
    snap = metrics.snapshot()
    print(json.dumps({"programs": snap["eager_compiles"], "usage": snap["persistent_cache"],
                      "evicted": snap["cache_evictions"].get("persistent_cache", 0),
                      "warnings": [str(w.message) for w in caught if "cache" in str(w.message).lower()]}))
""")


def test_processes_compiling_into_one_directory_stay_within_the_bound(tmp_path):
    """The issue's reproduction: torchrun-like processes compiling the same and different
    programs into one cache directory at once, with a bound small enough to evict meanwhile."""
    bound = 48 * KiB  # about 16 eager programs of about 3 KiB: less than one process compiles
    env = child_env(tmp_path, TORCHTPU_CACHE_MAX_SIZE="48K")
    runs = run_all([[sys.executable, "-c", EAGER, str(rank), "8", "3"] for rank in range(3)], env, timeout=400)
    out = [result(run) for run in runs]
    assert all(not o["warnings"] for o in out), [o["warnings"] for o in out]
    path = Path(out[0]["usage"]["directory"])
    assert path == tmp_path / "cache" / "xla" and out[0]["usage"]["max_bytes"] == bound
    written = sum(o["programs"]["compilations"] for o in out)
    assert written * 2 * KiB > bound  # they wrote past the bound
    assert 0 < sum(entries(path).values()) <= bound
    assert sum(o["evicted"] for o in out) == usage_file(path)["evictions"] > 0
    assert sum(o["programs"]["persistent_hits"] for o in out) > 0  # and loaded each other's programs
