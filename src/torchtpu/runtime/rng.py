"""Device random-number state: a (seed, offset) pair per device, like CUDA's Philox state.

Every random op consumes one offset; its key is ``fold_in(key(seed), offset)``, computed inside
the jitted program so drawing costs no extra dispatch. Same seed, same numbers.

A ``torch.Generator("tpu")`` (made by the C++ hooks, ``csrc/hooks.cpp``) is a (seed, offset) pair
of its own: an op given ``generator=g`` draws from g's pair and leaves the device's untouched.
The device's default generator (``torch.accelerator.get_rng_state``) reads and writes the state
here, through ``seed_offset`` and ``set_seed_offset``.

The state is plain Python: seeding works before the runtime starts (as ``torch.cuda.manual_seed``
does), so this module imports JAX only where a key is made, inside a traced program.
"""

from __future__ import annotations

import random as _pyrandom
import threading

import numpy as np
import torch

from torchtpu.runtime import multiprocess, state

_DEFAULT_SEED = 67280421310721  # torch's default CPU seed, for familiarity


# Reentrant: drawing from a default generator object calls back into this module under the lock.
_lock = threading.RLock()
_seeds: dict[int, int] = {}
_offsets: dict[int, int] = {}
_initial: dict[int, int] = {}


def _ensure(index: int) -> None:
    if index not in _seeds:
        # The process's first device follows torch.manual_seed, as cuda:0 does (under torchrun
        # that device is tpu:LOCAL_RANK).
        seed = torch.initial_seed() if index == multiprocess.local_rank() else _DEFAULT_SEED
        _seeds[index] = _initial[index] = seed
        _offsets[index] = 0


# While a context captures a graph (``eager/capture.py``), draws are answered by its recorder:
# the captured program reads its (seed, offset) at each replay instead of a fixed one.
capture_draw = None


def next_key_args(index: int, generator: torch.Generator | None = None) -> tuple:
    """Advance ``tpu:index``'s state (or ``generator``'s) by one draw; returns (seed_hi, seed_lo,
    offset) as uint32s (while the context captures a graph: the recorder's values for them)."""
    if capture_draw is not None:
        drawn = capture_draw(index, generator)
        if drawn is not None:
            return drawn
    return split(*reserve(index, generator))


def reserve(index: int, generator: torch.Generator | None = None, count: int = 1) -> tuple[int, int]:
    """Advance ``tpu:index``'s state (or ``generator``'s) by ``count`` draws; returns the (seed,
    offset) of the first."""
    with _lock:
        if generator is None:
            _ensure(index)
            seed, offset = _seeds[index], _offsets[index]
            _offsets[index] = offset + count
        else:
            if generator.device.type != "tpu":
                raise RuntimeError(f"Expected a 'tpu' device type for generator but found "
                                   f"'{generator.device.type}'")
            seed, offset = generator.initial_seed(), generator.get_offset()
            generator.set_offset(offset + count)
    return seed, offset


def split(seed: int, offset: int) -> tuple[np.uint32, np.uint32, np.uint32]:
    """(seed_hi, seed_lo, offset) as the uint32s a random op's program takes."""
    return np.uint32((seed >> 32) & 0xFFFFFFFF), np.uint32(seed & 0xFFFFFFFF), np.uint32(offset & 0xFFFFFFFF)


def make_key(seed_hi, seed_lo, offset):
    """The ``jax.random`` key for one draw (traceable)."""
    import jax

    key = jax.random.wrap_key_data(jax.numpy.stack([seed_hi, seed_lo]).astype(np.uint32), impl="threefry2x32")
    return jax.random.fold_in(key, offset)


def manual_seed(seed: int, index: int | None = None) -> None:
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    with _lock:
        for i in ([index] if index is not None else [_current()]):
            _seeds[i] = _initial[i] = seed
            _offsets[i] = 0


def manual_seed_all(seed: int) -> None:
    for i in range(state.device_count()):
        manual_seed(seed, i)


def seed(index: int | None = None) -> int:
    """Seed with a non-deterministic random number; returns it."""
    s = _pyrandom.SystemRandom().getrandbits(63)
    manual_seed(s, index)
    return s


def initial_seed(index: int | None = None) -> int:
    i = _current() if index is None else index
    with _lock:
        _ensure(i)
        return _initial[i]


def seed_offset(index: int) -> tuple[int, int]:
    """``tpu:index``'s (seed, offset)."""
    with _lock:
        _ensure(index)
        return _seeds[index], _offsets[index]


def set_seed_offset(index: int, seed_value: int, offset: int) -> None:
    """Set ``tpu:index``'s (seed, offset); its initial seed is kept once it has one."""
    with _lock:
        _seeds[index] = int(seed_value)
        _initial.setdefault(index, int(seed_value))
        _offsets[index] = int(offset)


def get_state(index: int | None = None) -> torch.Tensor:
    """The state as a CPU ``torch.uint8`` tensor (16 bytes: seed, offset), as torch.cuda returns."""
    data = np.array(seed_offset(_current() if index is None else index), dtype=np.uint64)
    return torch.from_numpy(data.view(np.uint8).copy())


def set_state(state: torch.Tensor, index: int | None = None) -> None:
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.numel() != 16:
        raise RuntimeError("tpu RNG state must be a torch.uint8 tensor of 16 bytes (from get_rng_state())")
    seed_value, offset = state.cpu().numpy().view(np.uint64).tolist()
    set_seed_offset(_current() if index is None else index, seed_value, offset)


_current = state.current_device
