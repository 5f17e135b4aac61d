"""The ``torch.tpu`` module, multiple devices, RNG, eager modes and the CPU fallback."""

import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch.testing import assert_close

import torchtpu


def test_autoload_with_plain_import_torch():
    code = "import torch; print(torch.randn(2, 2, device='tpu').sum().item() is not None, torch.tpu.is_available())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True True"


def test_device_module_basics():
    assert torch.tpu.is_available()
    torch.ones(1, device="tpu")  # the runtime starts at first use (tests/test_lazy_start.py)
    assert torch.tpu.is_initialized()
    assert torch.tpu.device_count() == 4  # conftest asks XLA for 4 CPU devices
    assert torch.tpu.get_device_name() == "XLA:CPU"
    props = torch.tpu.get_device_properties(0)
    assert props.name == "XLA:CPU" and props.platform == "cpu"
    assert torch.tpu.get_amp_supported_dtype() == [torch.bfloat16, torch.float16]


def test_current_device_and_context():
    assert torch.tpu.current_device() == 0
    with torch.tpu.device(2):
        assert torch.tpu.current_device() == 2
        x = torch.ones(2, device="tpu")
        assert x.device == torch.device("tpu", 2)
    assert torch.tpu.current_device() == 0
    torch.tpu.set_device("tpu:1")
    try:
        assert torch.tpu.current_device() == 1
    finally:
        torch.tpu.set_device(0)
    with pytest.raises(RuntimeError, match="Invalid device ordinal"):
        torch.tpu.set_device(9)


def test_multi_device_placement():
    a = torch.arange(6.0).reshape(2, 3)
    for i in range(torch.tpu.device_count()):
        x = a.to(f"tpu:{i}")
        assert x.device == torch.device("tpu", i)
        y = (x * 2).t()[1]
        assert y.device == torch.device("tpu", i)
        assert_close(y.cpu(), (a * 2).t()[1])
        # the jax.Array lives on the matching PJRT device
        assert torchtpu.device.bridge.read(x).devices() == {torchtpu.runtime.platform.jax_device(i)}
    moved = a.to("tpu:1").to("tpu:3")
    assert moved.device == torch.device("tpu", 3)
    assert_close(moved.cpu(), a)


def test_synchronize_streams_events():
    x = torch.randn(64, 64, device="tpu")
    start = torch.tpu.Event(enable_timing=True)
    end = torch.tpu.Event(enable_timing=True)
    start.record()
    y = x * 2
    end.record()
    torch.tpu.synchronize()
    assert start.elapsed_time(end) >= 0
    s = torch.tpu.current_stream()
    s.synchronize()
    assert s.query()
    with torch.tpu.StreamContext(s):  # torch.cuda's spelling, entered by CUDA-minded libraries
        z = y + 1
    assert_close(z.cpu(), x.cpu() * 2 + 1)


def test_synchronize_waits_for_work_whose_outputs_were_freed():
    """As ``torch.cuda.synchronize``: everything launched on the device has run when it returns,
    also ops whose results were dropped at once (no array is left to wait on)."""
    import time

    a = torch.randn(1024, 1024, device="tpu")
    torch.mm(a, a).cpu()  # compiled
    alone = []
    for _ in range(2):
        start = time.perf_counter()
        torch.mm(a, a).cpu()
        alone.append(time.perf_counter() - start)
    torch.tpu.synchronize()
    start = time.perf_counter()
    for _ in range(3):
        torch.mm(a, a)  # (its result freed at once)
    torch.tpu.synchronize()
    waited = time.perf_counter() - start
    # three matmuls ran: at least one alone's time (a sync that returned at once took < 1 ms)
    assert waited >= 0.9 * min(alone), (waited, alone)


def test_tpu_stream_is_a_torch_stream_and_record_stream_works():
    s = torch.tpu.Stream(priority=-1)
    assert isinstance(s, torch.Stream) and s.device == torch.device("tpu", 0) and s.priority == -1
    x = torch.randn(8, device="tpu")
    x.record_stream(s)  # SGLang's mixed-chunk batches call it; nothing to do on one in-order stream
    x.record_stream(torch.tpu.current_stream())
    assert_close((x * 2).cpu(), x.cpu() * 2)


def test_memory_stats_track_live_buffers():
    torch.tpu.synchronize()
    before = torch.tpu.memory_allocated()
    x = torch.ones(1024, 1024, device="tpu") * 2
    torch.tpu.synchronize()
    during = torch.tpu.memory_allocated()
    assert during - before >= 4 * 1024 * 1024
    assert torch.tpu.max_memory_allocated() >= during
    stats = torch.tpu.memory_stats()
    assert stats["allocated_bytes.all.current"] == during
    del x
    torch.tpu.empty_cache()
    assert torch.tpu.memory_allocated() < during


def test_mem_get_info_and_reserved():
    x = torch.ones(1024, device="tpu")
    free, total = torch.tpu.mem_get_info()
    assert (free, total) == torch.tpu.mem_get_info(0) == torch.tpu.mem_get_info("tpu:0")
    assert 0 < free <= total and total - free >= x.nbytes
    stats = torch.tpu.memory_stats()
    assert torch.tpu.memory_reserved() == stats["reserved_bytes.all.current"] >= stats["allocated_bytes.all.current"]
    assert stats["reserved_bytes.all.peak"] >= stats["reserved_bytes.all.current"]
    assert torch.tpu.max_memory_reserved() == torch.tpu.memory_stats()["reserved_bytes.all.peak"] >= torch.tpu.memory_reserved()
    with pytest.raises(RuntimeError, match="Invalid device ordinal"):
        torch.tpu.mem_get_info(torch.tpu.device_count())


# ---------------------------------------------------------------- random numbers

def test_same_seed_same_numbers():
    torch.manual_seed(123)
    a = torch.randn(5, device="tpu").cpu()
    b = torch.rand(5, device="tpu").cpu()
    torch.manual_seed(123)
    assert_close(torch.randn(5, device="tpu").cpu(), a)
    assert_close(torch.rand(5, device="tpu").cpu(), b)
    c = torch.randn(5, device="tpu").cpu()
    assert not torch.equal(c, a)


def test_rng_state_round_trip():
    torch.tpu.manual_seed(7)
    state = torch.tpu.get_rng_state()
    assert state.dtype == torch.uint8
    a = torch.randn(4, device="tpu").cpu()
    torch.tpu.set_rng_state(state)
    assert_close(torch.randn(4, device="tpu").cpu(), a)
    assert torch.tpu.initial_seed() == 7
    s = torch.tpu.seed()
    assert torch.tpu.initial_seed() == s


def test_manual_seed_all_and_per_device():
    torch.tpu.manual_seed_all(5)
    a0 = torch.randn(3, device="tpu:0").cpu()
    with torch.tpu.device(1):
        torch.tpu.manual_seed(5)
    a1 = torch.randn(3, device="tpu:1").cpu()
    assert_close(a0, a1)


# ---------------------------------------------------------------- eager modes

def test_eager_modes_property_and_context():
    assert torch.tpu.eager_mode is torch.tpu.EagerMode.DEFER_NEVER
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING):
        assert torch.tpu.eager_mode is torch.tpu.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
        x = torch.randn(3, device="tpu")
        assert_close((x + 1).cpu(), x.cpu() + 1)
    assert torch.tpu.eager_mode is torch.tpu.EagerMode.DEFER_NEVER
    torch.tpu.eager_mode = "defer_never_and_launch_blocking"
    try:
        assert torch.tpu.eager_mode is torch.tpu.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
    finally:
        torch.tpu.eager_mode = torch.tpu.EagerMode.DEFER_NEVER
    with pytest.raises(ValueError, match="unknown eager mode"):
        torch.tpu.eager_mode = "fastest"


def test_launch_blocking_env_var():
    code = "import torch; print(torch.tpu.eager_mode.name)"
    env = dict(os.environ, TORCHTPU_LAUNCH_BLOCKING="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.strip() == "DEFER_NEVER_AND_LAUNCH_BLOCKING", out.stderr


def test_bad_env_value_is_a_clear_error():
    code = "import torch; torch.randn(1, device='tpu')"
    env = dict(os.environ, TORCHTPU_LAUNCH_BLOCKING="maybe")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "TORCHTPU_LAUNCH_BLOCKING" in out.stderr


# ---------------------------------------------------------------- CPU fallback

# A custom op with only a CPU kernel: torchtpu has no lowering and PyTorch no decomposition for it.
_lib = torch.library.Library("torchtpu_test", "DEF")
_lib.define("scaled_cumsum(Tensor x, float scale) -> Tensor")
_lib.impl("scaled_cumsum", lambda x, scale: torch.cumsum(x, 0) * scale, "CPU")


def test_cpu_fallback_on_counts_and_warns():
    torchtpu.metrics.reset()
    x = torch.randn(5)
    with pytest.warns(UserWarning, match="torchtpu_test.scaled_cumsum.default has no lowering"):
        out = torch.ops.torchtpu_test.scaled_cumsum(x.to("tpu"), 2.0)
    assert out.device.type == "tpu"
    assert_close(out.cpu(), torch.cumsum(x, 0) * 2.0)
    torch.ops.torchtpu_test.scaled_cumsum(x.to("tpu"), 2.0)  # warned once, counted twice
    assert torchtpu.metrics.snapshot()["cpu_fallbacks"]["torchtpu_test.scaled_cumsum.default"] == 2


def test_cpu_fallback_off_raises_naming_the_op(no_fallback):
    with pytest.raises(NotImplementedError, match=r"torchtpu_test.scaled_cumsum.default.*enable_cpu_fallback"):
        torch.ops.torchtpu_test.scaled_cumsum(torch.randn(3, device="tpu"), 2.0)


def test_cpu_fallback_off_raises(no_fallback):
    from torchtpu.eager.fallback import cpu_fallback

    with pytest.raises(NotImplementedError, match="enable_cpu_fallback"):
        cpu_fallback(torch.ops.aten.kron.default, torch.randn(2, device="tpu"), torch.randn(2, device="tpu"))


def test_cpu_fallback_writes_back_inplace_args():
    from torchtpu.eager.fallback import cpu_fallback

    torchtpu.metrics.reset()
    x = torch.randn(3, 4)
    t = x.to("tpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = cpu_fallback(torch.ops.aten.mul_.Scalar, t, 3.0)
    assert result is t
    assert_close(t.cpu(), x * 3)
    assert torchtpu.metrics.snapshot()["cpu_fallbacks"]["aten.mul_.Scalar"] == 1


def test_cpu_fallback_writes_back_mutated_tensor_lists():
    """Ops that mutate a Tensor[] (fused optimizers) get every element written back: AdamW(fused=True)
    on tpu left exp_avg at zero and trained wrongly before."""
    from torchtpu.eager.fallback import cpu_fallback

    xs, ys = [torch.randn(3), torch.randn(2, 2)], [torch.randn(3), torch.randn(2, 2)]
    ts = [x.to("tpu") for x in xs]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cpu_fallback(torch.ops.aten._foreach_add_.List, ts, [y.to("tpu") for y in ys])
    for t, x, y in zip(ts, xs, ys):
        assert_close(t.cpu(), x + y)


# ---------------------------------------------------------------- errors

def test_mixed_devices_error_message():
    with pytest.raises(RuntimeError, match=r"Expected all tensors to be on the same device, but found at least "
                                           r"two devices, tpu:0 and cpu!"):
        torch.ones(3, device="tpu") + torch.ones(3)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.ones(3, device="tpu:0") + torch.ones(3, device="tpu:1")


def test_numpy_needs_cpu_first():
    with pytest.raises(TypeError, match=r"cpu\(\)"):
        torch.ones(3, device="tpu").numpy()


def test_out_of_memory_is_torch_oom():
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 4096.00 GiB"):
        x = torch.empty(2**40, device="tpu")
        (x + 1).cpu()


def test_unsupported_dtype_is_clear():
    with pytest.raises(TypeError, match="not supported on the tpu device"):
        torch.ones(3, dtype=torch.complex32).to("tpu").cpu()  # (float8 is supported: test_float8.py)


# ---------------------------------------------------------------- serialization and storages

def test_save_load_round_trip(tmp_path):
    x = torch.randn(4, 5)
    t = x.to("tpu") * 2
    model = torch.nn.Linear(3, 2)
    state = {"t": t, "view": t.t()[1:], "bf16": x.bfloat16().to("tpu:1"), "bool": (t > 0),
             "model": model.to("tpu").state_dict()}
    torch.save(state, tmp_path / "ckpt.pt")
    loaded = torch.load(tmp_path / "ckpt.pt")
    assert loaded["t"].device == torch.device("tpu", 0)
    assert loaded["bf16"].device == torch.device("tpu", 1)
    assert_close(loaded["t"].cpu(), x * 2)
    assert_close(loaded["view"].cpu(), (x * 2).t()[1:])
    assert loaded["view"].stride() == (1, 5)
    assert_close(loaded["bf16"].cpu(), x.bfloat16())
    assert_close(loaded["bool"].cpu(), x * 2 > 0)
    assert_close((loaded["t"] + 1).cpu(), x * 2 + 1)  # loaded tensors compute
    on_cpu = torch.load(tmp_path / "ckpt.pt", map_location="cpu")
    assert on_cpu["model"]["weight"].device.type == "cpu"
    assert_close(on_cpu["model"]["weight"], model.weight.detach().cpu())


def test_storages_have_sizes_and_distinct_addresses():
    a = torch.randn(4, 5, device="tpu")
    b = a * 2
    assert a.untyped_storage().nbytes() == 80 and b.untyped_storage().nbytes() == 80
    assert a.data_ptr() != b.data_ptr() and a.data_ptr() != 0
    v = b.t()[1:]
    assert v.data_ptr() == b.data_ptr() + 4  # a view points into its base, as on any device


def test_cpu_fallback_context_restores_the_setting():
    assert torch.tpu.is_cpu_fallback_enabled()
    with torch.tpu.cpu_fallback_enabled(False):
        assert not torch.tpu.is_cpu_fallback_enabled()
        with pytest.raises(NotImplementedError):
            torch.ops.torchtpu_test.scaled_cumsum(torch.randn(3, device="tpu"), 2.0)
    assert torch.tpu.is_cpu_fallback_enabled()


def test_to_device_copies_the_host_values_at_the_time_of_the_call():
    # Regression: jax.device_put may read a numpy view of the CPU tensor after it returns (or keep
    # it, on XLA:CPU), so an in-place change of the source right after .to() leaked into the copy.
    for n in (3, 1 << 16):
        src = torch.zeros(n)
        on_tpu = src.to("tpu")
        src.add_(1)
        assert on_tpu.cpu().eq(0).all()


def test_views_that_differ_only_in_offset_share_one_program():
    # A KV-cache-like pattern: reading and writing row i of a buffer must not compile per i.
    from torchtpu.device import bridge

    cache = torch.zeros(16, 8, 4, device="tpu")
    expected = torch.zeros(16, 8, 4)
    reads, writes = bridge._gather.cache_info().currsize, bridge._scatter.cache_info().currsize
    for i in range(16):
        row = torch.full((8, 4), float(i))
        cache[i, :, 1:3] = row[:, 1:3].to("tpu")  # a strided view at a new offset each step
        expected[i, :, 1:3] = row[:, 1:3]
        assert_close(cache[i, :, 1:3].cpu(), expected[i, :, 1:3])
    assert bridge._gather.cache_info().currsize - reads <= 2
    assert bridge._scatter.cache_info().currsize - writes <= 2
    assert_close(cache.cpu(), expected)


@pytest.mark.parametrize("fn", [lambda x: torch.true_divide(x, 2.0), lambda x: torch.where(x > 0, x, 0.5),
                                lambda x: torch.where(x > 0, 0.5, x), lambda x: torch.nn.functional.silu(x) * 3,
                                lambda x: torch.nn.functional.mish(x)])
def test_ops_pytorch_decomposes_keep_their_gradient(fn):
    # A device kernel on a CompositeImplicitAutograd op (true_divide, where.ScalarOther, ...) would
    # take the call before PyTorch's decomposition and leave the result without a grad_fn.
    x = torch.randn(6, requires_grad=True)
    t = x.detach().to("tpu").requires_grad_(True)
    fn(x).sum().backward()
    fn(t).sum().backward()
    assert_close(t.grad.cpu(), x.grad, rtol=1e-5, atol=1e-6)


def test_static_float_and_int_arguments_do_not_share_a_program():
    # 4 == 4.0 and hash(4) == hash(4.0): a cache keyed on the values alone ran arange(0.0, 4.0)'s
    # float program for arange(0, 4).
    assert torch.arange(0.0, 4.0, device="tpu").dtype == torch.float32
    assert torch.arange(0, 4, device="tpu").dtype == torch.int64
    assert torch.full((2,), 3, device="tpu").dtype == torch.int64
    assert torch.full((2,), 3.0, device="tpu").dtype == torch.float32
