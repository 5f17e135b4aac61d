"""torch.fft on tpu vs PyTorch CPU: the three aten FFT ops, every torch.fft function, gradients,
torch.compile and the OpInfo ``fft.*`` entries."""

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db

aten = torch.ops.aten
pytestmark = pytest.mark.usefixtures("no_fallback")
TOL = dict(atol=1e-4, rtol=1e-4)

# torch.fft conjugates lazily (the conj bit) in ifft(real), ihfft and hfft*: those cases check that
# the bridge resolves the bit and that conj_physical keeps its autograd.


def randn(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_complex:
        return torch.randn(*shape, generator=gen, dtype=torch.complex64).to(dtype)
    return torch.randn(*shape, generator=gen).to(dtype)


def check(fn, x, grad=False, **tol):
    """``fn(x)`` on tpu equals ``fn(x)`` on CPU (dtype, shape, values; gradients if ``grad``)."""
    tol = {**TOL, **tol}
    xc = x.detach().clone().requires_grad_(grad)
    xt = x.detach().to("tpu").requires_grad_(grad)
    expected, actual = fn(xc), fn(xt)
    assert actual.device.type == "tpu"
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.cpu(), expected, **tol)
    if grad:
        cot = randn(*expected.shape, dtype=expected.dtype, seed=1)
        (gc,) = torch.autograd.grad(expected, xc, cot)
        (gt,) = torch.autograd.grad(actual, xt, cot.to("tpu"))
        torch.testing.assert_close(gt.cpu(), gc, **tol)


# ---------------------------------------------------------------- the aten ops


@pytest.mark.parametrize("i,dims", enumerate([[0], [3], [2, 1], [3, 0], [0, 2, 3], [0, 1, 2, 3]]), ids=str)
def test_aten_ops(i, dims):
    z, x = randn(4, 6, 5, 3, dtype=torch.complex64), randn(4, 6, 5, 3)
    # normalization: 0 none, 1 1/sqrt(n), 2 1/n (spread over the dims cases; torch.fft tests try all)
    check(lambda t: aten._fft_c2c(t, dims, i % 3, True), z)
    check(lambda t: aten._fft_c2c(t, dims, (i + 1) % 3, False), z)
    check(lambda t: aten._fft_r2c(t, dims, (i + 2) % 3, True), x)
    check(lambda t: aten._fft_r2c(t, dims, i % 3, False), x)
    for last in (1, 4 + i % 2):
        # the op's contract: the input's last transformed dim holds last // 2 + 1 values
        check(lambda t: aten._fft_c2r(t, dims, (i + 1) % 3, last), z.narrow(dims[-1], 0, last // 2 + 1))


def test_aten_ops_float64_and_noncontiguous():
    z = randn(4, 6, 5, dtype=torch.complex128)
    check(lambda t: aten._fft_c2c(t, [1], 1, True), z)
    check(lambda t: aten._fft_r2c(t, [1, 2], 2, True), randn(4, 6, 5, dtype=torch.float64))
    check(lambda t: aten._fft_c2r(t, [0, 1], 0, 10), z, atol=1e-9, rtol=1e-9)
    c = randn(4, 6, 5, dtype=torch.complex64)
    check(lambda t: aten._fft_c2c(t.transpose(0, 2), [0, 1], 1, False), c)
    check(lambda t: aten._fft_r2c(t.transpose(1, 2)[..., ::2], [2], 0, True), randn(4, 6, 8))
    check(lambda t: aten._fft_c2r(t[:, ::2], [1], 2, 4), c)


def test_half_precision_refused_like_cpu():
    # PyTorch CPU refuses reduced precision with NotImplementedError("Unsupported dtype Half")
    for dtype, name in [(torch.float16, "Half"), (torch.bfloat16, "BFloat16")]:
        x = torch.ones(8, dtype=dtype)
        with pytest.raises(NotImplementedError, match=f"Unsupported dtype {name}"):
            torch.fft.rfft(x)
        with pytest.raises(NotImplementedError, match=f"Unsupported dtype {name}"):
            torch.fft.rfft(x.to("tpu"))
        with pytest.raises(NotImplementedError, match=f"Unsupported dtype {name}"):
            aten._fft_r2c(x.to("tpu"), [0], 0, True)


# ---------------------------------------------------------------- torch.fft functions

ONE_D = {"fft": True, "ifft": True, "rfft": False, "irfft": True, "hfft": True, "ihfft": False}
N_D = {"fft2": True, "ifft2": True, "fftn": True, "ifftn": True, "rfft2": False, "irfft2": True,
       "rfftn": False, "irfftn": True, "hfft2": True, "ihfft2": False, "hfftn": True, "ihfftn": False}
ONE_D_ARGS = [{}, {"n": 3}, {"n": 11}, {"dim": -2, "n": 4}]
# the *2 functions are *n with dim=(-2, -1): they get the first three
N_D_ARGS = [{}, {"s": (3, 8)}, {"dim": (2, 0)}, {"s": (5, 2, 7), "dim": (0, 1, 2)}, {"s": (3, 9), "dim": (-1, 0)},
            {"dim": (1,)}]
NORMS = [None, "backward", "forward", "ortho"]


def _cases(table, arg_list):
    for name, takes_complex in table.items():
        for dtype in (torch.float32, torch.complex64) if takes_complex else (torch.float32,):
            for i, kwargs in enumerate(arg_list[:3] if name.endswith("2") else arg_list):
                kw = dict(kwargs, norm=NORMS[i % len(NORMS)])  # every norm, spread over the arguments
                yield pytest.param(name, dtype, kw, id=f"{name}-{str(dtype)[6:]}-{kw}")


@pytest.mark.parametrize("name,dtype,kwargs", list(_cases(ONE_D, ONE_D_ARGS)))
def test_fft_1d(name, dtype, kwargs):
    check(lambda t: getattr(torch.fft, name)(t, **kwargs), randn(4, 6, 5, dtype=dtype))


@pytest.mark.parametrize("name,dtype,kwargs", list(_cases(N_D, N_D_ARGS)))
def test_fft_nd(name, dtype, kwargs):
    check(lambda t: getattr(torch.fft, name)(t, **kwargs), randn(4, 6, 5, dtype=dtype))


@pytest.mark.parametrize("name", ["fft", "rfft", "irfft", "fft2", "rfftn", "irfftn", "ifftn"])
def test_noncontiguous_inputs(name):
    dtype = torch.float32 if name.startswith("r") else torch.complex64
    x = randn(6, 8, 10, dtype=dtype)
    check(lambda t: getattr(torch.fft, name)(t.transpose(0, 2)[::2]), x)
    check(lambda t: getattr(torch.fft, name)(t[:, 1::2], dim=(0, 1) if "n" in name or "2" in name else 0), x)


def test_dtypes():
    check(torch.fft.fft, torch.arange(10, dtype=torch.int32))  # ints compute in the default float
    check(torch.fft.rfft, torch.tensor([True, False, True, True]))
    check(torch.fft.fftn, randn(3, 4, dtype=torch.float64), atol=1e-10, rtol=1e-10)  # → complex128
    check(torch.fft.irfft, randn(3, 4, dtype=torch.complex128), atol=1e-10, rtol=1e-10)  # → float64
    check(torch.fft.ifft2, randn(3, 4, dtype=torch.complex128), atol=1e-10, rtol=1e-10)


def test_zero_dim_and_empty_dim_list():
    check(torch.fft.fftn, torch.tensor(1.5))
    check(torch.fft.ifftn, torch.tensor(1.5 - 2j, dtype=torch.complex64))
    check(lambda t: torch.fft.fftn(t, dim=[]), randn(3))
    with pytest.raises(RuntimeError, match="at least one axis"):
        torch.fft.rfftn(randn(3).to("tpu"), dim=[])


def test_empty_batch():
    # PyTorch CPU (MKL) errors on a 0-sized batch dim; tpu returns the empty result of the right shape
    for fn, x in [(torch.fft.fft, randn(0, 6)), (torch.fft.rfft, randn(0, 6)),
                  (torch.fft.irfft, randn(0, 6, dtype=torch.complex64)), (torch.fft.fft2, randn(2, 0, 3, 4))]:
        like = fn(torch.ones(*[max(s, 1) for s in x.shape], dtype=x.dtype))
        shape = [0 if s == 0 else n for s, n in zip(x.shape, like.shape)]
        out = fn(x.to("tpu"))
        assert out.dtype == like.dtype and list(out.shape) == shape
        assert out.cpu().shape == out.shape


def test_zero_points_error():
    with pytest.raises(RuntimeError, match="Invalid number of data points"):
        torch.fft.fft(randn(0, 6).to("tpu"), dim=0)


def test_out_variant():
    x = randn(4, 6)
    out = torch.empty(0, dtype=torch.complex64).to("tpu")
    torch.fft.rfft(x.to("tpu"), out=out)
    torch.testing.assert_close(out.cpu(), torch.fft.rfft(x), **TOL)
    outc = torch.empty(4, 6, dtype=torch.complex64).to("tpu")
    torch.fft.fft2(x.to(torch.complex64).to("tpu"), norm="ortho", out=outc)
    torch.testing.assert_close(outc.cpu(), torch.fft.fft2(x.to(torch.complex64), norm="ortho"), **TOL)


def test_shift_and_freq():
    for fn in (torch.fft.fftshift, torch.fft.ifftshift):
        check(fn, randn(5, 6, dtype=torch.complex64))
        check(lambda t: fn(t, dim=1), randn(5, 7))
    for n, d in [(5, 1.0), (8, 0.25), (1, 1.0)]:
        for fn in (torch.fft.fftfreq, torch.fft.rfftfreq):
            out = fn(n, d, device="tpu")
            assert out.device.type == "tpu"
            torch.testing.assert_close(out.cpu(), fn(n, d))
    out = torch.fft.fftfreq(6, dtype=torch.float64, device="tpu")
    torch.testing.assert_close(out.cpu(), torch.fft.fftfreq(6, dtype=torch.float64))


# ---------------------------------------------------------------- gradients

GRADS = [
    ("rfft", torch.float32, {}), ("rfft", torch.float32, {"n": 9, "norm": "ortho"}),
    ("irfft", torch.complex64, {}), ("irfft", torch.complex64, {"n": 7, "norm": "forward"}),
    ("fft", torch.complex64, {"norm": "ortho"}), ("fft", torch.float32, {"n": 4}),
    ("ifft", torch.complex64, {"dim": 0}), ("fft2", torch.complex64, {"s": (3, 8)}),
    ("rfftn", torch.float32, {"norm": "forward"}), ("irfftn", torch.complex64, {"s": (5, 6)}),
    ("ifft", torch.float32, {}), ("hfft", torch.complex64, {}), ("ihfft", torch.float32, {}),
    ("ihfft2", torch.float32, {}),
]


@pytest.mark.parametrize("name,dtype,kwargs", [pytest.param(n, d, k, id=f"{n}-{str(d)[6:]}-{k}")
                                               for n, d, k in GRADS])
def test_gradients(name, dtype, kwargs):
    check(lambda t: getattr(torch.fft, name)(t, **kwargs), randn(4, 6, dtype=dtype), grad=True)


# ---------------------------------------------------------------- eager modes and torch.compile


def test_eager_modes(each_eager_mode):
    x = randn(4, 10)
    check(lambda t: torch.fft.irfft(torch.fft.rfft(t, norm="ortho") * 2, n=10, norm="ortho") + t, x, grad=True)
    check(lambda t: torch.fft.ifftn(torch.fft.fftn(t, s=(6, 8)) * 3), x.to(torch.complex64))



def test_compiled():
    def fn(x, z):
        return torch.fft.irfft(torch.fft.rfft(x, norm="ortho") * 2, n=x.shape[-1]), torch.fft.fftn(z, dim=(0, 1))

    x, z = randn(4, 10), randn(3, 4, 5, dtype=torch.complex64)
    compiled = torch.compile(fn, backend="tpu")
    for expected, actual in zip(fn(x, z), compiled(x.to("tpu"), z.to("tpu"))):
        torch.testing.assert_close(actual.cpu(), expected, **TOL)


# ---------------------------------------------------------------- OpInfo fft.* entries

FFT_OPS = [op for op in op_db if op.name.startswith("fft.")]


def _opinfo_params():
    for op in FFT_OPS:
        for dtype in (torch.float32, torch.complex64):
            if dtype not in op.supported_dtypes("cpu"):
                continue
            yield pytest.param(op, dtype, id=f"{op.name}-{str(dtype)[6:]}")


@pytest.mark.parametrize("op,dtype", list(_opinfo_params()))
def test_opinfo(op, dtype):
    samples = list(op.sample_inputs("cpu", dtype))
    assert samples
    for sample in samples:
        args = [a.to("tpu") if isinstance(a, torch.Tensor) else a for a in sample.args]
        kwargs = {k: v.to("tpu") if isinstance(v, torch.Tensor) else v for k, v in sample.kwargs.items()}
        expected = op(sample.input, *sample.args, **sample.kwargs)
        actual = op(sample.input.to("tpu"), *args, **kwargs)
        assert actual.device.type == "tpu" and actual.dtype == expected.dtype
        torch.testing.assert_close(actual.cpu(), expected, **TOL)
