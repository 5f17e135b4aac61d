"""Regressions from PyTorch's own device-generic tests (issue #28), each checked against PyTorch's
CPU result: DLPack round trips, kaiser_window, random_ on unsigned dtypes, float -> int casts of
out-of-range values, torch.complex of half inputs."""

import numpy as np
import pytest
import torch
from torch.testing import assert_close

pytestmark = [pytest.mark.usefixtures("each_eager_mode"), pytest.mark.usefixtures("no_fallback")]


def same(tpu, cpu, **tol):
    assert tpu.device.type == "tpu"
    assert tpu.dtype == cpu.dtype, (tpu.dtype, cpu.dtype)
    assert_close(tpu.cpu(), cpu, **tol)


# ------------------------------------------------------------------ DLPack
# test_tensor_creation_ops.py TestAsArray*.test_alias_from_dlpack / test_copy_from_dlpack held zeros.

_DLPACK_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool,
                  torch.complex64]


def _on_cpu(kwargs):
    """The same asarray arguments for the CPU twin."""
    return {k: ("cpu" if k == "device" else v) for k, v in kwargs.items()}


def _made(dtype, device):
    cpu = torch.arange(-6, 19).reshape(5, 5)
    cpu = cpu != 0 if dtype == torch.bool else cpu.to(dtype)
    return cpu.to(device)


@pytest.mark.parametrize("dtype", _DLPACK_DTYPES)
def test_dlpack_alias_as_on_cpu(dtype):
    """``torch.asarray(to_dlpack(t), ...)`` aliases ``t`` where the CPU does (same data_ptr, writes
    seen both ways) and copies where it does, with ``t``'s values."""
    for kwargs in ({}, {"copy": False}, {"dtype": dtype}, {"device": "tpu", "copy": False},
                   {"dtype": dtype, "requires_grad": False}):
        cpu, x = _made(dtype, "cpu"), _made(dtype, "tpu")
        got_cpu = torch.asarray(torch.utils.dlpack.to_dlpack(cpu), **_on_cpu(kwargs))
        got = torch.asarray(torch.utils.dlpack.to_dlpack(x), **kwargs)
        assert (got.data_ptr() == x.data_ptr()) == (got_cpu.data_ptr() == cpu.data_ptr())
        same(got, got_cpu)
        if dtype not in (torch.bool,):
            got[1, 2] = 7
            got_cpu[1, 2] = 7
            same(x, cpu)  # the write reached the exported tensor, as on the CPU
            x[0, 0] = 3
            cpu[0, 0] = 3
            same(got, got_cpu)


@pytest.mark.parametrize("dtype", _DLPACK_DTYPES)
def test_dlpack_copy_as_on_cpu(dtype):
    for kwargs in ({"copy": True}, {"device": "tpu", "copy": True}, {"dtype": dtype, "copy": True}):
        cpu, x = _made(dtype, "cpu"), _made(dtype, "tpu")
        got = torch.asarray(torch.utils.dlpack.to_dlpack(x), **kwargs)
        assert got.data_ptr() != x.data_ptr()
        same(got, torch.asarray(torch.utils.dlpack.to_dlpack(cpu), **_on_cpu(kwargs)))
        got.zero_()
        same(x, cpu)  # a copy: the exported tensor is unchanged
    other = torch.float64 if dtype != torch.float64 else torch.float32
    cpu, x = _made(dtype, "cpu"), _made(dtype, "tpu")
    same(torch.asarray(torch.utils.dlpack.to_dlpack(x), dtype=other),
         torch.asarray(torch.utils.dlpack.to_dlpack(cpu), dtype=other))


def test_dlpack_of_views_and_offsets():
    cpu = torch.arange(24.).reshape(4, 6)
    x = cpu.to("tpu")
    to = torch.utils.dlpack.to_dlpack
    for view in (lambda t: t[1], lambda t: t[1:, 2:5], lambda t: t.t(), lambda t: t[:, 3], lambda t: t[2:2]):
        got, want = torch.from_dlpack(to(view(x))), torch.from_dlpack(to(view(cpu)))
        same(got, want)
        assert got.data_ptr() == view(x).data_ptr()
        assert got.stride() == want.stride()
    row = torch.from_dlpack(to(x[2]))
    row.mul_(-1)
    cpu[2].mul_(-1)
    same(x, cpu)


def test_dlpack_from_tensor_aliases():
    """``torch.from_dlpack(t)`` of a tpu tensor: an alias on tpu, as PyTorch gives for a CUDA one;
    ``copy=True`` copies and ``device=`` moves."""
    x = torch.arange(5., device="tpu")
    y = torch.from_dlpack(x)
    assert y.device == x.device and y.data_ptr() == x.data_ptr() and y is not x
    y[0] = 9
    assert x[0].item() == 9
    c = torch.from_dlpack(x, copy=True)
    c[1] = -1
    assert x[1].item() == 1 and c.device == x.device
    on_cpu = torch.from_dlpack(x, device="cpu")
    assert on_cpu.device.type == "cpu"
    assert_close(on_cpu, torch.tensor([9., 1., 2., 3., 4.]))
    with pytest.raises(BufferError, match="require gradient"):
        torch.from_dlpack(torch.ones(2, device="tpu", requires_grad=True))
    with pytest.raises(ValueError, match="without copying"):
        torch.from_dlpack(x, device="cpu", copy=False)


def test_dlpack_capsule_torchtpu_never_saw_raises():
    """A capsule from PyTorch's exporter itself (bypassing torchtpu) cannot be resolved: a clear
    error, never a tensor of zeros."""
    fresh = torch.arange(3., device="tpu") + 1
    with pytest.raises(BufferError, match="did not export"):
        torch.from_dlpack(torch._C._to_dlpack(fresh))
    with pytest.raises(BufferError, match="did not export"):
        torch.asarray(torch._C._to_dlpack(torch.ones(2, device="tpu") * 2))


def test_dlpack_foreign_consumers_get_values():
    x = torch.arange(6., device="tpu").reshape(2, 3)
    np.testing.assert_array_equal(np.from_dlpack(x), np.arange(6.).reshape(2, 3))
    cap = x.__dlpack__(dl_device=(torch.utils.dlpack.DLDeviceType.kDLExtDev, 0))
    got = torch.from_dlpack(cap)
    assert got.data_ptr() == x.data_ptr()
    same(got, torch.arange(6.).reshape(2, 3))


def test_asarray_under_a_default_device():
    with torch.device("tpu"):
        t = torch.asarray([1, 2, 3])
    assert t.device.type == "tpu"
    assert_close(t.cpu(), torch.tensor([1, 2, 3]))


def test_asarray_device_without_index_aliases():
    """PyTorch's test_device_without_index (CUDA's): ``device="tpu"`` is the current device."""
    x = torch.arange(5, device="tpu")
    assert torch.asarray(x, device="tpu").data_ptr() == x.data_ptr()
    assert torch.asarray(x, device="tpu", copy=False).data_ptr() == x.data_ptr()
    assert torch.asarray(x, device="tpu", copy=True).data_ptr() != x.data_ptr()


# ------------------------------------------------------------------ kaiser_window
# test_tensor_creation_ops.py test_kaiser_window_*: "DispatchStub: missing kernel for tpu".

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("length", [0, 1, 2, 5, 300])
def test_kaiser_window_matches_cpu(dtype, length):
    # Known limit: as the process's very first tpu op (runtime not started), PyTorch's composite
    # kernel runs instead of ours and fails in its DispatchStub; from the second call on it is ours.
    torch.zeros(1, device="tpu")
    for periodic in (True, False):
        for beta in (0.5, 12.0, 27.3):
            same(torch.kaiser_window(length, periodic=periodic, beta=beta, dtype=dtype, device="tpu"),
                 torch.kaiser_window(length, periodic=periodic, beta=beta, dtype=dtype))
    same(torch.kaiser_window(length, dtype=dtype, device="tpu"), torch.kaiser_window(length, dtype=dtype))


def test_kaiser_window_checks():
    torch.zeros(1, device="tpu")
    with pytest.raises(RuntimeError, match="floating point"):
        torch.kaiser_window(3, dtype=torch.long, device="tpu")
    with pytest.raises(RuntimeError, match="not implemented for sparse types"):
        torch.kaiser_window(3, layout=torch.sparse_coo, device="tpu")
    assert torch.kaiser_window(3, requires_grad=True, device="tpu").requires_grad


# ------------------------------------------------------------------ random_
# test_tensor_creation_ops.py test_random_to/from_to_tpu_uint16/uint32 (KeyError 'torch.uint16'),
# test_random_from_to_tpu_* (the "from is out of bounds" UserWarning), test_random_to_tpu_float16.

def _random_outcome(dtype, device, args):
    t = torch.empty(4000, dtype=dtype, device=device)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            t.random_(*args)
            error = None
        except RuntimeError as e:
            error = str(e)
    messages = sorted(str(w.message).split(". ")[0] for w in caught if issubclass(w.category, UserWarning))
    return error, messages, (None if error else t.double().cpu())


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.float32, torch.float16, torch.bfloat16,
                                   torch.float64, torch.int8, torch.bool])
def test_random_checks_and_warnings_as_on_cpu(dtype):
    for args in ((-1, 5), (0, 2 ** 40), (2 ** 25, 2 ** 26), (-2 ** 60, 0), (0,), (3,), (4000,), (32752,),
                 (-3000, 3000), (2 ** 30, None), (70000, None), (7, 7)):
        cpu = _random_outcome(dtype, "cpu", args)
        tpu = _random_outcome(dtype, "tpu", args)
        assert tpu[:2] == cpu[:2], (args, tpu[:2], cpu[:2])
        if dtype == torch.bfloat16:  # draws round to the nearest bfloat16, past the ends too (CPU's as well)
            continue
        if tpu[2] is not None and len(args) == 2 and args[1] is not None:
            assert args[0] <= tpu[2].min() and tpu[2].max() < args[1], args
        elif tpu[2] is not None and len(args) == 1:
            assert 0 <= tpu[2].min() and tpu[2].max() < args[0], args


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32])
def test_random_unsigned(dtype):
    t = torch.empty(5000, dtype=dtype, device="tpu")
    t.random_(0, 42)
    assert t.dtype == dtype and 0 <= int(t.min()) and int(t.max()) < 42
    top = torch.iinfo(dtype).max
    t.random_(top - 10, top + 1)
    assert top - 10 <= int(t.min()) and int(t.max()) <= top


# ------------------------------------------------------------------ torch.complex / torch.polar
# test_torch_complex_same_dtype_error / test_torch_complex_out_dtype_error: PyTorch's complex_check_dtype.

def _outcome(fn):
    try:
        return "ok", fn().dtype
    except RuntimeError as e:
        return "error", str(e)


@pytest.mark.parametrize("op", [torch.complex, torch.polar])
def test_complex_and_polar_dtype_checks_as_on_cpu(op):
    def calls(d):
        f = lambda dt: torch.tensor([1., 2.], device=d, dtype=dt)  # noqa: E731
        return [lambda: op(f(torch.float32), f(torch.float64)), lambda: op(f(torch.float64), f(torch.float32)),
                lambda: op(f(torch.float32), f(torch.float32), out=torch.zeros(2, device=d)),
                lambda: op(f(torch.float32), torch.tensor([1, 2], device=d)),
                lambda: op(f(torch.float32), f(torch.float32), out=torch.zeros(2, device=d, dtype=torch.complex128)),
                lambda: op(f(torch.float64), f(torch.float64), out=torch.zeros(2, device=d, dtype=torch.complex128))]
    for tpu, cpu in zip(calls("tpu"), calls("cpu")):
        assert _outcome(tpu) == _outcome(cpu)


@pytest.mark.parametrize("source", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_float_to_int_casts_out_of_range_as_on_cpu(source):
    """Out-of-range, infinite and NaN floats cast to integers as PyTorch's CPU casts them (through
    a 32- or 64-bit int, then wrapped), not saturated as XLA's convert does."""
    values = torch.tensor([-2.0, -1.5, -0.5, 0.5, 1.5, 300.0, 70000.0, 3e9, 1e10, 2.0**63, -(2.0**65),
                           float("nan"), float("inf"), -float("inf"), torch.finfo(torch.float).max,
                           torch.finfo(torch.float).min]).to(source)
    for dtype in (torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.int64, torch.bool):
        assert torch.equal(values.to("tpu").to(dtype).cpu(), values.to(dtype)), dtype
