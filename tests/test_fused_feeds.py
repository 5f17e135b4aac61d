"""DEFER_AND_FUSE runs the same cached programs whatever way a step's batch reaches the device:
the same device batch every step, a host batch moved with ``.to("tpu")`` inside the step, a slice
of a data set moved to ``tpu`` before the loop, or an item of a list of device batches. For the
small GPT and a ``nn.TransformerEncoderLayer`` model (benchmarks/eager_modes.py's loops), once
warmed up a step compiles nothing (no fused program, no XLA program at all), and the losses are
DEFER_NEVER's."""

import os
import sys

import pytest
import torch
from torch.testing import assert_close

from torchtpu import metrics
from torchtpu.eager import fused

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from eager_modes import DATA_MODELS, FEEDS, make_data_loop  # noqa: E402

WARMUP, STEPS = 6, 8


def _xla_programs_built() -> int:
    return sum(metrics.programs["eager"][what] for what in ("compiled", "loaded"))


def _counts(before: dict, built: int) -> dict:
    after = fused.stats()
    return {"compiled": after["programs_compiled"] - before["programs_compiled"],
            "hits": after["program_cache_hits"] - before["program_cache_hits"], "xla": _xla_programs_built() - built}


def _train(model_name: str, feed: str, mode) -> tuple[list[float], list[dict]]:
    """Losses of WARMUP + STEPS steps, read only after the last (a loop that logs rarely), and
    what each step after the warm-up compiled and ran, the last one counted at ``synchronize``."""
    step = make_data_loop(model_name, feed, batches=16)
    losses, counts = [], []
    with torch.tpu.set_eager_mode(mode):
        for _ in range(WARMUP):
            losses.append(step().detach())
        for _ in range(STEPS):
            before, built = fused.stats(), _xla_programs_built()
            losses.append(step().detach())
            counts.append(_counts(before, built))
        before, built = fused.stats(), _xla_programs_built()
        torch.tpu.synchronize()  # the last step runs here
        counts.append(_counts(before, built))
        return [loss.item() for loss in losses], counts


@pytest.mark.parametrize("feed", FEEDS)
@pytest.mark.parametrize("model_name", DATA_MODELS)
def test_after_warm_up_no_step_compiles_whatever_the_feed(model_name, feed):
    expected, _ = _train(model_name, feed, torch.tpu.EagerMode.DEFER_NEVER)
    losses, counts = _train(model_name, feed, torch.tpu.EagerMode.DEFER_AND_FUSE)
    assert_close(losses, expected, rtol=2e-5, atol=2e-5)
    assert [c["compiled"] for c in counts] == [0] * (STEPS + 1), counts
    assert [c["xla"] for c in counts] == [0] * (STEPS + 1), counts
    # each step ran as one cached program: at the next step's first op (the cut at
    # optimizer.step()), the last one at synchronize
    assert [c["hits"] for c in counts] == [1] * (STEPS + 1), counts
