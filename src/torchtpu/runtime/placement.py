"""Where an array lives: the one place that maps a ``tpu`` device index to a JAX placement.

Every ``tpu:N`` is one PJRT device of this process, and an array made for it (a factory's
output, a host transfer, a cached scalar, a loaded storage) is placed with ``sharding(N)``.
Nothing else builds shardings or calls ``jax.device_put``: a storage may also hold an array
placed on a mesh of devices (several local devices, or devices of other processes under
``jax.distributed``), and ops on it follow the array's own placement, so a distributed layer
changes what lives where here, not at each call site.
"""

from __future__ import annotations

import functools

import jax

from torchtpu.runtime import platform


@functools.cache
def sharding(index: int) -> jax.sharding.Sharding:
    """The placement of arrays made for ``tpu:index``."""
    return jax.sharding.SingleDeviceSharding(platform.jax_device(index))


def put(value, index: int) -> jax.Array:
    """``value`` (host data or an array on another device) as an array on ``tpu:index``."""
    return jax.device_put(value, sharding(index))


def default(index: int | None = None):
    """A context in which JAX makes uncommitted arrays (scalars, constants) on ``tpu:index``
    (default: this process's first device, ``tpu:LOCAL_RANK`` under a multi-process launch)."""
    return jax.default_device(platform.jax_device(platform.first_index() if index is None else index))


def index_of(array: jax.Array) -> int | None:
    """The ``tpu`` index an array lives on: its device, or for an array on a mesh, the device of
    its first shard in this process; None where no device of this process holds part of it."""
    devices = platform.devices()
    for shard in array.addressable_shards:
        try:
            return platform.first_index() + devices.index(shard.device)
        except ValueError:
            continue
    return None
