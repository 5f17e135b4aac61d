"""The PJRT platform and devices JAX offers, chosen as ``TORCHTPU_PLATFORM`` says: what starting the
runtime (``state.start``) asks for, below both it and ``platform`` (which starts the runtime first).
Importing this imports JAX."""

from __future__ import annotations

import functools

import jax

from torchtpu.config import config
from torchtpu.runtime import multiprocess

_PREFERENCE = ("tpu", "gpu", "cpu")


@functools.cache
def platform() -> str:
    """The PJRT platform in use: ``tpu``, ``gpu`` or ``cpu`` (chosen as the runtime starts)."""
    wanted = config.platform
    if wanted:
        try:
            jax.devices(wanted)
        except RuntimeError as exc:
            raise RuntimeError(
                f"TORCHTPU_PLATFORM={wanted} but JAX has no {wanted} devices ({exc}). "
                f"Install the matching extra (pip install 'torchtpu[{wanted}]') or unset TORCHTPU_PLATFORM."
            ) from None
        return wanted
    for name in _PREFERENCE:
        try:
            if jax.devices(name):
                return name
        except RuntimeError:
            continue
    raise RuntimeError("JAX found no devices at all, not even the CPU")


@functools.cache
def devices() -> tuple[jax.Device, ...]:
    """The PJRT devices that ``tpu:0``, ``tpu:1``, ... map to, in order. Under a multi-process
    launch a process drives one device, its first local one (``tpu:LOCAL_RANK``)."""
    local = tuple(jax.local_devices(backend=platform()))
    return local[:1] if multiprocess.active() else local
