"""DEFER_AND_FUSE specifics: programs are cached by structure, dead values are dropped, memory
stays flat, and materialisations are counted by reason. (Its semantics are covered by running
the semantics, training-parity and OpInfo tests in both eager modes.)"""

import gc

import jax
import pytest
import torch
from torch.testing import assert_close

from torchtpu.eager import fused

DEFER = torch.tpu.EagerMode.DEFER_AND_FUSE


def _live_arrays() -> int:
    gc.collect()
    return len(jax.live_arrays())


def test_recorded_graph_is_visible_and_runs_on_demand():
    x = torch.randn(8, 8, device="tpu")
    with torch.tpu.set_eager_mode(DEFER):
        y = (x * 2).exp()
        assert len(fused.pending_graph()) == 2
        assert_close(y.cpu(), (x.cpu() * 2).exp())
        assert fused.pending_graph() == []


def test_materialisation_reasons_are_counted():
    x = torch.randn(4, device="tpu")
    before = fused.stats()["materializations"]
    with torch.tpu.set_eager_mode(DEFER):
        (x + 1).sum().item()
        (x * 3).cpu()
        x.add_(1)
        torch.tpu.synchronize()
        if (x > 100).any():
            pass
    after = fused.stats()["materializations"]
    for reason in ("item", "transfer_to_host", "synchronize"):
        assert after.get(reason, 0) > before.get(reason, 0), reason


def test_training_loop_compiles_once_and_memory_stays_flat():
    torch.manual_seed(0)
    w = torch.randn(32, 32, device="tpu")
    x = torch.randn(16, 32, device="tpu")
    with torch.tpu.set_eager_mode(DEFER):
        def step(w):
            h = (x @ w).tanh()
            grad = x.t() @ (1 - h * h)
            return w - 0.01 * grad

        for i in range(20):  # warm-up, with the same materialisation pattern as the loop below
            w = step(w)
            if i % 10 == 9:
                w.sum().item()
        compiled = fused.stats()["programs_compiled"]
        hits = fused.stats()["program_cache_hits"]
        baseline = _live_arrays()
        for i in range(1000):
            w = step(w)
            if i % 10 == 9:
                w.sum().item()
        assert _live_arrays() <= baseline + 2
        assert fused.stats()["programs_compiled"] == compiled  # every program was a cache hit
        assert fused.stats()["program_cache_hits"] - hits >= 100


def test_dead_intermediates_are_not_outputs():
    x = torch.randn(64, device="tpu")
    with torch.tpu.set_eager_mode(DEFER):
        y = x * 2
        z = y + 1
        del y  # freed before materialisation: stays inside the fused program
        graph = fused.current_executor().graph
        value = z.cpu()
    live = [r() for refs in graph.outputs for r in refs]
    assert sum(d is not None and d.value is not None for d in live) == 1
    assert_close(value, x.cpu() * 2 + 1)


def test_same_seed_same_numbers_as_defer_never():
    torch.manual_seed(3)
    eager = (torch.randn(6, device="tpu") * 2).cpu()
    torch.manual_seed(3)
    with torch.tpu.set_eager_mode(DEFER):
        deferred = (torch.randn(6, device="tpu") * 2).cpu()
    assert_close(deferred, eager)


def test_data_dependent_op_materialises():
    x = torch.tensor([0.0, 1.0, -2.0, 3.0], device="tpu")
    with torch.tpu.set_eager_mode(DEFER):
        idx = (x * 2 > 0).nonzero()
        assert idx.shape == (2, 1)
    assert_close(idx.cpu(), torch.tensor([[1], [3]]))


def test_out_of_memory_at_materialisation():
    with torch.tpu.set_eager_mode(DEFER):
        big = torch.empty(2**40, device="tpu")
        with pytest.raises(torch.OutOfMemoryError):
            (big + 1).sum().item()


def _programs_run() -> int:
    return fused.stats()["program_cache_hits"] + fused.stats()["programs_compiled"]


@pytest.mark.parametrize("split", [True, False])
def test_a_read_runs_what_it_needs_first_and_the_rest_behind_it(monkeypatch, split):
    monkeypatch.setattr(fused, "SPLIT_AT_READ", split)
    monkeypatch.setattr(fused, "SPLIT_MIN_NODES", 1)  # this graph's rest is a few ops
    torch.manual_seed(0)  # the same values whatever ran before (the loss can be a sum near zero)
    x = torch.randn(16, 8, device="tpu")
    w = torch.randn(8, 8, device="tpu")
    cx, cw = x.cpu(), w.cpu()
    with torch.tpu.set_eager_mode(DEFER):
        h = x @ w  # needed by the loss and, after `del h`, only inside the graph by `update`
        loss = h.tanh().sum()
        update = w - 0.1 * (x.t() @ h)  # the "backward and step": not needed for the loss
        other = x.exp()  # needed by nothing the read wants
        del h
        before = _programs_run()
        value = loss.item()
        assert _programs_run() - before == (2 if split else 1)
        assert fused.pending_graph() == []
        for t in (update, other):  # the rest was dispatched too: values, not pending nodes
            array = getattr(t.untyped_storage(), "_jax")
            assert isinstance(array, jax.Array) or array.value is not None
    ch = cx @ cw
    assert value == pytest.approx(ch.tanh().sum().item(), rel=1e-5, abs=1e-5)  # a sum of 128 terms
    assert_close(update.cpu(), cw - 0.1 * (cx.t() @ ch))
    assert_close(other.cpu(), cx.exp())


def test_a_split_read_of_a_view_and_its_repeat_hit_the_cache(monkeypatch):
    monkeypatch.setattr(fused, "SPLIT_MIN_NODES", 1)
    x = torch.randn(6, 4, device="tpu")
    with torch.tpu.set_eager_mode(DEFER):
        values = []
        for _ in range(3):
            y = x * 2
            rest = y + 1
            values.append(y[1:, 2].sum().item())  # a strided view: its gather is part of the read
            values.append(rest.cpu())
        compiled = fused.stats()["programs_compiled"]
        y = x * 2
        rest = y + 1
        y[1:, 2].sum().item()
        assert fused.stats()["programs_compiled"] == compiled
    expected = (x.cpu() * 2)[1:, 2].sum().item()
    assert values[0] == pytest.approx(expected, rel=1e-6) and values[4] == pytest.approx(expected, rel=1e-6)
    assert_close(values[5], x.cpu() * 2 + 1)


def test_a_value_lost_to_a_failed_program_says_so_and_the_mode_keeps_working():
    x = torch.randn(4, device="tpu")
    with torch.tpu.set_eager_mode(DEFER):
        big = torch.empty(2**40, device="tpu")
        lost = big + 1  # pending, and part of the program that cannot run
        with pytest.raises(torch.OutOfMemoryError):
            (x + 1).sum().item()
        with pytest.raises(RuntimeError, match="has no value: a fused program of .* failed"):
            lost[:2].cpu()
        assert_close((x * 2).cpu(), x.cpu() * 2)


def test_a_read_with_little_else_pending_runs_one_program():
    x = torch.randn(8, device="tpu")
    with torch.tpu.set_eager_mode(DEFER):
        y = x * 2
        rest = y + 1  # one op besides what the read needs: not worth a second program
        before = _programs_run()
        y.sum().item()
        assert _programs_run() - before == 1
    assert_close(rest.cpu(), x.cpu() * 2 + 1)
