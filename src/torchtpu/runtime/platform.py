"""Which PJRT platform backs the ``tpu`` device, and its devices."""

from __future__ import annotations

import functools

import jax

from torchtpu.config import config

# torch's int64/float64 semantics need JAX's 64-bit mode. This is the one JAX setting torchtpu
# changes, once, at import (documented in docs/design.md and the README).
jax.config.update("jax_enable_x64", True)

_PREFERENCE = ("tpu", "gpu", "cpu")


@functools.cache
def platform() -> str:
    """The PJRT platform in use: ``tpu``, ``gpu`` or ``cpu``."""
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
    """The PJRT devices that ``tpu:0``, ``tpu:1``, ... map to, in order."""
    return tuple(jax.local_devices(backend=platform()))


def device_count() -> int:
    return len(devices())


def jax_device(index: int) -> jax.Device:
    """The PJRT device behind ``tpu:index``."""
    devs = devices()
    if not 0 <= index < len(devs):
        raise RuntimeError(
            f"Invalid device ordinal tpu:{index}: {len(devs)} {platform().upper()} device(s) are available"
        )
    return devs[index]


def device_name(index: int = 0) -> str:
    """A truthful name for what backs ``tpu:index``, e.g. ``XLA:CPU`` or ``TPU v5 lite``."""
    dev = jax_device(index)
    if dev.platform == "cpu":
        return "XLA:CPU"
    kind = getattr(dev, "device_kind", "") or dev.platform.upper()
    return kind if dev.platform == "tpu" else f"{kind} (XLA:{dev.platform.upper()})"
