"""``torch.accelerator`` on ``tpu``: every public function of torch 2.14, with the semantics
PyTorch documents (and ``torch.tpu.get_device_properties(i).total_memory``). conftest.py gives
4 XLA:CPU devices, so the current-device functions are checked across several devices."""

import os
import time
import warnings

import pytest
import torch

A = torch.accelerator
MIB = 2**20
SLACK = 4096  # an op's scalar operands can stay on the device as small cached constants


def assert_about(grown: int, nbytes: int) -> None:
    """Memory grew by the bytes of the new tensor (plus at most a few scalar constants)."""
    assert nbytes <= grown <= nbytes + SLACK, (grown, nbytes)

# Every public name of torch.accelerator (and its random module) that a test below exercises.
COVERED = {
    "Graph", "current_accelerator", "current_device_idx", "current_device_index", "current_stream",
    "device_count", "device_index", "empty_cache", "empty_host_cache", "get_device_capability",
    "get_memory_info", "is_available", "max_memory_allocated", "max_memory_reserved", "memory_allocated",
    "memory_reserved", "memory_stats", "reset_accumulated_memory_stats", "reset_peak_memory_stats",
    "set_device_idx", "set_device_index", "set_stream", "synchronize",
}
COVERED_RANDOM = {"initial_seed", "get_rng_state", "get_rng_state_all"}


@pytest.fixture(autouse=True)
def _started_on_device_zero():
    """The runtime started (memory statistics are empty before, as on CUDA: test_lazy_start.py)
    and tpu:0 current again after each test."""
    torch.ones(1, device="tpu")
    yield
    torch.tpu.set_device(0)


def test_every_public_function_is_covered():
    """A torch release that adds a function fails here until a test below exercises it."""
    assert set(A.__all__) <= COVERED, set(A.__all__) - COVERED
    if hasattr(A, "random"):  # torch.accelerator.random is new in torch 2.14
        assert set(A.random.__all__) <= COVERED_RANDOM, set(A.random.__all__) - COVERED_RANDOM


# ---------------------------------------------------------------- the device and its count

def test_availability_and_count():
    assert A.is_available()
    assert A.current_accelerator() == torch.device("tpu")
    assert A.current_accelerator(check_available=True) == torch.device("tpu")
    assert A.current_accelerator().index is None  # documented: the index is current_device_index's
    assert A.device_count() == torch.tpu.device_count() == 4


def test_set_device_index_moves_what_tpu_means():
    assert A.current_device_index() == torch.tpu.current_device() == 0
    A.set_device_index(2)
    assert A.current_device_index() == torch.tpu.current_device() == 2
    assert torch.arange(3.0).to("tpu").device == torch.device("tpu", 2)
    assert torch.ones(2, device="tpu").device == torch.device("tpu", 2)
    A.set_device_index("tpu:1")
    assert torch.tpu.current_device() == 1
    A.set_device_index(torch.device("tpu", 3))
    assert torch.tpu.current_device() == 3
    A.set_device_index(-1)  # documented: a negative index is a no-op
    assert torch.tpu.current_device() == 3
    torch.tpu.set_device(0)  # and the other way round
    assert A.current_device_index() == 0


def test_set_device_index_rejects_what_is_not_a_device():
    with pytest.raises(RuntimeError, match="Invalid device ordinal tpu:4"):
        A.set_device_index(4)
    with pytest.raises(ValueError, match="specified index"):
        A.set_device_index(torch.device("tpu"))
    with pytest.raises(ValueError, match="doesn't match the current accelerator"):
        A.set_device_index("cpu")
    assert A.current_device_index() == 0


def test_device_index_context():
    with A.device_index(3):
        assert A.current_device_index() == torch.tpu.current_device() == 3
        assert torch.zeros(2, device="tpu").device == torch.device("tpu", 3)
        with A.device_index(1):
            assert torch.tpu.current_device() == 1
        assert torch.tpu.current_device() == 3
        with A.device_index(None):  # documented: no switch
            assert torch.tpu.current_device() == 3
    assert A.current_device_index() == 0
    with pytest.raises(RuntimeError, match="Invalid device ordinal"):
        with A.device_index(7):
            pass
    assert A.current_device_index() == 0


def test_deprecated_aliases():
    with pytest.warns(FutureWarning):
        A.set_device_idx(1)
    with pytest.warns(FutureWarning):
        assert A.current_device_idx() == 1


# ---------------------------------------------------------------- streams, events, synchronize

def test_current_stream_and_set_stream():
    stream = A.current_stream()
    assert isinstance(stream, torch.Stream) and stream.device == torch.device("tpu", 0)
    assert A.current_stream(1).device_index == 1
    assert A.current_stream("tpu:2").device_index == 2
    A.set_stream(A.current_stream(3))  # documented: also makes the stream's device current
    assert A.current_device_index() == torch.tpu.current_device() == 3
    A.set_stream(stream)
    assert A.current_device_index() == 0


def test_synchronize_waits_for_pending_work(each_eager_mode):
    """After synchronize() the work queued before it has run: under DEFER_AND_FUSE too, where a
    result's buffer exists only once its fused program ran."""
    A.synchronize()
    before = A.memory_allocated()
    x = torch.full((256, 1024), 2.0, device="tpu") * 3  # 1 MiB
    A.synchronize()
    assert_about(A.memory_allocated() - before, x.nbytes)
    A.synchronize(0)
    A.synchronize("tpu:1")
    A.synchronize(torch.device("tpu", 2))
    assert x[0, 0].item() == 6.0


def test_streams_and_events():
    """One in-order stream per device: waiting for a stream or an event waits for the device."""
    x = torch.ones(64, 64, device="tpu")
    stream = torch.Stream("tpu")
    assert stream.query()
    stream.synchronize()
    A.current_stream().wait_stream(stream)
    event = stream.record_event()
    stream.wait_event(event)
    y = x @ x
    event.record()
    event.synchronize()
    assert event.query()
    assert y[0, 0].item() == 64.0
    with torch.Stream("tpu:1"):
        pass


def test_timed_events():
    start, end = torch.Event("tpu", enable_timing=True), torch.Event("tpu", enable_timing=True)
    start.record()
    began = time.perf_counter()
    time.sleep(0.05)
    torch.ones(32, device="tpu").sum().item()
    end.record()
    end.synchronize()
    waited_ms = (time.perf_counter() - began) * 1000
    assert 50 <= start.elapsed_time(end) <= waited_ms + 5
    untimed = torch.Event("tpu")
    untimed.record()
    with pytest.raises(ValueError, match="enable_timing=True"):
        untimed.elapsed_time(end)


@pytest.mark.skipif(not hasattr(A, "Graph"), reason="torch.accelerator.Graph is new in torch 2.12")
def test_graph_capture_is_refused_clearly():
    """XLA compiles whole programs (torch.compile); there is no stream capture to replay."""
    with pytest.raises(RuntimeError, match="Graph is not supported on device type: tpu"):
        A.Graph()


# ---------------------------------------------------------------- memory

def test_memory_allocated_follows_tensors():
    A.synchronize()
    before = A.memory_allocated()
    x = torch.empty(MIB, dtype=torch.uint8, device="tpu").fill_(1)
    A.synchronize()
    grown = A.memory_allocated() - before
    assert_about(grown, x.nbytes)
    assert A.memory_allocated(0) == A.memory_allocated("tpu:0") == A.memory_allocated(torch.device("tpu", 0))
    del x
    assert A.memory_allocated() == before + grown - MIB  # freed as the tensor dies: no empty_cache


def test_memory_is_counted_per_device():
    A.synchronize()
    before0, before1 = A.memory_allocated(0), A.memory_allocated(1)
    x = torch.ones(MIB // 4, device="tpu:1")
    A.synchronize()
    assert_about(A.memory_allocated(1) - before1, x.nbytes)
    assert A.memory_allocated(0) == before0


def test_peaks_and_their_reset():
    A.synchronize()
    A.reset_peak_memory_stats()
    base = A.memory_allocated()
    assert A.max_memory_allocated() == base
    x = torch.ones(MIB, device="tpu")  # 4 MiB
    A.synchronize()
    del x
    base = A.memory_allocated()
    assert A.max_memory_allocated() >= base + 4 * MIB
    assert A.max_memory_reserved() >= A.memory_reserved() >= A.memory_allocated()
    A.reset_peak_memory_stats()
    assert A.max_memory_allocated() == A.memory_allocated() == base
    assert A.max_memory_reserved() == A.memory_reserved()


def test_memory_stats_names_and_accumulated_reset():
    A.synchronize()
    stats = A.memory_stats()
    assert list(stats) == sorted(stats)  # documented: an OrderedDict of sorted flat names
    assert stats["allocated_bytes.all.current"] == A.memory_allocated()
    assert stats["allocated_bytes.all.peak"] == A.max_memory_allocated()
    assert stats["reserved_bytes.all.current"] == A.memory_reserved()
    assert stats["reserved_bytes.all.peak"] == A.max_memory_reserved()
    assert all(isinstance(v, int) and v >= 0 for v in stats.values())
    A.reset_accumulated_memory_stats()
    after = A.memory_stats()
    assert after["allocated_bytes.all.allocated"] == after["allocated_bytes.all.freed"] == 0
    assert after["allocated_bytes.all.current"] == stats["allocated_bytes.all.current"]


def test_empty_cache():
    A.synchronize()
    before = A.memory_allocated()
    x = torch.ones(MIB, device="tpu")
    A.synchronize()
    del x
    A.empty_cache()
    assert A.memory_allocated() <= before + SLACK
    assert A.memory_reserved() == A.memory_allocated()  # XLA:CPU keeps no cache


@pytest.mark.skipif(not hasattr(A, "empty_host_cache"),
                    reason="torch.accelerator.empty_host_cache is new in torch 2.12")
def test_empty_host_cache_keeps_pinned_tensors():
    """It used to dereference a null host allocator (a segfault); pinned memory is not cached."""
    pinned = torch.arange(1000.0).pin_memory()
    A.empty_host_cache()
    assert pinned.is_pinned()
    assert torch.equal(pinned.to("tpu", non_blocking=True).cpu(), torch.arange(1000.0))


def _host_memory() -> int:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            limit = open(path).read().strip()
        except OSError:
            continue
        total = min(total, int(limit)) if limit.isdigit() else total
    return total


def test_memory_info_and_total_memory():
    """(free, total) as torch.tpu.mem_get_info; on XLA:CPU total is the host memory the process
    may use and free falls by what tpu tensors hold."""
    A.synchronize()
    free, total = A.get_memory_info()
    assert (free, total) == torch.tpu.mem_get_info() == A.get_memory_info("tpu:0")
    assert total == _host_memory() and 0 < free <= total
    x = torch.ones(MIB, device="tpu")
    A.synchronize()
    assert_about(free - A.get_memory_info()[0], x.nbytes)
    for i in range(A.device_count()):
        props = torch.tpu.get_device_properties(i)
        assert props.total_memory == A.get_memory_info(i)[1] == total
        assert props.index == i
    assert torch.tpu.get_device_properties("tpu:1").total_memory == total


# ---------------------------------------------------------------- capability and random

def test_device_capability_lists_the_dtypes_tensors_can_have():
    dtypes = A.get_device_capability()["supported_dtypes"]
    assert {torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.bool,
            torch.complex64} <= dtypes
    assert torch.complex32 not in dtypes and torch.qint8 not in dtypes
    for dtype in dtypes:
        assert torch.zeros(2, dtype=dtype, device="tpu").cpu().dtype == dtype
    assert A.get_device_capability("tpu:1") == A.get_device_capability(1)


@pytest.mark.skipif(not hasattr(A, "random"), reason="torch.accelerator.random is new in torch 2.14")
def test_random_reads_the_devices_generator():
    torch.tpu.manual_seed(1234)
    assert A.random.initial_seed() == 1234
    state = A.random.get_rng_state()
    assert state.dtype == torch.uint8 and torch.equal(state, torch.tpu.get_rng_state())
    first = torch.randn(4, device="tpu").cpu()
    torch.tpu.set_rng_state(state)
    assert torch.equal(torch.randn(4, device="tpu").cpu(), first)
    torch.tpu.manual_seed_all(7)
    states = A.random.get_rng_state_all()
    assert len(states) == A.device_count()
    assert all(torch.equal(s, states[0]) for s in states)
    with A.device_index(2):
        assert A.random.initial_seed() == 7
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert A.random.initial_seed(3) == 7
