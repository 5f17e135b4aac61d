"""The C++ PrivateUse1 hooks (``runtime/native.py``, ``csrc/hooks.cpp``): pinned memory,
storage resizing, the device allocator behind torch.accelerator's memory functions (generators:
``test_ops_random.py``).

PyTorch takes PrivateUse1 hooks once per process, and importing torchtpu registers them, so the
build and pinned-memory cases run in a fresh child with ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` that
imports ``native`` alone (through stub parent packages, which also checks that it needs nothing
else of torchtpu) and registers the device itself. Children run in their own process group,
killed as a whole when they end or time out, so no DataLoader worker outlives a test. The cases
that need the runtime run in this process, where importing torchtpu registered the hooks.
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
from torchtpu.runtime import native

from native_required import native_hooks_needed, skip_without_native

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
class _Callbacks:  # what the hooks ask of Python (torchtpu.device.hooks): the ones these tests reach
    is_available = staticmethod(lambda: True)
    has_primary_context = staticmethod(lambda index: True)

torch._register_device_module("tpu", _Module)
assert native.register_hooks(_Callbacks), native.unavailable_reason()
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
        skip_without_native(f"the C++ hooks cannot be built here: {reason}")


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
        assert native.register_hooks(_Callbacks)
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
        native._SOURCES = [{broken!r}]
        t0 = time.perf_counter()
        assert native.load() is None
        reason = native.unavailable_reason()
        assert reason and "\\n" not in reason, reason
        assert native.register_hooks(object()) is False
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
        native._SOURCES = [{broken!r}]
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


needs_hooks = native_hooks_needed()


def _storage_tensor(storage, dtype=torch.float32):
    """A tensor over all of ``storage``."""
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage)


@needs_hooks
@pytest.mark.usefixtures("each_eager_mode")
@pytest.mark.parametrize("device", ["cpu", "tpu"])
def test_storage_resize_as_fsdp2(device):
    """FSDP2 frees an unsharded parameter with storage.resize_(0) and re-allocates it with
    resize_(n) before copying all-gathered data in; views see the new data, as on the CPU."""
    t = torch.randn(1000, device=device)
    view = t[10:20]
    storage = t.untyped_storage()
    torch.accelerator.synchronize()  # the fused mode's pending work runs: t's array exists
    before = torch.accelerator.memory_allocated() if device == "tpu" else 0
    storage.resize_(0)
    assert storage.nbytes() == 0 and t.untyped_storage().nbytes() == 0
    if device == "tpu":  # its array is gone, and its bytes with it
        assert torch.accelerator.memory_allocated() <= before - 4000
    storage.resize_(4000)
    assert storage.nbytes() == 4000 and t.untyped_storage() is storage
    src = torch.randn(1000)
    t.copy_(src.to(device))
    assert torch.equal(t.cpu(), src) and torch.equal(view.cpu(), src[10:20])
    view.mul_(2)  # still one storage
    assert torch.equal(t[10:20].cpu(), src[10:20] * 2)


@needs_hooks
@pytest.mark.parametrize("device", ["cpu", "tpu"])
def test_storage_resize_keeps_the_prefix(device):
    t = torch.arange(10.0, device=device)
    storage = t.untyped_storage()
    address = storage.data_ptr()
    storage.resize_(80)  # grows: the first 40 bytes kept (the rest uninitialised: zeros on tpu)
    assert storage.nbytes() == 80 and storage.data_ptr() != address
    assert torch.equal(_storage_tensor(storage)[:10].cpu(), torch.arange(10.0))
    storage.resize_(16)  # shrinks: truncated
    assert torch.equal(_storage_tensor(storage).cpu(), torch.arange(4.0))
    storage.resize_(6)  # not a whole number of float32s: the bytes are kept
    assert torch.equal(_storage_tensor(storage, torch.uint8).cpu(), torch.arange(4.0).view(torch.uint8)[:6])
    empty = torch.empty(0, device=device).untyped_storage()  # a storage that never had an array
    empty.resize_(8)
    assert _storage_tensor(empty).shape == (2,)


@needs_hooks
@pytest.mark.parametrize("device", ["cpu", "tpu"])
def test_tensor_resize_grows_its_storage_in_place(device):
    t = torch.arange(4.0, device=device)
    storage, view = t.untyped_storage(), t[:2]
    t.resize_(8)
    assert t.untyped_storage() is storage and view.untyped_storage().nbytes() == 32
    assert torch.equal(t[:4].cpu(), torch.arange(4.0))
    t[:2] = 7.0
    assert torch.equal(view.cpu(), torch.full((2,), 7.0))


@needs_hooks
def test_accelerator_memory_functions():
    x = torch.ones(4096, device="tpu")
    accelerator = torch.accelerator
    stats = accelerator.memory_stats()
    assert stats["allocated_bytes.all.current"] == torch.tpu.memory_allocated() >= x.nbytes
    accelerator.empty_cache()  # frees earlier tests' garbage now, not between the two readings
    before = accelerator.memory_allocated()
    y = torch.ones(8192, device="tpu")
    assert accelerator.memory_allocated() - before == y.nbytes
    assert accelerator.max_memory_allocated() >= accelerator.memory_allocated()
    assert accelerator.memory_reserved() >= accelerator.memory_allocated()
    del y
    accelerator.empty_cache()
    assert accelerator.memory_allocated() == before
    accelerator.reset_peak_memory_stats()
    assert accelerator.max_memory_allocated() == accelerator.memory_allocated()
    free, total = accelerator.get_memory_info()
    assert (free, total) == torch.tpu.mem_get_info() == torch.tpu.mem_get_info("tpu:0")
    assert 0 < free <= total and total - free >= x.nbytes
    accelerator.synchronize()
    accelerator.synchronize(0)


@needs_hooks
def test_storages_pytorch_creates_on_tpu():
    storage = torch.UntypedStorage(16, device="tpu")  # crashed without a device allocator
    assert storage.nbytes() == 16 and storage.device == torch.device("tpu", 0)
    assert torch.equal(_storage_tensor(storage).cpu(), torch.zeros(4))  # zeros at first use
    assert storage.data_ptr() != torch.UntypedStorage(16, device="tpu").data_ptr()
    assert torch.empty(3, device="tpu").untyped_storage().nbytes() == 12


def _failed_build(tmp_path) -> None:
    """A cache directory whose build of the C++ hooks is remembered as failed."""
    name, build_dir = native._location()
    tag_dir = tmp_path / "ext" / os.path.basename(build_dir)
    tag_dir.mkdir(parents=True)
    (tag_dir / f"{name}.failed").write_text("the C++ hooks failed to build: no compiler (test)")


def test_a_required_extension_that_cannot_be_built_fails(tmp_path):
    """TORCHTPU_REQUIRE_NATIVE=1 (CI sets it): a failed build is an error, not a warning."""
    _failed_build(tmp_path)
    proc = subprocess.run([sys.executable, "-c", "import torch; torch.zeros(1, device='tpu')"], capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "TORCHTPU_CACHE_DIR": str(tmp_path), "TORCHTPU_REQUIRE_NATIVE": "1"})
    assert proc.returncode != 0
    assert "TORCHTPU_REQUIRE_NATIVE" in proc.stderr and "no compiler (test)" in proc.stderr, proc.stderr[-2000:]


def test_without_the_extension(tmp_path):
    """A failed build: a warning names what needs the C++ hooks; everything else works."""
    _failed_build(tmp_path)
    code = textwrap.dedent("""
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import torch
        from torchtpu.runtime import native
        assert not native.registered()
        message = " ".join(str(w.message) for w in caught)
        assert "no compiler (test)" in message and "torch.Generator('tpu')" in message, message
        assert "UntypedStorage.resize_" in message and "memory statistics" in message, message
        t = torch.arange(4.0, device="tpu")
        t.resize_(8)  # a new storage for t, the old elements kept
        assert torch.equal(t[:4].cpu(), torch.arange(4.0)) and t.untyped_storage().nbytes() == 32
        torch.manual_seed(1)
        drawn = torch.randn(3, device="tpu").cpu()
        torch.manual_seed(1)
        assert torch.equal(torch.randn(3, device="tpu").cpu(), drawn)
        free, total = torch.tpu.mem_get_info()
        assert 0 < free <= total and torch.tpu.memory_allocated() > 0
        try:
            t.untyped_storage().resize_(0)
        except NotImplementedError as exc:
            assert "resizePrivateUse1Bytes" in str(exc)
        else:
            raise AssertionError("resize_ worked without the C++ hooks")
        print("OK")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TORCHTPU_CACHE_DIR": str(tmp_path), "TORCHTPU_REQUIRE_NATIVE": "0"})
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
