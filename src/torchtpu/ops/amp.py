"""Mixed-precision training's gradient-scaler ops (``torch.amp.GradScaler("tpu")``), as CUDA's.

``_amp_foreach_non_finite_check_and_unscale_`` multiplies every gradient by ``inv_scale`` (in
fp32, cast back) and sets ``found_inf`` to 1 if any of them holds an inf or NaN;
``_amp_update_scale_`` then backs the scale off after an overflow, or grows it after
``growth_interval`` clean steps. Both stay on the device: the scaler reads one value per step.

Eager runs the in-place overloads (``mutates=``: their written arguments' new values are
returned last, a written ``Tensor[]``'s one per element); compiled graphs get the functional
overloads from functionalisation. The ``out=`` overloads are derived from the functional ones and,
as PyTorch's own (generated) kernels, write ``out`` only, not ``found_inf`` or ``growth_tracker``.
"""

from __future__ import annotations

import jax.numpy as jnp

from torchtpu.ops.registry import aten, lowering


def _check_scalars(found_inf, inv_scale) -> None:
    # PyTorch's checks, in its words (aten/src/ATen/native/cuda/AmpKernels.cu)
    for x, name in ((inv_scale, "inv_scale"), (found_inf, "found_inf")):
        if x.size != 1:
            raise RuntimeError(f"{name} must be a 1-element tensor.")
        if x.dtype != jnp.float32:
            raise RuntimeError(f"{name} must be a float tensor.")


def _unscale(grads, found_inf, inv_scale):
    """(the grads times ``inv_scale``, ``found_inf`` set to 1 if any grad is not finite)."""
    _check_scalars(found_inf, inv_scale)
    out = []
    bad = jnp.zeros((), jnp.bool_)
    for g in grads:
        if not jnp.issubdtype(g.dtype, jnp.floating):
            raise RuntimeError("_amp_foreach_non_finite_check_and_unscale_: expected floating point gradients, "
                               f"got {g.dtype}")
        bad = bad | ~jnp.all(jnp.isfinite(g))
        out.append((g.astype(jnp.float32) * inv_scale.reshape(())).astype(g.dtype))
    return out, jnp.where(bad, jnp.ones_like(found_inf), found_inf)


# What functionalisation puts in compiled graphs; it returns (Tensor[], Tensor), which eager
# kernels do not return, so eager runs the in-place form only (the functional one falls back).
@lowering(aten._amp_foreach_non_finite_check_and_unscale.default, graph_only=True)
def non_finite_check_and_unscale(grads, found_inf, inv_scale):
    return _unscale(grads, found_inf, inv_scale)


@lowering(aten._amp_foreach_non_finite_check_and_unscale_.default, mutates=("self", "found_inf"))
def non_finite_check_and_unscale_(grads, found_inf, inv_scale):
    grads, found_inf = _unscale(grads, found_inf, inv_scale)
    return (*grads, found_inf)  # a written Tensor[]'s new values come flat, one per element


def _update_scale(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    """(new scale, new growth tracker), as CUDA's ``amp_update_scale_cuda_kernel``."""
    for x, name, dtype, kind in ((scale, "current_scale", jnp.float32, "a float"),
                                 (growth_tracker, "growth_tracker", jnp.int32, "an int"),
                                 (found_inf, "found_inf", jnp.float32, "a float")):
        if x.size != 1:
            raise RuntimeError(f"{name} must be a 1-element tensor.")
        if x.dtype != dtype:
            raise RuntimeError(f"{name} must be {kind} tensor.")
    found = found_inf.reshape(()) != 0
    successful = growth_tracker + 1
    grow = successful == growth_interval
    grown = (scale * growth_factor).astype(scale.dtype)
    grown = jnp.where(jnp.isfinite(grown), grown, scale)  # a scale that would overflow stays
    new_scale = jnp.where(found, scale * backoff_factor, jnp.where(grow, grown, scale)).astype(scale.dtype)
    new_tracker = jnp.where(found | grow, jnp.zeros_like(growth_tracker), successful).astype(growth_tracker.dtype)
    return new_scale, new_tracker


@lowering(aten._amp_update_scale.default)
def update_scale(scale, growth_tracker, found_inf, scale_growth_factor, scale_backoff_factor, growth_interval):
    return _update_scale(scale, growth_tracker, found_inf, scale_growth_factor, scale_backoff_factor, growth_interval)


@lowering(aten._amp_update_scale_.default, mutates=("self", "growth_tracker"))
def update_scale_(scale, growth_tracker, found_inf, scale_growth_factor, scale_backoff_factor, growth_interval):
    new_scale, new_tracker = _update_scale(scale, growth_tracker, found_inf, scale_growth_factor,
                                           scale_backoff_factor, growth_interval)
    return new_scale, new_scale, new_tracker
