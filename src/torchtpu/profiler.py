"""Device and host traces through JAX's profiler, viewable in TensorBoard, XProf or Perfetto.

``trace(logdir)`` records XLA's device activity and JAX's own host spans (tracing, lowering,
``backend_compile_and_load``, executions) plus torchtpu's spans: one per eager op dispatched
(``dispatch aten.add.Tensor``), one per CPU fallback (``cpu_fallback aten.foo``), and one per
``torch.profiler.record_function`` block, under its own name. The op spans are opened by the one
place every eager op runs (``modes.execute``: eager and ``_foreach_*`` kernels alike, so an
optimizer step has its span) when ``modes.tracing`` is set, which only a running trace does: the
eager path pays one flag check per op otherwise.

The trace lands in ``logdir/plugins/profile/<run>/<host>.xplane.pb`` (TensorBoard/XProf) and
``<host>.trace.json.gz`` (Chrome trace format: Perfetto opens it; ``trace_events`` reads it).
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import json
import os
import threading
from typing import Any, Iterator

import jax
import torch
from jax.profiler import TraceAnnotation

from torchtpu import patches
from torchtpu.eager import modes

annotate = TraceAnnotation
"""``with annotate("name"):`` marks a host span in the running trace (nearly free when none runs)."""

active = False
"""True while ``trace`` records."""

_lock = threading.Lock()


_saved_record_function: dict[str, Any] = {}


def patch_record_function() -> bool:
    """Patch ``profiler.record_function`` (``torchtpu.patches``, for a trace's duration):
    ``record_function.__enter__/__exit__`` also open and close a JAX span of the same name."""
    cls = torch.autograd.profiler.record_function
    enter, exit_ = cls.__dict__["__enter__"], cls.__dict__["__exit__"]
    _saved_record_function.update(__enter__=enter, __exit__=exit_)

    def __enter__(self):
        result = enter(self)
        self._torchtpu_span = TraceAnnotation(self.name)
        self._torchtpu_span.__enter__()
        return result

    def __exit__(self, exc_type, exc_value, tb):
        span = self.__dict__.pop("_torchtpu_span", None)
        if span is not None:
            span.__exit__(exc_type, exc_value, tb)
        return exit_(self, exc_type, exc_value, tb)

    cls.__enter__, cls.__exit__ = __enter__, __exit__
    return True


def unpatch_record_function() -> None:
    cls = torch.autograd.profiler.record_function
    for name, value in _saved_record_function.items():
        setattr(cls, name, value)
    _saved_record_function.clear()


@contextlib.contextmanager
def trace(logdir: str | os.PathLike, *, perfetto: bool = False, python_tracer: bool = False,
          host_tracer_level: int = 2) -> Iterator[str]:
    """Record a device and host trace of the block into ``logdir``; yields ``logdir``.

    ``perfetto=True`` also writes ``perfetto_trace.json.gz`` for ui.perfetto.dev.
    ``python_tracer=True`` adds a span per Python function call (large, slow to write).
    Pending device work is waited for before the trace stops, so the block's ops are in it.
    """
    global active
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 1 if python_tracer else 0
    options.host_tracer_level = host_tracer_level
    with _lock:
        if active:
            raise RuntimeError("a torchtpu.profiler.trace is already running; traces cannot nest")
        active = True
    try:
        jax.profiler.start_trace(str(logdir), create_perfetto_trace=perfetto, profiler_options=options)
        try:
            modes.tracing = True  # eager ops and CPU fallbacks open their spans
            patches.apply("profiler.record_function")
            try:
                yield str(logdir)
                _synchronize()
            finally:
                patches.undo("profiler.record_function")
                modes.tracing = False
        finally:
            jax.profiler.stop_trace()
    finally:
        active = False


def _synchronize() -> None:
    if hasattr(torch, "tpu"):
        torch.tpu.synchronize()


def trace_files(logdir: str | os.PathLike, suffix: str = ".trace.json.gz") -> list[str]:
    """The trace files under ``logdir`` ending in ``suffix``, oldest run first."""
    pattern = os.path.join(str(logdir), "plugins", "profile", "*", "*" + suffix)
    return sorted(glob.glob(pattern), key=os.path.getmtime)


def trace_events(logdir: str | os.PathLike) -> list[dict[str, Any]]:
    """The complete events (spans) of the latest trace in ``logdir``: dicts with name, ts, dur, pid, tid."""
    files = trace_files(logdir)
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz under {logdir}/plugins/profile: was a trace recorded there?")
    with gzip.open(files[-1], "rt") as fp:
        events = json.load(fp)["traceEvents"]
    return [e for e in events if e.get("ph") == "X"]
