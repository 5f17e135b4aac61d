"""Device state: whether the device is there, how many there are, which one is current, and
starting the runtime.

Importing this module imports no JAX and starts nothing: ``import torch`` registers the ``tpu``
device through it. The runtime (JAX and its PJRT client) starts at first use, as CUDA does:
``start()`` is called by the first op on a ``tpu`` tensor and by the ``torch.tpu`` functions that
need devices. The layers above say what else must happen then through ``on_start`` (the eager
layer registers its kernels there), so this module never imports them.

Fork safety: a child forked after the runtime started cannot use it (the PJRT client's threads
do not survive ``fork``). The child gets a clear error on its first ``tpu`` op, as CUDA's
"Cannot re-initialize CUDA in forked subprocess"; a child that does not touch ``tpu`` (a
DataLoader worker) is unaffected.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import threading
import warnings
from typing import Any, Callable

from torchtpu.config import config
from torchtpu.runtime import multiprocess, native

_local = threading.local()
_lock = threading.RLock()
_started = False
_starting = False
_bad_fork = False
_on_start: list[Callable[[], None]] = []
_on_fork_child: list[Callable[[], None]] = []

BAD_FORK_MESSAGE = (
    "Cannot re-initialize tpu in forked subprocess. The tpu runtime was started before this "
    "process was forked; to use tpu with multiprocessing, use the 'spawn' start method "
    "(torch.multiprocessing.set_start_method('spawn'), or multiprocessing_context='spawn' for a "
    "DataLoader).")


def started() -> bool:
    """Whether the runtime has started in this process."""
    return _started


def in_bad_fork() -> bool:
    """Whether this process was forked after its parent started the runtime."""
    return _bad_fork


def on_start(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the runtime starts (now, if it has)."""
    _on_start.append(callback)
    if _started:
        callback()


def on_fork_child(callback: Callable[[], None]) -> None:
    """Run ``callback`` in a child forked after the runtime started."""
    _on_fork_child.append(callback)


def start() -> None:
    """Start the runtime (JAX, the PJRT client, then every ``on_start`` callback) once."""
    global _started, _starting
    if _started:
        return
    if _bad_fork:
        raise RuntimeError(BAD_FORK_MESSAGE)
    with _lock:
        if _started or _starting:  # _starting: a callback used the device while starting
            return
        _starting = True
        try:
            import jax

            # torch's int64/float64 semantics need JAX's 64-bit mode (see docs/design.md).
            jax.config.update("jax_enable_x64", True)
            # A fork after this point warns in JAX ("JAX is multithreaded ... deadlock"); a child
            # that touches tpu gets our error instead (see the module docstring), and DataLoader
            # workers that never touch it are safe, as they are under CUDA.
            warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
            from torchtpu.runtime import pjrt

            multiprocess.initialize()  # before any other JAX call (a no-op for a lone process)
            with _cpu_compile_flags():
                pjrt.devices()
            for callback in list(_on_start):
                callback()
            _started = True
            sync_guard()
        finally:
            _starting = False


# XLA:CPU compiles a small program (an eager op's) in about half the time with its elemental fusion
# emitters than with the MLIR-based ones that are its default, and the code runs about as fast
# (``benchmarks/first_call.py``); a fresh machine's test suite is mostly such first compiles.
CPU_COMPILE_FLAGS = ("--xla_cpu_use_fusion_emitters=false",)
_FLAGS_KNOWN = ((0, 10, 1), (0, 11))  # the jaxlib releases whose XLA has them (pyproject's range)


@contextlib.contextmanager
def _cpu_compile_flags():
    """``CPU_COMPILE_FLAGS`` in ``XLA_FLAGS`` while the PJRT clients start, which is when XLA
    reads it (once per process); restored after, so child processes do not inherit them. Not
    with ``TORCHTPU_CPU_FAST_COMPILE=0``, where the user's ``XLA_FLAGS`` names them, or with a
    jaxlib outside the tested range (XLA aborts on a flag it does not know)."""
    import jaxlib

    before = os.environ.get("XLA_FLAGS")
    version = tuple(int(p) for p in re.findall(r"\d+", jaxlib.__version__)[:3])
    flags = [f for f in CPU_COMPILE_FLAGS if f.split("=")[0] not in (before or "")]
    if not config.cpu_fast_compile or not flags or not _FLAGS_KNOWN[0] <= version < _FLAGS_KNOWN[1]:
        yield
        return
    os.environ["XLA_FLAGS"] = " ".join([before or "", *flags]).strip()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = before


def _after_fork_in_child() -> None:
    global _bad_fork, _started
    if not _started:
        return
    _bad_fork = True
    _started = False
    for callback in _on_fork_child:
        callback()


os.register_at_fork(after_in_child=_after_fork_in_child)


# ---------------------------------------------------------------- availability and count

def _accelerator_plugin_installed() -> bool:
    """Whether JAX may find a TPU or GPU (a PJRT plugin is installed); cheap, starts nothing."""
    if importlib.util.find_spec("libtpu") is not None:
        return True
    spec = importlib.util.find_spec("jax_plugins")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            try:
                if any(not name.startswith(("_", ".")) for name in os.listdir(location)):
                    return True
            except OSError:
                continue
    return False


_CPU_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def _cpu_device_count() -> int:
    match = _CPU_COUNT_FLAG.search(os.environ.get("XLA_FLAGS", ""))
    if match:
        return int(match.group(1))
    return int(os.environ.get("JAX_NUM_CPU_DEVICES", "1") or 1)


def _count_without_start() -> int | None:
    """The device count when the platform can say it without starting (XLA:CPU), else None."""
    if config.platform == "cpu" or (not config.platform and not _accelerator_plugin_installed()):
        return _cpu_device_count()
    return None


def is_available() -> bool:
    """True when at least one device can back ``tpu`` (XLA:CPU always can unless another
    platform is forced with ``TORCHTPU_PLATFORM``)."""
    if not _started and config.platform in ("", "cpu"):
        return True
    try:
        return device_count() > 0
    except RuntimeError:
        return False


def device_count() -> int:
    """How many ``tpu:N`` devices there are (without starting the runtime where possible).

    Under a multi-process launch this counts the host's devices, one per local process, as
    ``torch.cuda.device_count()`` does under torchrun; this process owns ``tpu:LOCAL_RANK``.
    """
    if multiprocess.active():
        return multiprocess.local_world_size()
    if not _started:
        count = _count_without_start()
        if count is not None:
            return count
        start()
    from torchtpu.runtime import pjrt

    return len(pjrt.devices())


# ---------------------------------------------------------------- the current device

def current_device() -> int:
    """The index of the current ``tpu`` device of this thread: by default ``tpu:0``, or under a
    multi-process launch this process's own device, ``tpu:LOCAL_RANK``. With the C++ hooks the
    device guard holds it, so PyTorch (``.to("tpu")``, autograd's threads) sees the same one."""
    module = native.guard()
    if module is not None:
        return module.current_device()
    index = getattr(_local, "index", None)
    if index is None:
        index = _local.index = multiprocess.local_rank()
    return index


def sync_guard() -> None:
    """Tell the C++ device guard the process's default device and the device count (at
    registration, and again once the runtime has started and knows the count)."""
    module = native.guard()
    if module is None:
        return
    count = _count_without_start() if not _started and not multiprocess.active() else None
    if count is None:
        count = device_count() if (_started or multiprocess.active()) else 1
    module.set_device_layout(multiprocess.local_rank(), count)


def device_index(device: Any = None) -> int:
    """The ``tpu`` device index meant by ``device``: an int, a ``torch.device``, a string such
    as ``"tpu:1"``, or None / a bare ``"tpu"`` for the current device."""
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    import torch

    device = torch.device(device)
    if device.type != "tpu":
        raise ValueError(f"Expected a tpu device, but got: {device}")
    return current_device() if device.index is None else device.index


def check_index(index: int) -> int:
    """``index`` if ``tpu:index`` exists, else PyTorch's invalid-ordinal error."""
    count = device_count()
    if not 0 <= index < count:
        raise RuntimeError(f"Invalid device ordinal tpu:{index}: {count} device(s) are available")
    return index


def set_device(device: Any) -> None:
    """Make ``device`` the current ``tpu`` device of this thread."""
    index = _local.index = check_index(device_index(device))
    module = native.guard()
    if module is not None:
        module.set_current_device(index)


multiprocess.bind_state(started, sync_guard)  # multiprocess is below this module: it asks through these
