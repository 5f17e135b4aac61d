"""Out-of-bounds indices raise on ``tpu`` (``ops/checks.py``), in every eager mode and compiled,
instead of XLA's clamped reads and dropped writes; in-bounds indices (negative ones included,
where PyTorch allows them) give the CPU's values. The error comes at the next synchronisation
after the op (a read to the host, ``synchronize``), at the op itself in
DEFER_NEVER_AND_LAUNCH_BLOCKING, and is both an ``IndexError`` and a ``RuntimeError``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

MODES = ["defer_never", "defer_never_and_launch_blocking", "defer_and_fuse"]


def _i(d, *values):
    return torch.tensor(values, device=d)


def _x(d):
    return torch.arange(5.0, device=d)


# name -> (fn(device, index values...), in-bounds indices, out-of-bounds indices)
CASES = {
    "getitem": (lambda d, *v: _x(d)[_i(d, *v)], (0, -5, 4), (0, 5)),
    "getitem_negative": (lambda d, *v: _x(d)[_i(d, *v)], (-1,), (0, -6)),
    "getitem_2d": (lambda d, *v: torch.ones(3, 4, device=d)[:, _i(d, *v)], (3, -4), (4,)),
    "setitem": (lambda d, *v: torch.zeros(5, device=d).index_put_((_i(d, *v),), torch.tensor(7.0, device=d)),
                (1, -1), (1, 11)),
    "index_put_accumulate": (lambda d, *v: torch.zeros(5, device=d).index_put_(
        (_i(d, *v),), torch.ones(len(v), device=d), accumulate=True), (1, 1), (5,)),
    "index_select": (lambda d, *v: torch.index_select(_x(d), 0, _i(d, *v)), (4, 0), (4, 5)),
    "index_select_negative": (lambda d, *v: torch.index_select(_x(d), 0, _i(d, *v)), (0,), (-1,)),
    "index_add": (lambda d, *v: torch.zeros(5, device=d).index_add_(0, _i(d, *v), torch.ones(len(v), device=d)),
                  (0, 4), (5,)),
    "index_copy": (lambda d, *v: torch.zeros(5, device=d).index_copy_(0, _i(d, *v), torch.ones(len(v), device=d)),
                   (2,), (-1,)),
    "index_fill": (lambda d, *v: torch.zeros(5, device=d).index_fill_(0, _i(d, *v), 1.0), (-1, 0), (5,)),
    "gather": (lambda d, *v: torch.gather(_x(d), 0, _i(d, *v)), (4, 0), (7,)),
    "scatter": (lambda d, *v: torch.zeros(3, device=d).scatter_(0, _i(d, *v), 1.0), (2,), (5,)),
    "scatter_add": (lambda d, *v: torch.zeros(3, device=d).scatter_add_(0, _i(d, *v), torch.ones(len(v), device=d)),
                    (0, 2), (-1,)),
    "take": (lambda d, *v: torch.take(_x(d), _i(d, *v)), (-5, 4), (9,)),
    "put": (lambda d, *v: torch.zeros(5, device=d).put_(_i(d, *v), torch.ones(len(v), device=d)), (-1,), (5,)),
    "embedding": (lambda d, *v: F.embedding(_i(d, *v), torch.arange(6.0, device=d).reshape(3, 2)), (2, 0), (3,)),
    "embedding_bag": (lambda d, *v: F.embedding_bag(_i(d, *v), torch.arange(6.0, device=d).reshape(3, 2),
                                                    _i(d, 0)), (2, 1), (3,)),
}


def _run(fn, d, values):
    out = fn(d, *values)
    return out.cpu() if isinstance(out, torch.Tensor) else out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(CASES))
def test_in_bounds_match_cpu_and_out_of_bounds_raise(case, mode):
    fn, good, bad = CASES[case]
    with torch.tpu.set_eager_mode(mode):
        assert_close(_run(fn, "tpu", good), _run(fn, "cpu", good))
        with pytest.raises(IndexError, match="out of (bounds|range)") as info:
            _run(fn, "tpu", bad)
            torch.tpu.synchronize()  # a write is not read back: the error comes here
        assert isinstance(info.value, RuntimeError)  # as gather's on the CPU, and CUDA's assert
        # reported once: the device works on
        assert_close(_run(fn, "tpu", good), _run(fn, "cpu", good))
        torch.tpu.synchronize()


def test_the_error_names_the_op_and_comes_at_the_next_read():
    x = _x("tpu")
    y = x[_i("tpu", 0, 10)]  # DEFER_NEVER: queued, nothing read yet
    z = x * 2
    with pytest.raises(IndexError, match=r"aten\.index\.Tensor: .*dimension 0 with size 5"):
        z.cpu()
    assert_close(z.cpu(), torch.arange(5.0) * 2)
    del y


def test_launch_blocking_raises_at_the_op():
    with torch.tpu.set_eager_mode("defer_never_and_launch_blocking"):
        with pytest.raises(IndexError, match="index_select"):
            torch.index_select(_x("tpu"), 0, _i("tpu", 5))


def test_a_loop_that_never_reads_keeps_its_codes_bounded():
    from torchtpu.ops import checks

    x = _x("tpu")
    for _ in range(3 * checks.FOLD_AT + 1):
        x = x[_i("tpu", 4, 3, 2, 1, 0)]
    assert len(checks._pending) <= checks.FOLD_AT
    assert_close(x.cpu(), torch.arange(5.0).flip(0))  # an odd number of flips
    x = x[_i("tpu", 8)]
    for _ in range(2 * checks.FOLD_AT):
        x = x[_i("tpu", 0)]
    with pytest.raises(IndexError):
        x.cpu()


@pytest.mark.parametrize("fn", [lambda x, i: x[i] * 2, lambda x, i: torch.gather(x, 0, i) + 1,
                                lambda x, i: torch.zeros_like(x).index_add(0, i, x[:2]),
                                lambda x, i: F.embedding(i, x.reshape(5, 1))],
                         ids=["index", "gather", "index_add", "embedding"])
def test_compiled(fn):
    compiled = torch.compile(fn, backend="tpu")
    x = _x("tpu")
    good = _i("tpu", 1, 2)
    assert_close(compiled(x, good).cpu(), fn(x.cpu(), good.cpu()))
    with pytest.raises(IndexError, match="out of (bounds|range)"):
        compiled(x, _i("tpu", 1, 7)).cpu()
    assert_close(compiled(x, good).cpu(), fn(x.cpu(), good.cpu()))


@pytest.mark.parametrize("mode", ["DEFER_NEVER", "DEFER_AND_FUSE", "DEFER_NEVER_AND_LAUNCH_BLOCKING"])
def test_masked_put_with_a_wrong_number_of_values_raises(mode):
    """``x[mask] = v`` with more than one row of ``v`` and not as many as the mask's True elements:
    PyTorch's shape mismatch, found on the device (it wrote [1, 2, 3, 3] before), raised at the
    next read (at the op when launches block); a matching count and a broadcast row still write."""
    with torch.tpu.set_eager_mode(mode):
        a = torch.arange(4.0, device="tpu")
        with pytest.raises(RuntimeError, match=r"shape mismatch: value tensor of shape \[3\]"):
            a[a > -1] = torch.tensor([1.0, 2.0, 3.0], device="tpu")  # raises here when launches block
            a.cpu()  # else at the next read
        b = torch.arange(4.0, device="tpu")
        b[b > 0] = torch.tensor([7.0, 8.0, 9.0], device="tpu")
        b[b > 8] = torch.tensor([5.0], device="tpu")
        assert b.cpu().tolist() == [0.0, 7.0, 8.0, 5.0]
