"""Installs the eager kernels: every lowering, its in-place and out= variants, the view and
transfer kernels, and the boxed fallback, all on the ``tpu`` (PrivateUse1) dispatch key."""

from __future__ import annotations

import torch

from torchtpu import metrics, patches
from torchtpu.device import registration
from torchtpu.eager import argument_errors, attention, dispatch, fallback, fused, modes, native_kernels, transfer, views
from torchtpu.ops import checks, foreach, registry
from torchtpu.runtime import state, streams
from torchtpu.runtime.compat import OpOverload, dispatch_get_all_op_names, dispatch_has_kernel_for_dispatch_key

aten = torch.ops.aten
_libs: list[torch.library.Library] = []
KERNELS: dict[OpOverload, object] = {}


def _is_inplace(op: OpOverload) -> bool:
    args = op._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write \
        and not any(a.is_out for a in args)


def _variants(op: OpOverload):
    """The in-place overload and the out= overloads that compute the same thing as ``op``."""
    name = op._schema.name.split("::")[1]
    inputs = [(a.name, str(a.type)) for a in op._schema.arguments]
    inplace_packet = getattr(aten, name + "_", None)
    if inplace_packet is not None:
        # the in-place overload with the same arguments, whatever its name: pow_.Scalar is
        # pow.Tensor_Scalar's (Tensor self, Scalar exponent), not pow.Scalar's (Scalar self, ...)
        for other in inplace_packet.overloads():
            candidate = getattr(inplace_packet, other)
            if [(a.name, str(a.type)) for a in candidate._schema.arguments] == inputs:
                yield "inplace", candidate
                break
    packet = getattr(aten, name)
    for other in packet.overloads():
        candidate = getattr(packet, other)
        schema = candidate._schema
        if any(a.is_out for a in schema.arguments):
            if [(a.name, str(a.type)) for a in schema.arguments if not a.is_out] == inputs:
                yield "out", candidate


def _composite(op: OpOverload) -> bool:
    # PyTorch decomposes these above autograd (true_divide, where.ScalarOther, ...): a device kernel
    # would take the call before the decomposition and the result would have no grad_fn. Their
    # lowerings still serve compiled graphs.
    try:
        # the C++ registration only: Python decompositions registered for tracing (py_impl, e.g.
        # native_batch_norm's) do not run in eager and must not cost the op its kernel
        return dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")
    except RuntimeError:  # an overload only Python knows of (no dispatcher entry): not composite
        return False


def kernels() -> dict[OpOverload, object]:
    """Every eager kernel, by overload (built once)."""
    if KERNELS:
        return KERNELS
    lowerings = registry.load_all()
    for op, low in lowerings.items():
        if _composite(op):
            continue
        if low.view:  # metadata on the base's storage; in-place view ops (t_) stay PyTorch's
            KERNELS[op] = views.view_kernel(op)
            continue
        kernel = dispatch.Kernel(low)
        if op.namespace != "aten":  # a custom op (jax_op, torch_nn's chunked losses): no aten variants
            KERNELS[op] = kernel
            continue
        if low.mutates:  # writes its arguments itself: no derived in-place or out= variants
            KERNELS[op] = dispatch.MutatingKernel(kernel)
            continue
        if _is_inplace(op):
            KERNELS[op] = dispatch.InplaceKernel(kernel)
            continue
        KERNELS[op] = kernel
        for kind, variant in _variants(op):
            if variant in lowerings or variant in KERNELS or _composite(variant):
                continue
            if kind == "inplace":
                KERNELS[variant] = dispatch.InplaceKernel(kernel)
            else:
                out_names = tuple(a.name for a in variant._schema.arguments if a.is_out)
                KERNELS[variant] = dispatch.OutKernel(kernel, out_names)
    for out, (functional, exact, warn) in _FACTORY_OUTS.items():
        if functional in KERNELS and out not in lowerings:
            KERNELS[out] = dispatch.FactoryOutKernel(KERNELS[functional], exact, warn)
    KERNELS.update(attention.kernels())
    KERNELS.update(_foreach_kernels())
    KERNELS.update(views.KERNELS)
    KERNELS.update(transfer.KERNELS)
    return KERNELS


# Factories' out= overloads, which take no dtype (out's is used) and so are no variant of their
# functional overload; without a kernel they reach the fallback, whose decompositions resize a
# view ``out`` of the right size (writing the wrong elements) and whose CPU run cannot resize a
# tpu storage. (out= overload: (functional overload, resize unless out is already 1-D of the
# length, warn of a resize))
_FACTORY_OUTS = {
    aten.arange.start_out: (aten.arange.start_step, False, True),
    aten.linspace.out: (aten.linspace.default, False, False),
    aten.logspace.out: (aten.logspace.default, False, False),
    aten.range.out: (aten.range.step, False, False),
    aten.randperm.generator_out: (aten.randperm.generator, True, False),
}


def _foreach_kernels() -> dict[OpOverload, object]:
    """One kernel per ``_foreach_*`` overload (functional and in-place) whose per-tensor op is lowered."""
    found: dict[OpOverload, object] = {}
    names = sorted({n[len("aten::"):].split(".")[0] for n in dispatch_get_all_op_names()
                    if n.startswith("aten::_foreach_")})
    for name in names:
        packet = getattr(aten, name)
        inplace = name.endswith("_")
        functional_packet = getattr(aten, name[:-1], None) if inplace else packet
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if functional_packet is None or overload not in functional_packet.overloads() or _composite(op):
                continue
            functional = getattr(functional_packet, overload)
            lowering = foreach.derived(functional)
            if lowering is None:
                continue
            kernel = dispatch.ForeachKernel(lowering)
            found[op] = dispatch.ForeachInplaceKernel(kernel) if inplace else kernel
    return found


def install() -> None:
    """Register every kernel with PyTorch's dispatcher (idempotent); run when the runtime starts."""
    if _libs:
        return
    libs: dict[str, torch.library.Library] = {}

    def lib_for(op):
        return libs.get(op.namespace) or libs.setdefault(op.namespace, torch.library.Library(op.namespace, "IMPL"))

    native = native_kernels.install(lib_for, kernels())  # their Python kernels on PrivateUse2
    for op, kernel in kernels().items():
        if op not in native:
            _impl(lib_for(op), op, kernel)
    _libs.extend(libs.values())
    _libs.append(attention.install_autograd())  # SDPA chooses its backend above autograd
    registration.set_fallback(fallback.fallback)
    patches.apply("dlpack.exports")  # tpu tensors' data_ptr() addresses nothing (torchtpu.patches)
    global _hooked
    if _hooked:  # a reinstall (after _uninstall): the hooks below are in place already
        return
    _hooked = True
    modes.install_fused(fused.FusedExecutor)
    metrics.register_source("fused_eager", fused.stats)
    streams.before_synchronize(lambda: modes.flush("synchronize"))
    streams.before_synchronize(checks.raise_pending)  # after the flush: the codes of what it ran
    state.on_fork_child(_uninstall)
    registry.on_change(_forget_programs)


def _impl(lib: torch.library.Library, op: OpOverload, kernel) -> None:
    name = op._schema.name.split("::")[1]
    lib.impl(name if op._overloadname == "default" else f"{name}.{op._overloadname}",
             argument_errors.guarded(op, kernel), "PrivateUse1")


def add(op: OpOverload) -> None:
    """Give ``op``, lowered after the kernels were built (``torchtpu.jax_op``), its eager kernel."""
    if not KERNELS:  # not built yet: kernels() will find its lowering in the registry
        return
    KERNELS[op] = dispatch.Kernel(registry.get(op))
    if _libs:  # installed already: register this one now
        lib = torch.library.Library(op.namespace, "IMPL")
        _impl(lib, op, KERNELS[op])
        _libs.append(lib)


def _forget_programs(op: OpOverload) -> None:
    """``op``'s platform override changed: drop the programs its eager kernel built."""
    kernel = KERNELS.get(op)
    inference = getattr(kernel, "inference", None)  # (the fused attention op's no-backward kernel)
    kernel = getattr(kernel, "functional", kernel)  # in-place, out= and mutating kernels wrap it
    for each in (kernel, inference):
        if isinstance(each, dispatch.Kernel):
            each._jitted.clear()
    native_kernels.forget()  # (the C++ kernels' learned programs of it, too)


_hooked = False


def _uninstall() -> None:
    """In a child forked after the runtime started: every tpu op reaches the fallback again, which
    tries to start the runtime and raises the bad-fork error (``runtime/state.py``)."""
    registration.set_fallback(None)
    native_kernels.uninstall()
    while _libs:
        _libs.pop()._destroy()
