"""Run a user program on ``cpu`` and on ``tpu`` and compare what it recorded, step by step.

A program is a function ``run(device, steps, workdir, resume_from=None) -> history``, written
the way a PyTorch user writes a training script: it seeds torch, builds its model on the CPU,
moves it with ``.to(device)`` and trains. ``history`` maps a series name ("loss",
"grad_norm", "eval_loss", "tokens", ...) to ``{step: value}``; a value is a float, an int, a
list of ints, or a tensor (on any device). Seeding and building on the CPU give both runs the
same initial weights and the same data; the only difference is the device that computes.

Integer values (counts, token ids) must be equal. Floating-point values are compared with
``tolerance(step)`` below.

Why these tolerances. Both sides compute in float32 (eps 1.2e-7) but not the same way: XLA:CPU
fuses elementwise chains, contracts multiply-adds into FMAs, reduces in a different order and
uses its own exp/log/tanh approximations (a few ulp); convolutions and matmuls go through a
different library with a different blocking. So one forward and backward differs from ATen's
by a few ulp: measured on these programs, at most 6e-7 relative in steps 0 and 1. Those steps
are compared at rtol 1e-5 (~80 ulp, 15x the measured worst): a wrong lowering, a stale
parameter or a missing update is off by far more. Training then compounds the difference:
each step starts from the previous step's rounding, and Adam's ``g / (sqrt(v) + eps)`` turns
relative differences in small gradients into relative differences in updates. Measured over
these runs the divergence grows to 2e-5 (16-33 steps) and 1.2e-4 (the 64-step GPT), so later
steps are compared at rtol 1e-3 (8x the worst), which still catches a wrong learning rate, a
skipped clip, a lost momentum buffer or a wrong BatchNorm statistic: each shifts the loss by
percents within a few steps. The absolute floor (atol) covers values that pass through zero (a
parameter, a mean); for a tensor it is scaled by the tensor's largest magnitude, since an
element near zero carries the rounding of the large values it was computed from (a logit near
0 next to logits of 10 comes out of the same matmul and has their absolute error, not a
relative one of its own).

These figures are for XLA:CPU, where the tests run (``tests/conftest.py``). On a GPU or TPU,
XLA's default float32 matmul precision may be lower (TF32 / bf16 passes) and would need its
own tolerances.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import traceback
from typing import Any, Callable

import torch
from torch.testing import assert_close

History = dict[str, dict[int, Any]]
Program = Callable[..., History]

TIGHT_STEPS = 2  # steps 0 and 1: rounding has not compounded yet
TIGHT = dict(rtol=1e-5, atol=1e-6)
LOOSE = dict(rtol=1e-3, atol=1e-5)


def tolerance(step: int) -> dict[str, float]:
    return TIGHT if step < TIGHT_STEPS else LOOSE


def run_on_cpu_and_tpu(run: Program, steps: int, workdir, tpu_eager_mode: str | None = None,
                       **kwargs) -> tuple[History, History]:
    """``run`` on ``cpu`` and on ``tpu`` (each in its own sub-directory of ``workdir``).

    ``tpu_eager_mode`` (e.g. "DEFER_AND_FUSE") runs the tpu side in that eager mode, as a user
    would by setting ``TORCHTPU_DEFER_AND_FUSE=1``; the program itself does not change.
    """
    results = []
    for device in ("cpu", "tpu"):
        directory = os.path.join(workdir, device)
        os.makedirs(directory, exist_ok=True)
        mode = contextlib.nullcontext()
        if device == "tpu" and tpu_eager_mode is not None:
            mode = torch.tpu.set_eager_mode(getattr(torch.tpu.EagerMode, tpu_eager_mode))
        with mode, _shut_down_on_failure():
            results.append(plain(run(device, steps, directory, **kwargs)))
    return results[0], results[1]


@contextlib.contextmanager
def _shut_down_on_failure():
    """If a program fails, stop its DataLoader's workers and pin-memory thread before pytest
    reports the failure.

    The loader's iterator stays alive in the failed frames, and with it the pin-memory thread,
    which keeps wrapping the prefetched batches' errors in tracebacks. Python 3.11 formats a
    traceback with ``ast.parse``, whose state is not thread-safe: pytest formatting its report at
    the same time then dies with an INTERNALERROR ("AST constructor recursion depth mismatch")
    that ends the whole session. Clearing the frames drops the iterator, whose finaliser joins
    the thread and the workers; the traceback keeps its lines.
    """
    try:
        yield
    except BaseException as error:
        traceback.clear_frames(error.__traceback__)
        gc.collect()
        raise


def assert_greedy_choices_are_robust(cpu_logits: torch.Tensor, tpu_logits: torch.Tensor) -> None:
    """Greedy tokens may be compared exactly: rounding cannot have flipped any choice.

    ``*_logits`` are the (batch, decode steps, vocab) logits each token was chosen from. At
    every step the CPU's margin between its top two logits must exceed twice the largest
    tpu/CPU difference of that step's logits; then both argmaxes agree. (If a near-tie ever
    made them differ, the tokens could not be compared and only the logits up to that step
    would be meaningful: pick another seed or prompt.)
    """
    top2 = cpu_logits.topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]
    difference = (tpu_logits - cpu_logits).abs().amax(dim=-1)
    close_calls = (margin <= 2 * difference).nonzero().tolist()
    assert not close_calls, (
        f"(row, decode step) {close_calls[0]}: top-2 margin {margin[tuple(close_calls[0])]:.3g} "
        f"<= 2 x logit difference {difference[tuple(close_calls[0])]:.3g}; greedy tokens cannot be "
        f"compared exactly there"
    )


def assert_resumes_identically(run: Program, device: str, steps: int, workdir, reference: History, from_step: int,
                               **kwargs):
    """``run`` resumed from the checkpoint its uninterrupted run wrote at ``from_step``
    (``<workdir>/<device>/ckpt_<from_step>.pt``) records exactly what that run recorded."""
    directory = os.path.join(workdir, device)
    checkpoint = os.path.join(directory, f"ckpt_{from_step}.pt")
    assert os.path.exists(checkpoint), f"the {device} run wrote no checkpoint at step {from_step}"
    with _shut_down_on_failure():
        resumed = plain(run(device, steps, directory, resume_from=checkpoint, **kwargs))
    assert_histories_equal(resumed, reference, from_step)
    return resumed


def plain(history: History) -> History:
    """``history`` with every tensor detached and copied to the CPU."""

    def convert(value):
        if isinstance(value, torch.Tensor):
            return value.detach().cpu()
        if isinstance(value, (list, tuple)):
            return type(value)(convert(v) for v in value)
        return value

    return {name: {step: convert(v) for step, v in series.items()} for name, series in history.items()}


def _is_exact(value) -> bool:
    if isinstance(value, torch.Tensor):
        return not value.is_floating_point()
    if isinstance(value, (list, tuple)):
        return all(_is_exact(v) for v in value)
    return isinstance(value, (bool, int))


def assert_histories_match(cpu: History, tpu: History, tolerance=tolerance) -> None:
    """Every series of ``tpu`` equals the one of ``cpu``: same steps, values within tolerance."""
    assert tpu.keys() == cpu.keys(), f"recorded series differ: tpu {sorted(tpu)} vs cpu {sorted(cpu)}"
    for name in cpu:
        assert tpu[name].keys() == cpu[name].keys(), f"{name}: recorded at different steps"
        for step in sorted(cpu[name]):
            c, t = cpu[name][step], tpu[name][step]
            if _is_exact(c):
                assert _equal(t, c), f"{name} at step {step}: tpu {t} != cpu {c}"
            else:
                assert_value_close(t, c, tolerance(step), f"{name} at step {step}")


def assert_value_close(tpu, cpu, tol: dict[str, float], what: str) -> None:
    """One float or floating tensor within ``tol``; a tensor's atol scales with its magnitude."""
    cpu, tpu = torch.as_tensor(cpu), torch.as_tensor(tpu)
    tol = dict(tol)
    tol["atol"] *= max(1.0, float(cpu.abs().max()))  # see "the absolute floor" above
    assert_close(tpu, cpu, **tol, msg=lambda m: f"{what} (tpu vs cpu): {m}")


def assert_histories_equal(resumed: History, reference: History, from_step: int) -> None:
    """A run resumed from a checkpoint at ``from_step`` continues exactly as the reference did.

    Same device, same programs, same inputs: the numbers must be identical, not just close
    (XLA:CPU, like ATen on one thread, is deterministic).
    """
    for name, series in reference.items():
        later = {s: v for s, v in series.items() if s >= from_step}
        got = resumed.get(name, {})
        got = {s: v for s, v in got.items() if s >= from_step}
        assert got.keys() == later.keys(), f"{name}: resumed run recorded steps {sorted(got)}, expected {sorted(later)}"
        for step in sorted(later):
            assert _equal(got[step], later[step]), (
                f"{name} at step {step}: resumed {got[step]} != uninterrupted {later[step]}"
            )


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        return a.shape == b.shape and a.dtype == b.dtype and bool((a == b).all())
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b


def max_divergence(cpu: History, tpu: History) -> dict[str, float]:
    """Largest relative difference per series (for tuning and reporting tolerances)."""
    out = {}
    for name in cpu:
        worst = 0.0
        for step, c in cpu[name].items():
            if _is_exact(c):
                continue
            c, t = torch.as_tensor(c, dtype=torch.float64), torch.as_tensor(tpu[name][step], dtype=torch.float64)
            worst = max(worst, float(((t - c).abs() / c.abs().clamp_min(1e-6)).max()))
        out[name] = worst
    return out
