"""DEFER_AND_FUSE finds a training step's end without a read: ``optimizer.step()`` cuts the
recording, so a loop that reads its loss only at the end runs one cached program per step (not
one ever-growing recording cut wherever the size bound lands), with DEFER_NEVER's losses."""

import torch
from torch.testing import assert_close

from torchtpu.eager import fused

STEPS = 8


def _train(mode, read_every: bool, steps: int = STEPS, zero_to_none: bool = True) -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(32, 8).to("tpu"), torch.randn(32, 4).to("tpu")
    losses = []
    with torch.tpu.set_eager_mode(mode):
        for _ in range(steps):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=zero_to_none)
            losses.append(loss.detach())
            if read_every:
                loss.item()
        return [loss.item() for loss in losses]


def _delta(before: dict, after: dict, key: str):
    if key == "materializations":
        return {r: n - before[key].get(r, 0) for r, n in after[key].items() if n != before[key].get(r, 0)}
    return after[key] - before[key]


def test_a_loop_without_reads_runs_one_cached_program_per_step():
    expected = _train(torch.tpu.EagerMode.DEFER_NEVER, read_every=False)
    before = fused.stats()
    losses = _train(torch.tpu.EagerMode.DEFER_AND_FUSE, read_every=False)
    after = fused.stats()
    assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    # every step but the last ends at its optimizer step (the last one at the read after the loop)
    assert _delta(before, after, "materializations").get("optimizer_step") == STEPS - 1
    assert "graph_size" not in _delta(before, after, "materializations")
    # the first step (AdamW makes its state) and the last (split at the read) differ; the rest repeat
    assert _delta(before, after, "program_cache_hits") >= STEPS - 3


def test_a_read_after_the_step_still_runs_what_it_needs_first():
    expected = _train(torch.tpu.EagerMode.DEFER_NEVER, read_every=True)
    before = fused.stats()
    losses = _train(torch.tpu.EagerMode.DEFER_AND_FUSE, read_every=True)
    after = fused.stats()
    assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    reasons = _delta(before, after, "materializations")
    assert reasons.get("item") == STEPS and "optimizer_step" not in reasons
    assert _delta(before, after, "program_cache_hits") >= 2 * (STEPS - 2)


def test_zeroing_gradients_after_the_step_lands_in_the_next_program():
    # zero_grad(set_to_none=False) records ops after the optimizer step: they start the next
    # step's program, which is the same every step from the second on
    expected = _train(torch.tpu.EagerMode.DEFER_NEVER, read_every=False, zero_to_none=False)
    before = fused.stats()
    losses = _train(torch.tpu.EagerMode.DEFER_AND_FUSE, read_every=False, zero_to_none=False)
    after = fused.stats()
    assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    assert _delta(before, after, "materializations").get("optimizer_step") == STEPS  # the last zeroing cut too
    assert _delta(before, after, "program_cache_hits") >= STEPS - 4


def test_a_hand_written_loop_without_reads_is_cut_where_it_repeats():
    torch.manual_seed(0)
    w0, x = torch.randn(16, 16), torch.randn(8, 16)

    def train(mode, steps=200):
        w, xs = w0.to("tpu"), x.to("tpu")
        with torch.tpu.set_eager_mode(mode):
            for _ in range(steps):  # no optimizer, no read: only the op sequence marks the steps
                h = (xs @ w).tanh()
                w = w - 0.01 * (xs.t() @ (1 - h * h))
            return w.cpu()

    expected = train(torch.tpu.EagerMode.DEFER_NEVER)
    before = fused.stats()
    assert_close(train(torch.tpu.EagerMode.DEFER_AND_FUSE), expected, rtol=1e-5, atol=1e-6)
    after = fused.stats()
    reasons = _delta(before, after, "materializations")
    assert reasons.get("repeat", 0) >= 3 and "graph_size" not in reasons
    # the recording up to the first period found, then the same run of whole periods every time
    assert _delta(before, after, "program_cache_hits") >= reasons["repeat"] - 2


def test_tail_period():
    a, b, c = object(), object(), object()
    assert fused._tail_period([a, b, c] * 3) == 3
    assert fused._tail_period([c, a, b, a, b, a, b]) == 0  # not periodic from its start
    assert fused._tail_period([a, b, c, a, b]) == 0  # fewer than two repeats
    assert fused._tail_period([a] * 5) == 1
