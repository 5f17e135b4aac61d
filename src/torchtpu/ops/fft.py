"""FFT ops: torch.fft lowered to jnp.fft.

``torch.fft.*`` reaches the device as three aten ops: ``_fft_r2c`` (real → complex, forward),
``_fft_c2r`` (complex → real, inverse) and ``_fft_c2c``. Their ``normalization`` int is the
scale applied to the result whatever the direction (ATen's ``fft_norm_mode``: 0 none,
1 ``1/sqrt(n)``, 2 ``1/n``); ``jnp.fft`` names it per direction, hence the two tables below.
fftshift/ifftshift (roll) and fftfreq/rfftfreq (arange) are composite and never arrive here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from torchtpu.ops.registry import aten, lowering

# ATen's fft_norm_mode → the jnp ``norm`` that applies that scale on a forward / inverse transform
FORWARD_NORM = {0: "backward", 1: "ortho", 2: "forward"}
INVERSE_NORM = {0: "forward", 1: "ortho", 2: "backward"}

# PyTorch's CPU FFT refuses reduced precision; same error, same type
_UNSUPPORTED = {np.dtype(jnp.float16): "Half", np.dtype(jnp.bfloat16): "BFloat16"}


def _check_dtype(x: jax.Array) -> None:
    name = _UNSUPPORTED.get(np.dtype(x.dtype))
    if name is not None:
        raise NotImplementedError(
            f"Unsupported dtype {name}: torch.fft on the tpu device, as on CPU, supports "
            "float32/float64 and complex64/complex128; cast the input with .float() first")


def _axes(x: jax.Array, dim: list[int]) -> list[int]:
    return [d % x.ndim for d in dim]


@lowering(aten._fft_c2c.default)
def fft_c2c(x: jax.Array, dim: list[int], normalization: int, forward: bool) -> jax.Array:
    """Complex → complex FFT over ``dim``; the inverse transform when not ``forward``."""
    _check_dtype(x)
    axes = _axes(x, dim)
    if not axes:
        return x
    if forward:
        return jnp.fft.fftn(x, axes=axes, norm=FORWARD_NORM[normalization])
    return jnp.fft.ifftn(x, axes=axes, norm=INVERSE_NORM[normalization])


@lowering(aten._fft_r2c.default)
def fft_r2c(x: jax.Array, dim: list[int], normalization: int, onesided: bool) -> jax.Array:
    """Real → complex forward FFT over ``dim``."""
    _check_dtype(x)
    axes = _axes(x, dim)
    norm = FORWARD_NORM[normalization]
    if onesided:  # the last dim of ``dim`` keeps its n // 2 + 1 non-redundant outputs
        return jnp.fft.rfftn(x, axes=axes, norm=norm)
    return jnp.fft.fftn(x.astype(jnp.result_type(x.dtype, jnp.complex64)), axes=axes, norm=norm)


@lowering(aten._fft_c2r.default)
def fft_c2r(x: jax.Array, dim: list[int], normalization: int, last_dim_size: int) -> jax.Array:
    """Complex (Hermitian half) → real inverse FFT over ``dim``; ``last_dim_size`` real outputs on ``dim[-1]``."""
    _check_dtype(x)
    axes = _axes(x, dim)
    sizes = [x.shape[a] for a in axes[:-1]] + [last_dim_size]
    return jnp.fft.irfftn(x, s=sizes, axes=axes, norm=INVERSE_NORM[normalization])
