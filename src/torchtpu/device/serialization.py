"""``torch.save`` / ``torch.load`` of tpu tensors.

Saving needs nothing special: storages have their real byte count, and reading their bytes goes
through the bridge. Loading needs a tpu storage made from the saved bytes: PyTorch would ask a
C++ allocator (which a Python backend has not), so we register a deserializer for ``tpu:N``
locations (``torch.serialization.register_package``) that builds the storage ourselves.
"""

from __future__ import annotations

import numpy as np
import torch

from torchtpu.runtime import state

_PRIORITY = 5  # ahead of PyTorch's generic backend deserializer


def _tag(storage) -> str | None:
    device = storage.device
    if device.type == "tpu":
        return f"tpu:{device.index}"
    return None


def _deserialize(storage, location: str):
    if not location.startswith("tpu"):
        return None
    index = state.device_index(location)
    if storage.device.type == "tpu":
        return storage if storage.device.index == index else None
    # registered at import, which must not import JAX (runtime/state.py): the bridge is imported here
    from torchtpu.device import bridge
    from torchtpu.runtime import placement

    nbytes = storage.nbytes()
    data = np.frombuffer(bytes(storage), dtype=np.uint8) if nbytes else np.zeros((0,), np.uint8)
    result = bridge.new_storage(nbytes, index)
    bridge.set_array(result, placement.put(data, index))
    return result


def install() -> None:
    torch.serialization.register_package(_PRIORITY, _tag, _deserialize)
