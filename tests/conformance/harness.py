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
import itertools
import re
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
ENTRY_TIMEOUT_S = 30

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
# How many samples of an entry a mode checks (its first ones; generators are deterministic):
# a bound on the sweep's time. float32 entries have 8 samples at the median; 43 of them have
# more than 64 (max_pool2d has 1440).
SAMPLE_CAPS: dict[str, int | None] = {mode: 8 for mode in MODES}
SAMPLE_CAPS.update(eager_float32=64, backward_float32=64, compiled_float32=64, module_forward=16,
                   module_backward=16)
_cap: list[int | None] = [None]  # the running entry's cap (entries run one at a time)


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


class EntryTimeout(BaseException):
    """The entry ran past its time limit (a BaseException, so no ``except Exception`` in the
    code under test or in the harness swallows it)."""


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


_NOT_COMPARABLE = re.compile(r"determinis|undefined", re.IGNORECASE)


def compare_cpu_skip(op) -> str | None:
    """Why the OpInfo skips ``test_compare_cpu``, when the reason is that results are not
    comparable (non-deterministic or undefined outputs); other skips ("Skipped!") don't count."""
    for info in getattr(op, "decorators", ()) or ():
        if not hasattr(info, "test_name") or info.device_type is not None or not info.active_if:
            continue
        for deco in info.decorators:
            if getattr(deco, "__qualname__", "").startswith("skip."):
                reason = str(inspect.getclosurevars(deco).nonlocals.get("reason", ""))
                if "not comparable" in reason or (info.test_name == "test_compare_cpu"
                                                  and _NOT_COMPARABLE.search(reason)):
                    return reason
    return None


# ---------------------------------------------------------------- moving and comparing

def _leaf_copy(t: torch.Tensor, device: str) -> torch.Tensor:
    """An independent copy of ``t`` on ``device`` (a partial view keeps its whole storage)."""
    if _partial_view(t):
        return _storage_copy(t, device)
    out = t.detach().to(device) if device != "cpu" else t.detach().clone()
    return out.requires_grad_(t.requires_grad)


def _partial_view(t: torch.Tensor) -> bool:
    """A view that sees only part of its storage (``as_strided`` samples reach beyond it)."""
    if t.requires_grad or t.is_conj() or t.is_neg() or t.layout != torch.strided or t.device.type != "cpu":
        return False
    return t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size()


def _storage_copy(t: torch.Tensor, device: str) -> torch.Tensor:
    storage = t.untyped_storage()
    flat = torch.empty(0, dtype=t.dtype).set_(storage, 0, (storage.nbytes() // t.element_size(),), (1,))
    flat = flat.clone() if device == "cpu" else flat.to(device)
    return flat.as_strided(t.shape, t.stride(), t.storage_offset())


def to_device(value, device: str):
    """Copy every tensor in a nested structure to ``device`` (leaves keep ``requires_grad``)."""
    return tree_map(lambda x: _leaf_copy(x, device) if isinstance(x, torch.Tensor) else x, value)


class DeviceMismatch(AssertionError):
    """A result that should live on tpu came back on another device."""


def to_host(value, strict: bool = True):
    """Bring a result to the CPU for comparison; ``strict``: a tensor not on tpu is an error."""
    def host(x):
        if not isinstance(x, torch.Tensor):
            return x
        if strict and x.device.type != DEVICE:
            raise DeviceMismatch(f"result tensor is on {x.device}, expected {DEVICE}")
        return x.detach().cpu()

    return tree_map(host, value)


def assert_same(actual, expected, atol: float, rtol: float, metadata_only: bool = False,
                tensors_only: bool = False) -> None:
    """``actual`` (already on the host) equals the CPU result within tolerance.

    Tensors and numbers are compared with ``assert_close``; other leaves (strings, dtypes, None)
    with ``==`` unless ``tensors_only``.
    """
    flat_a, spec_a = tree_flatten(actual)
    flat_e, spec_e = tree_flatten(expected)
    if spec_a != spec_e:
        raise AssertionError(f"result structure differs: {spec_a} vs {spec_e}")
    close_a, close_e = [], []
    for a, e in zip(flat_a, flat_e):
        if isinstance(e, torch.Tensor):
            if metadata_only:
                if not isinstance(a, torch.Tensor) or a.shape != e.shape or a.dtype != e.dtype:
                    raise AssertionError(f"result metadata differs: {_meta(a)} vs {_meta(e)}")
                continue
            close_a.append(a)
            close_e.append(e)
        elif isinstance(e, (bool, int, float, complex)) and not metadata_only and not tensors_only:
            close_a.append(a)
            close_e.append(e)
        elif not tensors_only and not metadata_only and a != e:
            raise AssertionError(f"result differs: {a!r} vs {e!r}")
    if close_e:
        if atol == 0 and rtol == 0:
            # an exact (integer or bool) sample dtype: floating results of it (sqrt of an int
            # tensor, special functions) get their own dtype's default, as assert_close gives them
            atol = rtol = None
        torch.testing.assert_close(close_a, close_e, atol=atol, rtol=rtol, equal_nan=True,
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


_MISSING = re.compile(r"Could not run '([^']+)' on the tpu device")


def _missing_op(exc: BaseException | None) -> str | None:
    """The aten op a failure names as having no lowering (looking through wrapped causes)."""
    while exc is not None:
        match = _MISSING.search(str(exc))
        if match:
            return match.group(1)
        exc = exc.__cause__ or exc.__context__
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


def no_cpu_fallback():
    return torch.tpu.cpu_fallback_enabled(False)


def _fallback_count() -> int:
    from torchtpu import metrics

    return sum(metrics.fallbacks.values())


def run_entry(name: str, mode: str, timeout: int = ENTRY_TIMEOUT_S, max_samples: int | None = -1) -> Result:
    """Check one entry in one mode; never raises (every outcome is a ``Result``).

    ``max_samples``: check only the first ones (None: all; default: the mode's ``SAMPLE_CAPS``).
    """
    kind, dtype = MODES[mode]
    _cap[0] = SAMPLE_CAPS[mode] if max_samples == -1 else max_samples
    entry = module_entries()[name] if kind in MODULE_KINDS else op_entries()[name]
    args = (entry,) if kind in MODULE_KINDS else (entry, dtype)
    result = Result(name, mode, PASS)
    start = time.perf_counter()
    fallbacks = _fallback_count()
    try:
        with no_cpu_fallback(), time_limit(timeout):
            _CHECKS[kind](*args, result)
    except NotApplicable as exc:
        result.status, result.error = NA, str(exc)
    except _Skip as exc:
        result.status, result.error = SKIP, str(exc)
    except (Exception, EntryTimeout) as exc:  # noqa: BLE001 - every failure of the op under test is a result
        result.status = FAIL
        missing = _missing_op(exc)
        summary = f"no lowering for {missing} (CPU fallback off)" if missing else _first_line(exc)
        result.error = f"[sample {result.samples}] {summary}"
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


def _seed(seed: int) -> None:
    """Seed the CPU generator only (torch.manual_seed also walks every device's lazy-init hooks)."""
    torch.default_generator.manual_seed(seed)


def _samples(op, dtype: torch.dtype, requires_grad: bool) -> Iterator:
    _seed(0)
    yield from itertools.islice(op.sample_inputs("cpu", dtype, requires_grad=requires_grad), _cap[0])


def _call(fn: Callable, sample):
    return sample.output_process_fn_grad(fn(sample.input, *sample.args, **sample.kwargs))


def _reproducible(op, sample, expected) -> bool:
    """Whether the CPU result is the same under another seed (False for random ops)."""
    _seed(12345)
    again = _call(op, _transform(sample, "cpu"))
    try:
        assert_same(again, expected, 0.0, 0.0)
        return True
    except AssertionError:
        return False


def _seeded_cpu(op, sample):
    _seed(0)
    return _call(op, sample)


def _check_forward(op, dtype: torch.dtype, result: Result, fn: Callable | None = None) -> None:
    """Forward: outputs and the (possibly mutated) inputs match the CPU run of the same sample."""
    if dtype not in op.supported_dtypes("cpu"):
        raise NotApplicable(f"{dtype} is not among the OpInfo's CPU dtypes")
    atol, rtol = tolerance(op, dtype)
    skip_reason = compare_cpu_skip(op) or _reseeds(op)
    run_tpu = fn or op
    reproducible, checked = True, 0
    for sample in _samples(op, dtype, requires_grad=False):
        tpu_sample = _transform(sample, DEVICE)
        if not _touches_device(tpu_sample):
            continue  # no tensor and no device= argument: the call never reaches tpu
        cpu_sample = _transform(sample, "cpu")
        try:
            expected = _seeded_cpu(op, cpu_sample)
        except Exception as exc:  # noqa: BLE001 - an error input: tpu must refuse it too
            _expect_error(run_tpu, tpu_sample, exc)
            result.samples += 1
            continue
        if checked < _RANDOM_CHECK_ELEMENTS:  # a random op is random for every sample: check a few
            reproducible = reproducible and _reproducible(op, sample, expected)
            checked += sum(t.numel() for t in tree_flatten(expected)[0] if isinstance(t, torch.Tensor))
        metadata_only = skip_reason is not None or not reproducible
        if metadata_only:
            result.note = f"compared shape/dtype only: {skip_reason or 'CPU result changes with the seed'}"
        try:
            actual = to_host(_call(run_tpu, tpu_sample))
        except RuntimeError as exc:
            if not _WANTS_CPU.search(str(exc)):
                raise
            tpu_sample = _host_indices(sample)
            actual = to_host(_call(run_tpu, tpu_sample))
        try:
            assert_same(actual, expected, atol, rtol, metadata_only)
        except AssertionError:
            if metadata_only or not _as_accurate(actual, expected, lambda: _seeded_cpu(op, _float64(sample)), atol, rtol):
                raise
            result.note = FP64_NOTE
        assert_same(to_host(_inputs(tpu_sample), strict=False), _inputs(cpu_sample), atol, rtol, metadata_only,
                    tensors_only=True)
        result.samples += 1
    if result.samples == 0:
        raise NotApplicable(f"the OpInfo has no {dtype} samples that reach {DEVICE}")


def _reseeds(op) -> str | None:
    """OpInfo wraps its random ops in ``wrapper_set_seed`` (a fixed seed per call): their CPU and
    tpu results come from different generators, so only metadata is comparable."""
    code = getattr(op.op, "__code__", None)
    if code is not None and "wrapper_set_seed" in code.co_names:
        return "random op (OpInfo reseeds it with wrapper_set_seed)"
    return None


_RANDOM_CHECK_ELEMENTS = 16  # output elements compared under two seeds before an op counts as deterministic
_WANTS_CPU = re.compile(r"to be on cpu|on CPU|cpu tensor", re.IGNORECASE)
FP64_NOTE = "outside assert_close tolerance, but as close to a float64 CPU result as the CPU result is"


def _touches_device(sample) -> bool:
    leaves = tree_flatten(_inputs(sample))[0]
    return any(isinstance(x, torch.Tensor) or (isinstance(x, torch.device) and x.type == DEVICE)
               for x in leaves) or sample.kwargs.get("device") == DEVICE


def _expect_error(fn: Callable, sample, cpu_error: Exception) -> None:
    try:
        _call(fn, sample)
    except Exception as exc:  # noqa: BLE001 - any refusal matches the CPU's, but a missing lowering
        if _missing_op(exc):
            raise
        return
    raise AssertionError(f"CPU raised {type(cpu_error).__name__} ({_first_line(cpu_error)[:80]}) but {DEVICE} did not")


_WIDER = {torch.float32: torch.float64, torch.float16: torch.float64, torch.bfloat16: torch.float64,
          torch.complex64: torch.complex128, torch.complex32: torch.complex128}


def _float64(sample):
    """The sample on the CPU with floating tensors widened to 64 bits (the accuracy reference)."""
    def widen(x):
        if isinstance(x, torch.Tensor):
            return x.detach().to(_WIDER.get(x.dtype, x.dtype)).requires_grad_(x.requires_grad)
        return x

    return sample.transform(widen)


def _rmse(x: torch.Tensor) -> float:
    return float(torch.sqrt(torch.mean(x.abs().to(torch.float64) ** 2))) if x.numel() else 0.0


def _as_accurate(actual, expected, reference: Callable, atol: float, rtol: float) -> bool:
    """Inductor's accuracy rule (``torch._dynamo.utils.same`` with an fp64 reference): a float
    result outside tolerance still counts when its RMS error against a float64 CPU run is at
    most twice the CPU result's (plus a hair of slack); everything else must match exactly."""
    try:
        ref = reference()
    except Exception:  # noqa: BLE001 - no float64 reference: the plain comparison stands
        return False
    flat_a, spec_a = tree_flatten(actual)
    flat_e, spec_e = tree_flatten(expected)
    flat_r, spec_r = tree_flatten(ref)
    if not (spec_a == spec_e == spec_r):
        return False
    for a, e, r in zip(flat_a, flat_e, flat_r):
        if not isinstance(e, torch.Tensor) or not (e.is_floating_point() or e.is_complex()):
            try:
                assert_same(a, e, 0.0, 0.0)
            except AssertionError:
                return False
            continue
        if not isinstance(a, torch.Tensor) or a.shape != e.shape or a.dtype != e.dtype or r.shape != e.shape:
            return False
        finite = torch.isfinite(e)
        if not torch.equal(finite, torch.isfinite(a)):
            return False
        try:
            torch.testing.assert_close(a[~finite], e[~finite], equal_nan=True)
        except AssertionError:
            return False
        wide = _WIDER.get(e.dtype, e.dtype)
        a64, e64, r64 = (t[finite].to(wide) for t in (a, e, r))
        if _rmse(a64 - r64) > 2 * _rmse(e64 - r64) + atol / 10 + rtol * _rmse(r64):
            return False
    return True


def _transform(sample, device: str):
    """A copy of ``sample`` on ``device``: tensors copied, factory ``device=`` arguments retargeted."""
    moved = sample.transform(lambda x: _leaf_copy(x, device) if isinstance(x, torch.Tensor) else x)
    if device == "cpu":
        return moved
    retarget = functools.partial(_retarget, device=device)
    moved.args = tuple(retarget(a) for a in moved.args)
    moved.kwargs = {k: (device if k == "device" and v is not None else retarget(v)) for k, v in moved.kwargs.items()}
    return moved


def _retarget(value, device: str):
    if (isinstance(value, torch.device) and value.type == "cpu") or value == "cpu":
        return torch.device(device) if isinstance(value, torch.device) else device
    return value


def _host_indices(sample):
    """``sample`` with its integer tensor arguments (not its input) back on the CPU: some ops
    demand CPU index tensors (``tensor_split``'s sections), as PyTorch's own samples make them."""
    host = _transform(sample, "cpu")
    moved = _transform(sample, DEVICE)
    keep = lambda t: t if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool else None  # noqa: E731

    def pick(on_device, on_host):
        if isinstance(on_device, torch.Tensor):
            return on_device if keep(on_host) is not None else on_host
        return on_device

    moved.args = tuple(tree_map(pick, list(moved.args), list(host.args)))
    moved.kwargs = {k: tree_map(pick, v, host.kwargs[k]) for k, v in moved.kwargs.items()}
    return moved


def _inputs(sample):
    return (sample.input, sample.args, sample.kwargs)


def _check_compiled(op, dtype: torch.dtype, result: Result) -> None:
    reason = compile_unavailable()
    if reason:
        raise _Skip(reason)
    import torch._dynamo

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    def call(*args, **kwargs):
        return op(*args, **kwargs)

    compiled = torch.compile(call, backend=DEVICE, dynamic=False)
    _check_forward(op, dtype, result, fn=compiled)
    breaks = sum(counters["graph_break"].values())
    if breaks:
        result.note = "; ".join(filter(None, [result.note, f"{breaks} graph breaks (those parts ran eagerly)"]))


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
        _seed(0)
        cotangents, expected = _gradients(op, cpu_sample, None, "cpu")
        if expected is None:
            continue
        _, actual = _gradients(op, tpu_sample, cotangents, DEVICE)
        actual, expected = to_host(list(actual)), list(expected)
        try:
            assert_same(actual, expected, atol, rtol)
        except AssertionError:
            wide = [c.to(_WIDER.get(c.dtype, c.dtype)) for c in cotangents]
            if not _as_accurate(actual, expected, lambda: list(_gradients(op, _float64(sample), wide, "cpu")[1]),
                                atol, rtol):
                raise
            result.note = FP64_NOTE
        result.samples += 1
    if result.samples == 0:
        raise NotApplicable("no sample has a differentiable output")


# ---------------------------------------------------------------- modules

def _module_inputs(info, requires_grad: bool) -> list:
    _seed(0)
    inputs = info.module_inputs_func(info, device="cpu", dtype=torch.float32,
                                     requires_grad=requires_grad, training=True)
    return list(itertools.islice(inputs, _cap[0]))


def _build_module(info, module_input) -> torch.nn.Module:
    """The module on the CPU, seeded; a lazy one is materialised by a first call (moving an
    uninitialised lazy module to another device makes its parameters empty tensors)."""
    _seed(0)
    c = module_input.constructor_input
    module = info.module_cls(*c.args, **c.kwargs).to(torch.float32)
    module.train(True)
    if info.is_lazy:
        f = module_input.forward_input
        with torch.no_grad():
            module(*to_device(f.args, "cpu"), **to_device(f.kwargs, "cpu"))
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
    _seed(12345)
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
        _seed(0)
        expected = cpu_module(*to_device(args, "cpu"), **to_device(kwargs, "cpu"))
        metadata_only = not _module_reproducible(info, module_input, expected)
        if metadata_only:
            result.note = "compared shape/dtype only: CPU result changes with the seed"
        actual = to_host(tpu_module(*to_device(args, DEVICE), **to_device(kwargs, DEVICE)))
        try:
            assert_same(actual, expected, atol, rtol, metadata_only)
        except AssertionError:
            if metadata_only or not _as_accurate(actual, expected, lambda: _module_call(*_module_float64(info, module_input)),
                                                 atol, rtol):
                raise
            result.note = FP64_NOTE
        result.samples += 1
    if result.samples == 0:
        raise NotApplicable("the ModuleInfo has no forward inputs")


def _module_call(module, args, kwargs):
    _seed(0)
    return module(*args, **kwargs)


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


def _widen(value):
    return tree_map(lambda x: x.detach().to(_WIDER.get(x.dtype, x.dtype)).requires_grad_(x.requires_grad)
                    if isinstance(x, torch.Tensor) else x, value)


def _module_float64(info, module_input):
    """The CPU module and its forward inputs widened to 64 bits (the accuracy reference)."""
    module = _build_module(info, module_input).to(torch.float64)
    f = module_input.forward_input
    return module, _widen(f.args), _widen(f.kwargs)


def _module_grads_float64(info, module_input, cotangents):
    module, args, kwargs = _module_float64(info, module_input)
    wide = [c.to(_WIDER.get(c.dtype, c.dtype)) for c in cotangents]
    return _module_grads(module, args, kwargs, wide, "cpu")[1]


def _check_module_backward(info, result: Result) -> None:
    """Module backward: input and parameter gradients match the CPU module's."""
    _module_skip(info)
    atol, rtol = _default_tolerance(torch.float32)
    for module_input in _module_inputs(info, requires_grad=True):
        if module_input.forward_input is None:
            continue
        cpu_module, tpu_module, (args, kwargs) = _module_pair(info, module_input)
        _seed(0)
        cotangents, expected = _module_grads(cpu_module, args, kwargs, None, "cpu")
        if expected is None:
            continue
        expected_again = _module_grads(_build_module(info, module_input), args, kwargs, cotangents, "cpu")[1]
        try:
            assert_same(expected_again, expected, 0.0, 0.0)
        except AssertionError:
            continue  # random module (dropout): gradients are not comparable
        _, actual = _module_grads(tpu_module, args, kwargs, cotangents, DEVICE)
        actual = to_host(actual)
        try:
            assert_same(actual, expected, atol, rtol)
        except AssertionError:
            if not _as_accurate(actual, expected, lambda: _module_grads_float64(info, module_input, cotangents),
                                atol, rtol):
                raise
            result.note = FP64_NOTE
        result.samples += 1
    if result.samples == 0:
        raise NotApplicable("no module input has a differentiable, reproducible output")


_CHECKS: dict[str, Callable] = {
    "eager": _check_forward,
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
