"""``torch.distributed`` on ``tpu``: the ``"tpu"`` c10d backend (also registered as ``"tpu_dist"``,
the name Hugging Face Transformers and Ray Train use) and the multi-process launch helpers.

Importing this registers the backend names with ``torch.distributed`` (done when torchtpu loads)
and imports no JAX; the backend itself (``backend.py``) loads when a group is created.
"""

from __future__ import annotations

import torch.distributed as dist

from torchtpu.runtime.multiprocess import launch, launch_env

NAMES = ("tpu", "tpu_dist")


def _create(dist_backend_opts, backend_options=None):
    from torchtpu.distributed.backend import create

    return create(dist_backend_opts, backend_options)


def register() -> None:
    """Register the backend under both names, for ``tpu`` tensors (idempotent)."""
    if not dist.is_available():
        return
    for name in NAMES:
        if name in dist.Backend.backend_list:
            continue
        dist.Backend.register_backend(name, _create, extended_api=True, devices=["tpu"])


__all__ = ["NAMES", "launch", "launch_env", "register"]
