"""Factory ops on tpu against PyTorch CPU: full/zeros/ones, *_like and new_*, eye, linspace,
logspace, tril/triu_indices, scalar_tensor, arange."""

import pytest
import torch
from torch.testing import assert_close

pytestmark = pytest.mark.usefixtures("no_fallback")


def check(fn, **tol):
    """``fn(device)`` on tpu gives the CPU result (values, dtype, shape), on a tpu device."""
    cpu, tpu = fn("cpu"), fn("tpu")
    assert tpu.device.type == "tpu"
    assert_close(tpu.cpu(), cpu, **tol)


@pytest.mark.parametrize("dtype", [None, torch.int64, torch.bool, torch.float64, torch.bfloat16])
def test_full_zeros_ones(dtype):
    check(lambda d: torch.zeros(2, 3, dtype=dtype, device=d))
    check(lambda d: torch.ones(4, dtype=dtype, device=d))
    check(lambda d: torch.full((2, 2), 1, dtype=dtype, device=d))
    check(lambda d: torch.zeros((), dtype=dtype, device=d))
    check(lambda d: torch.ones(0, 3, dtype=dtype, device=d))


def test_full_infers_dtype():
    check(lambda d: torch.full((2,), 3, device=d))
    check(lambda d: torch.full((2,), 3.5, device=d))
    check(lambda d: torch.full((2,), True, device=d))


def test_like_and_new():
    base = torch.randn(3, 4)
    check(lambda d: torch.zeros_like(base.to(d)))
    check(lambda d: torch.ones_like(base.to(d), dtype=torch.int32))
    check(lambda d: torch.full_like(base.to(d), 7))
    check(lambda d: torch.full_like(base.to(d).t(), -1.5))
    check(lambda d: base.to(d).new_zeros(2, 5))
    check(lambda d: base.to(d).new_ones((3,), dtype=torch.int64))
    check(lambda d: base.to(d).new_full((2,), 4.0))
    for t in (torch.empty_like(base.to("tpu")), base.to("tpu").new_empty(5)):
        assert t.device.type == "tpu" and t.dtype == torch.float32


def test_eye():
    check(lambda d: torch.eye(3, device=d))
    check(lambda d: torch.eye(2, 5, device=d))
    check(lambda d: torch.eye(4, 2, dtype=torch.int64, device=d))
    check(lambda d: torch.eye(0, device=d))


@pytest.mark.parametrize("args", [(0, 1, 5), (-3.5, 10, 7), (2, -2, 4), (1, 5, 1), (0, 1, 0), (0, 100, 1000)])
def test_linspace(args):
    check(lambda d: torch.linspace(*args, device=d))
    check(lambda d: torch.linspace(*args, dtype=torch.int64, device=d))
    check(lambda d: torch.linspace(*args, dtype=torch.float64, device=d))


def test_linspace_tensor_bounds():
    check(lambda d: torch.linspace(torch.tensor(1.0, device=d), torch.tensor(3.0, device=d), 5, device=d))
    check(lambda d: torch.linspace(torch.tensor(-1.0, device=d), 4, 6, device=d))


@pytest.mark.parametrize("args", [(0, 2, 5), (-1, 1, 4, 2.0), (0, 3, 4, 10.0)])
def test_logspace(args):
    check(lambda d: torch.logspace(*args, device=d))
    check(lambda d: torch.logspace(*args, dtype=torch.float64, device=d))
    check(lambda d: torch.logspace(*args, dtype=torch.int64, device=d))


@pytest.mark.parametrize("args", [(3, 3), (4, 3, -1), (3, 5, 2), (0, 0), (5, 2, 3)])
def test_tril_triu_indices(args):
    check(lambda d: torch.tril_indices(*args, device=d))
    check(lambda d: torch.triu_indices(*args, device=d))
    check(lambda d: torch.tril_indices(*args, dtype=torch.int32, device=d))


def test_scalar_tensor_and_arange():
    check(lambda d: torch.scalar_tensor(3.5, device=d))
    check(lambda d: torch.scalar_tensor(2, dtype=torch.int64, device=d))
    check(lambda d: torch.arange(5, device=d))
    check(lambda d: torch.arange(1, 4, 0.5, device=d))
    check(lambda d: torch.arange(10, 0, -3, device=d))


def test_factory_on_second_device():
    t = torch.linspace(0, 1, 3, device="tpu:1")
    assert t.device == torch.device("tpu", 1)
    assert_close(t.cpu(), torch.linspace(0, 1, 3))
    e = torch.eye(2, device="tpu:1")
    assert e.device == torch.device("tpu", 1)
