"""Results that must match PyTorch's CPU results exactly where they were once silently wrong:
dtypes after ``torch.set_default_dtype`` (cached promotions and programs), ``out=`` into views,
factories' ``out=``, ``torch.range``, linspace/logspace edge cases and DLPack export."""

import numpy as np
import pytest
import torch
from torch.testing import assert_close

pytestmark = [pytest.mark.usefixtures("each_eager_mode"), pytest.mark.usefixtures("no_fallback")]


def same(tpu, cpu, **tol):
    """``tpu`` (a tpu tensor) holds ``cpu``'s values, dtype and shape."""
    assert tpu.device.type == "tpu"
    assert tpu.dtype == cpu.dtype, (tpu.dtype, cpu.dtype)
    assert_close(tpu.cpu(), cpu, **tol)


def check(fn, **tol):
    same(fn("tpu"), fn("cpu"), **tol)


# ------------------------------------------------------------------ the default dtype

_DEFAULT_DTYPE_CASES = {
    "int_div": lambda d: torch.tensor([1, 2], device=d) / torch.tensor([2, 2], device=d),
    "arange_bools": lambda d: torch.arange(False, True, .5, device=d),
    "arange_float": lambda d: torch.arange(0, 2.5, device=d),
    "uint8_plus_float": lambda d: torch.tensor([1, 2], dtype=torch.uint8, device=d) + 5.5,
    "complex_times_ones": lambda d: 1j * torch.ones(3, device=d),
    "int_true_divide_scalar": lambda d: torch.tensor([3, 4], device=d) / 2,
    "sqrt_int": lambda d: torch.sqrt(torch.tensor([4, 9], device=d)),
    "full_float": lambda d: torch.full((2,), 1.5, device=d),
    "full_complex": lambda d: torch.full((2,), 1 + 2j, device=d),
    "zeros": lambda d: torch.zeros(2, device=d),
    "linspace": lambda d: torch.linspace(0, 1, 5, device=d),
    "linspace_complex": lambda d: torch.linspace(0, 1j, 3, device=d),
    "logspace": lambda d: torch.logspace(0, 1, 3, device=d),
    "range": lambda d: torch.range(0, 3, device=d),
    "mean_of_float_tensor_plus_int": lambda d: (torch.tensor([1, 2], device=d) + 0.5).mean(),
    "foreach_add_scalar": lambda d: torch._foreach_add([torch.tensor([1, 2], device=d)], 0.5)[0],
}


@pytest.mark.filterwarnings("ignore:torch.range is deprecated")
@pytest.mark.parametrize("name", sorted(_DEFAULT_DTYPE_CASES))
def test_results_follow_the_default_dtype(name):
    """Each op under float32, float64 and float32 again: a program or promotion cached under the
    first default dtype must not answer for the second."""
    fn = _DEFAULT_DTYPE_CASES[name]
    previous = torch.get_default_dtype()
    try:
        for default in (torch.float32, torch.float64, torch.float32):
            torch.set_default_dtype(default)
            check(fn)
    finally:
        torch.set_default_dtype(previous)


def test_inplace_follows_the_default_dtype():
    """The in-place (donating) programs too: ``x.add_(0.5)`` on a float tensor, and ``x.div_(2)``
    of a float64 tensor, whose dtype does not change but whose trace read the default."""
    previous = torch.get_default_dtype()
    try:
        for default in (torch.float32, torch.float64, torch.float32):
            torch.set_default_dtype(default)
            cpu = torch.arange(4, dtype=torch.float64)
            tpu = cpu.to("tpu")
            cpu.add_(0.25).div_(3)
            tpu.add_(0.25).div_(3)
            same(tpu, cpu)
            cpu = torch.zeros(2, dtype=torch.complex128)
            tpu = cpu.to("tpu")
            same(tpu.add_(1j), cpu.add_(1j))
    finally:
        torch.set_default_dtype(previous)


# ------------------------------------------------------------------ out= into views

def _views():
    """(name, make a base on a device, take the view of it) for out= targets: each of 4 elements
    shaped (2, 2), sharing storage with elements out= must leave alone."""
    return {
        "narrow": (lambda d: torch.zeros(2, 3, device=d), lambda b: b.narrow(1, 1, 2)),
        "transpose": (lambda d: torch.zeros(2, 2, device=d), lambda b: b.t()),
        "strided": (lambda d: torch.zeros(4, 4, device=d), lambda b: b[::2, 1::2]),
        "offset_row": (lambda d: torch.zeros(3, 2, device=d), lambda b: b[1:]),
    }


def _into_view(view_name, op):
    """``op(view)`` writing into the view; returns (the op's result, the whole base) per device."""
    make_base, take = _views()[view_name]

    def run(d):
        base = make_base(d)
        result = op(take(base), d)
        return result, base

    return run


def _check_out(view_name, op, **tol):
    run = _into_view(view_name, op)
    (cpu_result, cpu_base), (tpu_result, tpu_base) = run("cpu"), run("tpu")
    same(tpu_base, cpu_base, **tol)
    same(tpu_result, cpu_result, **tol)
    assert tpu_result.shape == cpu_result.shape and tpu_result.stride() == cpu_result.stride()


_FACTORY_OUTS = {
    "arange": lambda out, d: torch.arange(0, 4, out=out),
    "arange_end": lambda out, d: torch.arange(4, out=out),
    "arange_step": lambda out, d: torch.arange(1, 3, 0.5, out=out),
    "linspace": lambda out, d: torch.linspace(0, 3, 4, out=out),
    "logspace": lambda out, d: torch.logspace(0, 3, 4, base=2, out=out),
    "range": lambda out, d: torch.range(0, 3, out=out),
}


@pytest.mark.filterwarnings("ignore:torch.range is deprecated")
@pytest.mark.parametrize("view", sorted(_views()))
@pytest.mark.parametrize("factory", sorted(_FACTORY_OUTS))
def test_factory_out_into_view(factory, view):
    """A factory's out= of the right size fills the view's elements in order (PyTorch's kernels
    resize out only when its element count differs)."""
    _check_out(view, _FACTORY_OUTS[factory])


_OP_OUTS = {
    "add": lambda out, d: torch.add(torch.tensor([[1., 2.], [3., 4.]], device=d), 10, out=out),
    "mul_tensors": lambda out, d: torch.mul(torch.tensor([[1., 2.], [3., 4.]], device=d),
                                            torch.tensor([2., 3.], device=d), out=out),
    "sum": lambda out, d: torch.sum(torch.arange(8., device=d).view(2, 2, 2), dim=0, out=out),
    "matmul": lambda out, d: torch.matmul(torch.tensor([[1., 2.], [3., 4.]], device=d),
                                          torch.tensor([[0., 1.], [1., 0.]], device=d), out=out),
    "clamp": lambda out, d: torch.clamp(torch.tensor([[-1., 2.], [3., 9.]], device=d), 0, 5, out=out),
}


@pytest.mark.parametrize("view", sorted(_views()))
@pytest.mark.parametrize("op", sorted(_OP_OUTS))
def test_op_out_into_view(op, view):
    _check_out(view, _OP_OUTS[op])


def test_factory_out_of_another_size_is_resized():
    """Out of another element count is resized to 1-D (from its storage offset), as on the CPU;
    arange warns of it as PyTorch does."""
    with pytest.warns(UserWarning, match="does not match the computed number of elements 3"):
        _check_out("narrow", lambda out, d: torch.arange(0, 3, out=out))
    _check_out("narrow", lambda out, d: torch.linspace(0, 1, 3, out=out))
    _check_out("narrow", lambda out, d: torch.logspace(0, 1, 3, out=out))
    with pytest.warns(UserWarning, match="is 7 which does not match"):
        check(lambda d: torch.arange(5, out=torch.zeros(7, device=d)))
    check(lambda d: torch.arange(5, out=torch.zeros(0, device=d)))


def test_factory_out_takes_out_dtype():
    for dtype in (torch.int32, torch.float64, torch.bfloat16, torch.int64):
        check(lambda d: torch.arange(0, 4, out=torch.empty(0, dtype=dtype, device=d)))
        check(lambda d: torch.linspace(-1.5, 4, 6, out=torch.empty(6, dtype=dtype, device=d)))
        check(lambda d: torch.logspace(0.3, 1.3, 6, out=torch.empty(6, dtype=dtype, device=d)))
    # an integer out truncates the step first: all zeros on the CPU
    check(lambda d: torch.arange(0, 2, 0.5, out=torch.zeros(4, dtype=torch.int64, device=d)))


# ------------------------------------------------------------------ range, randperm(out=), new_empty_strided

@pytest.mark.filterwarnings("ignore:torch.range is deprecated")
@pytest.mark.parametrize("args", [(0, 4), (0, 1, 0.3), (1, 0, -0.25), (-3, 7, 2), (2, 2), (0.5, 3)])
@pytest.mark.parametrize("dtype", [None, torch.int32, torch.float64, torch.int64])
def test_range(args, dtype):
    if dtype in (torch.int32, torch.int64) and any(isinstance(a, float) for a in args):
        pytest.skip("PyTorch's own range kernel divides by the step truncated to 0 (SIGFPE, also on meta)")
    check(lambda d: torch.range(*args, dtype=dtype, device=d))
    check(lambda d: torch.range(*args, out=torch.empty(0, dtype=dtype or torch.float32, device=d)))


@pytest.mark.filterwarnings("ignore:torch.range is deprecated")
def test_range_errors():
    for args, message in (((0, 4, 0), "step must be nonzero"), ((4, 0, 1), "upper bound and lower bound inconsistent with step sign")):
        for d in ("cpu", "tpu"):
            with pytest.raises(RuntimeError, match=message):
                torch.range(*args[:3], dtype=args[3] if len(args) > 3 else None, device=d)
    for d in ("cpu", "tpu"):
        with pytest.raises(RuntimeError, match="step must be nonzero"):
            torch.arange(0, 4, 0, device=d)
        with pytest.raises(RuntimeError, match="upper bound and lower bound inconsistent with step sign"):
            torch.arange(4, 0, 1, device=d)
        with pytest.raises(RuntimeError, match="unsupported range"):
            torch.arange(0, float("inf"), device=d)


def test_randperm_out():
    for n, make in ((5, lambda d: torch.empty(0, dtype=torch.int64, device=d)),
                    (6, lambda d: torch.zeros(2, 3, dtype=torch.int64, device=d).t()),
                    (4, lambda d: torch.empty(4, dtype=torch.int32, device=d)),
                    (3, lambda d: torch.zeros(6, dtype=torch.int64, device=d)[::2]),
                    (3, lambda d: torch.zeros(6, dtype=torch.int64, device=d)[::3])):
        out = make("tpu")
        cpu = torch.randperm(n, out=make("cpu"))
        result = torch.randperm(n, out=out)
        assert result is out and result.dtype == cpu.dtype
        assert result.shape == cpu.shape and result.stride() == cpu.stride()
        assert sorted(result.cpu().tolist()) == list(range(n))
    g = torch.Generator(device="tpu").manual_seed(3)
    first = torch.randperm(8, generator=g, out=torch.empty(8, dtype=torch.int64, device="tpu")).cpu()
    g.manual_seed(3)
    again = torch.randperm(8, generator=g, out=torch.empty(8, dtype=torch.int64, device="tpu")).cpu()
    assert first.tolist() == again.tolist() and sorted(first.tolist()) == list(range(8))


def test_new_empty_strided():
    for size, stride, dtype in (((2, 3), (3, 1), None), ((2, 3), (1, 2), torch.int64), ((4,), (2,), torch.float64)):
        cpu = torch.ones(2).new_empty_strided(size, stride, dtype=dtype)
        tpu = torch.ones(2, device="tpu").new_empty_strided(size, stride, dtype=dtype)
        assert (tpu.device.type, tpu.shape, tpu.stride(), tpu.dtype) == ("tpu", cpu.shape, cpu.stride(), cpu.dtype)
        same(tpu.fill_(2), cpu.fill_(2))


# ------------------------------------------------------------------ linspace / logspace

@pytest.mark.parametrize("steps", [0, 1, 2, 6])
@pytest.mark.parametrize("dtype", [None, torch.int32, torch.int64, torch.uint8, torch.float64, torch.complex64,
                                   torch.bfloat16])
def test_logspace(steps, dtype):
    for start, end, base in ((.3, 1.3, 10.0), (2.5, 3, 10.0), (0, 3, 2.0), (-1, 2, 3.0), (1, 0, 0.5)):
        if dtype == torch.uint8 and (start < 0 or end < 0 or base ** max(start, end) >= 256):
            continue  # out of uint8's range: the CPU's conversion is undefined behaviour
        check(lambda d: torch.logspace(start, end, steps, base=base, dtype=dtype, device=d))


@pytest.mark.parametrize("steps", [0, 1, 2, 5])
@pytest.mark.parametrize("dtype", [None, torch.int32, torch.int64, torch.float64, torch.complex128, torch.float16])
def test_linspace(steps, dtype):
    for start, end in ((-2.7, 5.9), (2.7, 5), (0, 1), (10, -3)):
        check(lambda d: torch.linspace(start, end, steps, dtype=dtype, device=d))


@pytest.mark.parametrize("steps", [0, 1, 4])
def test_complex_endpoints(steps):
    check(lambda d: torch.linspace(1j, 2 + 3j, steps, device=d))
    check(lambda d: torch.linspace(0, 2 + 3j, steps, dtype=torch.complex128, device=d))
    check(lambda d: torch.linspace(torch.tensor(1j, device=d), torch.tensor(2., device=d), steps))
    check(lambda d: torch.logspace(1j, 2, steps, device=d), rtol=1e-5, atol=1e-5)
    check(lambda d: torch.logspace(0, 1 + 1j, steps, base=2, device=d), rtol=1e-5, atol=1e-5)


def test_space_steps_errors():
    for d in ("cpu", "tpu"):
        with pytest.raises(RuntimeError, match="number of steps must be non-negative"):
            torch.linspace(0, 1, -1, device=d)
        with pytest.raises(RuntimeError, match="number of steps must be non-negative"):
            torch.logspace(0, 1, -1, device=d)


# ------------------------------------------------------------------ DLPack

def _sample(dtype):
    return (torch.arange(6).reshape(2, 3) - 2).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool, torch.complex64, torch.float64,
                                   torch.bfloat16])
def test_dlpack_capsule_round_trip(dtype):
    """A capsule of a tpu tensor imports as that tensor (an alias): its values, never zeros."""
    cpu = _sample(dtype)
    x = cpu.to("tpu") if dtype != torch.bool else (cpu.to("tpu") != 0)
    expected = cpu if dtype != torch.bool else cpu != 0
    for got in (torch.from_dlpack(torch.utils.dlpack.to_dlpack(x)), torch.asarray(torch.to_dlpack(x)),
                torch.from_dlpack(x)):
        same(got, expected)
        assert got.data_ptr() == x.data_ptr()
    back = torch.asarray(torch.utils.dlpack.to_dlpack(x), device="tpu")
    same(back, expected)
    same(torch.from_dlpack(x, device="tpu"), expected)
    same(torch.asarray(torch.utils.dlpack.to_dlpack(x), copy=True), expected)
    assert_close(torch.from_dlpack(x, device="cpu"), expected)


def test_dlpack_views_and_bits():
    """Views export their own elements; the lazy neg/conj bits are not carried (the stored values
    are), as on the CPU."""
    cpu = torch.arange(12.).reshape(3, 4)
    x = cpu.to("tpu")
    to = torch.utils.dlpack.to_dlpack
    for view in (lambda t: t.t(), lambda t: t[1:, ::2], lambda t: t.neg()._neg_view()):
        same(torch.from_dlpack(to(view(x))), torch.from_dlpack(to(view(cpu))))
    z = (x + 1j)
    zc = cpu + 1j
    same(torch.from_dlpack(z.conj().resolve_conj()), zc.conj().resolve_conj())
    same(torch.from_dlpack(to(z.conj())), torch.from_dlpack(to(zc.conj())))


def test_dlpack_consumers_and_errors():
    x = torch.arange(4., device="tpu")
    assert x.__dlpack_device__() == (torch.utils.dlpack.DLDeviceType.kDLCPU, 0)
    np.testing.assert_array_equal(np.from_dlpack(x), np.arange(4.))
    with pytest.raises(BufferError, match="without a copy"):
        x.__dlpack__(copy=False)
    with pytest.raises(BufferError, match="require gradient"):
        torch.from_dlpack(torch.ones(2, device="tpu", requires_grad=True))
    with pytest.raises(BufferError, match="conjugate bit"):
        (x + 1j).conj().__dlpack__()
    # the import is an alias, as on the CPU: writes go both ways
    imported = torch.from_dlpack(x)
    imported += 1
    assert_close(x.cpu(), torch.arange(4.) + 1)
    # CPU tensors keep PyTorch's zero-copy export
    c = torch.arange(3.)
    torch.from_dlpack(torch.utils.dlpack.to_dlpack(c)).add_(1)
    assert_close(c, torch.arange(3.) + 1)


@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
def test_op_out_of_another_size_into_view():
    """An op's out= view of another size is resized (from its offset, contiguous), as on the CPU."""
    _check_out("narrow", lambda out, d: torch.add(torch.ones(3, device=d), 1, out=out))
    _check_out("offset_row", lambda out, d: torch.sum(torch.ones(3, 2, device=d), dim=1, out=out))
    _check_out("transpose", lambda out, d: torch.mul(torch.ones(2, 3, device=d), 2, out=out))


def test_random_factories_follow_the_default_dtype():
    previous = torch.get_default_dtype()
    try:
        for default in (torch.float32, torch.float64, torch.float32):
            torch.set_default_dtype(default)
            for make in (torch.rand, torch.randn):
                assert make(3, device="tpu").dtype == default
            assert torch.empty(2, device="tpu").dtype == default
    finally:
        torch.set_default_dtype(previous)


def test_compiled_follows_the_default_dtype():
    """A compiled function recompiles for another default dtype (Dynamo guards it): its programs
    must not be the first default dtype's."""

    def f(x, y):
        return x / y + torch.ones(2, device=x.device) * 0.5, torch.arange(0, 2.0, device=x.device)

    compiled = torch.compile(f, backend="tpu")
    previous = torch.get_default_dtype()
    try:
        for default in (torch.float32, torch.float64, torch.float32):
            torch.set_default_dtype(default)
            x, y = torch.tensor([1, 2]), torch.tensor([2, 2])
            for got, want in zip(compiled(x.to("tpu"), y.to("tpu")), f(x, y)):
                same(got, want)
    finally:
        torch.set_default_dtype(previous)
