"""The C++ PrivateUse1 hooks (``runtime/native.py``, ``csrc/hooks.cpp``): pinned memory.

PyTorch takes PrivateUse1 hooks once per process, and importing torchtpu registers them, so each
case runs in a fresh child with ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` that imports ``native``
alone (through stub parent packages, which also checks that it needs nothing else of torchtpu)
and registers the device itself. Children run in their own process group, killed as a whole
when they end or time out, so no DataLoader worker outlives a test.
"""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import torchtpu

SRC = os.path.dirname(os.path.abspath(torchtpu.__file__))

# Import runtime/native.py without running torchtpu/__init__.py (which registers the device).
PRELUDE = """
import gc, os, sys, time, types
for _name, _path in (("torchtpu", {src!r}), ("torchtpu.runtime", {src!r} + "/runtime")):
    _stub = types.ModuleType(_name); _stub.__path__ = [_path]; sys.modules[_name] = _stub
import torch
from torchtpu.runtime import native
"""

# What torch.utils.backend_registration._setup_privateuseone_for_python_backend does, with the
# C++ hooks instead of the Python ones. The DataLoader needs the device module
# (torch.accelerator.is_available) and the guard (torch.accelerator.current_device_index).
REGISTER = """
class _Module:
    is_available = staticmethod(lambda: True)
    is_initialized = staticmethod(lambda: True)
    device_count = staticmethod(lambda: 1)
    current_device = staticmethod(lambda: 0)
    _is_in_bad_fork = staticmethod(lambda: False)
    manual_seed_all = staticmethod(lambda seed: None)

class _Guard(torch._C._acc.DeviceGuard):
    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1

torch.utils.rename_privateuse1_backend("tpu")
torch.utils.generate_methods_for_privateuse1_backend()
torch._register_device_module("tpu", _Module)
assert native.register_hooks(lambda: True, lambda i: True), native.unavailable_reason()
torch._C._acc.register_python_privateuseone_device_guard(_Guard())
"""


def _run(code: str, timeout: float = 60, register: bool = False, **env: str) -> str:
    """Run ``code`` in a fresh Python (autoload off, the device registered if ``register``); return its output."""
    source = PRELUDE.format(src=SRC) + (REGISTER if register else "") + textwrap.dedent(code)
    proc = subprocess.Popen([sys.executable, "-c", source], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", **env}, text=True,
                            start_new_session=True)
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the child and anything it left behind
        except ProcessLookupError:
            pass
    if timed_out:
        pytest.fail(f"child timed out after {timeout} s:\n{proc.communicate()[0]}")
    assert proc.returncode == 0, out
    return out


@pytest.fixture(scope="module")
def built():
    """Build the extension (first use only: may take a minute) in the shared cache; skip if it cannot be."""
    out = _run("""
        module = native.load()
        print("REASON:", native.unavailable_reason() if module is None else "")
    """, timeout=900)
    reason = out.rsplit("REASON:", 1)[1].strip()
    if reason:
        pytest.skip(f"the C++ hooks cannot be built here: {reason}")


def test_cached_load_is_fast_and_imports_little(built):
    out = _run("""
        t0 = time.perf_counter()
        assert native.load() is not None
        print(f"LOAD_MS {(time.perf_counter() - t0) * 1e3:.1f}")
        assert "torch.utils.cpp_extension" not in sys.modules  # the fast path skips it
        assert "jax" not in sys.modules
        assert sorted(m for m in sys.modules if m.startswith("torchtpu")) == [
            "torchtpu", "torchtpu.config", "torchtpu.runtime", "torchtpu.runtime.native"]
    """)
    assert "LOAD_MS" in out


def test_pin_memory_and_is_pinned(built):
    _run(register=True, code="""
        base = native.pinned_bytes()
        x = torch.randn(4, 4)
        assert not x.is_pinned()
        p = x.pin_memory()
        assert p.is_pinned() and p.device.type == "cpu" and torch.equal(p, x)
        assert native.pinned_bytes() == base + 64
        assert p[1:, 2:].is_pinned() and p[3].is_pinned()  # views of pinned memory are pinned
        # A storage that starts inside the pinned block: the interior-pointer lookup.
        inner = torch.tensor([]).set_(p.untyped_storage()[16:32])
        assert inner.data_ptr() == p.data_ptr() + 16 and inner.is_pinned()
        assert not torch.randn(4, 4).is_pinned()
        assert not torch.empty(0).pin_memory().is_pinned()  # no bytes, nothing pinned
        q = torch.arange(10, dtype=torch.int64).pin_memory()
        assert q.is_pinned() and native.pinned_bytes() == base + 64 + 80
        del p, inner, q
        gc.collect()
        assert native.pinned_bytes() == base
        # The hooks cannot be registered twice by someone else; ours can be (callables swapped).
        assert torch._C._acc.register_python_privateuseone_hook(
            torch.utils.backend_registration._DummyPrivateUse1Hook()) is False
        assert native.register_hooks(lambda: True, lambda i: True)
        assert torch.randn(2).pin_memory().is_pinned()
    """)


def test_dataloader_pins_batches(built):
    _run(register=True, code="""
        import multiprocessing
        from torch.utils.data import DataLoader, TensorDataset

        assert torch.accelerator.current_accelerator().type == "tpu"
        data = torch.arange(64 * 3, dtype=torch.float32).reshape(64, 3)
        labels = torch.arange(64)
        loader = DataLoader(TensorDataset(data, labels), batch_size=8, pin_memory=True, num_workers=2)
        xs, ys = [], []
        for xb, yb in loader:
            assert xb.is_pinned() and yb.is_pinned()
            xs.append(xb)
            ys.append(yb)
        assert len(xs) == 8
        assert torch.equal(torch.cat(xs), data) and torch.equal(torch.cat(ys), labels)
        assert native.pinned_bytes() >= data.nbytes + labels.nbytes
        del loader, xs, ys, xb, yb
        gc.collect()
        assert native.pinned_bytes() == 0
        deadline = time.monotonic() + 10
        while multiprocessing.active_children() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not multiprocessing.active_children()
    """)


def test_build_failure_is_one_line_and_remembered(tmp_path):
    broken = tmp_path / "hooks.cpp"
    broken.write_text("this is not C++;\n")
    stale = """
        native._SOURCE = {broken!r}
        t0 = time.perf_counter()
        assert native.load() is None
        reason = native.unavailable_reason()
        assert reason and "\\n" not in reason, reason
        assert native.register_hooks(lambda: True, lambda i: True) is False
        assert native.pinned_bytes() == 0
        print("REASON:", reason)
        print(f"SECONDS {{time.perf_counter() - t0:.2f}}")
    """.format(broken=str(broken))
    first = _run(stale, TORCHTPU_CACHE_DIR=str(tmp_path / "cache"))
    assert "error" in first.lower()
    second = _run(stale, TORCHTPU_CACHE_DIR=str(tmp_path / "cache"))
    assert "remembered" in second  # not rebuilt by every process


def test_stale_locks_do_not_hang(tmp_path):
    """A builder killed while holding the locks (ours and an old torch's lock file) blocks nobody."""
    broken = tmp_path / "hooks.cpp"
    broken.write_text("this is not C++ either;\n")
    _run("""
        import fcntl, signal, subprocess
        native._SOURCE = {broken!r}
        name, build_dir = native._location()
        os.makedirs(build_dir)
        open(os.path.join(build_dir, "lock"), "w").close()  # FileBaton's lock file, left behind
        # A process that takes our build lock, then dies with it.
        holder = subprocess.Popen([sys.executable, "-c", (
            "import fcntl, os, time; fd = os.open({{lock!r}}, os.O_RDWR | os.O_CREAT); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(600)"
        ).format(lock=os.path.join(build_dir, "build.lock"))], stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "held"
        holder.kill()
        holder.wait()
        # Neither lock blocks: the build runs (and fails on the broken source) within the timeout.
        assert native.load() is None and "remembered" not in native.unavailable_reason()
    """.format(broken=str(broken)), TORCHTPU_CACHE_DIR=str(tmp_path / "cache"))


def test_pinned_host_to_tpu_in_process():
    x = torch.randn(64, 8).pin_memory()
    assert x.is_pinned()
    y = x.to("tpu", non_blocking=True)
    torch.testing.assert_close(y.cpu(), x)
    data, labels = torch.randn(64, 8), torch.arange(64)
    loader = DataLoader(TensorDataset(data, labels), batch_size=8, pin_memory=True, num_workers=2)
    seen = []
    for xb, yb in loader:
        assert xb.is_pinned() and yb.is_pinned()
        xt, yt = xb.to("tpu", non_blocking=True), yb.to("tpu", non_blocking=True)
        assert xt.device.type == "tpu"
        seen.append((xt.cpu(), yt.cpu()))
    torch.testing.assert_close(torch.cat([x for x, _ in seen]), data)
    torch.testing.assert_close(torch.cat([y for _, y in seen]), labels)
