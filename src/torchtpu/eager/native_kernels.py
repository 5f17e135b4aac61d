"""The native eager path: which ops run through the C++ kernel (``csrc/eager.cpp``), and its switch.

An eligible op gets two kernels: the C++ one on ``tpu``'s key (PrivateUse1), and its Python
kernel (``eager/dispatch.py``, the reference) on PrivateUse2, which the C++ kernel redispatches to
for whatever it does not run itself: first calls (it learns each call signature's program from
the Python kernel's run), capture, launch-blocking, dtype-viewed storages, errors. In
DEFER_AND_FUSE a known call is recorded by the C++ kernel (the executor's ``call``, as the Python
kernel records it). See the C++ file's header for the per-call work.

Eligible: a functional ``dispatch.Kernel`` (or its in-place variant) whose arguments are tensors,
tensor lists, numbers, static values (no index lists) and a factory's ``device`` (a ``tpu`` one:
its index, or the current device, is part of the key and the outputs' device when no tensor gives
one), returning one tensor or a tuple of them, whose program runs under ``jax.jit`` (not
data-dependent), draws no random numbers (device-side index checks are kept as the Python kernel
keeps them: the program's code goes to ``checks.defer``), and whose PyTorch
argument checks (``argument_errors.CHECKS``) look only at arguments with defaults (the C++ kernel
leaves a call with a non-default one to Python).

``TORCHTPU_NATIVE_EAGER=0`` (or ``set_enabled(False)``) sends every call to the Python kernels.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from torchtpu import metrics
from torchtpu.config import config
from torchtpu.device import bridge
from torchtpu.eager import argument_errors, dispatch, fused, modes
from torchtpu.ops import checks, precision
from torchtpu.runtime import compat, execution, native
from torchtpu.runtime.dtypes import TORCH_TO_JAX

_KIND = {dispatch._TENSOR: 0, dispatch._LIST: 1, dispatch._SCALAR: 3, dispatch._STATIC: 4}
_DEVICE = 5  # a factory's ``device``: static, and its outputs' device when no tensor gives one
_module = None  # the extension, once set up
REGISTERED: list = []  # the ops with a native kernel


def _setup():
    """The extension with the native kernel's references set, or None (no extension)."""
    global _module
    if _module is not None:
        return _module
    module = native.load()
    if module is None or not hasattr(module, "native_eager_setup"):
        return None
    module.native_eager_setup({
        "array_type": compat.ArrayImpl,
        "laid_out_type": dispatch._LaidOut,
        "override_var": execution._override,
        "execution_globals": vars(execution),
        "never": modes._AT_ONCE[modes.EagerMode.DEFER_NEVER],
        "bridge_globals": vars(bridge),
        "modes_globals": vars(modes),
        "precision_globals": vars(precision),
        "matmul_setting": precision._torch_setting,
        "scalar": dispatch._scalar,
        "host_scalar": dispatch._host_scalar,
        "op_counts": metrics.ops,
        "write_back": write_back,
        "wrap_laid_out": dispatch.wrap_laid_out,
        "defer_check": checks.defer,
        "deferred_type": fused.Deferred,
        "recording_executor": _recording_executor,
        "dtypes": [(t, np.dtype(j)) for t, j in TORCH_TO_JAX.items()],
    })
    bridge.use_native_addresses(module.native_reserve_address, module.native_set_next_address)
    _module = module
    return module


def _recording_executor():
    """The executor the current context records into when its mode is DEFER_AND_FUSE's plain one
    (a capture's recorder keeps the Python kernels), else None: where the C++ kernel records a
    known call itself (``FusedExecutor.call``, as ``modes.execute`` does)."""
    now = execution.current()
    if now.mode is not modes.EagerMode.DEFER_AND_FUSE:
        return None
    executor = now.executor
    return executor if type(executor) is fused.FusedExecutor else None


def write_back(target: torch.Tensor, value, name: str) -> None:
    """An in-place op's result into its target, as ``dispatch.InplaceKernel`` writes it (the native
    kernel's path for views, casts and broadcasts)."""
    if value.dtype != TORCH_TO_JAX[target.dtype]:
        dispatch._check_cast(value.dtype, target.dtype, name)
    bridge.write(target, value)


def eligible(op, kernel) -> tuple | None:
    """(argument kinds, trigger argument positions) if ``kernel`` can run natively, else None.
    ``kernel``: a functional kernel, or an in-place one (``op_``) over an eligible functional one."""
    if type(kernel) is dispatch.InplaceKernel:
        kernel = kernel.functional
    if type(kernel) is not dispatch.Kernel or op.namespace != "aten":
        return None
    low, sig = kernel.lowering, kernel.sig
    if not low.jit or low.random or low.mutates or sig.returns_list \
            or sig.returns_none or sig.generator is not None:
        return None
    arguments = op._schema.arguments
    kinds = []
    for i, a in enumerate(arguments):
        kind = sig.keyword.get(a.name) if a.kwarg_only else sig.positional[i]
        if kind not in _KIND or a.is_out:
            return None
        kinds.append(_DEVICE if a.name == "device" and sig.device_arg else _KIND[kind])
    if not all(str(r.type) in ("Tensor", "Tensor(a!)") for r in op._schema.returns):
        return None
    names = [a.name for a in arguments]
    triggers = set()
    for _, when in argument_errors.CHECKS.get(op._schema.name.split("::")[-1].rstrip("_"), ()):
        if not when:
            return None  # a check on every call: Python's
        for name in when:
            if name in names:
                if not arguments[names.index(name)].has_default_value():
                    return None
                triggers.add(names.index(name))
    return kinds, sorted(triggers)


# View ops: the C++ extension registers the CPU's kernels of the primitive ones; the composite ones
# are then PyTorch's own (CompositeExplicitAutograd) kernels over those, as on CUDA.
_PRIMITIVE_VIEWS = ("view.default", "as_strided.default", "_reshape_alias.default", "unfold.default")


def _native_views(kernels: dict) -> set:
    """The view ops whose Python kernels the native views replace."""
    aten = torch.ops.aten
    primitive = {getattr(getattr(aten, n.split(".")[0]), n.split(".")[1]) for n in _PRIMITIVE_VIEWS}
    found = set()
    for op, kernel in kernels.items():
        if not getattr(kernel, "is_view", False):
            continue
        if op in primitive or compat.dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeExplicitAutograd") \
                and op not in (aten.view.dtype,):
            found.add(op)
    return found


def install(lib_for, kernels: dict) -> set:
    """Register the native kernel of every eligible op in ``kernels`` (their Python kernels go on
    PrivateUse2 through ``lib_for(op)``); returns those ops. None are when the setting is off or
    the extension is missing (then every op keeps its Python kernel on PrivateUse1)."""
    if not config.native_eager:
        return set()
    module = _setup()
    if module is None:
        return set()
    done = set()
    for op, kernel in kernels.items():
        found = eligible(op, kernel)
        if found is None:
            continue
        kinds, triggers = found
        name = op._schema.name.split("::")[1]
        impl = name if op._overloadname == "default" else f"{name}.{op._overloadname}"
        lib_for(op).impl(impl, argument_errors.guarded(op, kernel), "PrivateUse2")
        inplace = type(kernel) is dispatch.InplaceKernel
        functional = kernel.functional if inplace else kernel  # (its run reports what the C++ kernel learns)
        module.native_eager_register(op.namespace, impl, str(op), functional, kinds, triggers,
                                     bool(functional.dots), inplace, bool(functional.lowering.checked))
        done.add(op)
    REGISTERED[:] = sorted(done, key=str)
    views = _native_views(kernels)
    module.native_views_register()
    module.native_eager_enable(True)
    return done | views


def uninstall() -> None:
    if _module is not None:
        _module.native_eager_clear()
    REGISTERED.clear()


def forget() -> None:
    """Drop every program the native kernels learned (a lowering changed: they learn the new ones)."""
    if _module is not None:
        _module.native_eager_forget()


def enabled() -> bool:
    """Whether calls of the registered ops take the native path now."""
    return _module is not None and _module.native_eager_enabled()


def set_enabled(on: bool) -> None:
    """Turn the native path on or off for this process (off: every call runs its Python kernel)."""
    if _module is None:
        if on and config.native_eager:
            warnings.warn("tpu: the native eager kernel is not available in this process (no C++ extension: "
                          f"{native.unavailable_reason()}); ops run their Python kernels", stacklevel=2)
        return
    _module.native_eager_enable(bool(on))


BUDGET_STAGES = ("GIL, mode check, argument walk", "table lookup", "JAX call", "outputs", "op count")


def budget(on: bool) -> None:
    """Time the stages of native calls from now on (``on``) or stop; the sums start again at 0."""
    if _module is not None:
        _module.native_eager_budget(bool(on))


def budget_read() -> tuple[int, dict[str, float]]:
    """(native calls timed since ``budget(True)``, {stage: microseconds per call}) — where the C++
    kernel's time goes (``BUDGET_STAGES``); empty without the extension."""
    if _module is None:
        return 0, {}
    calls, *ns = _module.native_eager_budget_read()
    return calls, {stage: (t / calls / 1e3 if calls else 0.0) for stage, t in zip(BUDGET_STAGES, ns)}


def stats() -> dict:
    """{op name: (calls run natively, call signatures known, calls left to Python because of: the
    mode or a capture, an argument PyTorch's checks look at, an argument the native walk does not
    take, a signature given up on, learning a signature; then, of the native calls, those whose
    laid-out outputs took the Python wrap (``dispatch.wrap_laid_out``: the arrays it reshapes);
    then the calls recorded natively into a DEFER_AND_FUSE graph (not in the first count))}."""
    return dict(_module.native_eager_stats()) if _module is not None else {}
