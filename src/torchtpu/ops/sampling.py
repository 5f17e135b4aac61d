"""Sampling ops: grid sampling (2-d and 3-d), fractional max pooling and anti-aliased
upsampling, forward and the backward ops autograd calls.

Backward ops are ``jax.vjp`` of the forward lowering, as in ``nn.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from torchtpu.ops.nn import _up
from torchtpu.ops.registry import aten, lowering

# ---------------------------------------------------------------- grid sampling

def _unnormalize(coord, size: int, align_corners: bool):
    if align_corners:
        return (coord + 1) / 2 * (size - 1)
    return ((coord + 1) * size - 1) / 2


def _reflect(coord, twice_low: int, twice_high: int):
    if twice_low == twice_high:
        return jnp.zeros_like(coord)
    low, span = twice_low / 2, (twice_high - twice_low) / 2
    coord = jnp.abs(coord - low)
    extra = jnp.fmod(coord, span)
    flips = jnp.floor(coord / span)
    return jnp.where(flips % 2 == 0, extra + low, span - extra + low)


def _source_coord(coord, size: int, padding_mode: int, align_corners: bool):
    """A normalised grid coordinate as an input pixel coordinate, after PyTorch's padding mode."""
    coord = _unnormalize(coord, size, align_corners)
    if padding_mode == 2:  # reflection
        coord = _reflect(coord, 0, 2 * (size - 1)) if align_corners else _reflect(coord, -1, 2 * size - 1)
    if padding_mode in (1, 2):  # border (and reflection's final clip)
        coord = jnp.clip(coord, 0, size - 1)
    return coord


def _gather_2d(x, iy, ix):
    """x[n, :, iy, ix] for integer maps (N, Ho, Wo); out-of-bounds points read 0."""
    n, c, h, w = x.shape
    valid = (iy >= 0) & (iy < h) & (ix >= 0) & (ix < w)
    flat = (jnp.clip(iy, 0, h - 1) * w + jnp.clip(ix, 0, w - 1)).astype(jnp.int32)
    vals = jnp.take_along_axis(x.reshape(n, c, h * w), flat.reshape(n, 1, -1), axis=2)
    return vals.reshape(n, c, *iy.shape[1:]) * valid[:, None].astype(x.dtype)


def _grid_sample(x, grid, interpolation_mode: int, padding_mode: int, align_corners: bool):
    h, w = x.shape[2:]
    ix = _source_coord(grid[..., 0], w, padding_mode, align_corners)
    iy = _source_coord(grid[..., 1], h, padding_mode, align_corners)
    if interpolation_mode == 1:  # nearest, rounding half to even as nearbyint does
        return _gather_2d(x, jnp.round(iy).astype(jnp.int32), jnp.round(ix).astype(jnp.int32))
    if interpolation_mode != 0:
        raise NotImplementedError("grid_sample: mode='bicubic' is not supported on the tpu device; "
                                  "use 'bilinear' or 'nearest'")
    x0, y0 = jnp.floor(ix), jnp.floor(iy)
    out = 0
    for dy in (0, 1):
        for dx in (0, 1):
            wy = (iy - y0) if dy else (y0 + 1 - iy)
            wx = (ix - x0) if dx else (x0 + 1 - ix)
            corner = _gather_2d(x, (y0 + dy).astype(jnp.int32), (x0 + dx).astype(jnp.int32))
            out = out + corner * (wy * wx)[:, None]
    return out


@lowering(aten.grid_sampler_2d.default)
def grid_sampler_2d(x, grid, interpolation_mode, padding_mode, align_corners):
    return _grid_sample(_up(x), _up(grid), interpolation_mode, padding_mode, align_corners).astype(x.dtype)


@lowering(aten.grid_sampler_2d_backward.default)
def grid_sampler_2d_backward(g, x, grid, interpolation_mode, padding_mode, align_corners, output_mask):
    _, vjp = jax.vjp(lambda a, b: _grid_sample(a, b, interpolation_mode, padding_mode, align_corners),
                     _up(x), _up(grid))
    gx, ggrid = vjp(_up(g))
    return gx.astype(x.dtype), ggrid.astype(grid.dtype)
