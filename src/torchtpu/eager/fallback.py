"""What runs an aten op that has no lowering: PyTorch's decomposition, else the CPU fallback.

Registered as PyTorch's boxed fallback for the ``tpu`` dispatch key, so it sees every op that
has no kernel of ours and no composite kernel of PyTorch's.

Sparse tensors are not supported on tpu: ops that dispatch to the sparse tpu keys (a sparse
tensor moved to tpu, a sparse factory on tpu, an op mixing a tpu tensor with a sparse one) reach
``sparse_not_supported`` (registered for those keys), and a sparse argument or result in the
fallback raises the same error, instead of PyTorch's generic "Could not run ... with arguments
from the 'Sparsetpu' backend".
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator
import warnings

from jax.profiler import TraceAnnotation
import torch

from torchtpu import metrics
from torchtpu.config import config
from torchtpu.device import bridge
from torchtpu.eager import modes, transfer
from torchtpu.runtime import state
from torchtpu.runtime.compat import decomposition_table, pytree

_active = threading.local()
_warned: set[str] = set()
_SPARSE_LAYOUTS = frozenset({torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc})
_SPARSE_KEYS = ("SparsePrivateUse1", "SparseCsrPrivateUse1")
_sparse_libs: list[torch.library.Library] = []


def sparse_error(op, layout=None) -> NotImplementedError:
    got = f" (got a {str(layout).replace('torch.', '')} tensor)" if layout is not None else ""
    return NotImplementedError(f"sparse tensors are not supported on tpu: {op} cannot run{got}. "
                               f"Use dense tensors on tpu (.to_dense()), or run the sparse op on the CPU.")


def sparse_not_supported(op, *args, **kwargs):
    """The boxed fallback of the sparse tpu dispatch keys."""
    found = _first_sparse(args, kwargs)
    raise sparse_error(op, found.layout if found is not None else None)


def install_sparse_fallback() -> None:
    """Register ``sparse_not_supported`` for the sparse tpu dispatch keys (idempotent)."""
    if _sparse_libs:
        return
    for key in _SPARSE_KEYS:
        lib = torch.library.Library("_", "IMPL")
        lib.fallback(sparse_not_supported, key)
        _sparse_libs.append(lib)


def _makes_sparse(op) -> bool:
    """An aten op about sparse tensors (``to_sparse``, ``_sparse_*``): none runs on tpu."""
    name = op._schema.name
    return name.startswith("aten::") and "sparse" in name


def _first_sparse(args, kwargs):
    """The first sparse tensor among the arguments (or in a list argument), else None."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            if value.layout in _SPARSE_LAYOUTS:
                return value
        elif isinstance(value, (list, tuple)):
            for x in value:
                if isinstance(x, torch.Tensor) and x.layout in _SPARSE_LAYOUTS:
                    return x
    return None


def enable_cpu_fallback(enabled: bool = True) -> None:
    """Run ops without a lowering on the CPU (default on); off, they raise NotImplementedError."""
    config.cpu_fallback = bool(enabled)


def is_cpu_fallback_enabled() -> bool:
    return config.cpu_fallback


@contextlib.contextmanager
def cpu_fallback_enabled(enabled: bool) -> Iterator[None]:
    """Turn the CPU fallback on or off for a block, then restore it."""
    previous = config.cpu_fallback
    config.cpu_fallback = bool(enabled)
    try:
        yield
    finally:
        config.cpu_fallback = previous


def fallback(op, *args, **kwargs):
    sparse = _first_sparse(args, kwargs)
    if sparse is not None or _makes_sparse(op):
        raise sparse_error(op, sparse.layout if sparse is not None else None)
    decomposition = decomposition_table.get(op)
    running = getattr(_active, "ops", None)
    if running is None:
        running = _active.ops = set()
    if decomposition is not None and op not in running:
        running.add(op)
        try:
            metrics.count_decomposition(str(op))
            result = decomposition(*args, **kwargs)
        finally:
            running.discard(op)
        if result is not NotImplemented:
            return result
    return cpu_fallback(op, *args, **kwargs)


def cpu_fallback(op, *args, **kwargs):
    """Run ``op`` on the CPU and move the results back, counted and warned about once per op."""
    if modes.tracing:  # a torchtpu.profiler.trace is recording
        with TraceAnnotation(f"cpu_fallback {op}"):
            return _cpu_fallback(op, *args, **kwargs)
    return _cpu_fallback(op, *args, **kwargs)


def _cpu_fallback(op, *args, **kwargs):
    name = str(op)
    if not config.cpu_fallback:
        raise NotImplementedError(
            f"Could not run '{name}' on the tpu device: torchtpu has no lowering for it and the CPU "
            f"fallback is off. Turn it on with torch.tpu.enable_cpu_fallback(True) (or "
            f"TORCHTPU_CPU_FALLBACK=1) to run this op on the CPU.")
    metrics.count_fallback(name)
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"tpu: {name} has no lowering; running it on the CPU (slow, counted in "
                      f"torchtpu.metrics). Please report it.", stacklevel=4)
    modes.flush("cpu_fallback")
    device = None

    def to_cpu(x):
        nonlocal device
        if isinstance(x, torch.Tensor) and x.device.type == "tpu":
            device = device or x.device
            return transfer.to_host(x)
        return x

    def to_tpu(x):
        if isinstance(x, torch.Tensor) and x.device.type == "cpu":
            index = state.device_index(device)
            return bridge.wrap(transfer.to_device(x, index), index)
        return x

    cpu_args, cpu_kwargs = pytree.tree_map(to_cpu, (args, kwargs))
    if device is None:
        device = _device_of(kwargs)
    if "device" in cpu_kwargs and cpu_kwargs["device"] is not None:
        cpu_kwargs["device"] = torch.device("cpu")
    result = op(*cpu_args, **cpu_kwargs)
    sparse = _first_sparse(result if isinstance(result, (tuple, list)) else (result,), {})
    if sparse is not None:  # e.g. to_sparse() of a tpu tensor
        raise sparse_error(op, sparse.layout)
    # write mutated arguments back and return the original tensors for aliased outputs
    schema = op._schema
    flat_inputs = list(args) + [kwargs.get(a.name) for a in schema.arguments if a.kwarg_only]
    flat_cpu = list(cpu_args) + [cpu_kwargs.get(a.name) for a in schema.arguments if a.kwarg_only]
    aliased = {}
    positional = [a for a in schema.arguments if not a.kwarg_only][: len(args)]
    named = positional + [a for a in schema.arguments if a.kwarg_only]
    for arg, orig, cpu in zip(named, flat_inputs, flat_cpu):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        # a mutated Tensor[] (the _foreach_* and _fused_* optimizer ops) is written back element-wise
        pairs = zip(orig, cpu) if isinstance(orig, (list, tuple)) else ((orig, cpu),)
        for tensor, host in pairs:
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "tpu":
                if tuple(tensor.shape) != tuple(host.shape):
                    tensor.resize_(host.shape)
                bridge.write(tensor, transfer.to_device(host, tensor.get_device()))
                aliased[id(host)] = tensor
    return pytree.tree_map(lambda x: aliased[id(x)] if id(x) in aliased else to_tpu(x), result)


def _device_of(kwargs) -> torch.device:
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "tpu":
        return torch.device(device)
    return torch.device("tpu", 0)


# The eager layer's kernels and this fallback are installed together, when the runtime starts.
install_sparse_fallback()
