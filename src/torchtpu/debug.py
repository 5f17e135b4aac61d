"""Numerics debugging: run code on ``tpu`` and check every aten op against PyTorch on the CPU.

``compare_with_cpu(model, x)`` runs ``model(x)`` under a dispatch mode that, for every aten op
touching a ``tpu`` tensor, also runs the op on CPU copies of the same inputs and compares the
outputs. Each op is checked in isolation (both sides get the tpu run's inputs), so the first
mismatch names the op that is wrong, not the one where errors grew large enough to notice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from torchtpu.runtime.compat import TorchDispatchMode, current_autograd_node, printoptions, pytree

# rtol, atol per dtype: the defaults of torch.testing.assert_close
_TOLERANCES = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.complex64: (1.3e-6, 1e-5),
    torch.complex128: (1e-7, 1e-7),
}

# ops whose outputs are not determined by their inputs (besides nondeterministic_seeded ones)
_UNINITIALIZED = {"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty",
                  "new_empty_strided", "resize_", "set_"}


@dataclass
class Mismatch:
    """The first op whose tpu output differs from the CPU's beyond tolerance."""

    op: str
    module_path: str
    reason: str
    tpu_value: Any
    cpu_value: Any
    output_index: int = 0
    max_abs_diff: float | None = None
    first_index: tuple[int, ...] | None = None
    rtol: float | None = None
    atol: float | None = None
    ops_checked: int = 0

    def __str__(self) -> str:
        where = f" in module {self.module_path}" if self.module_path else ""
        lines = [f"tpu and CPU disagree at {self.op}{where} (output {self.output_index}): {self.reason}"]
        if self.max_abs_diff is not None:
            lines.append(f"  max abs diff {self.max_abs_diff:.6g} (rtol={self.rtol:g}, atol={self.atol:g})")
        if self.first_index is not None:
            i = self.first_index
            lines.append(f"  first differing element {list(i)}: tpu {self.tpu_value[i].item()!r}, "
                         f"cpu {self.cpu_value[i].item()!r}")
        lines.append(f"  tpu: {_summary(self.tpu_value)}")
        lines.append(f"  cpu: {_summary(self.cpu_value)}")
        lines.append(f"  ({self.ops_checked} ops matched before this one)")
        return "\n".join(lines)


def _summary(value) -> str:
    if isinstance(value, torch.Tensor):
        with printoptions(threshold=8, edgeitems=3, precision=6, linewidth=200):
            body = str(value.detach().reshape(-1)).replace("\n", " ")
        return f"shape {tuple(value.shape)} {value.dtype}, flattened: {body}"
    return repr(value)


def _tolerance(dtype: torch.dtype, rtol: float | None, atol: float | None) -> tuple[float, float]:
    if rtol is not None and atol is not None:
        return rtol, atol
    return _TOLERANCES.get(dtype, (0.0, 0.0))


def _compare(actual, expected, rtol, atol) -> dict[str, Any] | None:
    """How ``actual`` (tpu output, on the CPU) differs from ``expected``; None when they match."""
    if not isinstance(expected, torch.Tensor):
        same = actual == expected or (isinstance(actual, float) and math.isnan(actual) and math.isnan(expected))
        return None if same else {"reason": "values differ"}
    if not isinstance(actual, torch.Tensor):
        return {"reason": f"tpu returned {type(actual).__name__}, CPU a tensor"}
    if actual.shape != expected.shape:
        return {"reason": f"shape {tuple(actual.shape)} != CPU's {tuple(expected.shape)}"}
    if actual.dtype != expected.dtype:
        return {"reason": f"dtype {actual.dtype} != CPU's {expected.dtype}"}
    rtol, atol = _tolerance(expected.dtype, rtol, atol)
    bad, max_diff = _elementwise(actual, expected, rtol, atol)
    if not bool(bad.any()):
        return None
    return {"reason": f"{int(bad.sum())} of {bad.numel()} elements differ beyond tolerance",
            "max_abs_diff": max_diff, "first_index": tuple(int(i) for i in bad.nonzero()[0]),
            "rtol": rtol, "atol": atol}


def _elementwise(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float):
    """The mask of elements out of tolerance (exact for integers and bools) and the max abs difference."""
    if expected.dtype == torch.bool:
        return actual != expected, None
    wide = torch.complex128 if expected.is_complex() else torch.float64
    a, e = actual.to(wide), expected.to(wide)
    if expected.dtype.is_floating_point or expected.is_complex():
        bad = ~torch.isclose(a, e, rtol=rtol, atol=atol, equal_nan=True)
    else:
        bad = actual != expected
    diff = (a - e).abs()
    finite = diff[torch.isfinite(diff)]
    return bad, float(finite.max()) if finite.numel() else None


def _is_tpu(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "tpu"


def _to_cpu(x):
    if _is_tpu(x):
        return x.detach().cpu()
    if isinstance(x, torch.device) and x.type == "tpu":
        return torch.device("cpu")
    return x


def _involves_tpu(args, kwargs) -> bool:
    leaves, _ = pytree.tree_flatten((args, kwargs))
    return any(_is_tpu(x) or (isinstance(x, torch.device) and x.type == "tpu") for x in leaves)


def _checkable(func) -> bool:
    if torch.Tag.nondeterministic_seeded in func.tags:
        return False
    return func._schema.name.split("::")[-1] not in _UNINITIALIZED


class _ModuleStack:
    """The qualified name of the innermost ``nn.Module`` running, from global forward hooks."""

    def __init__(self, names: dict[int, str]):
        self.names = names
        self.stack: list[str] = []
        self.handles = []

    def __enter__(self):
        from torch.nn.modules import module

        self.handles = [module.register_module_forward_pre_hook(self._push),
                        module.register_module_forward_hook(self._pop, always_call=True)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return False

    def _push(self, mod, args):
        name = self.names.get(id(mod))
        if name is None:
            parent = self.stack[-1] if self.stack else ""
            name = f"{parent}.{type(mod).__name__}" if parent else type(mod).__name__
        self.stack.append(name)

    def _pop(self, mod, args, output):
        if self.stack:
            self.stack.pop()

    def current(self) -> str:
        node = current_autograd_node()
        if node is not None:
            return f"backward ({node.name()})"
        return self.stack[-1] if self.stack else ""


class _CompareMode(TorchDispatchMode):
    def __init__(self, modules: _ModuleStack, rtol, atol):
        super().__init__()
        self.modules, self.rtol, self.atol = modules, rtol, atol
        self.mismatch: Mismatch | None = None
        self.ops_checked = 0
        self.skipped: dict[str, str] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.mismatch is not None or not _checkable(func) or not _involves_tpu(args, kwargs):
            return func(*args, **kwargs)
        # copy inputs before the tpu op runs: in-place ops change them
        cpu_args, cpu_kwargs = pytree.tree_map(_to_cpu, (args, kwargs))
        if isinstance(cpu_kwargs.get("device"), str):
            cpu_kwargs["device"] = "cpu"
        out = func(*args, **kwargs)
        try:
            expected = func(*cpu_args, **cpu_kwargs)
        except Exception as exc:  # an op PyTorch's CPU kernels do not run cannot be compared
            self.skipped[str(func)] = f"{type(exc).__name__}: {exc}"
            return out
        self._check(func, out, expected)
        return out

    def _check(self, func, out, expected) -> None:
        actual_leaves, _ = pytree.tree_flatten(out)
        expected_leaves, _ = pytree.tree_flatten(expected)
        if len(actual_leaves) != len(expected_leaves):
            self._record(func, 0, out, expected, {"reason": "different number of outputs"})
            return
        for i, (a, e) in enumerate(zip(actual_leaves, expected_leaves)):
            if isinstance(a, torch.Tensor):
                a = a.detach().cpu()
            diff = _compare(a, e.detach() if isinstance(e, torch.Tensor) else e, self.rtol, self.atol)
            if diff is not None:
                self._record(func, i, a, e, diff)
                return
        self.ops_checked += 1

    def _record(self, func, index, actual, expected, diff) -> None:
        if isinstance(expected, torch.Tensor):
            expected = expected.detach()
        self.mismatch = Mismatch(op=str(func), module_path=self.modules.current(), tpu_value=actual,
                                 cpu_value=expected, output_index=index, ops_checked=self.ops_checked,
                                 **diff)


def compare_with_cpu(model_or_fn: Callable, *inputs, rtol: float | None = None, atol: float | None = None,
                     **kwargs) -> Mismatch | None:
    """Run ``model_or_fn(*inputs, **kwargs)`` on tpu, checking every aten op against the CPU.

    Returns the first ``Mismatch`` (op, module path, both values), or None when every op
    matched. ``rtol``/``atol`` default to ``torch.testing.assert_close``'s per-dtype tolerances.
    Random ops and ops that return uninitialised memory (``empty``) are not compared.
    """
    if (rtol is None) != (atol is None):
        raise ValueError("compare_with_cpu: pass both rtol and atol, or neither to use per-dtype defaults")
    root = getattr(model_or_fn, "__self__", model_or_fn)  # a bound method such as model.generate
    names = {}
    if isinstance(root, torch.nn.Module):
        names = {id(m): name or type(m).__name__ for name, m in root.named_modules()}
    with _ModuleStack(names) as modules:
        mode = _CompareMode(modules, rtol, atol)
        with mode:
            model_or_fn(*inputs, **kwargs)
    if mode.mismatch is None and mode.ops_checked == 0 and not mode.skipped:
        raise ValueError("compare_with_cpu: no op ran on a tpu tensor; move the model and inputs to 'tpu' first")
    return mode.mismatch


def pending_graph() -> list[str]:
    """The ops this thread (context) recorded in ``EagerMode.DEFER_AND_FUSE`` and has not run yet,
    in order."""
    from torchtpu.eager import fused

    return fused.pending_graph()
