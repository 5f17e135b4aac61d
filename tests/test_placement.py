"""Placement: where a tpu tensor's array lives is decided in one module (``runtime/placement.py``),
and a storage may hold an array placed on a mesh of devices: ops follow the array's placement."""

from __future__ import annotations

import jax
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from torchtpu.device import bridge
from torchtpu.runtime import placement, platform


def test_factories_and_transfers_land_on_their_device():
    for index in (0, 1):
        for t in (torch.zeros(3, device=f"tpu:{index}"), torch.ones(3).to(f"tpu:{index}")):
            array = bridge.read(t)
            assert array.sharding == placement.sharding(index)
            assert placement.index_of(array) == index


def test_storage_holding_a_mesh_array():
    devices = platform.devices()[:2]
    mesh = Mesh(np.array(devices), ("x",))
    host = np.arange(16, dtype=np.float32).reshape(4, 4)
    global_array = jax.device_put(host, NamedSharding(mesh, PartitionSpec("x")))
    t = bridge.wrap(global_array, placement.index_of(global_array))
    assert t.device == torch.device("tpu", 0)
    out = torch.relu(t * 2 - 10).sum(dim=1)
    assert len(bridge.read(out).sharding.device_set) == 2  # computed where the array lives
    torch.testing.assert_close(out.cpu(), torch.relu(torch.from_numpy(host) * 2 - 10).sum(dim=1))
    torch.testing.assert_close(t[1:3, ::2].cpu(), torch.from_numpy(host)[1:3, ::2])


def test_index_of_an_array_elsewhere():
    array = jax.device_put(np.zeros(2), platform.jax_device(1))
    assert placement.index_of(array) == 1
