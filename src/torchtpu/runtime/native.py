"""Builds and loads torchtpu's small C++ extension: the PrivateUse1 hooks, the device allocator
and the device guard (``csrc/hooks.cpp``), which give ``tpu`` what PyTorch reaches only from C++:
pinned host memory, ``torch.Generator("tpu")``, ``UntypedStorage.resize_``, torch.accelerator's
memory statistics and ``synchronize``; and ``torch.autocast("tpu")``'s kernels
(``csrc/autocast.cpp``: PyTorch's CUDA cast policy, registered by ``register_autocast``).

Contract:

* ``load()`` returns the extension module, or ``None`` when it cannot be built or loaded (no
  compiler, no headers, ...); no exception escapes, and ``unavailable_reason()`` then says why
  in one line. The outcome is kept for the rest of the process.
* The build lives in ``<cache_dir>/ext/<torch version>-<python tag>-<source hash>`` and the
  module's name carries the same tag, so two torch versions (or two sources) never share a build.
* Concurrent first builds are serialised by a kernel lock (``flock`` on ``build.lock``), which
  dies with its holder: a killed builder cannot leave a lock that hangs the others, and a waiter
  gives up after ``_LOCK_TIMEOUT_S``. A failed build is remembered for ``_RETRY_AFTER_S`` (delete
  its ``.failed`` file to retry at once), so a machine without a compiler does not pay for a
  build attempt at every ``import torch``.
* Fast path: once built, the ``.so`` is loaded directly through importlib, without importing
  ``torch.utils.cpp_extension`` (about 0.1 s); this runs during ``import torch``.
* ``register_hooks`` registers the C++ hooks, which REPLACE the Python hooks object (and the
  Python device guard): PyTorch takes PrivateUse1 hooks only once per process, so call it
  instead of ``torch._C._acc.register_python_privateuseone_hook``, never after it. Its argument
  answers what needs Python, one function per question, called by name when a hook needs it
  (``torchtpu.device.hooks`` lists them).
* Without the extension those features raise PyTorch's own errors: its Python hooks object
  cannot reach them, so the warning given then (``device/registration.py``) names them.

This module imports nothing from torchtpu but ``torchtpu.config``, and never jax.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from types import ModuleType

from torchtpu.config import config

_CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")
# hooks.cpp: the hooks, allocator and guard; autocast.cpp: the autocast policy (ATen's heavy
# headers, so a translation unit of its own, compiled in parallel)
# eager.cpp: the native eager kernel (eager/native.py)
_SOURCES = [os.path.join(_CSRC, name) for name in ("hooks.cpp", "autocast.cpp", "eager.cpp")]
_CFLAGS = ["-O2"]
_LIB_EXT = ".pyd" if os.name == "nt" else ".so"
_LOCK_TIMEOUT_S = 600.0  # the longest wait for another process's build
_RETRY_AFTER_S = 3600.0  # a failed build is retried after this long

_lock = threading.Lock()
_module: ModuleType | None = None
_reason: str | None = None
_tried = False
_registered = False
_autocast = False


class _Failure(Exception):
    """A build failure, already reduced to its one-line reason."""


def _one_line(exc: BaseException) -> str:
    """An exception as a one-line reason."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    return (text if isinstance(exc, _Failure) else f"{type(exc).__name__}: {text}")[:500]


def _build_error(exc: Exception, build_dir: str) -> str:
    """The useful line of a failed build: ninja's output echoes long command lines first."""
    import re

    text = str(exc)
    if not text.startswith("Error building extension"):
        return f"the C++ hooks could not be built: {_one_line(exc)}"
    lines = [line.strip() for line in text.splitlines()[1:] if line.strip()]
    output = [line for line in lines
              if not line.startswith(("FAILED:", "ninja:")) and "-DTORCH_EXTENSION_NAME" not in line]
    detail = next((line for line in output if re.search(r"error|not found|no such file", line, re.I)),
                  output[0] if output else "see the log")
    return f"the C++ hooks failed to build: {detail} (full log: ninja -C {build_dir})"


def _location() -> tuple[str, str]:
    """The extension's (module name, build directory) for this torch, Python and source."""
    import hashlib

    import torch

    digest = hashlib.sha256(repr(_CFLAGS).encode())
    for source in _SOURCES:
        with open(source, "rb") as f:
            digest.update(f.read())
    digest = digest.hexdigest()[:16]
    tag = f"{torch.__version__}-{sys.implementation.cache_tag}-{digest}"
    name = "torchtpu_hooks_" + "".join(c if c.isalnum() else "_" for c in tag)
    return name, os.path.join(config.cache_dir, "ext", tag)


def _import(name: str, path: str) -> ModuleType:
    """Load a built extension file directly (what cpp_extension does, without importing it)."""
    from importlib.machinery import ExtensionFileLoader
    from importlib.util import module_from_spec, spec_from_file_location

    loader = ExtensionFileLoader(name, path)
    module = module_from_spec(spec_from_file_location(name, path, loader=loader))
    loader.exec_module(module)
    return module


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


class _BuildLock:
    """An exclusive ``flock`` on a file: the kernel drops it if its holder dies."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = -1

    def __enter__(self) -> "_BuildLock":
        import fcntl

        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + _LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise _Failure(f"gave up after {_LOCK_TIMEOUT_S:.0f} s waiting for another process "
                                   f"building the C++ hooks (it holds {self.path})") from None
                time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)  # closing the descriptor drops the flock


def _cpp_load(name: str, build_dir: str) -> ModuleType:
    """cpp_extension.load, without its warnings (CUDA_HOME, compiler ABI) on stderr."""
    import logging
    import shutil

    if shutil.which("ninja") is None:  # the pip package's binary, when its bin/ is not on PATH
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except (ImportError, AttributeError):
            pass  # cpp_extension then says that ninja is missing
    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)  # a failure still reaches the reason
    try:
        from torch.utils import cpp_extension

        return cpp_extension.load(name=name, sources=_SOURCES, extra_cflags=_CFLAGS,
                                  build_directory=build_dir, verbose=False)
    finally:
        log.setLevel(level)


def _build(name: str, build_dir: str, so: str, ok: str, damaged: bool) -> ModuleType:
    """Build (or wait for another process's build) under the lock, then load; raises on failure."""
    os.makedirs(build_dir, exist_ok=True)
    with _BuildLock(os.path.join(build_dir, "build.lock")):
        if not damaged and os.path.exists(ok) and os.path.exists(so):  # built while we waited
            return _import(name, so)
        # Without its marker the .so may be half-linked (its builder was killed), which ninja
        # could take as up to date: delete it, forcing the (cheap) link step.
        _remove(ok)
        _remove(so)
        # Only the holder of our flock runs cpp_extension here, so a "lock" file it left is
        # stale: older torch used a lock file that a killed builder never removed, hanging every
        # later build; torch 2.14 flocks it, and removing it while nobody holds it is harmless.
        _remove(os.path.join(build_dir, "lock"))
        failed = os.path.join(build_dir, name + ".failed")
        try:
            module = _cpp_load(name, build_dir)
        except Exception as exc:
            reason = _build_error(exc, build_dir)
            with open(failed, "w") as f:
                f.write(reason)
            raise _Failure(reason) from exc
        # The marker says the .so is complete: the fast path never loads a half-linked file.
        with open(ok + ".tmp", "w") as f:
            f.write(so)
        os.replace(ok + ".tmp", ok)
        _remove(failed)
        return module


def _load() -> ModuleType:
    """The module: the cached build if there is one, else a remembered failure, else a build."""
    name, build_dir = _location()
    so = os.path.join(build_dir, name + _LIB_EXT)
    ok = os.path.join(build_dir, name + ".ok")
    damaged = False
    if os.path.exists(ok) and os.path.exists(so):
        try:
            return _import(name, so)  # the fast path
        except Exception:
            damaged = True  # rebuild it below
    failed = os.path.join(build_dir, name + ".failed")
    try:
        if time.time() - os.path.getmtime(failed) < _RETRY_AFTER_S:
            with open(failed) as f:
                raise _Failure(f"{f.read().strip()} [remembered; delete {failed} to retry now]")
    except OSError:
        pass
    return _build(name, build_dir, so, ok, damaged)


def load() -> ModuleType | None:
    """The hooks extension, built on first use; None if it cannot be had (see unavailable_reason)."""
    global _module, _reason, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                _module = _load()
            except Exception as exc:
                _module, _reason = None, _one_line(exc)
        return _module


def unavailable_reason() -> str | None:
    """Why load() returned None or register_hooks() returned False, in one line; else None."""
    return _reason


def register_hooks(callbacks: object) -> bool:
    """Register the C++ PrivateUse1 hooks (and allocator, guard) in place of the Python ones, with
    ``callbacks`` answering what needs Python; True if they are now registered."""
    global _reason, _registered
    module = load()
    if module is None:
        return False
    try:
        module.register_hooks(callbacks)
    except Exception as exc:  # hooks already registered by someone else
        _reason = _one_line(exc)
        return False
    _registered = True
    return True


def register_autocast() -> bool:
    """Register PyTorch's CUDA autocast policy for ``tpu`` (``csrc/autocast.cpp``); True if it is
    now registered (False: no extension, or another library holds AutocastPrivateUse1: see
    ``unavailable_reason``)."""
    global _reason, _autocast
    module = load()
    if module is None:
        return False
    try:
        module.register_autocast()
    except Exception as exc:
        _reason = f"the autocast kernels could not be registered: {_one_line(exc)}"
        return False
    _autocast = True
    return True


def autocast_registered() -> bool:
    """Whether ``torch.autocast("tpu")`` has its kernels (``register_autocast`` succeeded)."""
    return _autocast


def registered() -> bool:
    """Whether this process uses the C++ hooks (``register_hooks`` succeeded)."""
    return _registered


def guard() -> ModuleType | None:
    """The extension when its device guard holds the current device (the C++ hooks are
    registered), else None: ``runtime.state`` keeps the current device itself then."""
    return _module if _registered else None


def pinned_bytes() -> int:
    """Bytes of pinned host memory now allocated by the tpu hooks (0 if the extension is not loaded)."""
    module = _module
    return 0 if module is None else int(module.pinned_bytes())
