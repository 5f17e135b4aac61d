"""``torchtpu.profiler.trace``: the trace file JAX writes holds our dispatch, fallback and
``record_function`` spans next to XLA's own."""

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch.testing import assert_close

from torchtpu import profiler
from torchtpu.eager import dispatch, fallback


@torch.library.custom_op("torchtpu_test_profiler::cpu_only_neg", mutates_args=(), device_types="cpu")
def cpu_only_neg(x: torch.Tensor) -> torch.Tensor:
    return -x


def _spans(events, name):
    return [e for e in events if e["name"] == name]


def _inside(inner, outer) -> bool:
    return inner["tid"] == outer["tid"] and outer["ts"] <= inner["ts"] \
        and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 1e-3


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """One trace of a small workload (writing a trace takes a second or two): (logdir, result, expected)."""
    logdir = tmp_path_factory.mktemp("trace")
    a = torch.randn(8, 8)
    x = a.to("tpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profiler.trace(logdir) as where:
            assert profiler.active and where == str(logdir)
            with torch.profiler.record_function("torchtpu_test_block"):
                y = (x @ x).sin()
                y.add_(1)
            z = torch.ops.torchtpu_test_profiler.cpu_only_neg(y)
            result = z.cpu()
    return logdir, result, -((a @ a).sin() + 1)


def test_traced_code_computes_the_same(traced):
    _, result, expected = traced
    assert_close(result, expected)


def test_trace_files_written(traced):
    logdir, _, _ = traced
    assert len(profiler.trace_files(logdir)) == 1
    xplane = profiler.trace_files(logdir, ".xplane.pb")
    assert len(xplane) == 1 and os.path.getsize(xplane[0]) > 0


def test_record_function_and_dispatch_spans(traced):
    events = profiler.trace_events(traced[0])
    block, = _spans(events, "torchtpu_test_block")
    for name in ("dispatch aten.mm.default", "dispatch aten.sin.default", "dispatch aten.add.Tensor"):
        spans = _spans(events, name)
        assert len(spans) == 1, name
        assert _inside(spans[0], block), name
    fallback_span, = _spans(events, "cpu_fallback torchtpu_test_profiler.cpu_only_neg.default")
    assert not _inside(fallback_span, block)


def test_jax_executions_inside_dispatch_spans(traced):
    events = profiler.trace_events(traced[0])
    dispatch_sin, = _spans(events, "dispatch aten.sin.default")
    runs = _spans(events, "PjitFunction(aten_sin_default)")
    assert runs and all(_inside(run, dispatch_sin) for run in runs)


def test_trace_restores_everything(traced):
    assert not profiler.active
    assert dispatch.Kernel.run.__qualname__ == "Kernel.run"
    assert fallback.cpu_fallback.__module__ == "torchtpu.eager.fallback"
    assert "__enter__" in torch.autograd.profiler.record_function.__dict__
    assert torch.autograd.profiler.record_function.__enter__.__module__ == "torch.autograd.profiler"


def test_trace_stops_on_error_and_refuses_nesting(tmp_path):
    x = torch.ones(3, device="tpu")
    with pytest.raises(ZeroDivisionError):
        with profiler.trace(tmp_path / "a"):
            with pytest.raises(RuntimeError, match="already running"):
                with profiler.trace(tmp_path / "b"):
                    pass
            x.exp()
            1 / 0
    assert not profiler.active
    assert dispatch.Kernel.run.__qualname__ == "Kernel.run"
    names = {e["name"] for e in profiler.trace_events(tmp_path / "a")}
    assert "dispatch aten.exp.default" in names
    assert not (tmp_path / "b").exists()


def test_annotate_marks_a_span(tmp_path):
    a = torch.randn(4)
    with profiler.trace(tmp_path, perfetto=True):
        with profiler.annotate("torchtpu_test_compile"):
            out = a.to("tpu").cos()
    assert_close(out.cpu(), a.cos())
    events = profiler.trace_events(tmp_path)
    span, = _spans(events, "torchtpu_test_compile")
    assert _inside(_spans(events, "dispatch aten.cos.default")[0], span)
    assert profiler.trace_files(tmp_path, "perfetto_trace.json.gz")


def test_trace_events_without_trace(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.trace.json.gz"):
        profiler.trace_events(tmp_path)


def test_compile_work_inside_dispatch_span(tmp_path):
    # In a fresh process: after some other tests in this one (tests/test_foreach.py) the first
    # call of a new shape shows no compile event in the trace; not yet understood, so the
    # property is checked where the first call surely compiles.
    code = textwrap.dedent(f"""
        import random, torch
        from torch.testing import assert_close
        from torchtpu import profiler
        x = torch.randn(3, 7, random.randrange(1000, 100000)).to("tpu")  # a shape no run compiled
        with profiler.trace({str(tmp_path)!r}):
            out = x.cosh()
        assert_close(out.cpu(), x.cpu().cosh())
        events = profiler.trace_events({str(tmp_path)!r})
        span, = [e for e in events if e["name"] == "dispatch aten.cosh.default"]
        compiles = [e for e in events if e["name"] == "backend_compile_and_load"]
        inside = lambda a, b: a["tid"] == b["tid"] and b["ts"] <= a["ts"] and a["ts"] + a["dur"] <= b["ts"] + b["dur"] + 1e-3
        assert compiles and all(inside(c, span) for c in compiles), compiles
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


@pytest.mark.parametrize("mode", ["DEFER_NEVER", "DEFER_AND_FUSE"])
def test_optimizer_step_gets_a_span(tmp_path, mode):
    """A ``_foreach_*`` kernel (every optimizer step) runs through the same executor as any op,
    so it gets its span too, in either mode."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4, 4, device="tpu"))
    expected = p.detach().cpu() - 0.1 * torch.ones(4, 4)
    opt = torch.optim.SGD([p], lr=0.1, foreach=True)
    p.grad = torch.ones_like(p)
    with torch.tpu.set_eager_mode(getattr(torch.tpu.EagerMode, mode)):
        with profiler.trace(tmp_path):
            opt.step()
    assert_close(p.detach().cpu(), expected)
    names = {e["name"] for e in profiler.trace_events(tmp_path)}
    assert {n for n in names if n.startswith("dispatch aten._foreach_")}, sorted(names)
