"""The compilation caches across processes: XLA executables (JAX's persistent cache), aot_autograd's
graphs (PyTorch's AOTAutograd cache, compile/warm.py), corrupt entries, buffer donation."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from cache_dirs import fresh_cache_dir

# A child process: compiles a small training-like update, prints its cache stats as JSON.
CHILD = textwrap.dedent("""
    import json, warnings
    import torch
    import torchtpu.compile as tpu_compile

    tpu_compile.install()
    torch.tpu.enable_cpu_fallback(False)

    def update(p, g):
        with torch.no_grad():
            p.mul_(0.5).add_(torch.tanh(g) @ g.T)
        return p.sum()

    p0, g0 = torch.linspace(-1, 1, 64).reshape(8, 8), torch.linspace(0, 2, 64).reshape(8, 8)
    p = p0.to("tpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(update, backend="tpu")(p, g0.to("tpu"))
    ref = update(p0.clone(), g0)
    torch.testing.assert_close(out.cpu(), ref)
    torch.testing.assert_close(p.cpu(), p0 * 0.5 + torch.tanh(g0) @ g0.T)
    stats = tpu_compile.compiler.cache_stats()
    stats["warnings"] = [str(w.message) for w in caught if "cache" in str(w.message)]
    stats["cache_dir"] = tpu_compile.compiler.persistent_cache_dir()
    print("STATS" + json.dumps(stats))
""")


def run_child(cache_dir) -> dict:
    env = {**os.environ, "TORCHTPU_CACHE_DIR": str(fresh_cache_dir(cache_dir)), "TORCHTPU_PLATFORM": "cpu",
           "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache_dir, "torch"), "TORCHTPU_WARM_START": "aot"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("STATS"))
    return json.loads(line[len("STATS"):])


def cache_files(cache_dir) -> list[str]:
    # os.walk does not enter the linked extension build (cache_dirs.py): only the XLA caches
    return [os.path.join(root, f) for root, _, files in os.walk(cache_dir) for f in files]


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory):
    cache_dir = tmp_path_factory.mktemp("xla_cache")
    first = run_child(cache_dir)
    return cache_dir, first


def test_first_process_compiles_and_writes_the_cache(warm_cache):
    cache_dir, first = warm_cache
    assert first["cache_dir"].startswith(str(cache_dir))
    assert first["compilations"] >= 1
    assert first["persistent_hits"] == 0
    assert first["persistent_writes"] >= 1
    assert first["warm_writes"] == first["warm_misses"] >= 1  # aot_autograd's graphs, stored
    assert first["warm_hits"] == 0
    assert cache_files(cache_dir)


def test_mutated_input_buffer_is_donated(warm_cache):
    _, first = warm_cache
    assert first["donated_buffers"] == 1  # p's buffer was reused by XLA for p's new value


def test_second_process_loads_from_disk(warm_cache):
    cache_dir, first = warm_cache
    second = run_child(cache_dir)
    assert second["misses"] == first["misses"]  # nothing in memory in a new process
    assert second["persistent_hits"] == first["misses"]
    assert second["compilations"] == 0  # XLA did not compile
    assert second["warm_hits"] == second["warm_loads"] == first["warm_writes"]  # aot_autograd did not trace
    assert second["warm_misses"] == 0


def test_corrupt_entries_are_ignored_and_recompiled(tmp_path):
    run_child(tmp_path)
    files = cache_files(tmp_path)
    assert files
    for path in files:
        with open(path, "r+b") as f:
            size = max(os.path.getsize(path), 16)
            f.seek(0)
            f.write(b"\x00garbage\xff" * (size // 9 + 1))
    stats = run_child(tmp_path)  # must not fail: the child also checks its results
    assert stats["compilations"] >= 1
    assert stats["persistent_hits"] == 0
    assert stats["persistent_errors"] >= 1
    assert any("unreadable persistent compilation cache entry" in w for w in stats["warnings"]), stats["warnings"]
    assert stats["warm_errors"] >= 1 and stats["warm_hits"] == 0  # the AOTAutograd cache's entry too
    assert any("unreadable entry of the AOTAutograd cache" in w for w in stats["warnings"]), stats["warnings"]
