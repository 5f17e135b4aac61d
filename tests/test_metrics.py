"""``torchtpu.metrics`` counters and ``memory_summary``."""

import io
import re
import warnings

import jax
import pytest
import torch
from torch.testing import assert_close

from torchtpu import metrics
from torchtpu.memory import memory_summary


@torch.library.custom_op("torchtpu_test_metrics::cpu_only_scale", mutates_args=(), device_types="cpu")
def cpu_only_scale(x: torch.Tensor) -> torch.Tensor:
    """An op with a CPU kernel only: on tpu it can only run through the CPU fallback."""
    return x * 3 + 1


FALLBACK_NAME = "torchtpu_test_metrics.cpu_only_scale.default"


@pytest.fixture(autouse=True)
def fresh_metrics():
    metrics.reset()
    yield
    metrics.reset()


def test_ops_counted_per_op():
    a = torch.randn(4, 5)
    x = a.to("tpu")
    metrics.reset()
    y = x * 2 + x
    assert_close(y.cpu(), a * 2 + a)
    snap = metrics.snapshot()["ops"]
    assert snap["aten.mul.Tensor"] == 1
    assert snap["aten.add.Tensor"] == 1
    z = (x * 2) * 3
    assert_close(z.cpu(), a * 6)
    assert metrics.snapshot()["ops"]["aten.mul.Tensor"] == 3


def test_op_without_lowering_counts_as_fallback():
    a = torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = torch.ops.torchtpu_test_metrics.cpu_only_scale(a.to("tpu"))
    assert out.device.type == "tpu"
    assert_close(out.cpu(), a * 3 + 1)
    snap = metrics.snapshot()
    assert snap["cpu_fallbacks"] == {FALLBACK_NAME: 1}
    # the fallback moved the input to the host and the result back
    assert snap["transfers"]["to_host"] >= 1 and snap["transfers"]["to_device"] >= 2


def test_fallback_off_raises_and_counts_nothing(no_fallback):
    x = torch.randn(3, device="tpu")
    with pytest.raises(NotImplementedError, match="cpu_only_scale"):
        torch.ops.torchtpu_test_metrics.cpu_only_scale(x)
    assert metrics.snapshot()["cpu_fallbacks"] == {}


@pytest.mark.parametrize("make", [
    lambda: torch.arange(10, dtype=torch.float32),
    lambda: torch.arange(24, dtype=torch.int64).reshape(4, 6)[:, ::2],  # non-contiguous
    lambda: torch.tensor(2.5, dtype=torch.float64),  # 0-d
    lambda: torch.ones(0, 3, dtype=torch.bool),  # empty
    lambda: torch.randn(3, 5).to(torch.bfloat16),
], ids=["float32", "int64-strided", "0d-float64", "empty-bool", "bfloat16"])
def test_transfer_counts_bytes(make):
    cpu = make()
    nbytes = cpu.numel() * cpu.element_size()
    x = cpu.to("tpu")
    t = metrics.snapshot()["transfers"]
    assert (t["to_device"], t["to_device_bytes"]) == (1, nbytes)
    assert (t["to_host"], t["to_host_bytes"]) == (0, 0)
    back = x.cpu()
    assert_close(back, cpu)
    t = metrics.snapshot()["transfers"]
    assert (t["to_host"], t["to_host_bytes"]) == (1, nbytes)


def test_xla_compilations_counted_from_jax_events():
    def torchtpu_metrics_probe(v):
        return v * 7

    f = jax.jit(torchtpu_metrics_probe)
    f(jax.numpy.ones(3))
    f(jax.numpy.ones(3))  # cached: no second compilation
    f(jax.numpy.ones(4))  # new shape: compiled again
    stats = metrics.snapshot()["xla_compiles"]["jit(torchtpu_metrics_probe)"]
    assert stats["compilations"] == 2
    assert stats["compile_seconds"] > 0


def test_eager_kernel_compilation_counted():
    a = torch.randn(3, 1, 17, 5)  # a shape no other test uses: exp compiles for it
    out = a.to("tpu").exp()
    assert_close(out.cpu(), a.exp())
    assert metrics.snapshot()["xla_compiles"]["jit(aten_exp_default)"]["compilations"] == 1


def test_compile_and_recompile_counters():
    metrics.count_compile("forward", 1.25)
    metrics.count_compile("forward", cache_hit=True)
    metrics.count_compile("forward", cache_hit=True)
    metrics.count_compile("forward", 0.5)
    metrics.count_recompile("forward", "tensor 'x' size mismatch at index 0. expected 4, actual 8")
    metrics.count_recompile("forward", "tensor 'x' size mismatch at index 0. expected 4, actual 8")
    snap = metrics.snapshot()
    assert snap["compiles"] == {"forward": {"compilations": 2, "cache_hits": 2, "cache_misses": 2,
                                            "compile_seconds": 1.75}}
    assert snap["recompiles"] == [{"function": "forward", "count": 2,
                                   "reason": "tensor 'x' size mismatch at index 0. expected 4, actual 8"}]


def test_materializations_by_reason():
    for reason in ("item", "item", "cpu_fallback"):
        metrics.count_materialization(reason)
    assert metrics.snapshot()["materializations"] == {"item": 2, "cpu_fallback": 1}


def test_snapshot_is_a_copy_and_reset_zeroes():
    x = torch.randn(3, device="tpu")
    x.neg()
    metrics.count_compile("g", 1.0)
    metrics.count_recompile("g", "why")
    metrics.count_materialization("item")
    before = metrics.snapshot()
    x.neg()
    assert before["ops"]["aten.neg.default"] == 1
    metrics.reset()
    snap = metrics.snapshot()
    assert snap["ops"] == {} and snap["compiles"] == {} and snap["recompiles"] == []
    assert snap["materializations"] == {} and snap["xla_compiles"] == {}
    assert snap["transfers"] == {"to_device": 0, "to_device_bytes": 0, "to_host": 0, "to_host_bytes": 0}


def test_registered_source_in_snapshot_and_report():
    metrics.register_source("torchtpu_test_source", lambda: {"hits": 3, "seconds": 0.5})
    try:
        assert metrics.snapshot()["torchtpu_test_source"] == {"hits": 3, "seconds": 0.5}
        assert re.search(r"hits\s+3", metrics.report(file=io.StringIO()))
    finally:
        metrics._EXTRA.pop("torchtpu_test_source")


def test_report_shows_every_counter():
    a = torch.arange(6, dtype=torch.float32)
    x = a.to("tpu")
    y = x + x
    assert_close(y.cpu(), a + a)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.ops.torchtpu_test_metrics.cpu_only_scale(x)
    metrics.count_compile("train_step", 2.0)
    metrics.count_recompile("train_step", "dtype changed")
    metrics.count_materialization("item")
    printed = io.StringIO()
    text = metrics.report(file=printed)
    assert text == printed.getvalue()
    assert re.search(r"1\s+aten\.add\.Tensor", text)
    assert re.search(rf"1\s+{re.escape(FALLBACK_NAME)}", text)
    assert re.search(r"host -> device\s+\d+\s+\d+ B", text)
    assert re.search(r"device -> host\s+\d+\s+\d+ B", text)
    assert re.search(r"train_step\s+1\s+0\s+2\.000", text)
    assert re.search(r"1\s+train_step\s+dtype changed", text)
    assert re.search(r"1\s+item", text)


# ---------------------------------------------------------------- memory_summary

def _row(text: str, label: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(f"| {label}"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_memory_summary_matches_memory_stats():
    x = torch.ones(1024, 1024, device="tpu:3")  # 4 MiB
    stats = torch.tpu.memory_stats("tpu:3")
    text = memory_summary("tpu:3")
    assert "device ID 3 (XLA:CPU)" in text
    assert stats["allocated_bytes.all.current"] >= x.numel() * 4
    label, current, peak = _row(text, "Allocated memory")
    assert current == f"{stats['allocated_bytes.all.current'] // 1024} KiB"
    assert peak == f"{stats['allocated_bytes.all.peak'] // 1024} KiB"
    if stats["source"] == "live_buffers":
        assert _row(text, "Live buffers")[1] == str(stats["active.all.current"])
    assert len({len(line) for line in text.splitlines()}) == 1  # a rectangular table


def test_memory_summary_abbreviated_and_current_device():
    full, short = memory_summary(), memory_summary(abbreviated=True)
    assert "device ID 0" in full and "Allocated memory" in short
    assert len(short.splitlines()) < len(full.splitlines())
    with torch.tpu.device(2):
        assert "device ID 2" in memory_summary()
    with pytest.raises(ValueError, match="Expected a tpu device"):
        memory_summary("cpu")


def test_induced_recompilation_is_counted_with_its_reason():
    metrics.reset()

    @torch.compile(backend="tpu", dynamic=False)
    def double(x):
        return x * 2

    double(torch.ones(4, device="tpu"))
    double(torch.ones(5, device="tpu"))  # a new shape: the size guard fails, dynamo recompiles
    snap = metrics.snapshot()
    reasons = [r for r in snap["recompiles"] if "double" in str(r)]
    assert reasons, snap["recompiles"]
    assert any("size mismatch" in r["reason"] and "expected 4, actual 5" in r["reason"] for r in reasons)
    assert sum(v["compilations"] for v in snap["compiles"].values()) >= 2


def test_compiled_function_reads_fused_eager_values():
    x = torch.randn(8, device="tpu")
    compiled = torch.compile(lambda t: t.sin() + 1, backend="tpu")
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        y = x * 3  # deferred: the compiled call must run it first
        out = compiled(y)
    torch.testing.assert_close(out.cpu(), (x.cpu() * 3).sin() + 1)
