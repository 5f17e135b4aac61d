"""Which backend a ``torch.compile`` graph gets: ``tpu`` graphs go to ours, the rest to Inductor.

``torch.compile(fn)`` with no backend uses dynamo's default backend, which we set to a router:
a graph with ``tpu`` tensors goes to the ``tpu`` backend, any other to Inductor exactly as before.
An explicit ``backend="inductor"`` given ``tpu`` tensors compiles them with the ``tpu`` backend too,
and logs one line saying so: libraries hard-code it (TorchTitan's ``--compile.enable``). torch 2.11
and 2.12 cannot set the default backend, so there Inductor itself hands graphs on tpu to the
``tpu`` backend (silently: the string cannot be told from torch.compile's default).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import logging
import sys
from typing import Any, Callable

import torch
from torch.fx import GraphModule

from torchtpu.runtime import compat


def on_tpu(gm: GraphModule, example_inputs) -> bool:
    """Whether the graph computes on ``tpu`` (an input, or a value it makes, is a tpu tensor)."""
    if any(isinstance(x, torch.Tensor) and x.device.type == "tpu" for x in example_inputs):
        return True
    for node in gm.graph.nodes:
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, torch.Tensor) and value.device.type == "tpu":
            return True
    return False


def default_backend(gm: GraphModule, example_inputs, *, mode: str | None = None,
                    options: dict[str, Any] | None = None) -> Callable:
    """torch.compile's default backend: ``tpu`` for graphs on tpu, Inductor otherwise."""
    if on_tpu(gm, example_inputs):
        from torchtpu.compile.backend import backend

        return backend(gm, example_inputs, mode=mode, options=_without_inductor_options(options))
    return _inductor(mode, options)(gm, example_inputs)


def _without_inductor_options(options: dict[str, Any] | None) -> dict[str, Any] | None:
    """The XLA options among ``options``: Inductor's own settings tune code Inductor would
    generate, which a graph on tpu never runs (libraries written for Inductor pass them,
    e.g. ``max_autotune``), so they are dropped rather than handed to XLA as unknown options."""
    if not options:
        return options
    inductor_keys = compat.inductor_config.get_config_copy().keys()
    return {k: v for k, v in options.items() if k not in inductor_keys}


def _inductor(mode, options) -> Callable:
    return compat.TorchCompileInductorWrapper(mode, options, None)


def _default_settable() -> bool:
    """Whether dynamo's default backend can be set: torch >= 2.13 (``set_default_backend``)."""
    return compat.set_default_backend is not None


def _guarded_inductor_call(original: Callable) -> Callable:
    def __call__(self, model_, inputs_):
        if on_tpu(model_, inputs_):
            # Inductor generates CPU/GPU kernels; a graph on tpu runs the tpu backend instead, with
            # Inductor's own settings dropped. Libraries hard-code backend="inductor" (TorchTitan's
            # --compile.enable), so refusing it would leave them eager. On torch 2.11/2.12 the string
            # also arrives for torch.compile(fn), so only an explicit choice (2.13+) is logged.
            from torchtpu.compile.backend import backend

            if _default_settable():
                _log_inductor_rerouted()
            return backend(model_, inputs_, options=_without_inductor_options(getattr(self, "config", None)))
        return original(self, model_, inputs_)

    __call__.__wrapped__ = original
    return __call__


@functools.cache
def _log_inductor_rerouted() -> None:
    """One line per process: an explicit ``backend="inductor"`` got a graph on tpu."""
    logging.getLogger("torchtpu.compile").warning(
        'torch.compile(backend="inductor") was given a graph on tpu: compiling it with the tpu '
        'backend instead (Inductor generates CPU/GPU kernels; its settings are ignored). '
        'backend="tpu" says so explicitly and takes XLA options.')


def set_default() -> bool:
    """Patch ``dynamo.default_backend`` (``torchtpu.patches``): torch.compile's default backend
    becomes the router (a default the user chose is kept; torch 2.11/2.12 cannot set it, and there
    the Inductor wrapper routes: ``_guarded_inductor_call``)."""
    if not _default_settable():
        return False
    if compat.get_default_backend() == "inductor":
        compat.set_default_backend(default_backend)
    return compat.get_default_backend() is default_backend


def reset_default() -> None:
    if _default_settable() and compat.get_default_backend() is default_backend:
        compat.set_default_backend(None)


def guard_inductor() -> bool:
    """Patch ``inductor.tpu_guard``: Inductor given tpu tensors hands the graph to the tpu backend
    (logging one line where the choice was explicit, torch >= 2.13)."""
    wrapper = compat.TorchCompileInductorWrapper
    if not hasattr(wrapper.__call__, "__wrapped__"):
        wrapper.__call__ = _guarded_inductor_call(wrapper.__call__)
    return True


def unguard_inductor() -> None:
    wrapper = compat.TorchCompileInductorWrapper
    original = getattr(wrapper.__call__, "__wrapped__", None)
    if original is not None:
        wrapper.__call__ = original


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a callback right after one module is imported (and leaves ``sys.meta_path``)."""

    def __init__(self, name: str, callback: Callable[[], None]):
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        exec_module, callback = spec.loader.exec_module, self.callback

        def exec_then_callback(module):
            exec_module(module)
            callback()

        spec.loader.exec_module = exec_then_callback
        return spec


def after_import(name: str, callback: Callable[[], None]) -> bool:
    """Run ``callback`` once ``name`` is imported: now if it already is (then False: no hook is left
    in ``sys.meta_path``), else through a finder that leaves ``sys.meta_path`` when it fires (True)."""
    if name in sys.modules:
        callback()
        return False
    sys.meta_path.insert(0, _AfterImport(name, callback))
    return True


def cancel_after_import(name: str) -> None:
    """Remove the finders still waiting for ``name``."""
    sys.meta_path[:] = [f for f in sys.meta_path if not (isinstance(f, _AfterImport) and f.name == name)]
