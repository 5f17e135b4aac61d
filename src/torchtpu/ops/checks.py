"""Device-side argument checks: out-of-bounds indices raise ``IndexError``, never clamp.

XLA's gathers clamp an out-of-bounds index and its scatters drop the write: computed on the
device, a bad index would give a wrong answer silently. CUDA checks indices inside its kernels
and raises a device-side assert; this is its equivalent, without a host round trip per op.

A lowering registered with ``checked=True`` calls ``in_bounds`` on its indices. While its
program is traced (``collecting``), each check becomes a boolean computed inside the program;
the program folds them into one ``int32`` code (0: all in bounds, else the number of an
interned message) that it returns after its output. The executor hands the code to ``defer``:
codes wait on the device, and ``raise_pending`` reads them all at once at the next
synchronisation point (a value read to the host, ``torch.tpu.synchronize()``) and raises
``IndexError`` naming the op. In ``DEFER_NEVER_AND_LAUNCH_BLOCKING`` the code is read at the
op, so the error points at the op that caused it, as ``CUDA_LAUNCH_BLOCKING=1`` does.
"""

from __future__ import annotations

import contextvars
import functools
import threading
from contextlib import contextmanager

import jax
import jax.numpy as jnp
import numpy as np


# the checks of the program being traced: (op name, [(bad: bool array, message number)])
_collector: contextvars.ContextVar = contextvars.ContextVar("torchtpu_checks", default=None)

_messages: list[str] = [""]  # code -> message (0: no error)
_numbers: dict[str, int] = {}
_lock = threading.Lock()
_pending: list = []  # codes not read yet, each (code array, or a Lazy one)
FOLD_AT = 64  # pending codes past this are folded into one on the device (a loop that never reads)


class IndexOutOfBounds(IndexError, RuntimeError):
    """An index out of bounds, found on the device. An ``IndexError`` as the CPU raises for most
    ops, and a ``RuntimeError`` as it raises for ``gather``/``scatter`` and as CUDA's device-side
    assert is: code written for either catches it."""


class DeviceCheckFailed(RuntimeError):
    """Another argument check PyTorch makes on values that live on the device (``x[mask] = v``
    with as many rows of ``v`` as the mask has True elements), found there and raised at the next
    synchronisation as an out-of-bounds index is."""


_kinds: dict[int, type] = {}  # message number -> exception class (IndexOutOfBounds if absent)


def _number(message: str, kind: type | None = None) -> int:
    with _lock:
        n = _numbers.get(message)
        if n is None:
            n = _numbers[message] = len(_messages)
            _messages.append(message)
            if kind is not None:
                _kinds[n] = kind
        return n


def require(bad, message: str) -> None:
    """A check of the lowering being traced: ``bad`` (a boolean computed in the program) means
    PyTorch would have raised ``RuntimeError(message)``; raised at the next synchronisation."""
    current = _collector.get()
    if current is None:
        return
    op, checks = current
    checks.append((bad, _number(f"{op}: {message} (tpu checks this on the device and raises at the next "
                                f"synchronization after the op)", DeviceCheckFailed)))


@contextmanager
def collecting(op: str):
    """Collect the checks of ``op``'s lowering while it is traced; yields the list of
    (bad, message number) pairs, which ``code`` folds."""
    checks: list = []
    token = _collector.set((op, checks))
    try:
        yield checks
    finally:
        _collector.reset(token)


@contextmanager
def suspended():
    """No checks recorded within: a subgraph traced under another transformation (flex_attention's
    score_mod under vmap), whose flags could not leave it."""
    token = _collector.set(None)
    try:
        yield
    finally:
        _collector.reset(token)


def naming(op: str) -> None:
    """Within ``collecting``: name the op whose checks follow (a compiled graph runs many)."""
    current = _collector.get()
    if current is not None:
        _collector.set((op, current[1]))


def code(checks: list, always: bool = True):
    """One ``int32`` for the traced checks: 0, or the message number of a failed one (None where
    there are none, unless ``always``)."""
    if not checks and not always:
        return None
    # one jitted fold: inlined when traced, one dispatch for an unjitted lowering's concrete flags
    return _fold_flags(tuple(number for _, number in checks))(*[bad for bad, _ in checks])


@functools.cache
def _fold_flags(numbers: tuple):
    """The code of flags whose message numbers are ``numbers`` (jitted when cached)."""
    def fold(*flags):
        result = jnp.zeros((), jnp.int32)
        for bad, number in zip(flags, numbers):
            result = jnp.maximum(result, jnp.where(bad, jnp.int32(number), jnp.int32(0)))
        return result

    return jax.jit(fold)


def in_bounds(index, size: int, dim: int = 0, negative: bool = True) -> None:
    """Check that every element of ``index`` addresses one of ``size`` positions along ``dim``
    (``negative``: counting from the end is allowed, as in ``x[-1]``)."""
    current = _collector.get()
    if current is None or not hasattr(index, "dtype") or not jnp.issubdtype(index.dtype, jnp.integer) \
            or index.size == 0:
        return
    op, checks = current
    low = -size if negative else 0
    what = (f"an index is out of bounds for dimension {dim} with size {size}" if negative else
            f"index out of range in self: an index is negative or not below the size {size} of dimension {dim}")
    message = (f"{op}: {what} (tpu checks indices on the device and raises at the next synchronization "
               f"after the op; torch.tpu.set_eager_mode('defer_never_and_launch_blocking') raises at the op)")
    checks.append((_out_of_bounds(index, low, size), _number(message)))


@functools.partial(jax.jit, static_argnums=(1, 2))  # one dispatch where eager runs a lowering unjitted
def _out_of_bounds(index, low: int, size: int):
    return jnp.any((index < low) | (index >= size))


# ---------------------------------------------------------------- the executor's side

def defer(value, blocking: bool) -> None:
    """Keep a program's code until the next synchronisation (``blocking``: read it now)."""
    if value is None:
        return
    if blocking:
        _raise_for([_concrete(value)])
        return
    with _lock:
        _pending.append(value)
        if len(_pending) < FOLD_AT:
            return
        # the codes already computed become one, computed on the device now (never recorded into
        # a DEFER_AND_FUSE graph: a node that comes every so many steps would change its program)
        done = [v for v in _pending if _computed(v) is not None]
        if len(done) < 2:
            return
        rest = [v for v in _pending if _computed(v) is None]
        _pending.clear()
    try:
        folded = [_fold(len(done))(*[_computed(v) for v in done])]
    except Exception:  # noqa: BLE001 - codes of several devices: kept as they are
        folded = done
    with _lock:
        _pending[:0] = folded + rest


def _computed(value):
    """The code's array if it exists (not a fused node still pending), else None."""
    return value if isinstance(value, jax.Array) else getattr(value, "value", None)


@functools.cache
def _fold(n: int):
    return jax.jit(lambda *codes: functools.reduce(jnp.maximum, codes))


def _concrete(value):
    return value.materialize() if hasattr(value, "materialize") else value


def pending() -> bool:
    return bool(_pending)


def raise_pending() -> None:
    """Read the codes of the programs run since the last synchronisation; raise ``IndexError``
    for a failed check."""
    if not _pending:
        return
    with _lock:
        codes = list(_pending)
        _pending.clear()
    _raise_for([_concrete(c) for c in codes])


def _raise_for(codes: list) -> None:
    values = jax.device_get(codes)
    failed = [int(v) for v in np.ravel(values) if int(v)]
    if failed:
        n = max(failed)
        raise _kinds.get(n, IndexOutOfBounds)(_messages[n])


def discard_pending() -> None:
    """Forget the codes not read yet (a test, or a device reset)."""
    with _lock:
        _pending.clear()
