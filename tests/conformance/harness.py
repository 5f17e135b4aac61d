"""OpInfo / ModuleInfo conformance: run PyTorch's own samples on CPU and on ``tpu`` and compare.

One call checks one entry in one mode and returns a ``Result``:

- ``eager_<dtype>``: forward of an ``op_db`` entry in eager mode, for one dtype.
- ``backward_float32``: gradients of every sample input vs the CPU gradients.
- ``compiled_float32``: forward through ``torch.compile(backend="tpu")``.
- ``module_forward`` / ``module_backward``: ``module_db`` modules (outputs; input and
  parameter gradients), float32.

The CPU fallback is off while an entry runs, so a missing lowering fails it; if the fallback
counter moves anyway the entry is a ``cpu-fallback``. Inputs are made once on the CPU (seeded)
and copied to ``tpu``, so both sides see the same values. Ops whose CPU results are not
reproducible (random ops; entries whose OpInfo skips ``test_compare_cpu``) are compared on
shape, dtype and device only, and say so in ``Result.note``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import signal
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.testing._internal.common_device_type import precisionOverride, toleranceOverride
from torch.utils._pytree import tree_flatten, tree_map

DEVICE = "tpu"
PASS, FAIL, FALLBACK, SKIP, NA = "pass", "fail", "cpu-fallback", "skipped", "n/a"
ENTRY_TIMEOUT_S = 20

EAGER_DTYPES = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "bool": torch.bool,
    "complex64": torch.complex64,
}
# mode -> (kind, dtype)
MODES: dict[str, tuple[str, torch.dtype]] = {
    **{f"eager_{name}": ("eager", dtype) for name, dtype in EAGER_DTYPES.items()},
    "backward_float32": ("backward", torch.float32),
    "compiled_float32": ("compiled", torch.float32),
    "module_forward": ("module_forward", torch.float32),
    "module_backward": ("module_backward", torch.float32),
}
MODULE_KINDS = ("module_forward", "module_backward")


@dataclass
class Result:
    """The outcome of one entry in one mode."""

    entry: str
    mode: str
    status: str
    error: str = ""  # first line of the first failure (or the skip / n/a reason)
    samples: int = 0  # samples compared
    seconds: float = 0.0
    note: str = ""
    missing: list[str] = field(default_factory=list)  # aten ops that had no lowering

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class EntryTimeout(Exception):
    """The entry ran past its time limit."""


class NotApplicable(Exception):
    """The entry has nothing to check in this mode (no samples of this dtype, no autograd...)."""


# ---------------------------------------------------------------- the databases

def entry_name(op) -> str:
    """``name`` or ``name.variant``: unique across ``op_db``."""
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


@functools.cache
def op_entries() -> dict[str, Any]:
    from torch.testing._internal.common_methods_invocations import op_db

    return {entry_name(op): op for op in op_db}


@functools.cache
def module_entries() -> dict[str, Any]:
    from torch.testing._internal.common_modules import module_db

    return {info.name: info for info in module_db}


def entries_for(mode: str) -> list[str]:
    """Every entry name a mode sweeps."""
    kind, _ = MODES[mode]
    return sorted(module_entries() if kind in MODULE_KINDS else op_entries())


# ---------------------------------------------------------------- tolerances

# Overrides in an OpInfo's decorators that would apply to PyTorch's own accelerator-vs-CPU
# comparison (TestCommon.test_compare_cpu) or to every test of the op.
_TOLERANCE_TESTS = {(None, None), ("TestCommon", None), ("TestCommon", "test_compare_cpu"), (None, "test_compare_cpu")}
_TOLERANCE_DEVICES = (None, "cpu", "cuda")


def _default_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    from torch.testing._comparison import default_tolerances

    rtol, atol = default_tolerances(dtype)
    return atol, rtol


def tolerance(op, dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol): the dtype's default, raised to the OpInfo's own override where it has one."""
    atol, rtol = _default_tolerance(dtype)
    for info in getattr(op, "decorators", ()) or ():
        decorators = getattr(info, "decorators", [info])
        if hasattr(info, "test_name"):
            if (info.cls_name, info.test_name) not in _TOLERANCE_TESTS or info.device_type not in _TOLERANCE_DEVICES:
                continue
            if info.dtypes is not None and dtype not in info.dtypes:
                continue
        for deco in decorators:
            if isinstance(deco, toleranceOverride) and dtype in deco.d:
                atol, rtol = max(atol, deco.d[dtype].atol), max(rtol, deco.d[dtype].rtol)
            elif isinstance(deco, precisionOverride) and dtype in deco.d:
                atol = max(atol, deco.d[dtype])
    return atol, rtol


def compare_cpu_skip(op) -> str | None:
    """The reason the OpInfo skips ``test_compare_cpu`` (results not comparable), if it does."""
    for info in getattr(op, "decorators", ()) or ():
        if getattr(info, "test_name", None) != "test_compare_cpu" or info.device_type is not None:
            continue
        if not info.active_if:
            continue
        for deco in info.decorators:
            if getattr(deco, "__qualname__", "").startswith("skip."):
                reason = inspect.getclosurevars(deco).nonlocals.get("reason", "")
                return str(reason) or "skipped by OpInfo"
    return None


# ---------------------------------------------------------------- moving and comparing

def _leaf_copy(t: torch.Tensor, device: str) -> torch.Tensor:
    out = t.detach().to(device) if device != "cpu" else t.detach().clone()
    return out.requires_grad_(t.requires_grad)


def to_device(value, device: str):
    """Copy every tensor in a nested structure to ``device`` (leaves keep ``requires_grad``)."""
    return tree_map(lambda x: _leaf_copy(x, device) if isinstance(x, torch.Tensor) else x, value)


class DeviceMismatch(AssertionError):
    """A result that should live on tpu came back on another device."""


def to_host(value):
    """Bring a result to the CPU for comparison; a tensor not on tpu is an error."""
    def host(x):
        if not isinstance(x, torch.Tensor):
            return x
        if x.device.type != DEVICE:
            raise DeviceMismatch(f"result tensor is on {x.device}, expected {DEVICE}")
        return x.detach().cpu()

    return tree_map(host, value)


def assert_same(actual, expected, atol: float, rtol: float, metadata_only: bool = False) -> None:
    """``actual`` (already on the host) equals the CPU result within tolerance."""
    if metadata_only:
        flat_a, spec_a = tree_flatten(actual)
        flat_e, spec_e = tree_flatten(expected)
        if spec_a != spec_e:
            raise AssertionError(f"result structure differs: {spec_a} vs {spec_e}")
        for a, e in zip(flat_a, flat_e):
            if isinstance(e, torch.Tensor):
                if not isinstance(a, torch.Tensor) or a.shape != e.shape or a.dtype != e.dtype:
                    raise AssertionError(f"result metadata differs: {_meta(a)} vs {_meta(e)}")
        return
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, equal_nan=True,
                               check_device=False, check_stride=False)


def _meta(x) -> str:
    return f"Tensor{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else repr(x)[:40]


def _first_line(exc: BaseException) -> str:
    """A one-line summary of a failure: type, first message line and, for mismatches, the numbers."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    if isinstance(exc, AssertionError):
        detail = [ln for ln in lines[1:] if ln.startswith(("Mismatched", "Greatest", "The values", "The failure"))]
        text = " ".join([text, *detail[:3]])
    return f"{type(exc).__name__}: {text}"[:300]


_MISSING_PREFIX = "Could not run '"


def _missing_op(exc: BaseException) -> str | None:
    text = str(exc)
    if isinstance(exc, NotImplementedError) and text.startswith(_MISSING_PREFIX):
        return text[len(_MISSING_PREFIX):].split("'", 1)[0]
    return None


# ---------------------------------------------------------------- running one entry

@contextlib.contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """Raise ``EntryTimeout`` in the main thread after ``seconds``."""
    def expire(signum, frame):
        raise EntryTimeout(f"entry ran past its {seconds} s limit")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def no_cpu_fallback() -> Iterator[None]:
    previous = torch.tpu.is_cpu_fallback_enabled()
    torch.tpu.enable_cpu_fallback(False)
    try:
        yield
    finally:
        torch.tpu.enable_cpu_fallback(previous)


def _fallback_count() -> int:
    from torchtpu import metrics

    return sum(metrics.fallbacks.values())


def run_entry(name: str, mode: str, timeout: int = ENTRY_TIMEOUT_S) -> Result:
    """Check one entry in one mode; never raises (every outcome is a ``Result``)."""
    kind, dtype = MODES[mode]
    result = Result(name, mode, PASS)
    start = time.perf_counter()
    fallbacks = _fallback_count()
    try:
        with no_cpu_fallback(), time_limit(timeout):
            if kind in MODULE_KINDS:
                _CHECKS[kind](module_entries()[name], result)
            else:
                _CHECKS[kind](op_entries()[name], dtype, result)
    except NotApplicable as exc:
        result.status, result.error = NA, str(exc)
    except _Skip as exc:
        result.status, result.error = SKIP, str(exc)
    except Exception as exc:  # noqa: BLE001 - every failure of the op under test is a result
        result.status = FAIL
        result.error = f"[sample {result.samples}] {_first_line(exc)}"
        missing = _missing_op(exc)
        if missing:
            result.missing.append(missing)
    if _fallback_count() != fallbacks:
        from torchtpu import metrics

        result.status = FALLBACK
        result.error = result.error or "ran on the CPU fallback: " + ", ".join(sorted(metrics.fallbacks))
    result.seconds = round(time.perf_counter() - start, 3)
    return result


class _Skip(Exception):
    """The mode cannot run here; the message is the generated reason."""


def _samples(op, dtype: torch.dtype, requires_grad: bool) -> Iterator:
    torch.manual_seed(0)
    yield from op.sample_inputs("cpu", dtype, requires_grad=requires_grad)


def _call(fn: Callable, sample):
    return sample.output_process_fn_grad(fn(sample.input, *sample.args, **sample.kwargs))


def _reproducible(op, sample, expected) -> bool:
    """Whether the CPU result is the same under another seed (False for random ops)."""
    torch.manual_seed(12345)
    again = _call(op, _transform(sample, "cpu"))
    try:
        assert_same(again, expected, 0.0, 0.0)
        return True
    except AssertionError:
        return False


def _seeded_cpu(op, sample):
    torch.manual_seed(0)
    return _call(op, sample)


def _check_forward(op, dtype: torch.dtype, result: Result, fn: Callable | None = None) -> None:
    """Forward: outputs and the (possibly mutated) inputs match the CPU run of the same sample."""
    if dtype not in op.supported_dtypes("cpu"):
        raise NotApplicable(f"{dtype} is not among the OpInfo's CPU dtypes")
    atol, rtol = tolerance(op, dtype)
    skip_reason = compare_cpu_skip(op)
    run_tpu = fn or op
    for sample in _samples(op, dtype, requires_grad=False):
        tpu_sample = _transform(sample, DEVICE)
        cpu_sample = _transform(sample, "cpu")
        expected = _seeded_cpu(op, cpu_sample)
        metadata_only = skip_reason is not None or not _reproducible(op, sample, expected)
        if metadata_only:
            result.note = f"compared shape/dtype only: {skip_reason or 'CPU result changes with the seed'}"
        actual = to_host(_call(run_tpu, tpu_sample))
        assert_same(actual, expected, atol, rtol, metadata_only)
        assert_same(to_host(_inputs(tpu_sample)), _inputs(cpu_sample), atol, rtol, metadata_only)
        result.samples += 1
    if result.samples == 0:
        raise NotApplicable(f"the OpInfo has no {dtype} samples")


def _transform(sample, device: str):
    return sample.transform(lambda x: _leaf_copy(x, device) if isinstance(x, torch.Tensor) else x)


def _inputs(sample):
    return (sample.input, sample.args, sample.kwargs)


def _check_eager(op, dtype: torch.dtype, result: Result) -> None:
    _check_forward(op, dtype, result)


def _check_compiled(op, dtype: torch.dtype, result: Result) -> None:
    reason = compile_unavailable()
    if reason:
        raise _Skip(reason)
    import torch._dynamo

    torch._dynamo.reset()

    def call(*args, **kwargs):
        return op(*args, **kwargs)

    compiled = torch.compile(call, backend=DEVICE, dynamic=False)
    _check_forward(op, dtype, result, fn=compiled)


@functools.cache
def compile_unavailable() -> str | None:
    """Why ``torch.compile(backend="tpu")`` cannot run here, or None when it can."""
    import torch._dynamo

    try:
        import torchtpu.compile  # noqa: F401  (registers the backend once written)
    except Exception as exc:  # noqa: BLE001
        return f"torchtpu.compile does not import: {_first_line(exc)}"
    if DEVICE not in torch._dynamo.list_backends(exclude_tags=()):
        return f"torch.compile backend '{DEVICE}' is not registered (src/torchtpu/compile is not ready)"
    torch._dynamo.config.recompile_limit = 256  # one compile per sample shape is expected here
    return None


def _grad_pairs(sample) -> list[torch.Tensor]:
    return [t for t in tree_flatten(_inputs(sample))[0] if isinstance(t, torch.Tensor) and t.requires_grad]


def _differentiable(outputs) -> list[torch.Tensor]:
    return [t for t in tree_flatten(outputs)[0]
            if isinstance(t, torch.Tensor) and t.requires_grad and (t.is_floating_point() or t.is_complex())]


def _gradients(fn: Callable, sample, cotangents: list[torch.Tensor] | None, device: str):
    """(cotangents used, gradients of the sample's inputs) for one run of ``fn``."""
    outputs = _differentiable(_call(fn, sample))
    inputs = _grad_pairs(sample)
    if not outputs or not inputs:
        return None, None
    if cotangents is None:
        gen = torch.Generator().manual_seed(0)
        cotangents = [torch.randn(o.shape, dtype=o.dtype, generator=gen) for o in outputs]
    grads = torch.autograd.grad(outputs, inputs, [c.to(device) for c in cotangents], allow_unused=True)
    return cotangents, grads


def _check_backward(op, dtype: torch.dtype, result: Result) -> None:
    """Backward: every input gradient matches the CPU one, for the same output cotangents."""
    if not op.supports_autograd:
        raise NotApplicable("the OpInfo does not support autograd")
    if dtype not in op.supported_backward_dtypes("cpu"):
        raise NotApplicable(f"{dtype} is not among the OpInfo's CPU backward dtypes")
    if compare_cpu_skip(op):
        raise NotApplicable(f"CPU results not comparable: {compare_cpu_skip(op)}")
    atol, rtol = tolerance(op, dtype)
    for sample in _samples(op, dtype, requires_grad=True):
        cpu_sample, tpu_sample = _transform(sample, "cpu"), _transform(sample, DEVICE)
        torch.manual_seed(0)
        cotangents, expected = _gradients(op, cpu_sample, None, "cpu")
        if expected is None:
            continue
        _, actual = _gradients(op, tpu_sample, cotangents, DEVICE)
        assert_same(to_host(list(actual)), list(expected), atol, rtol)
        result.samples += 1
    if result.samples == 0:
        raise NotApplicable("no sample has a differentiable output")


# ---------------------------------------------------------------- modules

def _module_inputs(info, requires_grad: bool) -> list:
    torch.manual_seed(0)
    return list(info.module_inputs_func(info, device="cpu", dtype=torch.float32,
                                        requires_grad=requires_grad, training=True))


def _build_module(info, module_input) -> torch.nn.Module:
    torch.manual_seed(0)
    c = module_input.constructor_input
    module = info.module_cls(*c.args, **c.kwargs).to(torch.float32)
    module.train(True)
    return module


def _module_pair(info, module_input):
    cpu_module = _build_module(info, module_input)
    tpu_module = copy.deepcopy(cpu_module).to(DEVICE)
    f = module_input.forward_input
    return cpu_module, tpu_module, (f.args, f.kwargs)


def _module_skip(info) -> None:
    if torch.float32 not in info.supported_dtypes("cpu"):
        raise NotApplicable("float32 is not among the ModuleInfo's dtypes")


def _module_reproducible(info, module_input, expected) -> bool:
    module = _build_module(info, module_input)
    f = module_input.forward_input
    torch.manual_seed(12345)
    again = module(*to_device(f.args, "cpu"), **to_device(f.kwargs, "cpu"))
    try:
        assert_same(again, expected, 0.0, 0.0)
        return True
    except AssertionError:
        return False


def _check_module_forward(info, result: Result) -> None:
    """Module forward (train mode): outputs match the CPU module's for the same weights."""
    _module_skip(info)
    atol, rtol = _default_tolerance(torch.float32)
    for module_input in _module_inputs(info, requires_grad=False):
        if module_input.forward_input is None:
            continue
        cpu_module, tpu_module, (args, kwargs) = _module_pair(info, module_input)
        torch.manual_seed(0)
        expected = cpu_module(*to_device(args, "cpu"), **to_device(kwargs, "cpu"))
        metadata_only = not _module_reproducible(info, module_input, expected)
        if metadata_only:
            result.note = "compared shape/dtype only: CPU result changes with the seed"
        actual = to_host(tpu_module(*to_device(args, DEVICE), **to_device(kwargs, DEVICE)))
        assert_same(actual, expected, atol, rtol, metadata_only)
        result.samples += 1
    if result.samples == 0:
        raise NotApplicable("the ModuleInfo has no forward inputs")


def _module_grads(module, args, kwargs, cotangents, device: str):
    args, kwargs = to_device(args, device), to_device(kwargs, device)
    outputs = _differentiable(module(*args, **kwargs))
    inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    inputs += [p for p in module.parameters() if p.requires_grad]
    if not outputs or not inputs:
        return None, None
    if cotangents is None:
        gen = torch.Generator().manual_seed(0)
        cotangents = [torch.randn(o.shape, dtype=o.dtype, generator=gen) for o in outputs]
    grads = torch.autograd.grad(outputs, inputs, [c.to(device) for c in cotangents], allow_unused=True)
    return cotangents, list(grads)


def _check_module_backward(info, result: Result) -> None:
    """Module backward: input and parameter gradients match the CPU module's."""
    _module_skip(info)
    atol, rtol = _default_tolerance(torch.float32)
    for module_input in _module_inputs(info, requires_grad=True):
        if module_input.forward_input is None:
            continue
        cpu_module, tpu_module, (args, kwargs) = _module_pair(info, module_input)
        torch.manual_seed(0)
        cotangents, expected = _module_grads(cpu_module, args, kwargs, None, "cpu")
        if expected is None:
            continue
        expected_again = _module_grads(_build_module(info, module_input), args, kwargs, cotangents, "cpu")[1]
        try:
            assert_same(expected_again, expected, 0.0, 0.0)
        except AssertionError:
            continue  # random module (dropout): gradients are not comparable
        _, actual = _module_grads(tpu_module, args, kwargs, cotangents, DEVICE)
        assert_same(to_host(actual), expected, atol, rtol)
        result.samples += 1
    if result.samples == 0:
        raise NotApplicable("no module input has a differentiable, reproducible output")


_CHECKS: dict[str, Callable] = {
    "eager": _check_eager,
    "backward": _check_backward,
    "compiled": _check_compiled,
    "module_forward": _check_module_forward,
    "module_backward": _check_module_backward,
}


def format_traceback(name: str, mode: str) -> str:
    """Run one entry with the full traceback printed (for debugging a failure)."""
    kind, dtype = MODES[mode]
    try:
        with no_cpu_fallback():
            if kind in MODULE_KINDS:
                _CHECKS[kind](module_entries()[name], Result(name, mode, PASS))
            else:
                _CHECKS[kind](op_entries()[name], dtype, Result(name, mode, PASS))
    except Exception:  # noqa: BLE001
        return traceback.format_exc()
    return "passed"
