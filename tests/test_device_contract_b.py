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


# ------------------------------------------------------------------ argument checks PyTorch makes

def raises_as_cpu(fn):
    """``fn(device)`` raises on tpu what it raises on the CPU (type and message)."""
    with pytest.raises(Exception) as cpu:
        fn("cpu")
    with pytest.raises(type(cpu.value)) as tpu:
        fn("tpu")
    assert str(tpu.value) == str(cpu.value)


@pytest.mark.parametrize("op", ["linspace", "logspace", "arange", "range"])
def test_factory_out_that_overlaps_itself_raises(op):
    """test_linlogspace_mem_overlap: an expanded out= is refused, as TensorIterator refuses it."""
    calls = {"linspace": lambda out: torch.linspace(1, 10, 10, out=out),
             "logspace": lambda out: torch.logspace(1, 10, 10, out=out),
             "arange": lambda out: torch.arange(10.0, out=out),
             "range": lambda out: torch.range(0, 9, out=out)}
    with pytest.warns(UserWarning) if op == "range" else _nothing():
        raises_as_cpu(lambda d: calls[op](torch.rand(1, device=d).expand(10)))


def _nothing():
    import contextlib

    return contextlib.nullcontext()


@pytest.mark.parametrize("mean", ["scalar", "tensor", "out"])
@pytest.mark.parametrize("std", [-1.0, float("nan")])
def test_normal_with_a_negative_std_tensor_raises(mean, std):
    """test_normal_std_error: the std tensor's values are checked, as PyTorch checks them (a read)."""
    def call(d):
        s = torch.tensor([0.5, std], device=d)
        if mean == "scalar":
            return torch.normal(0.0, s)
        if mean == "out":
            return torch.normal(torch.zeros(2, device=d), s, out=torch.empty(2, device=d))
        return torch.normal(torch.zeros(2, device=d), s)

    raises_as_cpu(call)
    assert torch.normal(torch.zeros(2, device="tpu"), torch.ones(2, device="tpu")).shape == (2,)
    assert torch.normal(torch.zeros(0, device="tpu"), -torch.ones(0, device="tpu")).shape == (0,)
    raises_as_cpu(lambda d: torch.normal(torch.zeros(2, device=d), torch.ones(2, dtype=torch.complex64, device=d)))


_FMAX, _DMAX = torch.finfo(torch.float32).max, torch.finfo(torch.float64).max


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64])
@pytest.mark.parametrize("bounds", [(-_DMAX, 0), (0, _DMAX), (-_FMAX, _FMAX), (-70000, 0), (float("nan"), 0),
                                    (0, float("inf")), (2, 1.5)], ids=str)
def test_uniform_bounds_checked_as_on_cpu(dtype, bounds):
    """test_uniform_from_to: bounds outside the dtype, reversed, or a span past its maximum."""
    def call(d):
        return torch.empty(4, dtype=dtype, device=d).uniform_(*bounds)

    try:
        call("cpu")
    except RuntimeError:
        raises_as_cpu(call)
    else:
        assert call("tpu").shape == (4,)


@pytest.mark.parametrize("call", [lambda d: torch.randint(6, (3,), dtype=torch.complex64, device=d),
                                  lambda d: torch.randint(1, 6, (0,), dtype=torch.complex128, device=d),
                                  lambda d: torch.randint_like(torch.zeros(3, dtype=torch.complex64, device=d), 5),
                                  lambda d: torch.zeros(3, dtype=torch.complex64, device=d).random_(0, 5),
                                  lambda d: torch.zeros(3, dtype=torch.complex64, device=d).random_(5)],
                         ids=["randint", "randint_empty", "randint_like", "random_from_to", "random_to"])
def test_random_integers_into_complex_raise(call):
    """test_tensor_factories_empty: randint of a complex dtype is refused."""
    raises_as_cpu(call)


@pytest.mark.parametrize("size,stride", [((2,), ()), ((2, 3), (1,))], ids=str)
def test_empty_strided_sizes_and_strides_of_one_length(size, stride):
    """test_new_empty_strided: PyTorch's message, not a failed storage resize."""
    raises_as_cpu(lambda d: torch.empty_strided(size, stride, device=d))
    raises_as_cpu(lambda d: torch.zeros(1, device=d).new_empty_strided(size, stride))


# ------------------------------------------------------------------ warnings as on the CPU
# test_byte_mask, test_bool_indices, test_byte_mask_accumulate, test_multiple_byte_mask,
# test_byte_tensor_assignment: the uint8-mask deprecation warning came from the meta kernel run
# when a program is first traced, so not on later calls.

def _byte_mask_calls(d):
    v = torch.arange(105.0, device=d).reshape(5, 7, 3)
    mask = torch.tensor([1, 0, 1, 1, 0], dtype=torch.uint8, device=d)
    y, m = torch.ones(10, 10, device=d), torch.zeros(10, dtype=torch.uint8, device=d)
    return {
        "getitem": lambda: v[mask],
        "two_masks": lambda: v[mask, :, torch.ones(3, dtype=torch.uint8, device=d)],
        "none_then_mask": lambda: v[None, mask],
        "setitem": lambda: v.__setitem__(mask, torch.ones(3, 7, 3, device=d)),
        "index_put_accumulate": lambda: y.index_put_((m,), y[m], accumulate=True),
        "bool_mask": lambda: v[mask.bool()],
    }


def _warnings_of(fn, always=True):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        if always:
            warnings.simplefilter("always")
        fn()
    return [(w.category, str(w.message).split(" (Triggered internally")[0], w.lineno) for w in caught]


@pytest.mark.parametrize("case", list(_byte_mask_calls("cpu")))
def test_byte_mask_warns_each_call_as_on_cpu(case):
    cpu, tpu = _byte_mask_calls("cpu")[case], _byte_mask_calls("tpu")[case]
    for _ in range(2):  # the second call runs a cached program
        assert _warnings_of(tpu) == _warnings_of(cpu)


def test_byte_mask_warning_is_attributed_to_the_callers_line():
    """Under the default filter it is shown once per line of user code, as PyTorch's C++ warnings are."""
    v, mask = torch.zeros(5, device="tpu"), torch.tensor([1, 0, 1, 1, 0], dtype=torch.uint8, device="tpu")

    def calls():
        v[mask]; v[mask]  # noqa: E702 - one line: one warning
        for _ in range(3):
            v[mask]

    cpu_v, cpu_mask = v.cpu(), mask.cpu()

    def cpu_calls():
        cpu_v[cpu_mask]; cpu_v[cpu_mask]  # noqa: E702
        for _ in range(3):
            cpu_v[cpu_mask]

    caught = _warnings_of(calls, always=False)
    assert len(caught) == len(_warnings_of(cpu_calls, always=False)) == 2
    assert all(line != 0 for _, _, line in caught)


# ------------------------------------------------------------------ exceptions as on the CPU

@pytest.mark.parametrize("dtypes", [(torch.float32, torch.complex64, torch.float32),
                                    (torch.float64, torch.complex128, torch.float64),
                                    (torch.int64, torch.float32, torch.int64),
                                    (torch.bool, torch.int32, torch.bool)], ids=str)
def test_cat_out_of_the_first_inputs_dtype_refused_as_on_cpu(dtypes):
    """test_cat_out_different_dtypes: out= has the first input's dtype but not the result type's
    class: PyTorch's TypeError, not the generic cast error."""
    x_dtype, y_dtype, out_dtype = dtypes
    raises_as_cpu(lambda d: torch.cat([torch.tensor([1, 2, 3], dtype=x_dtype, device=d),
                                       torch.tensor([4, 5, 6], dtype=y_dtype, device=d)],
                                      out=torch.zeros(6, dtype=out_dtype, device=d)))
    out = torch.zeros(6, dtype=torch.float32, device="tpu")  # and a cast PyTorch accepts still works
    torch.cat([torch.ones(3, dtype=torch.float32, device="tpu"), torch.ones(3, dtype=torch.int64, device="tpu")],
              out=out)
    same(out, torch.ones(6))


@pytest.mark.parametrize("values", [[], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0, 5.0]], ids=str)
def test_mask_assignment_of_another_dtype_and_shape_as_on_cpu(values):
    """test_boolean_assignment_value_mismatch: PyTorch checks the shape before the dtype."""
    def call(d):
        a = torch.arange(0, 4, device=d)
        a[a > -1] = torch.tensor(values, device=d)

    raises_as_cpu(call)


def test_mask_assignment_of_more_rows_than_the_mask_has_elements():
    """More value rows than mask elements is a mismatch whatever the mask holds (a mask's True
    count is not read otherwise: a shorter mismatch is not caught, by design)."""
    def call(d):
        a = torch.arange(0, 4, device=d)[:1]
        a[a > -1] = torch.tensor([1, 2, 3], device=d)

    raises_as_cpu(call)

    def two_d(d):
        x = torch.zeros(2, 4, 3, device=d)
        x[:, torch.tensor([True, False, True, True], device=d)] = torch.ones(2, 5, 3, device=d)

    raises_as_cpu(two_d)
    for shape in [(3, 3), (2, 3, 3), (1, 3), (3,)]:  # these broadcast
        x = torch.zeros(2, 4, 3)
        m = torch.tensor([True, False, True, True])
        x[:, m] = torch.ones(shape)
        t = torch.zeros(2, 4, 3, device="tpu")
        t[:, m.to("tpu")] = torch.ones(shape, device="tpu")
        same(t, x)
