"""The native eager path (csrc/eager.cpp, eager/native_kernels.py) against the Python kernels it
learns from: op by op on OpInfo's samples, and the semantics it must keep (views alias, in-place
writes through views, errors, metrics, the other eager modes, threads, the switch)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db

from torchtpu import metrics
from torchtpu.eager import native_kernels as nk


@pytest.fixture(autouse=True)
def native_on():
    torch.ones(1, device="tpu")  # the runtime starts, installing the kernels
    if not nk.REGISTERED:
        pytest.skip("the native eager kernel is off in this process (TORCHTPU_NATIVE_EAGER=0 or no C++ extension)")
    was = nk.enabled()
    nk.set_enabled(True)
    yield
    nk.set_enabled(was)


def _calls(name: str) -> int:
    return nk.stats().get(name, (0,))[0]


def test_the_hot_ops_are_native():
    names = {str(op) for op in nk.REGISTERED}
    # the ops that dominate the tests' programs and the serving engines' eager parts
    for name in ("aten.add.Tensor", "aten.mul.Tensor", "aten.sub.Tensor", "aten.div.Tensor", "aten.relu.default",
                 "aten.exp.default", "aten.sum.dim_IntList", "aten.mean.dim", "aten.mm.default", "aten.addmm.default",
                 "aten.bmm.default", "aten._softmax.default", "aten.native_layer_norm.default", "aten.where.self",
                 "aten.eq.Tensor", "aten.add_.Tensor", "aten.mul_.Tensor", "aten.gelu.default", "aten.rsqrt.default",
                 "aten.silu.default"):
        assert name in names, name


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() \
            and torch.equal(a.cpu().view(torch.uint8) if a.dtype == torch.bool else a.cpu(),
                            b.cpu().view(torch.uint8) if b.dtype == torch.bool else b.cpu()) \
            or (a.dtype.is_floating_point and torch.equal(torch.nan_to_num(a.cpu(), 7.0), torch.nan_to_num(b.cpu(), 7.0)))
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)


_NATIVE_NAMES = None


def _native_base_names() -> set:
    global _NATIVE_NAMES
    if _NATIVE_NAMES is None:
        torch.ones(1, device="tpu")
        _NATIVE_NAMES = {str(op).split(".")[1].rstrip("_") for op in nk.REGISTERED}
    return _NATIVE_NAMES


_OPINFOS = [o for o in op_db if o.name.split(".")[0] in {
    # a spread of OpInfo entries over the native ops' families (the registered set is checked above)
    "add", "sub", "mul", "div", "true_divide", "rsub", "pow", "maximum", "minimum", "atan2", "remainder", "fmod",
    "abs", "neg", "exp", "log", "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid", "erf", "floor", "ceil", "round",
    "sign", "reciprocal", "clamp_min", "clamp_max", "where", "eq", "ne", "lt", "le", "gt", "ge", "logical_and",
    "logical_not", "bitwise_and", "sum", "mean", "amax", "amin", "prod", "var", "std", "argmax", "argmin",
    "logsumexp", "mm", "bmm", "addmm", "matmul", "softmax", "log_softmax", "nn.functional.relu",
    "nn.functional.gelu", "nn.functional.silu", "nn.functional.layer_norm", "nn.functional.linear",
    "nn.functional.embedding", "cumsum", "tril", "triu", "lerp", "addcmul", "addcdiv"}]


def _reference(call, native_calls: int):
    """(True, ``call()`` through the Python kernels), or (False, None) where that raises, after
    checking that each of ``native_calls`` calls with the native kernel on raises the same."""
    nk.set_enabled(False)
    try:
        return True, call()
    except Exception as exc:  # an error: the native path must raise the same
        nk.set_enabled(True)
        for _ in range(native_calls):
            with pytest.raises(type(exc)):
                call()
        return False, None
    finally:
        nk.set_enabled(True)


@pytest.mark.parametrize("info", _OPINFOS, ids=lambda o: o.name + ("." + o.variant_test_name if o.variant_test_name else ""))
def test_native_equals_python_op_by_op(info):
    """Each sample run natively (its second call, once the signature is learned) equals the Python
    kernel's result exactly: the same program on the same arrays."""
    dtype = torch.float32 if torch.float32 in info.supported_dtypes("cpu") else next(iter(info.supported_dtypes("cpu")))
    samples = list(info.sample_inputs("cpu", dtype, requires_grad=False))[:2]
    before = sum(v[0] for v in nk.stats().values())
    compared = 0
    for sample in samples:
        sample = sample.transform(lambda t: t.to("tpu") if isinstance(t, torch.Tensor) else t)

        def call():
            return info.op(sample.input, *sample.args, **sample.kwargs)

        ran, expected = _reference(call, native_calls=2)
        if not ran:
            continue
        call()  # learns
        got = call()
        assert _equal(got, expected), (info.name, sample)
        compared += 1
    assert compared or not samples
    assert sum(v[0] for v in nk.stats().values()) >= before  # (counted; the set test checks coverage)


@pytest.mark.parametrize("info", _OPINFOS, ids=lambda o: o.name + ("." + o.variant_test_name if o.variant_test_name else ""))
def test_native_recording_equals_python_recording_op_by_op(info):
    """In DEFER_AND_FUSE each sample, on inputs still pending (a recorded clone of each), recorded
    by the native kernel once its signature is learnt gives exactly what the Python kernel's
    recording gives: both record the same program on the same values."""
    dtype = torch.float32 if torch.float32 in info.supported_dtypes("cpu") else next(iter(info.supported_dtypes("cpu")))
    samples = list(info.sample_inputs("cpu", dtype, requires_grad=False))[:2]
    compared = 0
    recorded = sum(v[8] for v in nk.stats().values())
    for sample in samples:
        def call():
            pending = sample.transform(lambda t: t.to("tpu").clone() if isinstance(t, torch.Tensor) else t)
            out = info.op(pending.input, *pending.args, **pending.kwargs)
            return [t.cpu() if isinstance(t, torch.Tensor) else t for t in (out if isinstance(out, (tuple, list)) else [out])]

        with torch.tpu.set_eager_mode("defer_and_fuse"):
            ran, expected = _reference(call, native_calls=1)
            if not ran:
                continue
            call()  # learns what it had not learnt at once
            got = call()
        assert _equal(got, expected), (info.name, sample)
        compared += 1
    assert compared or not samples
    if compared:  # (at least the clones were recorded natively)
        assert sum(v[8] for v in nk.stats().values()) > recorded


def test_native_calls_are_counted_and_run_natively():
    x = torch.randn(8, 8, device="tpu")
    y = torch.randn(8, 8, device="tpu")
    metrics.reset()
    for _ in range(5):
        z = torch.relu(x @ y + x * 2)
    assert metrics.ops["aten.mm.default"] == 5 and metrics.ops["aten.add.Tensor"] == 5
    assert _calls("aten.mm.default") >= 4 and _calls("aten.relu.default") >= 4
    torch.testing.assert_close(z.cpu(), torch.relu(x.cpu() @ y.cpu() + x.cpu() * 2), rtol=1e-5, atol=1e-5)


def test_views_alias_and_in_place_writes_through_them():
    base = torch.zeros(6, 8, device="tpu")
    ref = torch.zeros(6, 8)
    for t, r in ((base, ref), (base[1:4], ref[1:4]), (base.t()[2], ref.t()[2]), (base.view(48)[5:9], ref.view(48)[5:9])):
        for _ in range(3):
            t.add_(1.5)
            r.add_(1.5)
            t.mul_(torch.full((), 2.0, device="tpu"))
            r.mul_(torch.full((), 2.0))
    assert torch.equal(base.cpu(), ref)
    v = base.t()
    assert v._base is base and v.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    out = base[2:5, 1:3] * 3 + 1  # a view read inside the native program
    assert torch.equal(out.cpu(), ref[2:5, 1:3] * 3 + 1)


def _laid_out_wraps() -> int:
    """Native calls so far whose laid-out outputs took the Python wrap."""
    return sum(v[7] for v in nk.stats().values())


@pytest.mark.parametrize("case", ["transposed", "channels_last", "size_one_dims", "two_outputs"])
def test_outputs_laid_out_as_pytorch_lays_them_out(case):
    """An op on a permuted input gives an output in the input's layout (PyTorch's rule); the native
    kernel runs the program that writes it in that layout at once. Same values and strides as the
    Python kernel and the CPU, and the result reads, views and writes back like any tensor."""
    gen = torch.Generator().manual_seed(3)
    if case == "transposed":  # (a rotary embedding's q * cos: q a [B, T, H, D] -> [B, H, T, D] view)
        x, other = torch.randn(2, 5, 4, 8, generator=gen).transpose(1, 2), torch.randn(1, 1, 5, 8, generator=gen)
    elif case == "channels_last":
        x = torch.randn(2, 3, 4, 5, generator=gen).contiguous(memory_format=torch.channels_last)
        other = torch.randn(3, 1, 1, generator=gen)
    elif case == "size_one_dims":  # a layout whose size-1 dims tie in memory order
        x, other = torch.randn(1, 1, 4, 8, generator=gen).transpose(1, 2), torch.randn(1, 4, 1, 8, generator=gen)
    else:
        x, other = torch.randn(3, 6, generator=gen).t(), None

    def run(device, native=True):
        nk.set_enabled(native)
        try:
            t = torch.empty_strided(x.shape, x.stride(), device=device).copy_(x)  # x's layout on the device
            for _ in range(2):  # the second call is the learnt native one
                before = _laid_out_wraps()
                outs = list(torch.sort(t, dim=0)) if other is None else [t * other.to(device) + 1.5]
            if device == "tpu" and native and case != "size_one_dims":  # (ties there: Python's reshape)
                assert _laid_out_wraps() == before  # the native kernel wrapped them in C++
            outs[0].add_(1.0)
            outs.append(outs[0].sum(0) if other is None else outs[0].flatten(1) * 2)
            return outs
        finally:
            nk.set_enabled(True)

    native, python, cpu = run("tpu"), run("tpu", native=False), run("cpu")
    for n, p, c in zip(native, python, cpu):
        assert n.stride() == p.stride() == c.stride()
        assert _equal(n, p)
        torch.testing.assert_close(n.cpu(), c)


def test_autograd_through_native_kernels():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    ref = [p.detach().clone() for p in model.parameters()]
    cpu_model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    with torch.no_grad():
        for p, r in zip(cpu_model.parameters(), ref):
            p.copy_(r)
    model.to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    cpu_opt = torch.optim.SGD(cpu_model.parameters(), lr=0.1, foreach=False)
    for step in range(6):
        x = torch.randn(8, 16)
        y = torch.randint(0, 4, (8,))
        for m, o, xx, yy in ((model, opt, x.to("tpu"), y.to("tpu")), (cpu_model, cpu_opt, x, y)):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(xx), yy).backward()
            o.step()
    for p, q in zip(model.parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-5)
    assert _calls("aten.addmm.default") > 0


def test_backward_runs_natively_in_its_callers_mode():
    """Autograd runs a backward pass on its own thread: the ops there follow the mode of the thread
    that called ``backward()`` (execution.py's ``current``), natively when that is at once."""
    torch.manual_seed(0)
    w_cpu = torch.randn(8, 8, requires_grad=True)
    x_cpu = torch.randn(4, 8)
    (torch.tanh(x_cpu @ w_cpu) * 3).sum().backward()
    for round, mode in enumerate(("defer_never", "defer_and_fuse", "defer_never")):
        w = w_cpu.detach().to("tpu").requires_grad_()
        x = x_cpu.to("tpu")
        with torch.tpu.set_eager_mode(mode):
            loss = (torch.tanh(x @ w) * 3).sum()
            before = _calls("aten.tanh_backward.default"), _calls("aten.mm.default")
            loss.backward()
            after = _calls("aten.tanh_backward.default"), _calls("aten.mm.default")
            grad = w.grad.cpu()
        torch.testing.assert_close(grad, w_cpu.grad, rtol=1e-5, atol=1e-5)
        if round == 2:  # (the first round may learn; the third runs what it learnt)
            assert after[0] > before[0] and after[1] > before[1], (before, after)
        elif mode == "defer_and_fuse":  # recorded by the caller's fused executor, none run at once
            assert after == before, (before, after)


def test_factories_run_natively_on_the_device_they_name():
    """A factory's ``device`` is part of its key: an index given, or the current device's."""
    if torch.tpu.device_count() < 2:
        pytest.skip("needs two tpu devices")
    made = []
    for round in range(3):
        before = _calls("aten.full.default"), _calls("aten.arange.default")
        for current in (0, 1):
            with torch.tpu.device(current):
                for device in ("tpu", "tpu:1", "tpu:0"):
                    a = torch.full((2, 3), 1.5 + current, device=device)
                    b = torch.arange(5, device=device, dtype=torch.int32)
                    made.append((device, current, a, b))
        if round == 2:  # (the earlier rounds learn every key)
            assert _calls("aten.full.default") - before[0] == 6 and _calls("aten.arange.default") - before[1] == 6
    for device, current, a, b in made:
        index = current if device == "tpu" else int(device[-1])
        assert a.device == b.device == torch.device("tpu", index)
        assert torch.equal(a.cpu(), torch.full((2, 3), 1.5 + current))
        assert torch.equal(b.cpu(), torch.arange(5, dtype=torch.int32))
        assert a.cpu().sum().item() == (a + 0).sum().item()  # usable where it is


def test_index_checked_ops_run_natively_and_still_raise():
    """embedding, gather, index_select check their indices on the device: the native kernel hands
    the check code on as the Python kernel does, so a bad index still raises at the next read."""
    # (signatures of this test's own: float64, padding_idx 3, so no other test's history counts)
    w = torch.randn(10, 4, dtype=torch.float64)
    idx = torch.tensor([[1, 2], [9, 0]])
    wt, it = w.to("tpu"), idx.to("tpu")
    for _ in range(3):
        before = _calls("aten.embedding.default"), _calls("aten.gather.default")
        e = torch.nn.functional.embedding(it, wt, padding_idx=3)
        g = torch.gather(wt, 0, it)
        s = torch.index_select(wt, 0, it[0])
        assert torch.equal(e.cpu(), torch.nn.functional.embedding(idx, w, padding_idx=3))
        assert torch.equal(g.cpu(), torch.gather(w, 0, idx))
        assert torch.equal(s.cpu(), torch.index_select(w, 0, idx[0]))
    assert _calls("aten.embedding.default") > before[0] and _calls("aten.gather.default") > before[1]
    bad = torch.tensor([[1, 12]], device="tpu")
    for _ in range(3):  # (learnt on the first call; native after)
        before = _calls("aten.embedding.default")
        out = torch.nn.functional.embedding(bad, wt, padding_idx=3)
        with pytest.raises(IndexError, match="embedding.*index out of range"):
            out.cpu()
    assert _calls("aten.embedding.default") > before


def test_errors_are_pytorch_errors_naming_the_op():
    x = torch.ones(3, dtype=torch.int64, device="tpu")
    for _ in range(2):
        with pytest.raises(RuntimeError, match="For integral input tensors, argument alpha must not be a floating"):
            torch.add(x, x, alpha=0.5)
        with pytest.raises(RuntimeError, match="result type Float can't be cast to the desired output type Long"):
            x.add_(torch.ones(3, device="tpu") / 3)
    assert torch.equal(x.cpu(), torch.ones(3, dtype=torch.int64))  # the failed in-place op lost nothing
    with pytest.raises(RuntimeError, match="same device"):
        torch.ones(2, device="tpu") + torch.ones(2)
    with pytest.raises(RuntimeError):
        torch.ones(2, 3, device="tpu") @ torch.ones(4, 5, device="tpu")


def _recorded(name: str) -> int:
    return nk.stats().get(name, (0,) * 9)[8]


def test_other_modes_and_capture_run_nothing_at_once():
    """DEFER_AND_FUSE records (natively, once the call is known), a capture and launch-blocking
    take the Python kernels: none of them runs a call at once through the native kernel."""
    x = torch.randn(4, 4, device="tpu")
    x + x
    before = _calls("aten.add.Tensor"), _recorded("aten.add.Tensor")
    with torch.tpu.set_eager_mode("defer_and_fuse"):
        y = x + x
        z = y + x
    assert _calls("aten.add.Tensor") == before[0]  # recorded by the fused executor, not run at once
    assert _recorded("aten.add.Tensor") == before[1] + 2
    torch.testing.assert_close(z.cpu(), 3 * x.cpu())
    before = _calls("aten.add.Tensor"), _recorded("aten.add.Tensor")
    with torch.tpu.set_eager_mode("defer_never_and_launch_blocking"):
        w = x + x
    graph = torch.tpu.TPUGraph()
    with torch.tpu.graph(graph):
        v = x + x
    graph.replay()
    assert (_calls("aten.add.Tensor"), _recorded("aten.add.Tensor")) == before
    torch.testing.assert_close(w.cpu(), 2 * x.cpu())
    torch.testing.assert_close(v.cpu(), 2 * x.cpu())


def test_fused_mode_records_known_calls_natively():
    """In DEFER_AND_FUSE the native kernel records a known call (the executor's ``call``, as the
    Python kernel does): results as PyTorch's CPU ones through views of pending values, lists,
    laid-out outputs, index-checked ops (a bad index still raises at the read), reductions and
    in-place calls (whole tensors and views); one program per read."""
    from torchtpu.device import bridge
    from torchtpu.eager import fused

    torch.manual_seed(0)
    a, b = torch.randn(6, 8), torch.randn(8, 6)
    w, idx = torch.randn(10, 8), torch.tensor([1, 9, 0])

    def program(a, b, w, idx):
        h = a * 2 + b.t()  # a view (transposed) of an input
        g = torch.relu(h) @ b  # mm
        c = torch.cat([g, g.t() * 0.5], dim=0)  # a list; the transposed view of a pending value
        e = torch.nn.functional.embedding(idx, w)  # index-checked
        s = c.sum(dim=1, keepdim=True) + e.mean()
        t = (h.t() * 3)[1:5]  # laid-out output of a pending value, then a slice of it
        h.add_(1)  # in place, the whole tensor
        t[0].mul_(2)  # in place, a view of a pending value
        return s, t, h

    expected = program(a, b, w, idx)
    at, bt, wt, it = (v.to("tpu") for v in (a, b, w, idx))
    program(at, bt, wt, it)  # (learnt at once)
    for _ in range(2):
        before = {n: (_calls(n), _recorded(n)) for n in ("aten.mul.Tensor", "aten.mm.default", "aten.cat.default",
                                                          "aten.embedding.default", "aten.add_.Tensor")}
        runs = fused.stats()["program_cache_hits"] + fused.stats()["programs_compiled"]
        with torch.tpu.set_eager_mode("defer_and_fuse"):
            got = program(at, bt, wt, it)
            assert all(type(bridge.array_of(v.untyped_storage())) is fused.Deferred for v in got)
            values = [v.cpu() for v in got]
        for v, e in zip(values, expected):
            torch.testing.assert_close(v, e, rtol=1e-5, atol=1e-5)
        after = {n: (_calls(n), _recorded(n)) for n in before}
        for n in ("aten.mul.Tensor", "aten.mm.default", "aten.cat.default", "aten.embedding.default",
                  "aten.add_.Tensor"):
            assert after[n][0] == before[n][0] and after[n][1] > before[n][1], (n, before[n], after[n])
        assert fused.stats()["program_cache_hits"] + fused.stats()["programs_compiled"] - runs <= 3  # (a read each)
    bad = torch.tensor([1, 12], device="tpu")
    with torch.tpu.set_eager_mode("defer_and_fuse"):
        for _ in range(2):
            out = torch.nn.functional.embedding(bad, wt)
            with pytest.raises(IndexError, match="index out of range"):
                out.cpu()
        with pytest.raises(RuntimeError):  # a known op's error: PyTorch's, from the Python kernel
            at @ at
    assert torch.equal(a.to("tpu").cpu(), a)


def test_fused_mode_reads_another_threads_pending_values():
    """A value another thread's executor has pending is computed by that executor when this
    thread's native recording reads it (``FusedExecutor.call`` materialises it)."""
    x = torch.randn(5, 5, device="tpu")
    x * 2 + x  # (learnt)
    pending = {}

    def other():
        with torch.tpu.set_eager_mode("defer_and_fuse"):
            pending["y"] = x * 2 + x

    t = threading.Thread(target=other)
    t.start()
    t.join()
    with torch.tpu.set_eager_mode("defer_and_fuse"):
        before = _recorded("aten.mul.Tensor")
        z = pending["y"] * 2 + x
        assert _recorded("aten.mul.Tensor") == before + 1
        got = z.cpu()
    torch.testing.assert_close(got, (x.cpu() * 2 + x.cpu()) * 2 + x.cpu())


def test_a_context_that_followed_the_fused_default_runs_natively_again():
    """A context that ran ops while the process default was DEFER_AND_FUSE holds a follower copy of
    that mode; once the default is DEFER_NEVER again the copy is stale (``execution.current()``
    passes over it) and the context's ops run at once, natively (found in the full suite: every op
    of a worker whose main thread had followed the fused default went through Python after)."""
    import contextvars

    from torchtpu.eager import modes

    x = torch.ones(3, device="tpu")

    def follow_then_return():
        previous = modes.get_mode()
        modes.set_mode("defer_and_fuse")
        try:
            (x + x).cpu()  # this context now follows the fused default
        finally:
            modes.set_mode(previous)
        assert modes.get_mode() == previous
        for _ in range(2):
            x * x  # (learnt, if not yet)
        before = _calls("aten.mul.Tensor")
        for _ in range(3):
            y = x * x
        return before, _calls("aten.mul.Tensor"), y

    if modes.get_mode() != modes.EagerMode.DEFER_NEVER:
        pytest.skip("the process default is not DEFER_NEVER here")
    before, after, y = contextvars.copy_context().run(follow_then_return)  # (this test's own context)
    assert torch.equal(y.cpu(), torch.ones(3))
    assert after - before == 3, nk.stats()["aten.mul.Tensor"]


def test_threads_share_the_native_kernels():
    errors = []

    def work(seed):
        try:
            g = torch.Generator().manual_seed(seed)
            a = torch.randn(16, 16, generator=g)
            t = a.to("tpu")
            for _ in range(50):
                t = torch.tanh(t @ t.t() * 0.01 + t)
                a = torch.tanh(a @ a.t() * 0.01 + a)
            torch.testing.assert_close(t.cpu(), a, rtol=1e-4, atol=1e-4)
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_switched_off_every_op_runs_its_python_kernel():
    code = ("import torch\nfrom torchtpu.eager import native_kernels as nk\n"
            "x = torch.ones(3, device='tpu')\nprint(len(nk.REGISTERED), nk.enabled(), (x + x).cpu().tolist())\n")
    env = {**os.environ, "TORCHTPU_NATIVE_EAGER": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "False", "[2.0,", "2.0,", "2.0]"]


def test_a_number_evicted_on_the_python_side_is_learnt_again():
    """The Python kernels' device scalars come from a bounded cache; when it evicts a number the
    native side still holds, a new signature with that number must still be learnt (not given up
    on), or a long-running process slowly falls back to Python."""
    from torchtpu.eager import dispatch

    for _ in range(3):
        torch.full((2, 3), 1.25, device="tpu")
    dispatch._cached_scalar.cache_clear()  # as an eviction would
    before = _calls("aten.full.default")
    for _ in range(4):
        out = torch.full((2, 5), 1.25, device="tpu")
    assert torch.equal(out.cpu(), torch.full((2, 5), 1.25))
    assert _calls("aten.full.default") - before >= 2  # learnt again on the second call at the latest
