"""Eager modes are per thread (per context): threads in different modes run at the same time,
each with its own semantics and CPU-exact results; a value deferred in one thread can be read in
another."""

import queue
import threading

import pytest
import torch

from torchtpu.eager import fused

NEVER = torch.tpu.EagerMode.DEFER_NEVER
BLOCKING = torch.tpu.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
FUSE = torch.tpu.EagerMode.DEFER_AND_FUSE
STEPS = 100  # 10 ops a step: 1,000 ops per thread
HANDOFF_STEP = 50  # the fused thread hands a pending value over after this step
READ_STEP = 60  # ... which the other thread reads after this one
TIMEOUT = 300


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 10, (8, 8), generator=g).float(), torch.randint(0, 7, (8, 8), generator=g).float()


def _program(x, w, *, check=lambda: None, handoff=None, read=None):
    """1,000 ops on integer-valued floats (every result is exact, so tpu and CPU agree bit for
    bit): elementwise, matmul, reductions, in-place updates through views, an ``.item()`` every
    100 ops. Returns (x, w, items, whatever ``read`` returned)."""
    items, got = [], None
    for step in range(STEPS):
        x = x + w                                   # values stay below 2**24: exact in float32
        x = torch.remainder(x * 3, 17)
        x = x @ w
        x = torch.remainder(x, 13)
        x[1:5, 2:6].add_(2)                         # in place, through a slice
        x.t()[0].mul_(2)                            # in place, through a transposed view (a column)
        r = x.sum(dim=1, keepdim=True)
        x = torch.remainder(x + r, 11)
        w = torch.remainder(w + x.amax(dim=0), 7)
        if step % 10 == 9:
            items.append(x.sum().item())            # a read every 100 ops
            check()
        if handoff is not None and step == HANDOFF_STEP:
            handoff(x * 2 + 1)
        if read is not None and step == READ_STEP:
            got = read()
    return x, w, items, got


def _run_threads(targets, barrier=None, events=()):
    """Run ``targets`` in threads; the first error is raised here (and releases the others' waits)."""
    errors = []

    def guard(fn):
        def run():
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
                errors.append(exc)
                if barrier is not None:
                    barrier.abort()
                for event in events:
                    event.set()
        return run

    threads = [threading.Thread(target=guard(fn)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a thread hung"


@pytest.mark.parametrize("other", [NEVER, BLOCKING])
def test_threads_in_different_modes_run_together_exactly(other):
    cx, cw = _inputs()
    expected = {}
    ex, ew, eitems, _ = _program(cx, cw, handoff=lambda t: expected.setdefault("handoff", t.clone()),
                                 read=lambda: None)
    barrier = threading.Barrier(2)
    passed: queue.Queue = queue.Queue()
    read_done = threading.Event()
    results = {}

    def fused_thread():
        with torch.tpu.set_eager_mode(FUSE):
            def check():
                assert torch.tpu.eager_mode is FUSE
                assert fused.current_executor() is not None

            def handoff(t):
                value = t.untyped_storage()._jax
                assert isinstance(value, fused.Deferred) and value.value is None  # recorded, not run
                passed.put(t)
                assert read_done.wait(TIMEOUT)  # the other thread reads it while it is still pending

            check()
            barrier.wait()
            results[FUSE] = _program(*(t.to("tpu") for t in _inputs()), check=check, handoff=handoff)
            check()

    def other_thread():
        with torch.tpu.set_eager_mode(other):
            def check():
                assert torch.tpu.eager_mode is other
                assert fused.current_executor() is None

            def read():
                t = passed.get(timeout=TIMEOUT)
                value = t.untyped_storage()._jax
                assert isinstance(value, fused.Deferred) and value.value is None  # still pending there
                try:
                    return t.cpu(), (t + 0).cpu()  # read as is, and as an input of this thread's op
                finally:
                    read_done.set()

            check()
            barrier.wait()
            results[other] = _program(*(t.to("tpu") for t in _inputs()), check=check, read=read)
            check()

    _run_threads([fused_thread, other_thread], barrier, [read_done])
    assert torch.tpu.eager_mode is NEVER  # the main thread's mode is untouched
    for mode in (FUSE, other):
        x, w, items, _ = results[mode]
        assert items == eitems, mode
        assert torch.equal(x.cpu(), ex), mode
        assert torch.equal(w.cpu(), ew), mode
    as_is, as_input = results[other][3]
    assert torch.equal(as_is, expected["handoff"])
    assert torch.equal(as_input, expected["handoff"])


def test_threads_following_a_fused_default_record_separately():
    """Threads without their own mode follow the process default; in DEFER_AND_FUSE each records
    into an executor of its own. The default changing under them (to DEFER_NEVER, mid-run) keeps
    their results exact; a thread's own mode outlives the change."""
    cx, cw = _inputs()
    ex, ew, eitems, _ = _program(cx, cw)
    barrier = threading.Barrier(3)
    executors, results = {}, {}
    changed = threading.Event()

    def follower(name):
        def run():
            assert torch.tpu.eager_mode is FUSE
            executors[name] = fused.current_executor()
            barrier.wait()
            results[name] = _program(*(t.to("tpu") for t in _inputs()))

        return run

    def own_mode():
        def check():
            if not changed.is_set():  # after 100 ops, while the followers record: the default changes
                torch.tpu.eager_mode = NEVER
                changed.set()
            assert torch.tpu.eager_mode is BLOCKING  # ... and this thread keeps its own mode

        with torch.tpu.set_eager_mode(BLOCKING):
            barrier.wait()
            results["own"] = _program(*(t.to("tpu") for t in _inputs()), check=check)

    torch.tpu.eager_mode = FUSE
    try:
        assert torch.tpu.eager_mode is FUSE
        _run_threads([follower("a"), follower("b"), own_mode], barrier)
        assert changed.is_set() and torch.tpu.eager_mode is NEVER
    finally:
        torch.tpu.eager_mode = NEVER
    assert executors["a"] is not None and executors["b"] is not None and executors["a"] is not executors["b"]
    for name in ("a", "b", "own"):
        x, w, items, _ = results[name]
        assert items == eitems, name
        assert torch.equal(x.cpu(), ex) and torch.equal(w.cpu(), ew), name


def test_a_block_mode_is_this_threads_only():
    seen = {}
    inside = threading.Event()
    release = threading.Event()

    def other():
        inside.wait(TIMEOUT)
        seen["other"] = torch.tpu.eager_mode
        release.set()

    t = threading.Thread(target=other)
    t.start()
    with torch.tpu.set_eager_mode(FUSE):
        inside.set()
        assert release.wait(TIMEOUT)
        assert torch.tpu.eager_mode is FUSE
    t.join(TIMEOUT)
    assert seen["other"] is NEVER


def test_an_op_under_way_when_the_default_leaves_fused_still_runs():
    """A context that follows the process default reads an op's arguments in DEFER_AND_FUSE
    (``Deferred``s); another thread switches the default before the op runs: the op runs at once
    on their values."""
    import types

    import jax

    from torchtpu.device import bridge
    from torchtpu.eager import modes

    plus_one = jax.jit(lambda a: a + 1)
    stub = types.SimpleNamespace(name="torchtpu_test.plus_one", lowering=types.SimpleNamespace(jit=True))
    torch.tpu.eager_mode = FUSE
    try:
        x = torch.arange(4.0, device="tpu") * 2
        array = bridge.read(x)
        assert isinstance(array, fused.Deferred)
        switch = threading.Thread(target=lambda: setattr(torch.tpu, "eager_mode", NEVER))
        switch.start()
        switch.join(TIMEOUT)
        assert torch.tpu.eager_mode is NEVER
        via_apply = bridge.apply(plus_one, array)
        via_execute = modes.execute(stub, plus_one, [array])
    finally:
        torch.tpu.eager_mode = NEVER
    assert isinstance(via_apply, jax.Array) and isinstance(via_execute, jax.Array)
    assert via_apply.tolist() == via_execute.tolist() == [1.0, 3.0, 5.0, 7.0]


@pytest.mark.parametrize("mode", [FUSE, BLOCKING, NEVER])
def test_backward_runs_in_its_callers_mode(mode):
    """Autograd runs a backward pass on its own device thread; it runs in the mode of the thread
    that called ``backward()`` (in DEFER_AND_FUSE: recorded into that thread's executor)."""
    a = torch.randn(4)
    x = a.to("tpu").requires_grad_(True)
    seen = []
    with torch.tpu.set_eager_mode(mode):
        h = x * 2
        h.register_hook(lambda g: seen.append((threading.current_thread() is threading.main_thread(),
                                               torch.tpu.eager_mode)))
        h.sin().sum().backward()
        if mode is FUSE:
            grad = x.grad.untyped_storage()._jax
            assert isinstance(grad, fused.Deferred) and grad.value is None
            assert grad.executor is fused.current_executor()
    assert seen == [(False, mode)]  # (if autograd ever runs it on the caller's thread, drop the first check)
    torch.testing.assert_close(x.grad.cpu(), 2 * (2 * a).cos())


def test_a_context_following_the_fused_default_follows_its_changes():
    """A context that follows a DEFER_AND_FUSE default keeps its executor in a copy of the default
    (one ContextVar read per op); a change of the default reaches it at once, and a return to
    DEFER_AND_FUSE records into the same executor again."""
    import jax

    torch.tpu.eager_mode = FUSE
    try:
        x = torch.ones(3, device="tpu") * 2
        first = fused.current_executor()
        assert first is not None and isinstance(x.untyped_storage()._jax, fused.Deferred)
        torch.tpu.eager_mode = NEVER
        assert torch.tpu.eager_mode is NEVER and fused.current_executor() is None
        y = x + 1
        assert isinstance(y.untyped_storage()._jax, jax.Array)  # ran at once
        torch.tpu.eager_mode = FUSE
        z = y * 2
        assert fused.current_executor() is first and isinstance(z.untyped_storage()._jax, fused.Deferred)
    finally:
        torch.tpu.eager_mode = NEVER
    assert z.cpu().tolist() == [6.0, 6.0, 6.0]
