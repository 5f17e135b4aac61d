"""Sampling ops: grid sampling (2-d and 3-d), fractional max pooling and anti-aliased
upsampling, forward and the backward ops autograd calls.

Backward ops are ``jax.vjp`` of the forward lowering, as in ``nn.py``, except fractional max
pooling, whose backward scatters the gradient through the saved indices as PyTorch does.
"""

from __future__ import annotations

import functools
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from torchtpu.ops.nn import _max_pool_backward, _pad_scales, _up, interpolation_lowerings
from torchtpu.ops.registry import aten, lowering

HIGHEST = lax.Precision.HIGHEST

# ---------------------------------------------------------------- grid sampling

BILINEAR, NEAREST, BICUBIC = 0, 1, 2
ZEROS, BORDER, REFLECTION = 0, 1, 2


def _unnormalize(coord, size: int, align_corners: bool):
    if align_corners:
        return (coord + 1) / 2 * (size - 1)
    return ((coord + 1) * size - 1) / 2


def _clip(coord, size: int):
    # where, not jnp.clip: PyTorch's gradient is 0 at the clip limits themselves
    return jnp.where(coord <= 0, 0.0, jnp.where(coord >= size - 1, size - 1.0, coord)).astype(coord.dtype)


def _reflect(coord, twice_low: int, twice_high: int):
    """Reflect ``coord`` into [low, high] as PyTorch does (its gradient flips sign on each bounce)."""
    if twice_low == twice_high:
        return jnp.zeros_like(coord)
    low, span = twice_low / 2, (twice_high - twice_low) / 2
    coord = coord - low
    coord = jnp.where(coord < 0, -coord, coord)
    extra = jnp.fmod(coord, span)
    flips = jnp.floor(coord / span)
    return jnp.where(flips % 2 == 0, extra + low, span - extra + low)


def _pad_coord(coord, size: int, padding_mode: int, align_corners: bool):
    """PyTorch's ``compute_coordinates``: a pixel coordinate after the padding mode."""
    if padding_mode == REFLECTION:
        coord = _reflect(coord, 0, 2 * (size - 1)) if align_corners else _reflect(coord, -1, 2 * size - 1)
    if padding_mode in (BORDER, REFLECTION):
        coord = _clip(coord, size)
    # PyTorch's safe_downgrade_to_int_range: coordinates no int can hold read nothing
    return jnp.where(jnp.isfinite(coord) & (jnp.abs(coord) < 2.0 ** 30), coord, -100.0).astype(coord.dtype)


def _gather(x, index):
    """``x[n, :, *index]``, channels last: (N, *out, C), for integer maps ``index[i]`` (N, *out) per
    spatial axis (broadcast together); points outside the input read 0."""
    n, c, *spatial = x.shape
    valid = functools.reduce(operator.and_, [(i >= 0) & (i < s) for i, s in zip(index, spatial)])
    flat = jnp.arange(n, dtype=jnp.int32).reshape((n,) + (1,) * (valid.ndim - 1))
    for i, s in zip(index, spatial):
        flat = flat * s + jnp.clip(i, 0, s - 1).astype(jnp.int32)
    # rows of channels: one contiguous C-vector per point is far cheaper for XLA than C scalars
    rows = jnp.moveaxis(x.reshape(n, c, math.prod(spatial)), 1, 2).reshape(n * math.prod(spatial), c)
    vals = jnp.take(rows, flat.reshape(flat.size), axis=0, mode="clip").reshape(flat.shape + (c,))
    return jnp.where(valid[..., None], vals, 0).astype(x.dtype)


def _cubic_coeffs(t, a: float = -0.75):
    """PyTorch's cubic convolution weights of the taps at -1, 0, 1, 2 for a fraction ``t``."""
    def near(x):  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x):  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    return [far(t + 1), near(t), near(1 - t), far(2 - t)]


def _sample_nearest(x, coords, padding_mode, align_corners):
    spatial = x.shape[2:]
    index = [_pad_coord(c, s, padding_mode, align_corners) for c, s in zip(coords, spatial)]
    return _gather(x, [jnp.round(i).astype(jnp.int32) for i in index])  # round half to even, as nearbyint


def _taps(coord, offsets):
    """``coord`` (N, *out) plus each tap offset, on a new tap axis: (N, T, *out)."""
    return coord[:, None] + jnp.asarray(offsets, coord.dtype).reshape((1, -1) + (1,) * (coord.ndim - 1))


def _axis(v, i: int, nd: int):
    """``v`` (N, 2, P) on tap axis ``1 + i`` of an (N, 2, ..., 2, P) layout, for broadcasting."""
    return v.reshape(v.shape[:1] + (1,) * i + (2,) + (1,) * (nd - 1 - i) + v.shape[2:])


def _sample_linear(x, coords, padding_mode, align_corners):
    """(Bi/tri)linear: the 2**nd corners gathered at once, on one tap axis per spatial axis."""
    nd = len(coords)
    index, weight = [], 1
    for i, (c, s) in enumerate(zip(coords, x.shape[2:])):
        c = _pad_coord(c, s, padding_mode, align_corners)
        low = jnp.floor(c)
        # PyTorch's weights: (low + 1 - c) for the low corner, (c - low) for the high one
        weight = weight * _axis(jnp.stack([low + 1 - c, c - low], axis=1), i, nd)
        index.append(_axis(_taps(low, [0, 1]).astype(jnp.int32), i, nd))
    return jnp.sum(_gather(x, index) * weight[..., None], axis=tuple(range(1, nd + 1)))


def _sample_cubic(x, coords, padding_mode, align_corners):
    """Bicubic: the 4x4 taps around the point, each tap's index through the padding mode."""
    (h, w), (iy, ix) = x.shape[2:], coords
    y0, x0 = jnp.floor(iy), jnp.floor(ix)
    rows = _pad_coord(_taps(y0, np.arange(-1, 3)), h, padding_mode, align_corners).astype(jnp.int32)
    cols = _pad_coord(_taps(x0, np.arange(-1, 3)), w, padding_mode, align_corners).astype(jnp.int32)
    vals = _gather(x, [rows[:, :, None], cols[:, None, :]])  # (N, 4, 4, *out, C)
    wy = jnp.stack(_cubic_coeffs(iy - y0), axis=1)[..., None]  # (N, 4, *out, 1)
    wx = jnp.stack(_cubic_coeffs(ix - x0), axis=1)[:, None, ..., None]  # (N, 1, 4, *out, 1)
    # along x first, then y, as PyTorch does
    return jnp.sum(jnp.sum(vals * wx, axis=2) * wy, axis=1)


SAMPLERS = {BILINEAR: _sample_linear, NEAREST: _sample_nearest, BICUBIC: _sample_cubic}


def _grid_sample(x, grid, interpolation_mode: int, padding_mode: int, align_corners: bool):
    """Sample ``x`` (N, C, *spatial) at ``grid`` (N, *out, nd), whose last axis lists x, y(, z)."""
    nd = x.ndim - 2
    if interpolation_mode == BICUBIC and nd != 2:
        raise RuntimeError("grid_sampler(): bicubic interpolation only supports 4D input")
    if interpolation_mode not in SAMPLERS:
        raise RuntimeError(f"grid_sampler(): expected interpolation_mode 0, 1 or 2, but got {interpolation_mode}")
    if any(s == 0 for s in x.shape[2:]):
        raise RuntimeError(f"grid_sampler(): expected input to have non-empty spatial dimensions, "
                           f"but input has sizes {tuple(x.shape)}")
    if grid.ndim != x.ndim or grid.shape[0] != x.shape[0] or grid.shape[-1] != nd:
        raise RuntimeError(f"grid_sampler(): expected grid of shape ({x.shape[0]}, ..., {nd}) for input of "
                           f"shape {tuple(x.shape)}, but got {tuple(grid.shape)}")
    # output points flattened to one axis: low-rank arrays compile faster on XLA:CPU
    out = grid.shape[1:-1]
    flat = grid.reshape(grid.shape[0], math.prod(out), nd)
    # grid's last axis is (x, y, z): the reverse of the spatial axes (D, H, W)
    coords = [_unnormalize(flat[..., nd - 1 - i], s, align_corners) for i, s in enumerate(x.shape[2:])]
    y = SAMPLERS[interpolation_mode](x, coords, padding_mode, align_corners)  # (N, P, C)
    return jnp.moveaxis(y, -1, 1).reshape(x.shape[:2] + out)


@lowering(aten.grid_sampler_2d.default, aten.grid_sampler_3d.default)
def grid_sampler(x, grid, interpolation_mode, padding_mode, align_corners):
    return _grid_sample(_up(x), _up(grid), interpolation_mode, padding_mode, align_corners).astype(x.dtype)


@lowering(aten.grid_sampler_2d_backward.default, aten.grid_sampler_3d_backward.default)
def grid_sampler_backward(g, x, grid, interpolation_mode, padding_mode, align_corners, output_mask):
    _, vjp = jax.vjp(lambda a, b: _grid_sample(a, b, interpolation_mode, padding_mode, align_corners),
                     _up(x), _up(grid))
    gx, ggrid = vjp(_up(g))
    return gx.astype(x.dtype), ggrid.astype(grid.dtype)


# ---------------------------------------------------------------- fractional max pooling

def _interval_starts(sample, n_in: int, n_out: int, k: int):
    """PyTorch's window starts along one axis from each plane's random sample (N, C) → (N, C, out).

    Computed in the sample's own dtype, as PyTorch's kernel does, so the truncations agree.
    """
    dt = sample.dtype
    last = jnp.full(sample.shape + (1,), n_in - k, jnp.int32)
    if n_out == 1:
        return last
    alpha = jnp.asarray(n_in - k, dt) / jnp.asarray(n_out - 1, dt)
    i = jnp.arange(n_out - 1).astype(dt)
    s = sample[..., None]
    starts = ((i + s) * alpha).astype(jnp.int32) - (s * alpha).astype(jnp.int32)
    return jnp.concatenate([starts, last], axis=-1)


def _window_argmax(win):
    """Index of PyTorch's pick along the last axis: the first maximum, or the last NaN if any."""
    isnan = jnp.isnan(win)
    last_nan = win.shape[-1] - 1 - jnp.argmax(isnan[..., ::-1], axis=-1)
    return jnp.where(isnan.any(axis=-1), last_nan, jnp.argmax(win, axis=-1))


def _check_fractional(x, kernel, output_size, samples, nd: int, strict: bool):
    name = f"fractional_max_pool{nd}d"
    if x.ndim not in (nd + 1, nd + 2):
        raise RuntimeError(f"{name}(): {nd + 1}D or {nd + 2}D (batch mode) tensor expected for input, "
                           f"but got: {x.ndim}")
    for dim in range(1, x.ndim):
        if x.shape[dim] == 0:
            raise RuntimeError(f"{name}(): Expected input to have non-zero size for non-batch dimensions, "
                               f"but got{list(x.shape)} with dimension {dim} being empty.")
    batch, planes = (x.shape[0] if x.ndim == nd + 2 else 1), x.shape[-nd - 1]
    if samples.ndim != 3 or samples.shape[0] < batch or samples.shape[1] != planes or samples.shape[2] != nd:
        raise RuntimeError(f"{name}(): expected _random_samples of shape ({batch}, {planes}, {nd}), "
                           f"but got {tuple(samples.shape)}")
    for n, k, o in zip(x.shape[-nd:], kernel, output_size):
        if o + k - 1 > n - strict:
            raise RuntimeError(f"{name}(): pool size {k} too large relative to input size {n}")


# per dimensionality: which sample column drives each spatial axis, and whether PyTorch's size
# check is strict (its 3-d kernel wants out + k - 1 < in, its 2-d kernel out + k - 1 <= in)
FRACTIONAL = {2: ((1, 0), False), 3: ((0, 1, 2), True)}


def _fractional_max_pool(x, kernel, output_size, samples, nd: int):
    columns, strict = FRACTIONAL[nd]
    kernel, output_size = tuple(kernel), tuple(output_size)
    _check_fractional(x, kernel, output_size, samples, nd, strict)
    batched = x.ndim == nd + 2
    xb = x if batched else x[None]
    n, c, *spatial = xb.shape
    samples = samples[:n]
    # each axis: (N, C, out, k) input positions, gathered one axis at a time
    positions = []
    win = xb
    for i, (size, k, o) in enumerate(zip(spatial, kernel, output_size)):
        starts = _interval_starts(samples[..., columns[i]], size, o, k)
        pos = starts[..., None] + jnp.arange(k, dtype=jnp.int32)
        positions.append(pos)
        shape = [n, c] + [1] * nd
        shape[2 + i] = o * k
        win = jnp.take_along_axis(win, pos.reshape(shape), axis=2 + i)
    # (N, C, o0*k0, o1*k1, ...) → (N, C, o0, o1, ..., k0*k1*...)
    win = win.reshape([n, c] + [d for o, k in zip(output_size, kernel) for d in (o, k)])
    perm = [0, 1] + [2 + 2 * i for i in range(nd)] + [3 + 2 * i for i in range(nd)]
    win = jnp.transpose(win, perm).reshape(n, c, *output_size, math.prod(kernel))
    arg = _window_argmax(win)
    values = jnp.take_along_axis(win, arg[..., None], axis=-1)[..., 0]
    offsets = jnp.unravel_index(arg, kernel)
    index = jnp.zeros(arg.shape, jnp.int64)
    for i, (size, pos) in enumerate(zip(spatial, positions)):
        # pos[n, c, out_i, offset_i] broadcast against the output grid
        shape = [n, c] + [1] * nd
        shape[2 + i] = output_size[i]
        axis_pos = jnp.take_along_axis(pos.reshape(*shape, kernel[i]), offsets[i][..., None], axis=-1)[..., 0]
        index = index * size + axis_pos
    return (values, index) if batched else (values[0], index[0])


def _fractional_lowerings(nd: int, fwd, bwd):
    @lowering(fwd)
    def forward(x, kernel_size, output_size, random_samples):
        return _fractional_max_pool(x, kernel_size, output_size, random_samples, nd)

    @lowering(bwd)
    def backward(g, x, kernel_size, output_size, indices):
        return _max_pool_backward(g, x, indices, nd)


_fractional_lowerings(2, aten.fractional_max_pool2d.default, aten.fractional_max_pool2d_backward.default)
_fractional_lowerings(3, aten.fractional_max_pool3d.default, aten.fractional_max_pool3d_backward.default)


# ---------------------------------------------------------------- anti-aliased upsampling

def _aa_linear(x):
    x = np.abs(x)
    return np.where(x < 1, 1 - x, 0)


def _aa_cubic(x, a=-0.5):
    # PyTorch's antialias bicubic uses a = -0.5 (as PIL does), not upsample_bicubic2d's -0.75
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1, near, np.where(x < 2, far, 0))


AA_FILTERS = {"linear": (2, _aa_linear), "cubic": (4, _aa_cubic)}  # name → (taps, filter)


def _area_scale(n_in: int, n_out: int, scale, align_corners: bool, ft) -> np.floating:
    """PyTorch's area_pixel_compute_scale in the kernel's float type ``ft``."""
    if align_corners:
        return ft(n_in - 1) / ft(n_out - 1) if n_out > 1 else ft(0)
    return ft(1.0 / scale) if scale is not None and scale > 0 else ft(n_in) / ft(n_out)


@functools.cache
def _aa_matrix(n_in: int, n_out: int, scale, align_corners: bool, kind: str, ft) -> np.ndarray:
    """(n_out, n_in) weights of PyTorch's antialias resampling along one axis, in float type ``ft``.

    Each output reads the inputs under its filter's support (widened by the scale when
    downsampling), weighted by the filter and normalised to sum to 1, as in PyTorch's
    ``_compute_weights_aa``.
    """
    taps, fn = AA_FILTERS[kind]
    s = _area_scale(n_in, n_out, scale, align_corners, ft)
    support = ft(taps * 0.5 * s) if s >= 1 else ft(taps * 0.5)
    invscale = ft(1.0 / s) if s >= 1 else ft(1.0)
    max_taps = int(math.ceil(support)) * 2 + 1
    m = np.zeros((n_out, n_in), ft)
    for i in range(n_out):
        center = ft(s * (i + 0.5))
        lo = max(int(np.float64(center - support) + 0.5), 0)
        size = min(max(min(int(np.float64(center + support) + 0.5), n_in) - lo, 0), max_taps)
        dist = (np.arange(lo, lo + size).astype(ft) - center).astype(np.float64) + 0.5
        w = fn((dist * invscale).astype(ft)).astype(ft)
        total = functools.reduce(lambda a, b: ft(a + b), w, ft(0))
        if total != 0:
            w = w / total
        m[i, lo:lo + size] = w
    return m


def _upsample_aa(x, output_size, align_corners, scales, kind: str):
    """Separable antialias resampling: one (out, in) matrix product per spatial axis, W first."""
    y = _up(x)
    ft = np.float64 if y.dtype == np.float64 else np.float32
    nd = len(output_size)
    for i in reversed(range(nd)):
        axis = x.ndim - nd + i
        m = _aa_matrix(x.shape[axis], output_size[i], scales[i], align_corners, kind, ft)
        y = jnp.moveaxis(jnp.tensordot(y, jnp.asarray(m, y.dtype), axes=([axis], [1]), precision=HIGHEST),
                         -1, axis)
    return y


def _aa_lowerings(kind: str, fwd, bwd):
    def interpolate(x, output_size, align_corners, scales):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise NotImplementedError(f"{fwd}: integer inputs are not supported on the tpu device; "
                                      "convert to a floating dtype first")
        return _upsample_aa(x, tuple(output_size), align_corners, _pad_scales(scales, 2), kind)

    interpolation_lowerings(fwd, bwd, interpolate)


_aa_lowerings("linear", aten._upsample_bilinear2d_aa.default, aten._upsample_bilinear2d_aa_backward.default)
_aa_lowerings("cubic", aten._upsample_bicubic2d_aa.default, aten._upsample_bicubic2d_aa_backward.default)
