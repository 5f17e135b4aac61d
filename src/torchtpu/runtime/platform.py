"""Which PJRT platform backs the ``tpu`` device, and its devices (importing this imports JAX;
``state`` is the part that does not)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax

from torchtpu.config import config
from torchtpu.runtime import state

_PREFERENCE = ("tpu", "gpu", "cpu")


@functools.cache
def platform() -> str:
    """The PJRT platform in use: ``tpu``, ``gpu`` or ``cpu`` (starts the runtime)."""
    state.start()
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


@dataclass(frozen=True)
class DeviceProperties:
    name: str
    platform: str
    device_kind: str
    index: int
    total_memory: int | None


def device_properties(index: int) -> DeviceProperties:
    """What backs ``tpu:index``: its name, platform, kind and (where PJRT reports it) memory."""
    dev = jax_device(index)
    try:
        stats = dev.memory_stats() or {}
    except Exception:
        stats = {}
    return DeviceProperties(name=device_name(index), platform=dev.platform,
                            device_kind=getattr(dev, "device_kind", dev.platform), index=index,
                            total_memory=stats.get("bytes_limit"))
