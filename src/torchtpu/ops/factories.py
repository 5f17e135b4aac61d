"""Factory ops: tensors made from nothing but sizes and values."""

from __future__ import annotations

import jax.numpy as jnp

from torchtpu.ops.dtypes import to_jax_dtype
from torchtpu.ops.registry import aten, lowering


def _dtype(dtype, default):
    import torch

    return to_jax_dtype(dtype if dtype is not None else (default or torch.get_default_dtype()))


def _default_complex():
    """The complex dtype of ``torch.get_default_dtype()`` (complex64 for float32, complex128 for
    float64), what PyTorch gives a factory of complex Python numbers."""
    import torch

    return {torch.float64: torch.complex128, torch.float16: torch.complex32}.get(torch.get_default_dtype(),
                                                                                 torch.complex64)


@lowering(aten.fill.Scalar)
def fill_scalar(x, value):
    return jnp.full(x.shape, value, dtype=x.dtype)


@lowering(aten.fill.Tensor)
def fill_tensor(x, value):
    return jnp.broadcast_to(value.astype(x.dtype), x.shape)


@lowering(aten.zero.default)
def zero(x):
    return jnp.zeros_like(x)


@lowering(aten.full.default)
def full(size, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None):
    import torch

    if dtype is None:
        kind = _py_kind(fill_value)
        dtype = {bool: torch.bool, int: torch.int64}.get(kind) or \
            (_default_complex() if kind is complex else torch.get_default_dtype())
    return jnp.full(tuple(size), fill_value, dtype=to_jax_dtype(dtype))


def _py_kind(value):
    import numpy as np

    if isinstance(value, (bool, int, float, complex)):
        return type(value) if type(value) in (bool, int, float, complex) else {
            np.dtype(np.bool_): bool, np.dtype(np.int64): int, np.dtype(np.float64): float,
            np.dtype(np.complex128): complex}[np.dtype(type(value))]
    return {"b": bool, "i": int, "u": int, "f": float, "c": complex}[np.dtype(value.dtype).kind]


@lowering(aten.scalar_tensor.default)
def scalar_tensor(s, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.asarray(s).astype(_dtype(dtype, None))


def _check_range(start, end, step) -> None:
    """PyTorch's checks of arange's and range's bounds, with its wording."""
    import math

    if step == 0:
        raise RuntimeError("step must be nonzero")
    if not (math.isfinite(start) and math.isfinite(end)):
        raise RuntimeError(f"unsupported range: {start} -> {end}")
    if not ((step > 0 and end >= start) or (step < 0 and end <= start)):
        raise RuntimeError("upper bound and lower bound inconsistent with step sign")


def _as_number(v):
    return v if isinstance(v, (bool, int, float)) else (int(v) if _py_kind(v) in (bool, int) else float(v))


def _steps(start, step, n: int, jdt):
    """``start + i * step`` for i < n, as PyTorch's CPU kernels compute it: in double for floating
    dtypes, and in int64 for integral ones, whose bounds and step are truncated to integers first
    (``arange(0, 2, 0.5, dtype=torch.int64)`` is all zeros there)."""
    if jnp.issubdtype(jdt, jnp.integer):
        return (int(start) + jnp.arange(n, dtype=jnp.int64) * int(step)).astype(jdt)
    return (start + jnp.arange(n, dtype=jnp.float64) * step).astype(jdt)


@lowering(aten.arange.start_step, static_scalars=True)
def arange(start, end, step=1, *, dtype=None, layout=None, device=None, pin_memory=None):
    import math

    import torch

    if dtype is None:
        kinds = {_py_kind(v) for v in (start, end, step)}
        dtype = torch.get_default_dtype() if float in kinds else torch.int64
    jdt = to_jax_dtype(dtype)
    start, end, step = (_as_number(v) for v in (start, end, step))
    _check_range(start, end, step)
    n = max(0, math.ceil((end - start) / step))
    return _steps(start, step, n, jdt)


@lowering(aten.range.step, aten.range.default, static_scalars=True)
def range_(start, end, step=1, *, dtype=None, layout=None, device=None, pin_memory=None):
    """The deprecated ``torch.range``: ``end`` included, the default dtype unless given."""
    jdt = _dtype(dtype, None)
    start, end, step = (_as_number(v) for v in (start, end, step))
    if jnp.issubdtype(jdt, jnp.integer):  # PyTorch computes in int64: bounds and step truncated first
        start, end, step = int(start), int(end), int(step)
    _check_range(start, end, step)
    n = (end - start) // step + 1 if isinstance(step, int) else int((end - start) / step) + 1
    return _steps(start, step, n, jdt)


@lowering(aten.arange.default, static_scalars=True)
def arange_end(end, *, dtype=None, layout=None, device=None, pin_memory=None):
    return arange(0, end, 1, dtype=dtype)


@lowering(aten.arange.start, static_scalars=True)
def arange_start(start, end, *, dtype=None, layout=None, device=None, pin_memory=None):
    return arange(start, end, 1, dtype=dtype)


@lowering(aten.zeros.default)
@lowering(aten._efficientzerotensor.default)  # autograd's zero gradients (sgn, ...): plain zeros here
def zeros(size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), _dtype(dtype, None))


@lowering(aten.ones.default)
def ones(size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.ones(tuple(size), _dtype(dtype, None))


@lowering(aten.eye.default, aten.eye.m)
def eye(n, m=None, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.eye(n, n if m is None else m, dtype=_dtype(dtype, None))


def _space_dtype(dtype, start, end):
    """linspace's and logspace's dtype: the given one, else the default complex dtype when an
    endpoint is complex, else the default dtype (as PyTorch infers it)."""
    if dtype is None and any(jnp.iscomplexobj(v) for v in (start, end)):
        return to_jax_dtype(_default_complex())
    return _dtype(dtype, None)


def _check_steps(steps: int) -> None:
    if steps < 0:
        raise RuntimeError("number of steps must be non-negative")


def _divide(x, n: int):
    """``x / n`` as a real division. XLA rewrites a division by a constant into a product with
    the rounded reciprocal, which can be an ulp off PyTorch's quotient (and then a point of an
    integer linspace truncates to the integer below)."""
    from jax import lax

    return x / lax.optimization_barrier(jnp.asarray(n, x.dtype))


def _spaced(start, end, steps: int, compute):
    """PyTorch's linspace of ``steps >= 2`` points in ``compute``: the first half counts up from
    ``start``, the second down from ``end``."""
    import numpy as np

    step = _divide(end - start, steps - 1)
    idx = np.arange(steps)
    up = start + step * idx.astype(compute)
    down = end - step * (steps - idx - 1).astype(compute)
    return jnp.where(idx < steps // 2, up, down)


def _two_sum(a, b):
    """Knuth's TwoSum: ``s + err == a + b`` exactly, ``s`` the rounded sum."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _multiply_add(a, s, k):
    """``a + s * k`` in float64 rounded once, as a fused multiply-add gives it (``k``: whole
    numbers below 2**26 in magnitude). ``s`` is split into two halves whose products with ``k``
    are exact; the three terms are then summed with one rounding (Boldo and Melquiond's sum
    through round-to-odd), so neither the compiler's contraction nor double rounding can move
    the result."""
    from jax import lax

    bits = lax.bitcast_convert_type(s, jnp.uint64)
    high = lax.bitcast_convert_type(bits & jnp.uint64(~((1 << 27) - 1) & (2**64 - 1)), jnp.float64)
    p1, p2 = high * k, (s - high) * k
    uh, ul = _two_sum(p1, p2)
    th, tl = _two_sum(a, uh)
    v, err = _two_sum(tl, ul)
    even = (lax.bitcast_convert_type(v, jnp.uint64) & jnp.uint64(1)) == 0
    v = jnp.where((err != 0) & even, jnp.nextafter(v, jnp.where(err > 0, jnp.inf, -jnp.inf)), v)
    return th + v


def _spaced_integral(start, end, steps: int):
    """PyTorch's CPU linspace for an integer dtype (``start``, ``end``: the truncated endpoints
    in float64; ``steps >= 2``): the step in double; point i below ``steps // 2`` is
    ``start + step * i``, the others ``end - step * (steps - 1 - i)``, each computed as one fused
    multiply-add (the CPU kernel is built with FMA contraction) and truncated; the endpoints are
    exact."""
    import numpy as np

    step = _divide(end - start, steps - 1)
    idx = np.arange(steps)
    first = idx < steps // 2
    base = jnp.where(first, start, end)
    k = np.where(first, idx, idx - (steps - 1)).astype(np.float64)
    points = _multiply_add(base, step, k)
    points = jnp.where(idx == 0, start, jnp.where(idx == steps - 1, end, points))
    return points


def _bound(value, dtype):
    """An endpoint as PyTorch's kernels take it: converted to the output dtype first (an integer
    output truncates 2.7 to 2); a complex endpoint of a real dtype keeps its real part."""
    value = jnp.asarray(value)
    if jnp.iscomplexobj(value) and not jnp.issubdtype(dtype, jnp.complexfloating):
        value = jnp.real(value)
    return value.astype(dtype)


@lowering(aten.linspace.default, aten.linspace.Tensor_Tensor, aten.linspace.Tensor_Scalar,
          aten.linspace.Scalar_Tensor)
def linspace(start, end, steps, *, dtype=None, layout=None, device=None, pin_memory=None):
    jdt = _space_dtype(dtype, start, end)
    _check_steps(steps)
    # integral outputs step in double and truncate each point; the others compute in their dtype
    compute = jnp.float64 if jnp.issubdtype(jdt, jnp.integer) else jdt
    start, end = (_bound(v, jdt).astype(compute) for v in (start, end))
    if steps <= 1:
        return jnp.full((steps,), start, compute).astype(jdt)
    if jnp.issubdtype(jdt, jnp.integer):
        return _spaced_integral(start, end, steps).astype(jdt)
    return _spaced(start, end, steps, compute).astype(jdt)


@lowering(aten.logspace.default, aten.logspace.Tensor_Tensor, aten.logspace.Tensor_Scalar,
          aten.logspace.Scalar_Tensor)
def logspace(start, end, steps, base=10.0, *, dtype=None, layout=None, device=None, pin_memory=None):
    """``base ** linspace(start, end)`` as PyTorch's CPU kernel computes it: real outputs take
    their endpoints in the output dtype (truncated, for integers) and the exponents and powers in
    double; complex outputs compute in their dtype; a single point is ``base ** start`` of the
    endpoint as given."""
    jdt = _space_dtype(dtype, start, end)
    _check_steps(steps)
    complex_out = jnp.issubdtype(jdt, jnp.complexfloating)
    compute = jdt if complex_out else jnp.float64
    if steps <= 1:
        first = jnp.asarray(start).astype(jnp.complex128 if complex_out else jnp.float64)
        value = jnp.power(jnp.asarray(base, first.dtype), first)
        return jnp.full((steps,), value).astype(jdt)
    start, end = (_bound(v, jdt).astype(compute) for v in (start, end))
    exponents = _spaced(start, end, steps, compute)
    return jnp.power(jnp.asarray(base).astype(compute), exponents).astype(jdt)


def _triangle_indices(select, row, col, offset, dtype):
    import numpy as np
    import torch

    rows, cols = select(row, offset, col)
    return jnp.asarray(np.stack([rows, cols]).reshape(2, -1), to_jax_dtype(dtype or torch.int64))


@lowering(aten.tril_indices.default)
def tril_indices(row, col, offset=0, *, dtype=None, layout=None, device=None, pin_memory=None):
    import numpy as np

    return _triangle_indices(np.tril_indices, row, col, offset, dtype)


@lowering(aten.triu_indices.default)
def triu_indices(row, col, offset=0, *, dtype=None, layout=None, device=None, pin_memory=None):
    import numpy as np

    return _triangle_indices(np.triu_indices, row, col, offset, dtype)



def _window_checks(name: str, window_length: int, dtype, layout) -> None:
    """PyTorch's ``window_function_checks``, with its wording."""
    import torch

    if layout is not None and layout != torch.strided:
        raise RuntimeError(f"{name} is not implemented for sparse types, got: layout={layout}")
    if not (dtype.is_floating_point or dtype.is_complex):
        raise RuntimeError(f"{name} expects floating point dtypes, got: dtype={dtype}")
    if window_length < 0:
        raise RuntimeError(f"{name} requires non-negative window_length, got window_length={window_length}")


@lowering(aten.kaiser_window.default, aten.kaiser_window.periodic, aten.kaiser_window.beta, dynamic=("beta",))
def kaiser_window(window_length, periodic=True, beta=12.0, *, dtype=None, layout=None, device=None,
                  pin_memory=None):
    """PyTorch's kernel: over ``arange`` in the window's dtype, in opmath,
    ``i0(beta * sqrt(|1 - ((k - alpha) / alpha)^2|)) / i0(beta)`` with ``alpha = (n - 1) / 2``."""
    import jax.scipy.special as jss
    import torch

    from torchtpu.ops.dtypes import opmath

    dtype = dtype if dtype is not None else torch.get_default_dtype()
    _window_checks("kaiser_window", window_length, dtype, layout)
    jdt = to_jax_dtype(dtype)
    if window_length <= 1:
        return jnp.ones((window_length,), jdt)
    n = window_length + 1 if periodic else window_length
    op = opmath(jdt)
    k = jnp.arange(n, dtype=jnp.int64).astype(jdt).astype(op)  # PyTorch's arange holds window's dtype
    alpha = jnp.asarray((n - 1) / 2.0, op)
    b = jnp.asarray(beta).astype(op)
    window = jss.i0(b * jnp.sqrt(jnp.abs(1 - ((k - alpha) / alpha) ** 2))) / jss.i0(b)
    return window[:window_length].astype(jdt)


def _like_dtype(x, dtype):
    return x.dtype if dtype is None else to_jax_dtype(dtype)


def full_like(x, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.full(x.shape, fill_value, _like_dtype(x, dtype))


def zeros_like(x, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.zeros(x.shape, _like_dtype(x, dtype))


def ones_like(x, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.ones(x.shape, _like_dtype(x, dtype))


def empty(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.zeros(tuple(size), _dtype(dtype, None))  # XLA has no uninitialised memory


def empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return empty(size, dtype=dtype)


def empty_permuted(size, physical_layout, *, dtype=None, layout=None, device=None, pin_memory=None):
    return empty(size, dtype=dtype)  # (empty_like's decomposition; the layout is XLA's to choose)


# Graph-only. In eager, ``zeros_like(x, device="cpu")`` must leave the device, which a lowering
# cannot, so eager keeps PyTorch's empty_like + fill_ path; eager's ``empty`` is a lazy shell
# (eager/views.py).
for _op, _fn in {aten.full_like.default: full_like, aten.zeros_like.default: zeros_like,
                 aten.ones_like.default: ones_like, aten.empty.memory_format: empty,
                 aten.empty_strided.default: empty_strided, aten.empty_permuted.default: empty_permuted}.items():
    lowering(_op, graph_only=True)(_fn)
