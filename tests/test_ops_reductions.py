"""Reductions and scans on tpu against PyTorch's CPU results, with the CPU fallback off."""

import pytest
import torch

pytestmark = pytest.mark.usefixtures("no_fallback")

FLOATS = [torch.float32, torch.bfloat16, torch.float64]
ALL = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool]


def make(shape, dtype, seed=0, low=-4, high=4):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if not dtype.is_floating_point and not dtype.is_complex:
        return torch.randint(low, high, shape, generator=g).to(dtype)
    return (torch.rand(shape, generator=g, dtype=torch.float64) * (high - low) + low).to(dtype)


def tol(dtype):
    return {torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
            torch.float16: dict(atol=2e-3, rtol=2e-3)}.get(dtype, {})


def tpu(x):
    return x.to("tpu") if isinstance(x, torch.Tensor) else x


def check(fn, *inputs, dtype=torch.float32, **kwargs):
    """fn on tpu copies of ``inputs`` equals fn on the CPU (values, dtypes, shapes)."""
    expected = fn(*inputs, **kwargs)
    got = fn(*[tpu(x) for x in inputs], **kwargs)
    got = torch.utils._pytree.tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, got)
    torch.testing.assert_close(got, expected, equal_nan=True, **tol(dtype))


def raises_like(fn, *inputs):
    """fn raises on the CPU, and the same exception type on tpu."""
    with pytest.raises(Exception) as cpu_error:
        fn(*inputs)
    with pytest.raises(cpu_error.type):
        fn(*[tpu(x) for x in inputs])


# ---------------------------------------------------------------- sum-like, every dtype

SUM_LIKE = {
    "sum": lambda x: x.sum(),
    "sum_dim": lambda x: x.sum(1),
    "sum_dims_keepdim": lambda x: x.sum((0, 2), keepdim=True),
    "sum_empty_dims": lambda x: torch.sum(x, dim=[]),
    "sum_dtype": lambda x: x.sum(0, dtype=torch.float64),
    "prod": lambda x: x.prod(),
    "prod_dim": lambda x: x.prod(-1, keepdim=True),
    "nansum": lambda x: torch.nansum(x, 1),
    "amax": lambda x: x.amax((0, 1)),
    "amin": lambda x: x.amin(-1),
    "max": lambda x: x.max(),
    "min_dim": lambda x: x.min(1),
    "max_dim_keepdim": lambda x: x.max(0, keepdim=True),
    "aminmax": lambda x: torch.aminmax(x, dim=1),
    "any": lambda x: x.any(),
    "all_dim": lambda x: x.all(2),
    "any_dims": lambda x: torch.any(x, dim=(0, 2)),
    "count_nonzero": lambda x: torch.count_nonzero(x, dim=(1, 2)),
    "cumsum": lambda x: x.cumsum(1),
    "cumprod": lambda x: x.cumprod(0),
    "cummax": lambda x: torch.cummax(x, 2),
    "cummin": lambda x: torch.cummin(x, 0),
}


@pytest.mark.parametrize("dtype", ALL, ids=str)
@pytest.mark.parametrize("name", list(SUM_LIKE))
def test_reduction_dtypes(name, dtype):
    if dtype == torch.bool and name in ("aminmax",):
        pytest.skip("PyTorch has no bool aminmax on CPU")
    x = make((3, 4, 5), dtype, low=-2, high=3)
    check(SUM_LIKE[name], x, dtype=dtype)


ARG = {
    "argmax": lambda x: x.argmax(),
    "argmax_dim": lambda x: x.argmax(1, keepdim=True),
    "argmin_dim": lambda x: x.argmin(-1),
    "argmax_keepdim_all": lambda x: torch.argmax(x, keepdim=True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize("name", list(ARG))
def test_arg_reductions(name, dtype):
    # distinct values: ties pick the first index on both sides, but keep the test about values
    x = torch.randperm(60, generator=torch.Generator().manual_seed(1)).reshape(3, 4, 5).to(dtype)
    check(ARG[name], x, dtype=dtype)


# ---------------------------------------------------------------- float reductions

FLOAT_ONLY = {
    "mean": lambda x: x.mean(),
    "mean_dims": lambda x: x.mean((0, 2), keepdim=True),
    "nanmean": lambda x: torch.nanmean(x, 1),
    "var": lambda x: x.var(),
    "var_dim_corr0": lambda x: torch.var(x, 1, correction=0),
    "std_dim_keepdim": lambda x: x.std((0, 1), keepdim=True),
    "var_mean": lambda x: torch.var_mean(x, 2, correction=2),
    "std_mean": lambda x: torch.std_mean(x, unbiased=False),
    "logsumexp": lambda x: torch.logsumexp(x, 1),
    "logsumexp_dims": lambda x: torch.logsumexp(x, (0, 2), keepdim=True),
    "logcumsumexp": lambda x: torch.logcumsumexp(x, 2),
    "norm": lambda x: torch.norm(x),
    "norm_p1": lambda x: torch.norm(x, p=1, dim=1),
    "vector_norm_inf": lambda x: torch.linalg.vector_norm(x, ord=float("inf"), dim=(0, 1)),
    "vector_norm_3": lambda x: torch.linalg.vector_norm(x, ord=3, dim=-1, keepdim=True),
    "vector_norm_0": lambda x: torch.linalg.vector_norm(x, ord=0),
    "median": lambda x: torch.median(x),
    "median_dim": lambda x: torch.median(x, 1),
    "nanmedian_dim": lambda x: torch.nanmedian(x, 2),
}


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("name", list(FLOAT_ONLY))
def test_float_reductions(name, dtype):
    x = make((3, 4, 5), dtype)
    check(FLOAT_ONLY[name], x, dtype=dtype)


@pytest.mark.parametrize("name", ["sum", "mean", "var", "logsumexp", "norm", "amax", "cumsum", "prod"])
def test_complex_reductions(name):
    fns = {"sum": lambda x: x.sum(0), "mean": lambda x: x.mean(), "var": lambda x: x.var(1),
           "logsumexp": lambda x: torch.logsumexp(x, 1), "norm": lambda x: torch.linalg.vector_norm(x, dim=0),
           "amax": lambda x: x.abs().amax(), "cumsum": lambda x: x.cumsum(1), "prod": lambda x: x.prod(1)}
    x = torch.complex(make((3, 4), torch.float32, 1), make((3, 4), torch.float32, 2))
    check(fns[name], x)


def test_nan_propagation():
    x = torch.tensor([[1.0, float("nan"), 3.0], [4.0, 5.0, -1.0]])
    for fn in (lambda t: t.amax(1), lambda t: t.max(1), lambda t: t.argmax(1), lambda t: t.min(),
               lambda t: torch.cummax(t, 1), lambda t: torch.median(t, 1), lambda t: torch.nanmedian(t, 1),
               lambda t: torch.nansum(t), lambda t: torch.nanmean(t, 1), lambda t: torch.median(t)):
        check(fn, x)


def test_mode_values():
    x = torch.tensor([[1, 2, 2, 3, 3, 0], [5, 5, 1, 1, 4, 4], [7, 7, 7, 7, 7, 7]])
    check(lambda t: torch.mode(t, 1), x, dtype=torch.int64)


# ---------------------------------------------------------------- dtypes of results

def test_accumulation_dtypes():
    check(lambda t: t.sum(), torch.ones(10, dtype=torch.int32))  # int32 sums to int64
    check(lambda t: t.sum(), torch.ones(10, dtype=torch.bool))
    check(lambda t: t.cumsum(0), torch.ones(10, dtype=torch.int8))
    check(lambda t: t.prod(dtype=torch.int32), torch.arange(1, 6))
    check(lambda t: t.all(), torch.tensor([1, 2], dtype=torch.uint8))  # uint8 stays uint8
    # bfloat16 accumulates in float32: 4096 ones plus small values would stall in bfloat16
    x = torch.full((4096,), 0.01, dtype=torch.bfloat16)
    got = x.to("tpu").sum().cpu()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, x.sum(), atol=0, rtol=0)


def test_mean_of_int_raises():
    raises_like(lambda t: t.mean(), torch.arange(4))
    check(lambda t: t.mean(dtype=torch.float32), torch.arange(4))


# ---------------------------------------------------------------- 0-d, empty, non-contiguous

ZERO_D = [
    lambda t: t.sum(0), lambda t: t.sum(-1, keepdim=True), lambda t: t.mean(-1), lambda t: t.amax(0),
    lambda t: t.argmax(0), lambda t: t.argmin(-1, keepdim=True), lambda t: t.max(0), lambda t: t.min(-1),
    lambda t: t.cumsum(0), lambda t: t.cumprod(-1), lambda t: torch.cummax(t, 0),
    lambda t: t.var(0, correction=0),
    lambda t: torch.logsumexp(t, 0), lambda t: torch.logcumsumexp(t, -1), lambda t: t.prod(0),
    lambda t: t.any(0), lambda t: t.all(-1), lambda t: torch.linalg.vector_norm(t, dim=0),
    lambda t: torch.median(t, 0), lambda t: torch.mode(t, 0), lambda t: torch.aminmax(t, dim=0),
]


@pytest.mark.parametrize("index", range(len(ZERO_D)))
def test_zero_dim_with_dim(index):
    check(ZERO_D[index], torch.tensor(2.5))


def test_zero_dim_out_of_range():
    raises_like(lambda t: t.sum(1), torch.tensor(1.0))
    raises_like(lambda t: t.argmax(-2), torch.tensor(1.0))


def test_duplicate_dims_raise():
    raises_like(lambda t: t.sum((0, 0)), torch.ones(2, 3))


EMPTY_OK = [
    lambda t: t.sum(), lambda t: t.sum(0), lambda t: t.prod(), lambda t: t.mean(1), lambda t: t.amax(1),
    lambda t: t.any(), lambda t: t.all(0), lambda t: t.cumsum(0), lambda t: t.count_nonzero(),
    lambda t: t.norm(), lambda t: torch.logsumexp(t, 0), lambda t: t.var(0), lambda t: torch.nansum(t),
]


@pytest.mark.parametrize("index", range(len(EMPTY_OK)))
def test_empty(index):
    check(EMPTY_OK[index], torch.empty(0, 3))


@pytest.mark.parametrize("fn", [lambda t: t.max(), lambda t: t.amax(0), lambda t: t.argmax(),
                                lambda t: t.max(0), lambda t: t.min(0), lambda t: torch.aminmax(t)])
def test_empty_without_identity_raises(fn):
    raises_like(fn, torch.empty(0, 3))


def test_non_contiguous():
    x = make((4, 6), torch.float32).t()
    for fn in (lambda t: t.sum(0), lambda t: t.var(1), lambda t: t.cumsum(0), lambda t: t.max(1),
               lambda t: t[::2].logsumexp(1)):
        check(fn, x)


# ---------------------------------------------------------------- out= and autograd

def test_out_variant():
    x = make((3, 4), torch.float32)
    out = torch.empty(3, device="tpu")
    torch.sum(x.to("tpu"), 1, out=out)
    torch.testing.assert_close(out.cpu(), x.sum(1))


GRAD = {
    "sum": lambda t: t.sum(1),
    "mean": lambda t: t.mean(),
    "var": lambda t: t.var(0),
    "std": lambda t: t.std(1),
    "logsumexp": lambda t: torch.logsumexp(t, 1),
    "amax": lambda t: t.amax(1),
    "norm": lambda t: t.norm(dim=0),
    "cumsum": lambda t: t.cumsum(1),
    "prod": lambda t: t.prod(1),
    "max_dim": lambda t: t.max(1).values,
}


@pytest.mark.parametrize("name", list(GRAD))
def test_gradients(name):
    x = make((3, 4), torch.float32, seed=3)
    grads = []
    for device in ("cpu", "tpu"):
        leaf = x.detach().to(device).requires_grad_()
        GRAD[name](leaf).pow(2).sum().backward()
        grads.append(leaf.grad.cpu())
    torch.testing.assert_close(grads[1], grads[0])


# ---------------------------------------------------------------- PyTorch's OpInfo samples

OPINFO = ["sum", "mean", "prod", "amax", "argmin", "var", "std_mean", "logsumexp", "linalg.vector_norm",
          "any", "cumsum", "cummax", "logcumsumexp", "nansum", "count_nonzero", "aminmax", "median",
          "max.reduction_with_dim", "min.reduction_no_dim"]


@pytest.mark.parametrize("name", OPINFO)
def test_opinfo_samples(name):
    from torch.testing._internal.common_methods_invocations import op_db

    def full_name(o):
        return o.name + ("." + o.variant_test_name if o.variant_test_name else "")

    op = next(o for o in op_db if full_name(o) == name)
    samples = list(op.sample_inputs("cpu", torch.float32))[:8]
    assert samples
    for s in samples:
        check(lambda x, *a: op.op(x, *a, **s.kwargs), s.input, *s.args)


# ---------------------------------------------------------------- segment_reduce

SEGMENTS = [  # (data shape, axis, lengths): empty segments, lengths short of the data (unsafe), axis 1
    ((5,), 0, [0, 1, 2, 2]),
    ((5,), 0, [2, 0, 3, 0]),
    ((5, 3), 0, [0, 1, 2, 2]),
    ((10, 2, 3), 0, [1, 2, 0, 6, 0]),
    ((3, 5), 1, [[2, 0, 3, 0], [0, 1, 2, 2], [3, 0, 2, 0]]),
    ((3, 5, 2), 1, [[2, 0, 3, 0], [0, 1, 2, 2], [1, 1, 1, 2]]),
]


def _segment_kwargs(axis, lengths, by_offsets):
    lengths = torch.tensor(lengths)
    if not by_offsets:
        return {"lengths": lengths}
    zeros = lengths.new_zeros(lengths.shape[:-1] + (1,))
    return {"offsets": torch.cat((zeros, lengths), -1).cumsum(-1)}


@pytest.mark.parametrize("initial", [None, 2.0])
@pytest.mark.parametrize("reduce", ["sum", "mean", "prod", "max", "min"])
@pytest.mark.parametrize("case", range(len(SEGMENTS)))
def test_segment_reduce_and_grad(case, reduce, initial):
    shape, axis, lengths = SEGMENTS[case]
    by_offsets = case % 2 == 1  # both ways of giving the segments, over the cases
    kwargs = dict(_segment_kwargs(axis, lengths, by_offsets), axis=axis, unsafe=True, initial=initial)
    x = make(shape, torch.float64, seed=case)
    x.view(-1)[::4] = 0.0  # zeros: prod's gradient takes its exclusive-product path
    results = []
    for device in ("cpu", "tpu"):
        leaf = x.detach().to(device).requires_grad_()
        out = torch.segment_reduce(leaf, reduce, **{k: tpu(v) if device == "tpu" else v for k, v in kwargs.items()})
        out.backward(torch.linspace(-1, 1, out.numel(), dtype=x.dtype).reshape(out.shape).to(device))
        results.append((out.detach().cpu(), leaf.grad.cpu()))
    torch.testing.assert_close(results[1], results[0], equal_nan=True)


def test_segment_reduce_max_ties_and_nan():
    x = torch.tensor([3.0, 3.0, 1.0, float("nan"), 2.0, -1.0, -1.0])
    lengths = torch.tensor([3, 2, 2])
    for reduce in ("max", "min"):
        check(lambda t, n: torch.segment_reduce(t, reduce, lengths=n), x, lengths)
        results = []
        for device in ("cpu", "tpu"):
            leaf = x.detach().to(device).requires_grad_()
            torch.segment_reduce(leaf, reduce, lengths=tpu(lengths) if device == "tpu" else lengths).backward(
                torch.tensor([1.0, 2.0, -3.0]).to(device))
            results.append(leaf.grad.cpu())
        torch.testing.assert_close(results[1], results[0], equal_nan=True)


def test_segment_reduce_half_precision_and_errors():
    x = make((6, 2), torch.bfloat16)
    check(lambda t, n: torch.segment_reduce(t, "mean", lengths=n), x, torch.tensor([2, 0, 4]), dtype=torch.bfloat16)
    raises_like(lambda t, n: torch.segment_reduce(t, "median", lengths=n), x, torch.tensor([2, 4]))


# ---------------------------------------------------------------- hash_tensor

@pytest.mark.parametrize("dtype", ALL + [torch.int8, torch.uint8], ids=str)
def test_hash_tensor(dtype):
    x = make((3, 4), dtype, low=-100, high=100)
    for kwargs in ({}, {"dim": 0}, {"dim": [1], "keepdim": True}, {"dim": (0, 1)}):
        check(lambda t: torch.hash_tensor(t, **kwargs), x)
    check(torch.hash_tensor, make((), dtype))
    check(lambda t: torch.hash_tensor(t, dim=1), make((0, 3), dtype))
    raises_like(torch.hash_tensor, make((0, 3), dtype))
