"""float8 on ``tpu`` (a TPU training dtype): tensors are held, moved and cast as PyTorch does on
the CPU — the same bits, including PyTorch's saturation of float8_e4m3fn casts where XLA's
convert would give NaN."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
VALUES = torch.tensor([0.1, -2.5, 448.0, 1e-3, 3.0, 460.0, 1000.0, -1000.0, 0.0, -0.0, 5e-6])


def _bits(t: torch.Tensor) -> list[int]:
    return t.cpu().view(torch.uint8).tolist()


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("dtype", FLOAT8, ids=str)
def test_casts_give_the_cpus_bits(dtype, source):
    x = VALUES.to(source)
    expected = x.to(dtype)
    assert _bits(x.to("tpu").to(dtype)) == _bits(expected)
    assert _bits(x.to("tpu").to(torch.float32).to(dtype)) == _bits(x.float().to(dtype))
    out = torch.empty(len(VALUES), dtype=dtype, device="tpu")
    out.copy_(x.to("tpu"))
    assert _bits(out) == _bits(expected)


@pytest.mark.parametrize("dtype", FLOAT8, ids=str)
def test_moves_views_and_upcasts(dtype):
    x = VALUES.to(dtype)
    t = x.to("tpu")
    assert t.dtype == dtype and _bits(t) == _bits(x)
    assert _bits(torch.cat([t, t[2:]])) == _bits(torch.cat([x, x[2:]]))
    assert_close(t.to(torch.float32).cpu(), x.to(torch.float32), equal_nan=True)  # (fnuz: 448 is NaN)
    assert _bits(t.reshape(1, -1).t()[3:]) == _bits(x.reshape(1, -1).t()[3:])
