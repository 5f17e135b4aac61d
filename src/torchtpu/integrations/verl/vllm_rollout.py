"""VeRL's vLLM rollout replica on ``tpu``: VeRL's vLLM server, adapted to vLLM 0.33 in one call.

VeRL 0.9.1's vLLM server (``vLLMHttpServer``) is written against vLLM 0.24; torchtpu's vLLM
platform serves with vLLM 0.33. The two meet everywhere the recipe goes but one call: before
every weight sync VeRL's ``abort_all_requests`` calls
``AsyncLLM.pause_generation(wait_for_inflight_requests=False, clear_cache=...)``, and vLLM 0.33's
``pause_generation`` takes ``mode`` (``"abort"``, ``"wait"`` or ``"keep"``) instead of that flag.

VeRL looks its rollout replica class up by ``rollout.name`` in ``RolloutReplicaRegistry``, its
registry of rollout backends (``register(name, loader)``). torchtpu's VeRL platform module
(``platform.py``, imported through the ``verl.plugins`` entry point) puts a loader under ``vllm``
there that answers, when the process's VeRL platform is ``tpu``, with ``TpuvLLMReplica`` from
this module: VeRL's own ``vLLMReplica`` whose server actor is ``TpuvLLMHttpServer``, VeRL's own
``vLLMHttpServer`` with its engine handle seen through ``PauseModeEngine`` when the installed
vLLM's ``pause_generation`` has no ``wait_for_inflight_requests``. Everything else (the server's
launch, its submission gate, generation, the weight-sync protocol) is VeRL's code. On another
platform the loader answers with VeRL's ``vLLMReplica``.

Importing this module imports VeRL's vLLM server (and so vLLM): only the process that launches
the rollout does.
"""

from __future__ import annotations

import inspect
from typing import Any

import ray
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica


def takes_wait_flag(pause_generation) -> bool:
    """Whether an ``AsyncLLM.pause_generation`` takes VeRL's ``wait_for_inflight_requests``."""
    return "wait_for_inflight_requests" in inspect.signature(pause_generation).parameters


class PauseModeEngine:
    """A vLLM ``AsyncLLM`` as VeRL's vLLM server calls it: ``pause_generation`` with VeRL's
    ``wait_for_inflight_requests`` becomes vLLM's ``mode`` (``False``: ``"abort"``, the in-flight
    requests aborted, which VeRL asks before a weight sync; ``True``: ``"wait"``). Every other
    attribute is the engine's own."""

    def __init__(self, engine: Any):
        object.__setattr__(self, "_engine", engine)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._engine, name, value)

    async def pause_generation(self, *, wait_for_inflight_requests: bool | None = None, **kwargs) -> None:
        if wait_for_inflight_requests is not None:
            if "mode" in kwargs:
                raise TypeError("pause_generation: give wait_for_inflight_requests or mode, not both")
            kwargs["mode"] = "wait" if wait_for_inflight_requests else "abort"
        await self._engine.pause_generation(**kwargs)


class TpuvLLMHttpServer(vLLMHttpServer):
    """VeRL's vLLM server, its engine seen through ``PauseModeEngine`` where vLLM's
    ``pause_generation`` takes ``mode`` instead of ``wait_for_inflight_requests``."""

    async def run_server(self, args):
        await super().run_server(args)
        if not takes_wait_flag(self.engine.pause_generation):
            self.engine = PauseModeEngine(self.engine)


class TpuvLLMReplica(vLLMReplica):
    """VeRL's vLLM replica, launching ``TpuvLLMHttpServer`` actors."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(TpuvLLMHttpServer)
