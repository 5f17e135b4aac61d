"""Random ops: every lowering takes a ``jax.random`` key first (``random=True``).

The key comes from the device's (seed, offset) state (``runtime/rng.py``), so the same seed gives
the same numbers on the tpu device; they are not the CPU generator's numbers. In-place samplers
(``uniform_``, ``normal_``, ...) are lowered as functions returning the new value of ``self``.
An op given ``generator=g`` (a ``torch.Generator("tpu")``) draws its key from g's own (seed,
offset) instead: the executor does that before the lowering runs, which never sees ``generator``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchtpu.ops.dtypes import is_float, to_jax_dtype, to_torch_dtype
from torchtpu.ops.registry import aten, lowering


def _sample_dtype(dtype):
    """Draw in float32 at least: jax's float16/bfloat16 draws are coarse."""
    return dtype if is_float(dtype) and np.dtype(dtype).itemsize >= 4 else np.dtype(np.float32)


def _uniform(key, shape, dtype, low=0.0, high=1.0):
    return jax.random.uniform(key, shape, _sample_dtype(dtype), low, high).astype(dtype)


def _normal(key, shape, dtype, mean=0.0, std=1.0):
    return (jax.random.normal(key, shape, _sample_dtype(dtype)) * std + mean).astype(dtype)


def _factory_dtype(dtype):
    return to_jax_dtype(dtype if dtype is not None else torch.get_default_dtype())


# ---------------------------------------------------------------- tensor-shaped samplers

@lowering(aten.uniform.default, random=True)
def uniform(key, x, low=0.0, high=1.0, *, generator=None):
    return _uniform(key, x.shape, x.dtype, low, high)


@lowering(aten.normal_.default, aten.normal_functional.default, random=True)
def normal_(key, x, mean=0.0, std=1.0, *, generator=None):
    if std < 0:
        raise RuntimeError(f"normal expects std >= 0.0, but found std {std}")
    return _normal(key, x.shape, x.dtype, mean, std)


@lowering(aten.normal.Tensor_float, aten.normal.float_Tensor, aten.normal.Tensor_Tensor, random=True)
def normal(key, mean, std=1.0, *, generator=None):
    dtype = next(a.dtype for a in (mean, std) if hasattr(a, "dtype"))
    shape = jnp.broadcast_shapes(jnp.shape(mean), jnp.shape(std))
    return (_normal(key, shape, dtype) * std + mean).astype(dtype)


@lowering(aten.normal.float_float, random=True)
def normal_float_float(key, mean, std, size, *, generator=None, dtype=None, layout=None, device=None,
                       pin_memory=None):
    return _normal(key, tuple(size), _factory_dtype(dtype), mean, std)


def _bernoulli(key, p, shape, dtype):
    return (jax.random.uniform(key, shape, jnp.float32) < jnp.asarray(p, jnp.float32)).astype(dtype)


@lowering(aten.bernoulli.default, random=True)
def bernoulli(key, x, *, generator=None):
    return _bernoulli(key, x, x.shape, x.dtype)


@lowering(aten.bernoulli.p, aten.bernoulli_.float, aten.bernoulli.Tensor, random=True)
def bernoulli_p(key, x, p=0.5, *, generator=None):
    return _bernoulli(key, p, x.shape, x.dtype)


def _digits(dtype) -> int:
    """The largest value ``random_()`` draws for ``dtype``, as PyTorch's (2^mantissa for floats)."""
    if dtype == np.bool_:
        return 1
    if is_float(dtype):
        return 2 ** (jnp.finfo(dtype).nmant + 1)
    return int(jnp.iinfo(dtype).max)


DIGITS = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}  # numeric_limits::digits


def _through(value: int, dtype: torch.dtype) -> int:
    """``static_cast<int64_t>(static_cast<scalar_t>(value))``, as PyTorch's CPU computes it."""
    return int(torch.tensor(value, dtype=torch.int64).to(dtype).to(torch.int64))


def float_bounds(dtype: torch.dtype, low: int, high: int | None) -> tuple[int, int | None]:
    """PyTorch's ``update_from`` / ``update_to`` for a floating ``dtype``: ``from`` raised and
    ``to`` (exclusive) lowered to where the dtype's rounding keeps draws inside ``[from, to)``."""
    digits = DIGITS[dtype]
    if low + 1 <= torch.iinfo(torch.int64).max:
        plus = _through(low + 1, dtype)
        if plus < low:
            low = plus + (1 << ((abs(low + 1).bit_length() - 1) - digits + 1))
    if high is not None:
        minus = _through(high - 1, dtype)
        if minus >= high:
            high = minus - (1 << ((abs(high - 1).bit_length() - 1) - digits + 1))
    return low, high


def _random(key, x, low: int, high: int | None):
    if is_float(x.dtype) and (low != 0 or high is not None):  # random_(from, to) / random_(to)
        low, high = float_bounds(to_torch_dtype(x.dtype), low, high)
    top = _digits(x.dtype) + 1 if high is None else high
    if low >= top:
        raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got from={low} >= to={top}")
    top = min(top, int(jnp.iinfo(jnp.int64).max))
    return jax.random.randint(key, x.shape, low, top, jnp.int64).astype(x.dtype)


@lowering(aten.random.default, random=True)
def random_default(key, x, *, generator=None):
    return _random(key, x, 0, None)


@lowering(aten.random.to, random=True)
def random_to(key, x, to, *, generator=None):
    return _random(key, x, 0, to)


def random_from(key, x, low, high=None, *, generator=None):
    return _random(key, x, low, high)


lowering(getattr(aten.random, "from"), random=True)(random_from)  # "from" is a Python keyword


@lowering(aten.exponential.default, random=True)
def exponential(key, x, lambd=1.0, *, generator=None):
    sample = jax.random.exponential(key, x.shape, _sample_dtype(x.dtype))
    return (sample / lambd).astype(x.dtype)


@lowering(aten.geometric.default, random=True)
def geometric(key, x, p, *, generator=None):
    u = jax.random.uniform(key, x.shape, jnp.float64 if x.dtype == jnp.float64 else jnp.float32,
                           minval=jnp.finfo(jnp.float32).tiny, maxval=1.0)
    return jnp.ceil(jnp.log(u) / jnp.log1p(-p)).astype(x.dtype)


@lowering(aten.log_normal.default, random=True)
def log_normal(key, x, mean=1.0, std=2.0, *, generator=None):
    return jnp.exp(_normal(key, x.shape, _sample_dtype(x.dtype), mean, std)).astype(x.dtype)


@lowering(aten.cauchy.default, random=True)
def cauchy(key, x, median=0.0, sigma=1.0, *, generator=None):
    return (jax.random.cauchy(key, x.shape, _sample_dtype(x.dtype)) * sigma + median).astype(x.dtype)


# ---------------------------------------------------------------- factories

@lowering(aten.rand.default, aten.rand.generator, random=True)
def rand(key, size, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None):
    return _uniform(key, tuple(size), _factory_dtype(dtype))


@lowering(aten.randn.default, aten.randn.generator, random=True)
def randn(key, size, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None):
    return _normal(key, tuple(size), _factory_dtype(dtype))


@lowering(aten.randint.default, aten.randint.generator, random=True)
def randint(key, high, size, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None):
    return randint_low(key, 0, high, size, generator=generator, dtype=dtype)


@lowering(aten.randint.low, aten.randint.low_generator, random=True)
def randint_low(key, low, high, size, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None):
    if low >= high:
        raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got from={low} >= to={high}")
    out = to_jax_dtype(dtype if dtype is not None else torch.int64)
    return jax.random.randint(key, tuple(size), low, high, jnp.int64).astype(out)


@lowering(aten.randperm.default, aten.randperm.generator, random=True)
def randperm(key, n, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None):
    return jax.random.permutation(key, n).astype(to_jax_dtype(dtype if dtype is not None else torch.int64))


@lowering(aten.multinomial.default, random=True)
def multinomial(key, probs, num_samples, replacement=False, *, generator=None):
    if probs.ndim not in (1, 2):
        raise RuntimeError("prob_dist must be 1 or 2 dim")
    if not replacement and num_samples > probs.shape[-1]:
        raise RuntimeError("cannot sample n_sample > prob_dist.size(-1) samples without replacement")
    rows = probs.reshape(-1, probs.shape[-1]).astype(jnp.float32)
    logits = jnp.log(rows)
    if replacement:
        draws = jax.random.categorical(key, logits, axis=-1, shape=(num_samples, rows.shape[0])).T
    else:  # Gumbel top-k: the k largest perturbed log-probabilities are a sample without replacement
        perturbed = logits + jax.random.gumbel(key, rows.shape)
        draws = jax.lax.top_k(perturbed, num_samples)[1]
    return draws.astype(jnp.int64).reshape(*probs.shape[:-1], num_samples)


def _like(x, dtype, device):
    if device is not None and torch.device(device).type != "tpu":
        raise NotImplementedError(f"tpu: random *_like ops cannot create a tensor on {device}; draw on "
                                  f"that device directly, e.g. torch.rand(x.shape, device={str(device)!r})")
    return x.dtype if dtype is None else to_jax_dtype(dtype)


@lowering(aten.rand_like.default, random=True)
def rand_like(key, x, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return _uniform(key, x.shape, _like(x, dtype, device))


@lowering(aten.randn_like.default, random=True)
def randn_like(key, x, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return _normal(key, x.shape, _like(x, dtype, device))


@lowering(aten.randint_like.default, aten.randint_like.low_dtype, random=True)
def randint_like(key, x, low, high=None, *, dtype=None, layout=None, device=None, pin_memory=None,
                 memory_format=None):
    low, high = (0, low) if high is None else (low, high)
    out = _like(x, dtype, device)
    return jax.random.randint(key, x.shape, low, high, jnp.int64).astype(out)
