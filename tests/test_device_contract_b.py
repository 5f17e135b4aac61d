"""Regressions from PyTorch's own device-generic tests (issue #28), each checked against PyTorch's
CPU result: integer linspace values, argument checks PyTorch makes, the exceptions it raises and
the warnings it gives."""

import pytest
import torch
from torch.testing import assert_close


def same(tpu, cpu, **tol):
    assert tpu.device.type == "tpu"
    assert tpu.dtype == cpu.dtype, (tpu.dtype, cpu.dtype)
    assert_close(tpu.cpu(), cpu, **tol)


# ------------------------------------------------------------------ linspace of integer dtypes
# test_linspace_vs_numpy_integral / test_linspace_tpu_int*: XLA turned the step's division into a
# product with the rounded reciprocal, and the CPU computes each point as one fused multiply-add;
# either moves a point that lands on an integer to the integer below.

_LINSPACE_INT = [(1, 127, 25), (1, 127, 50), (5378, -8576, 21), (2459, -5173, 55), (-9644, 2966, 55),
                 (10, 2000, 1991), (-2 ** 40, 2 ** 41 + 3, 997), (0, 9000, 9000), (2, 0, 3)]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("args", _LINSPACE_INT, ids=str)
def test_integer_linspace_as_on_cpu(args, dtype):
    start, end, steps = args
    if dtype == torch.int32 and max(abs(start), abs(end)) >= 2 ** 31:
        pytest.skip("out of int32's range")
    same(torch.linspace(start, end, steps, dtype=dtype, device="tpu"),
         torch.linspace(start, end, steps, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16])
def test_small_integer_linspace_as_on_cpu(dtype):
    for steps in (25, 50, 77):
        same(torch.linspace(1, 127, steps, dtype=dtype, device="tpu"), torch.linspace(1, 127, steps, dtype=dtype))


def test_float_linspace_step_is_a_true_division():
    """The step is (end - start) / (steps - 1), not a product with 1 / (steps - 1)."""
    for dtype in (torch.float32, torch.float64):
        same(torch.linspace(1, 127, 50, dtype=dtype, device="tpu"), torch.linspace(1, 127, 50, dtype=dtype),
             atol=0, rtol=0)
