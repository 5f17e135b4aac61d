"""Sampling ops on tpu vs PyTorch CPU: grid sampling (2-d, 3-d), fractional max pooling and
anti-aliased upsampling, forward and gradients."""

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

pytestmark = pytest.mark.usefixtures("no_fallback")

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.float64: dict(atol=1e-10, rtol=1e-10),
       torch.bfloat16: dict(atol=5e-2, rtol=5e-2)}
PADDINGS = ["zeros", "border", "reflection"]


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def check(fn, *args, grad=True, tol=None):
    """``fn`` on CPU and on tpu copies of ``args`` agree: every output, and every float input's gradient."""
    dtype = args[0].dtype
    tol = tol or TOL[dtype]
    cpu = [a.detach().clone().requires_grad_(grad and a.is_floating_point()) for a in args]
    tpu = [a.detach().to("tpu").requires_grad_(a.requires_grad) for a in cpu]
    cpu_out, tpu_out = fn(*cpu), fn(*tpu)
    cpu_out = cpu_out if isinstance(cpu_out, tuple) else (cpu_out,)
    tpu_out = tpu_out if isinstance(tpu_out, tuple) else (tpu_out,)
    for t, c in zip(tpu_out, cpu_out, strict=True):
        assert t.device.type == "tpu"
        assert_close(t.cpu(), c, **tol)
    if not grad:
        return
    seed = randn(*cpu_out[0].shape, dtype=cpu_out[0].dtype, seed=7)
    (cpu_out[0] * seed).sum().backward()
    (tpu_out[0] * seed.to("tpu")).sum().backward()
    for t, c in zip(tpu, cpu):
        if c.requires_grad:
            assert t.grad is not None and t.grad.device.type == "tpu"
            assert_close(t.grad.cpu(), c.grad, **tol)


# ---------------------------------------------------------------- grid sampling

@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("padding_mode", PADDINGS)
@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
def test_grid_sample_2d(mode, padding_mode, align_corners):
    x = randn(2, 3, 5, 6)
    grid = randn(2, 4, 3, 2, seed=1) * 1.5  # reaches outside [-1, 1]
    # bicubic grid gradients sum 16 terms that cancel outside the input: float32 noise ~1e-5 on CPU too
    tol = dict(atol=5e-5, rtol=1e-4) if mode == "bicubic" else None
    check(lambda x, g: F.grid_sample(x, g, mode=mode, padding_mode=padding_mode, align_corners=align_corners),
          x, grid, grad=mode != "nearest", tol=tol)


@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("padding_mode", PADDINGS)
@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
def test_grid_sample_3d(mode, padding_mode, align_corners):
    x = randn(2, 3, 4, 5, 6)
    grid = randn(2, 3, 2, 4, 3, seed=1) * 1.5
    check(lambda x, g: F.grid_sample(x, g, mode=mode, padding_mode=padding_mode, align_corners=align_corners),
          x, grid, grad=mode != "nearest")


@pytest.mark.parametrize("padding_mode", PADDINGS)
@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_grid_sample_on_pixel_centres(mode, padding_mode):
    """An identity grid lands exactly on the clip limits, where PyTorch's grid gradient is 0."""
    x = randn(1, 2, 4, 5)
    grid = F.affine_grid(torch.eye(2, 3)[None], [1, 2, 4, 5], align_corners=True)
    check(lambda x, g: F.grid_sample(x, g, mode=mode, padding_mode=padding_mode, align_corners=True), x, grid)


@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
def test_grid_sample_far_outside(mode):
    x = randn(1, 2, 4, 5)
    grid = torch.tensor([[[[1e6, -1e6], [-3e9, 0.5], [0.2, 4e12]]]])
    check(lambda x, g: F.grid_sample(x, g, mode=mode, align_corners=False), x, grid, grad=False)


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_grid_sample_float64(mode):
    x, grid = randn(2, 3, 5, 6, dtype=torch.float64), randn(2, 4, 3, 2, dtype=torch.float64, seed=1)
    check(lambda x, g: F.grid_sample(x, g, mode=mode, padding_mode="reflection", align_corners=False), x, grid)


@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
def test_grid_sample_bfloat16_computes_in_float32(mode):
    """bf16 samples in fp32 (PyTorch's CPU kernel rounds every step to bf16: less accurate)."""
    x, grid = randn(2, 3, 5, 6, dtype=torch.bfloat16), randn(2, 4, 3, 2, dtype=torch.bfloat16, seed=1)
    fn = lambda x, g: F.grid_sample(x, g, mode=mode, padding_mode="border", align_corners=False)  # noqa: E731
    got = fn(x.to("tpu"), grid.to("tpu"))
    assert got.dtype == torch.bfloat16
    assert_close(got.cpu(), fn(x.float(), grid.float()).bfloat16(), atol=0, rtol=0)


def test_grid_sample_non_contiguous_and_empty():
    x = randn(2, 3, 6, 5).transpose(2, 3)
    grid = randn(2, 3, 4, 2, seed=1).transpose(1, 2)
    check(lambda x, g: F.grid_sample(x, g, align_corners=False), x, grid)
    check(lambda x, g: F.grid_sample(x, g, align_corners=False), randn(0, 3, 5, 6), randn(0, 4, 3, 2), grad=False)


def test_grid_sample_3d_rejects_bicubic():
    x, grid = randn(1, 1, 2, 2, 2).to("tpu"), randn(1, 1, 1, 1, 3).to("tpu")
    with pytest.raises(RuntimeError, match="bicubic"):
        F.grid_sample(x, grid, mode="bicubic", align_corners=False)


def test_grid_sample_compiled():
    x, grid = randn(2, 3, 5, 6), randn(2, 4, 3, 2, seed=1) * 1.5
    fn = lambda x, g: F.grid_sample(x, g, mode="bicubic", padding_mode="border", align_corners=False)  # noqa: E731
    torch._dynamo.reset()
    got = torch.compile(fn, backend="tpu", dynamic=False)(x.to("tpu"), grid.to("tpu"))
    assert_close(got.cpu(), fn(x, grid), **TOL[torch.float32])


# ---------------------------------------------------------------- fractional max pooling

def _pool(nd, samples, *args, **kwargs):
    """fractional_max_pool{nd}d with fixed random samples, moved to the input's device."""
    fn = F.fractional_max_pool2d if nd == 2 else F.fractional_max_pool3d
    return lambda x: fn(x, *args, _random_samples=samples.to(x.device), return_indices=True, **kwargs)


@pytest.mark.parametrize("nd,shape,kernel,out", [
    (2, (2, 3, 11, 9), (3, 2), (4, 5)),
    (2, (3, 7, 7), 2, 3),  # unbatched
    (2, (1, 2, 9, 9), 3, 7),  # windows overlap
    (3, (2, 2, 7, 8, 6), (2, 3, 2), (3, 4, 2)),
    (3, (2, 6, 5, 7), 2, (3, 2, 4)),  # unbatched
])
def test_fractional_max_pool(nd, shape, kernel, out):
    x = randn(*shape)
    planes = shape[-nd - 1]
    samples = rand(shape[0] if len(shape) == nd + 2 else 1, planes, nd, seed=3)
    check(_pool(nd, samples, kernel, output_size=out), x)


def test_fractional_max_pool_non_contiguous():
    x = randn(2, 3, 12, 10).transpose(2, 3)
    samples = rand(2, 3, 2, seed=4)
    check(_pool(2, samples, (2, 3), output_size=(5, 4)), x)


@pytest.mark.parametrize("nd", [2, 3])
def test_fractional_max_pool_output_ratio_and_edge_samples(nd):
    x = randn(2, 3, *(9,) * nd)
    samples = torch.tensor([0.0, 0.999999, 0.5])[:nd].expand(2, 3, nd).contiguous()
    check(_pool(nd, samples, 2, output_ratio=(0.5,) * nd), x)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_fractional_max_pool_dtypes(dtype):
    """Window starts are computed in the sample's dtype, as PyTorch's kernel does."""
    x = randn(2, 4, 13, 12, dtype=dtype)
    samples = rand(2, 4, 2, dtype=dtype, seed=5)
    # half gradients: PyTorch accumulates overlapping windows in half, we in fp32 (not comparable exactly)
    check(_pool(2, samples, 3, output_size=(6, 5)), x, grad=dtype == torch.float64, tol=dict(atol=0, rtol=0))


def test_fractional_max_pool_ties_and_nan():
    """Ties pick the first maximum; a NaN wins its window (the last NaN when there are several)."""
    x = torch.tensor([[[[1., 3, 3, 0], [3, 2, float("nan"), 1], [0, float("nan"), 5, 5], [float("nan"), 1, 1, 5]]]])
    samples = torch.tensor([[[0.3, 0.6]]])
    check(_pool(2, samples, 2, output_size=3), x, grad=False, tol=dict(atol=0, rtol=0, equal_nan=True))


@pytest.mark.parametrize("nd", [2, 3])
def test_fractional_max_pool_empty_batch(nd):
    x = randn(0, 2, *(6,) * nd)
    samples = rand(1, 2, nd)
    check(_pool(nd, samples, 2, output_size=3), x, grad=False)


@pytest.mark.parametrize("nd,kernel,out", [(2, 3, 5), (3, 2, 5)])
def test_fractional_max_pool_too_large(nd, kernel, out):
    """2-d allows out + k - 1 == in; 3-d requires out + k - 1 < in: both as in PyTorch."""
    x = randn(1, 1, *(6,) * nd)
    fn = _pool(nd, rand(1, 1, nd), kernel, output_size=out)
    for device in ("cpu", "tpu"):
        with pytest.raises(RuntimeError, match="too large"):
            fn(x.to(device))


# ---------------------------------------------------------------- anti-aliased upsampling

@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("size", [(3, 3), (5, 13), (17, 31), (10, 7)])
@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_interpolate_antialias(mode, size, align_corners):
    x = randn(2, 3, 10, 20)
    check(lambda x: F.interpolate(x, size=size, mode=mode, align_corners=align_corners, antialias=True), x)


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_interpolate_antialias_scale_factor_float64(mode):
    x = randn(2, 2, 9, 11, dtype=torch.float64)
    check(lambda x: F.interpolate(x, scale_factor=(0.45, 1.7), mode=mode, antialias=True), x)


def test_interpolate_antialias_non_contiguous():
    x = randn(2, 20, 3, 10).permute(0, 2, 3, 1)
    check(lambda x: F.interpolate(x, size=(4, 6), mode="bilinear", antialias=True), x)


def test_upsample_aa_rejects_integers():
    x = torch.arange(2 * 3 * 8 * 8, dtype=torch.uint8).reshape(2, 3, 8, 8).to("tpu")
    with pytest.raises(NotImplementedError, match="integer"):
        F.interpolate(x, size=(4, 4), mode="bilinear", antialias=True)
