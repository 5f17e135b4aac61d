"""Memory formats on ``tpu`` are PyTorch's: a channels_last tensor stays channels_last through
``contiguous(memory_format=)``, ``empty``/``resize_`` with a memory format, ``*_like``, ``cat``,
elementwise ops, ``.to(dtype)`` and the moves to and from the host; a transposed operand gives a
transposed result, as on the CPU. Strides and values are compared with the CPU's, in the eager
modes that lay outputs out (``bridge.wrap``'s strides, from each program's meta kernel)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

CL = torch.channels_last


def _x(d):
    return torch.arange(120.0, device=d).reshape(2, 3, 4, 5).contiguous(memory_format=CL)


def _inplace(d):
    y = _x(d).clone()
    y.add_(1)
    return y


CASES = {
    "contiguous_channels_last": _x,
    "contiguous_back": lambda d: _x(d).contiguous(),
    "empty_channels_last": lambda d: torch.empty(2, 3, 4, 5, device=d, memory_format=CL).fill_(2),
    "resize_channels_last": lambda d: torch.empty(0, device=d).resize_(2, 3, 4, 5, memory_format=CL).fill_(1),
    "resize_as": lambda d: torch.empty(0, device=d).resize_as_(_x(d)).fill_(1),
    "cat_dim0": lambda d: torch.cat([_x(d), _x(d)]),
    "cat_dim1": lambda d: torch.cat([_x(d), _x(d)], 1),
    "zeros_like": lambda d: torch.zeros_like(_x(d)),
    "empty_like_contiguous": lambda d: torch.empty_like(_x(d), memory_format=torch.contiguous_format).fill_(3),
    "add_scalar": lambda d: _x(d) + 1,
    "mul": lambda d: _x(d) * _x(d),
    "relu": lambda d: torch.relu(_x(d)),
    "to_float64": lambda d: _x(d).to(torch.float64),
    "clone": lambda d: _x(d).clone(),
    "clone_contiguous": lambda d: _x(d).clone(memory_format=torch.contiguous_format),
    "sum_dim1": lambda d: _x(d).sum(1),
    "mean_keepdim": lambda d: _x(d).mean((2, 3), keepdim=True),
    "permuted_add": lambda d: _x(d).permute(0, 2, 1, 3) + 1,
    "transposed_mul": lambda d: torch.arange(6.0, device=d).reshape(2, 3).t() * 2,
    "inplace_add": _inplace,
    "view_of_result": lambda d: (_x(d) + 1)[:, 1:, ::2],
    "batch_norm": lambda d: F.batch_norm(_x(d), None, None, training=True),
    "softmax": lambda d: torch.softmax(_x(d), 1),
    "max_pool": lambda d: F.max_pool2d(_x(d), 2),
    "interpolate": lambda d: F.interpolate(_x(d), scale_factor=2),
}


@pytest.mark.parametrize("mode", ["defer_never", "defer_and_fuse"])
@pytest.mark.parametrize("case", list(CASES))
def test_strides_and_values_are_the_cpus(case, mode):
    expected = CASES[case]("cpu")
    with torch.tpu.set_eager_mode(mode):
        got = CASES[case]("tpu")
        assert got.stride() == expected.stride()
        assert_close(got.cpu(), expected)


def test_moves_keep_the_layout():
    x = torch.randn(2, 3, 4, 5).contiguous(memory_format=CL)
    on = x.to("tpu")
    assert on.is_contiguous(memory_format=CL) and on.stride() == x.stride()
    back = on.cpu()
    assert back.stride() == x.stride()
    assert_close(back, x)
    model = torch.nn.Conv2d(3, 4, 3).to(memory_format=CL).to("tpu")
    assert model.weight.is_contiguous(memory_format=CL)
    assert_close(model(on).cpu(), model.cpu()(x), rtol=1e-4, atol=1e-4)
