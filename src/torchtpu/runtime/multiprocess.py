"""Multi-process start-up: one process per device, as PyTorch runs on CUDA under ``torchrun``.

Under a launcher that sets ``WORLD_SIZE`` > 1 (torchrun, ``torch.multiprocessing`` with the
same variables, a TPU pod's launcher), each process drives exactly one device, and JAX's
multi-process runtime (``jax.distributed``) joins the processes so that one XLA program can run
collectives across all of their devices. ``jax.distributed.initialize`` must come before any
other JAX call, so ``state.start()`` calls ``initialize()`` here before it asks for devices.

What each process reads (all set by torchrun):

* ``RANK`` / ``WORLD_SIZE``: this process's id and the number of processes (JAX's
  ``process_id`` / ``num_processes``);
* ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``: its index among the processes of this host. Its device
  is ``tpu:LOCAL_RANK``, the index a CUDA script passes to ``set_device``; the other indices of
  the host belong to the other processes;
* the coordinator of ``jax.distributed``: ``TORCHTPU_COORDINATOR`` (``host:port``) if set, else
  ``MASTER_ADDR`` and the port after ``MASTER_PORT`` (torch's own store holds ``MASTER_PORT``).

``TORCHTPU_DISTRIBUTED=0`` turns this off (each process then runs alone, as before).

A rank that fails exits at once. At exit JAX waits, up to five minutes, until every process
reaches its shutdown barrier; a rank killed by an uncaught exception would wait there for ranks
that are blocked in a collective with it, and the launcher, which ends the job when one rank
exits, would wait too. So after an uncaught exception this process skips that barrier
(``install_excepthook``); the other ranks then see the failure and the launcher stops them.

This module imports no JAX at import time.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import Callable

from torchtpu import patches
from torchtpu.config import config

# What runtime/state.py (above this module: it starts the runtime, calling ``initialize`` here)
# tells this module, bound when state is imported: whether the runtime has started, and the
# device guard's update after a launch is declared.
_runtime_started: Callable[[], bool] = lambda: False
_layout_changed: Callable[[], None] = lambda: None


def bind_state(started: Callable[[], bool], layout_changed: Callable[[], None]) -> None:
    global _runtime_started, _layout_changed
    _runtime_started, _layout_changed = started, layout_changed

_initialized = False
_joined: Launch | None = None
_declared: Launch | None = None  # set by ``declare`` (a serving engine's rank process), else None


@dataclass(frozen=True)
class Launch:
    """This process's place in a multi-process launch."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    coordinator: str = ""  # host:port, chosen once when the process joins (``initialize``)


def _int_env(name: str, default: int | None = None) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def coordinator_address() -> str:
    """``host:port`` of the ``jax.distributed`` coordinator (run by the process of rank 0).

    ``TORCHTPU_COORDINATOR`` if set. Under torchrun (whose agent serves the store at
    ``MASTER_ADDR:MASTER_PORT`` from the start), rank 0 picks a free port and publishes it in that
    store for this run; otherwise the port after ``MASTER_PORT``, checked free on rank 0 (a busy
    port would crash the coordinator instead of raising).
    """
    if config.coordinator:
        return config.coordinator
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = _int_env("MASTER_PORT")
    if port is None:
        raise RuntimeError(
            "tpu: WORLD_SIZE > 1 but neither TORCHTPU_COORDINATOR nor MASTER_PORT is set; launch with "
            "torchrun, or set TORCHTPU_COORDINATOR=host:port (a free port on the host of rank 0)")
    rank = _int_env("RANK", 0)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return f"{addr}:{_port_from_store(addr, port, rank)}"
    if rank == 0 and not _port_free(port + 1):
        raise RuntimeError(
            f"tpu: the jax.distributed coordinator port {port + 1} (MASTER_PORT + 1) is in use on this host; "
            f"set TORCHTPU_COORDINATOR=host:port to a free port, or choose another MASTER_PORT")
    return f"{addr}:{port + 1}"


def _port_free(port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port free on this host now (the operating system's choice)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _port_from_store(addr: str, port: int, rank: int) -> int:
    """The coordinator port for this run: chosen free by rank 0, read from torchrun's store."""
    import datetime

    import torch.distributed as dist

    key = (f"torchtpu/coordinator/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/"
           f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    store = dist.TCPStore(addr, port, is_master=False, timeout=datetime.timedelta(seconds=config.distributed_timeout))
    if rank == 0:
        chosen = free_port()
        store.set(key, str(chosen))
        return chosen
    return int(store.get(key))


def launch() -> Launch | None:
    """This process's launch, or None when it runs alone (no ``WORLD_SIZE`` > 1, or
    ``TORCHTPU_DISTRIBUTED=0``). A launch given to ``declare`` wins over the environment."""
    if _declared is not None:
        return _declared
    world = _int_env("WORLD_SIZE", 1)
    if world <= 1 or not config.distributed:
        return None
    rank = _int_env("RANK")
    if rank is None:
        raise RuntimeError("tpu: WORLD_SIZE > 1 but RANK is not set; launch with torchrun")
    local_rank = _int_env("LOCAL_RANK", 0)
    local_world = _int_env("LOCAL_WORLD_SIZE", None) or (world if local_rank == rank else local_rank + 1)
    return Launch(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world)


def declare(rank: int, world_size: int, local_rank: int, local_world_size: int, coordinator: str) -> None:
    """Make this process rank ``rank`` of a ``world_size``-process launch, owning
    ``tpu:local_rank``, before the runtime starts: for launchers that pass ranks as arguments
    rather than torchrun's variables (a serving engine starting one process per tensor-parallel
    rank). ``coordinator`` is the ``jax.distributed`` coordinator's ``host:port``, the same in
    every process (served by rank 0).

    A process whose runtime has started cannot join any more: if it already runs as this
    launch, nothing happens; otherwise RuntimeError.
    """
    global _declared
    if not 0 <= rank < world_size or not 0 <= local_rank < local_world_size:
        raise ValueError(f"tpu: rank {rank} of {world_size}, local rank {local_rank} of {local_world_size} "
                         f"is not a valid place in a launch")
    if not coordinator:
        raise ValueError("tpu: a multi-process launch needs the jax.distributed coordinator's host:port")
    info = Launch(rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world_size,
                  coordinator=coordinator)
    if _runtime_started():
        current = dataclasses.replace(_joined, coordinator=coordinator) if _joined else None
        if current == info:
            return
        raise RuntimeError(
            f"tpu: this process cannot become rank {rank} of {world_size}: its tpu runtime has already "
            f"started ({'as rank %d of %d' % (_joined.rank, _joined.world_size) if _joined else 'alone'}). "
            f"The launch must be declared before the first tpu op.")
    _declared = info
    _layout_changed()  # the device guard learns the host's device count (one per local process)


def joined() -> Launch | None:
    """The launch this process joined (with its coordinator), or None before ``initialize``."""
    return _joined


def _current() -> Launch | None:
    """The launch this process joined (fixed once joined), else as the environment says now."""
    return _joined if _initialized else launch()


def active() -> bool:
    """Whether this process runs as one of several (``jax.distributed`` is or will be joined)."""
    return _initialized or launch() is not None


def local_rank() -> int:
    """This process's device index on its host (0 when it runs alone)."""
    info = _current()
    return info.local_rank if info else 0


def local_world_size() -> int:
    info = _current()
    return info.local_world_size if info else 1


def launch_env(local_rank: int, local_world_size: int, platform: str | None = None) -> dict[str, str]:
    """The environment one process of a ``local_world_size``-process launch on a host needs so
    that it owns exactly one device (``local_rank``), before JAX starts.

    * TPU: libtpu's chip-visibility variables (each process sees one chip; the processes of the
      host find each other through ``TPU_PROCESS_ADDRESSES``);
    * GPU: nothing here (``initialize`` passes ``local_device_ids``), unless
      ``CUDA_VISIBLE_DEVICES`` is already set by the user;
    * CPU: nothing (each process has one host device).
    """
    platform = platform or _guess_platform()
    if platform != "tpu" or local_world_size <= 1:
        return {}
    base_port = 8476
    return {
        "TPU_VISIBLE_CHIPS": str(local_rank),
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        "TPU_PROCESS_BOUNDS": f"{local_world_size},1,1",
        "TPU_PROCESS_ADDRESSES": ",".join(f"localhost:{base_port + i}" for i in range(local_world_size)),
        "TPU_PROCESS_PORT": str(base_port + local_rank),
        "CLOUD_TPU_TASK_ID": str(local_rank),
    }


def _guess_platform() -> str:
    if config.platform:
        return config.platform
    import importlib.util

    return "tpu" if importlib.util.find_spec("libtpu") is not None else "other"


def initialize() -> Launch | None:
    """Join ``jax.distributed`` for this process's launch (once; before any other JAX call).

    Returns the launch, or None when this process runs alone.
    """
    global _initialized, _joined
    if _initialized:
        return _joined
    info = launch()
    if info is None:
        return None
    # Chosen once: under torchrun rank 0 picks a fresh port each time it is asked.
    if not info.coordinator:
        info = dataclasses.replace(info, coordinator=coordinator_address())
    for name, value in launch_env(info.local_rank, info.local_world_size).items():
        os.environ.setdefault(name, value)
    import jax

    kwargs = {}
    if _guess_platform() not in ("tpu", "cpu") and "CUDA_VISIBLE_DEVICES" not in os.environ:
        kwargs["local_device_ids"] = [info.local_rank]
    try:
        jax.distributed.initialize(coordinator_address=info.coordinator, num_processes=info.world_size,
                                   process_id=info.rank, initialization_timeout=config.distributed_timeout,
                                   **kwargs)
    except RuntimeError as exc:
        if "before any JAX" in str(exc) or "must be called before" in str(exc):
            raise RuntimeError(
                "tpu: jax.distributed must start before any other JAX call, but JAX was already used "
                "in this process. Under torchrun, let torchtpu start first (do not call JAX before the "
                "first tpu op), or set TORCHTPU_DISTRIBUTED=0 to run each process alone.") from exc
        raise RuntimeError(
            f"tpu: could not join the {info.world_size}-process runtime as rank {info.rank} through the "
            f"coordinator {info.coordinator} ({exc}). Check that every rank was launched and that the "
            f"port is free (TORCHTPU_COORDINATOR=host:port chooses another)") from exc
    _joined, _initialized = info, True
    patches.apply("multiprocess.excepthook")
    return info


_previous_excepthook = None


def install_excepthook() -> bool:
    """Patch ``multiprocess.excepthook`` (``torchtpu.patches``): after an uncaught exception, leave
    without JAX's exit-time shutdown barrier (see above)."""
    global _previous_excepthook
    try:  # JAX's atexit handler: the barrier, then teardown
        from torchtpu.runtime.compat import jax_exit_clean_up as clean_up
    except ImportError:  # a JAX without it: keep its exit as it is
        return False
    previous = _previous_excepthook = sys.excepthook

    def excepthook(kind, value, tb):
        previous(kind, value, tb)  # the traceback, as without us
        atexit.unregister(clean_up)
        print(f"tpu: rank {_joined.rank} failed; it exits without waiting for the other ranks",
              file=sys.stderr, flush=True)

    sys.excepthook = excepthook
    return True


def uninstall_excepthook() -> None:
    global _previous_excepthook
    if _previous_excepthook is not None:
        sys.excepthook, _previous_excepthook = _previous_excepthook, None
