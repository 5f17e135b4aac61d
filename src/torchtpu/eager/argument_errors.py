"""The boundary between a lowering's argument errors and the exceptions PyTorch users catch.

A lowering that JAX refuses while tracing raises JAX's exception (``TypeError`` for a dtype,
``ValueError`` for a shape, an ``AssertionError`` of a helper): PyTorch raises ``RuntimeError``,
``IndexError`` or ``NotImplementedError`` for the same call, with its own wording. One rule, for
every eager kernel: such an exception is answered by what PyTorch itself says of the same
arguments. The call is run again by PyTorch's CPU kernel (on the arguments' values when they are
small, else on meta tensors of the same geometry, which run PyTorch's shape and dtype checks);
its exception is raised, with JAX's chained to it. Where PyTorch accepts the call, the refusal is
torchtpu's own, and a ``RuntimeError`` names the op and says what JAX said.

This runs only on the error path: a call that works pays nothing for it.

Some arguments PyTorch refuses are ones a lowering would compute an answer from (a float
``alpha`` for integers, a negative standard deviation, bounds outside the dtype): ``CHECKS``
holds PyTorch's check for those, by op name, run before every overload of the op (functional,
in-place and ``out=``) and only for those ops.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings

import torch

from torchtpu.runtime.compat import pytree
from torchtpu.runtime.dtypes import UnsupportedDtype

# What JAX (and jnp helpers) raise for arguments they refuse while tracing.
FOREIGN = (TypeError, ValueError, AssertionError)
# The reference runs on the arguments' values up to this many elements in all, else on meta tensors.
_VALUES_LIMIT = 1 << 20


def guarded(op, kernel):
    """``kernel`` (the eager kernel of ``op``) with PyTorch's argument checks of ``CHECKS`` and its
    foreign argument errors made PyTorch's."""
    arguments = op._schema.arguments
    names = [a.name for a in arguments]
    checks = [(fn, when) for fn, when in CHECKS.get(op._schema.name.split("::")[-1].rstrip("_"), ())
              if not when or any(n in names for n in when)]
    outs = tuple(a.name for a in arguments if a.is_out)
    if outs:
        checks.append((functools.partial(_out_contract, op, outs, {}), outs))

    def call(*args, **kwargs):
        try:
            return kernel(*args, **kwargs)
        except UnsupportedDtype:  # torchtpu's own refusal, already clear
            raise
        except FOREIGN as exc:
            raise pytorch_error(op, exc, args, kwargs) from exc

    if not checks:
        call.kernel = kernel
        return call
    defaults = {a.name: a.default_value for a in arguments if a.has_default_value()}
    # a check runs when one of its arguments is given (add's alpha: rarely), or always (``when`` empty)
    triggers = [(fn, tuple(when), min((names.index(n) for n in when if n in names), default=0))
                for fn, when in checks]

    def checked(*args, **kwargs):
        bound = None
        for fn, when, position in triggers:
            if when and len(args) <= position and not any(n in kwargs for n in when):
                continue
            if bound is None:
                bound = {**defaults, **dict(zip(names, args)), **kwargs}
            fn(bound)
        return call(*args, **kwargs)

    checked.kernel = kernel
    return checked


def validate(op, args: tuple, kwargs: dict):
    """PyTorch's own checks of a call's shapes, dtypes and static arguments: its meta kernel, run
    on meta tensors of the call's geometry. Run once per eager program (the first call of each
    static key, where the lowering is traced anyway), so a call PyTorch refuses is refused here
    too, with PyTorch's exception, instead of computing an answer. A meta kernel's refusal is
    confirmed on the CPU, on the values (where they are too large to copy, or the CPU kernel
    accepts the call, it stands: a meta kernel can be stricter than the CPU's). Returns the meta
    kernel's outputs (their strides are PyTorch's memory layout of the results), or None."""
    if op.namespace != "aten":
        return None
    reference = _reference_args(args, kwargs, "meta")
    if reference is None:
        return None
    if op._schema.name in _MASK_INDEXING:  # the byte-mask warning is given per call (_byte_mask), not here
        reference = _bool_masks(op, reference)
    try:
        return op(*reference[0], **reference[1])
    except NotImplementedError:  # no meta kernel (data-dependent ops): no verdict
        return None
    except Exception as meta_error:  # noqa: BLE001 - PyTorch's verdict, whatever it is
        error = _cpu_verdict(op, args, kwargs)  # None also where too big to confirm: no verdict
        if error is not None:
            raise error from meta_error


def _cpu_verdict(op, args: tuple, kwargs: dict) -> BaseException | None:
    """The exception PyTorch's CPU kernel raises for the call on its values, or None."""
    reference = _reference_args(args, kwargs, "cpu")
    if reference is None:
        return None
    try:
        op(*reference[0], **reference[1])
    except Exception as error:  # noqa: BLE001
        return None if _no_kernel(error) else error
    return None


def _no_kernel(error: BaseException) -> bool:
    """Whether ``error`` says the reference device has no kernel for the op (no verdict)."""
    return isinstance(error, NotImplementedError) and "Could not run" in str(error)


def _out_contract(op, outs: tuple, accepted: dict, bound: dict) -> None:
    """PyTorch's ``out=`` rules (which dtypes an output may have, whether it may overlap an input)
    differ by op; where an ``out=`` tensor shares a storage with an input, overlaps itself, or has another dtype than an
    input, PyTorch's CPU kernel is asked, once per geometry (``accepted`` remembers
    which calls it accepted; a refusal is not remembered: it may depend on the values)."""
    written = [t for name in outs for t in _tensors(bound.get(name))]
    inputs = [t for name, v in bound.items() if name not in outs for t in _tensors(v)]
    if not written or not inputs:
        return
    # every input's dtype: cat([float, complex], out=float) is refused though out has the first's
    if all(t.dtype == i.dtype for t in written for i in inputs) and not any(map(_self_overlapping, written)) and \
            not any(_shares_storage(w, t) for w in written for t in inputs):
        return
    key = _geometry(bound)
    if key is not None and key in accepted:
        return
    args = {name: v for name, v in bound.items()}
    error = _cpu_verdict(op, (), args)
    if error is not None:
        raise error
    if key is not None and len(accepted) < 1024:
        accepted[key] = True


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def _geometry(bound: dict):
    """A hashable key of a call's dtypes, shapes, strides and aliasing, and its other arguments."""
    groups: dict = {}
    parts = []
    for name, value in bound.items():
        for v in (value if isinstance(value, (list, tuple)) else (value,)):
            if isinstance(v, torch.Tensor):
                group = groups.setdefault(v.untyped_storage()._cdata, len(groups))
                parts.append((name, v.dtype, tuple(v.shape), v.stride(), v.storage_offset(), group))
            else:
                parts.append((name, v))
    try:
        hash(tuple(parts))
    except TypeError:
        return None
    return tuple(parts)


def pytorch_error(op, exc: BaseException, args: tuple, kwargs: dict) -> BaseException:
    """The exception PyTorch raises for ``op(*args, **kwargs)``, which a lowering refused with
    ``exc``; a ``RuntimeError`` naming the op if PyTorch accepts the call."""
    for device in ("cpu", "meta"):
        reference = _reference_args(args, kwargs, device)
        if reference is None:
            continue
        try:
            op(*reference[0], **reference[1])
        except Exception as expected:  # noqa: BLE001 - PyTorch's own verdict, whatever it is
            if _no_kernel(expected) or isinstance(expected, NotImplementedError) and device == "meta":
                continue  # no kernel there: no verdict
            return expected
        else:
            break
    return RuntimeError(f"tpu: {op} refused these arguments, which PyTorch's CPU kernel accepts: {exc}. "
                        f"Move the tensors to the CPU for this op, or report it as a torchtpu bug.")


def _reference_args(args: tuple, kwargs: dict, device: str):
    """``(args, kwargs)`` with every tpu tensor replaced by a CPU copy of its values (``cpu``, when
    all are small) or a meta tensor of its geometry (``meta``); None if that cannot be made. CPU
    copies keep the aliasing: tensors sharing a storage are views of one copy of it, so that
    PyTorch's overlap checks (an ``out=`` that is also an input) see what the call does."""
    tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and a.device.type == "tpu"]
    if device == "cpu" and sum(t.untyped_storage().nbytes() for t in tensors) > _VALUES_LIMIT:
        return None
    storages: dict = {}  # storage id -> its CPU copy, as a flat tensor of the first dtype seen

    def copy(a):
        key = a.untyped_storage()._cdata
        base = storages.get(key)
        if base is None:
            n = a.untyped_storage().nbytes() // a.element_size()
            # (cloned: a copy from the device is not resizable, and an out= reference may be resized)
            base = storages[key] = a.detach().as_strided((n,), (1,), 0).cpu().clone()
        if base.dtype != a.dtype:
            raise TypeError("a storage read in two dtypes")
        return base.as_strided(a.shape, a.stride(), a.storage_offset())

    def convert(a):
        if isinstance(a, torch.device) and a.type == "tpu":  # a factory's device=
            return torch.device(device)
        if isinstance(a, torch.Generator):  # the stream does not change what is checked
            return None
        if not isinstance(a, torch.Tensor):
            return a
        if device == "meta":  # CPU tensors too (a CPU index list, a 0-d scalar): one device
            return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
        return copy(a) if a.device.type == "tpu" else a

    try:
        with torch.no_grad():
            return pytree.tree_map(convert, (args, kwargs))
    except Exception:  # noqa: BLE001 - the values cannot be read (a capture, a failed device)
        return None


# ---------------------------------------------------------------- PyTorch's value checks, by op

CHECKS: dict[str, tuple] = {}


def check(*ops: str, when: tuple[str, ...] = ()):
    """Register a check of an op's bound arguments (name -> value) for every overload of ``ops``
    (those with an argument named in ``when``, if given), run when one of ``when`` is passed (every
    call if ``when`` is empty)."""
    def register(fn):
        for name in ops:
            CHECKS[name] = CHECKS.get(name, ()) + ((fn, when),)
        return fn
    return register


# C++ type names, as PyTorch's messages print them
_CPP_NAMES = {torch.bool: "bool", torch.uint8: "unsigned char", torch.int8: "signed char", torch.int16: "short int",
              torch.int32: "int", torch.int64: "long int", torch.uint16: "short unsigned int",
              torch.uint32: "unsigned int", torch.uint64: "long unsigned int",
              torch.float16: "c10::Half", torch.bfloat16: "c10::BFloat16",
              torch.float32: "float", torch.float64: "double", torch.complex64: "c10::complex<float>",
              torch.complex128: "c10::complex<double>"}
_SCALAR_NAMES = {torch.bool: "Bool", torch.uint8: "Byte", torch.int8: "Char", torch.int16: "Short",
                 torch.int32: "Int", torch.int64: "Long"}


def _number(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


@check("add", "sub", when=("alpha",))
def _alpha(bound: dict) -> None:
    alpha = bound.get("alpha")
    if alpha is None or alpha.__class__ is int and alpha == 1:
        return
    # PyTorch's alpha_check, in its order
    dtype = torch.result_type(bound["self"], bound["other"])
    if isinstance(alpha, bool) and dtype != torch.bool:
        raise RuntimeError("Boolean alpha only supported for Boolean results.")
    if not dtype.is_floating_point and not dtype.is_complex and not isinstance(alpha, int):
        raise RuntimeError("For integral input tensors, argument alpha must not be a floating point number.")
    if not dtype.is_complex and isinstance(alpha, complex):
        raise RuntimeError("For non-complex input tensors, argument alpha must not be a complex number.")


@check("clamp")
def _clamp_bounds(bound: dict) -> None:
    if bound.get("min") is None and bound.get("max") is None:
        raise RuntimeError("torch.clamp: At least one of 'min' or 'max' must not be None")


@check("random")
def _random_range(bound: dict) -> None:
    """PyTorch's ``random_from_to_impl`` checks (``DistributionTemplates.h``), in its order and
    wording: from < to; for floating dtypes the ends moved to where the dtype's rounding keeps
    draws inside (``update_from``/``update_to``, which the lowering uses too); both ends within
    the dtype; for floating dtypes a warning where an end lies past +-2^digits."""
    from torchtpu.ops.random import DIGITS, float_bounds

    dtype = bound["self"].dtype
    if dtype.is_complex or "to" not in bound and "from" not in bound:
        return
    low = bound.get("from", 0)
    high = bound.get("to")
    digits = DIGITS.get(dtype)
    if high is not None:
        if low >= high:
            raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got from={low} >= to={high}")
        if digits is not None:
            low, high = float_bounds(dtype, low, high)
            if low >= high:
                raise RuntimeError("random_ expects 'from' casted to dtype to be less than 'to' casted to dtype, "
                                   f"but got from={low} >= to={high}")
        to_inc = high - 1
    elif low == torch.iinfo(torch.int64).min:
        return  # the full 64-bit range: nothing to check
    elif digits is not None:  # [from, 2^digits]
        to_inc = min(2 ** digits, torch.iinfo(torch.int64).max)
        low, _ = float_bounds(dtype, low, None)
        if low >= to_inc:
            raise RuntimeError("random_ expects 'from' casted to dtype to be less than or equal to 'to_inc' casted "
                               f"to dtype, but got from={low} > to_inc={to_inc}")
    else:  # [from, the dtype's largest value]
        to_inc = 1 if dtype == torch.bool else torch.iinfo(dtype).max
    if dtype.is_floating_point:
        info = (torch.finfo(dtype).min, torch.finfo(dtype).max)
    elif dtype == torch.uint64:
        info = (0, torch.iinfo(torch.int64).max)
    else:
        info = (0, 1) if dtype == torch.bool else (torch.iinfo(dtype).min, torch.iinfo(dtype).max)
    if not info[0] <= low <= info[1]:
        raise RuntimeError(f"from is out of bounds for {_CPP_NAMES[dtype]}")
    if not info[0] <= to_inc <= info[1]:
        raise RuntimeError(f"to - 1 is out of bounds for {_CPP_NAMES[dtype]}")
    if digits is not None:
        for value, name in ((low, "from"), (to_inc, "to - 1")):
            if not -(2 ** digits) <= value <= 2 ** digits:
                warnings.warn(f"{name} is out of bounds [-(2^{digits}), 2^{digits}]. Due to precision limitations "
                              f"{_CPP_NAMES[dtype]} can support discrete uniform distribution only within this "
                              "range. This warning will become an error in version 1.7 release, please fix the "
                              "code in advance", UserWarning, stacklevel=2)


@check("complex", "polar")
def _complex_parts(bound: dict) -> None:
    """PyTorch's ``complex_check_dtype``, in its order and wording."""
    from torchtpu.runtime.dtypes import scalar_type_name

    first, second = (bound.get("real"), bound.get("imag")) if "real" in bound else (bound.get("abs"), bound.get("angle"))
    if not isinstance(first, torch.Tensor) or not isinstance(second, torch.Tensor):
        return
    floats = (torch.float16, torch.float32, torch.float64)
    a, b = first.dtype, second.dtype
    if a not in floats or b not in floats:
        raise RuntimeError(f"Expected both inputs to be Half, Float or Double tensors but got "
                           f"{scalar_type_name(a)} and {scalar_type_name(b)}")
    if a != b:
        raise RuntimeError(f"Expected object of scalar type {scalar_type_name(a)} but got scalar type "
                           f"{scalar_type_name(b)} for second argument")
    out = bound.get("out")
    expected = {torch.float16: torch.complex32, torch.float32: torch.complex64, torch.float64: torch.complex128}[a]
    if isinstance(out, torch.Tensor) and out.dtype != expected:
        raise RuntimeError(f"Expected object of scalar type {scalar_type_name(expected)} but got scalar type "
                           f"{scalar_type_name(out.dtype)} for argument 'out'")


@check("normal")
def _normal_std(bound: dict) -> None:
    std = bound.get("std")
    if isinstance(std, (int, float)) and std < 0:
        raise RuntimeError(f"normal expects std >= 0.0, but found std {_number(std)}")
    if isinstance(std, torch.Tensor):
        if std.is_complex():
            raise RuntimeError("normal expects standard deviation to be non-complex")
        # PyTorch reads std's minimum to the host (CUDA too): a synchronisation, as there
        if std.numel() and not bool(std.min().ge(0).item()):
            raise RuntimeError("normal expects all elements of std >= 0.0")
    _floating("normal_kernel_cpu", bound)


@check("uniform", "rand")
def _uniform(bound: dict) -> None:
    low, high = bound.get("from", 0), bound.get("to", 1)
    self = bound.get("self")
    if isinstance(self, torch.Tensor) and (self.dtype.is_floating_point or self.dtype.is_complex) \
            and not (self.is_complex() and self.numel() == 0):
        _uniform_bounds(self.dtype.to_real(), float(low), float(high))
    elif isinstance(low, (int, float)) and isinstance(high, (int, float)) and low > high:
        raise RuntimeError(f"uniform_ expects to return a [from, to) range, but found from={_number(low)} "
                           f"> to={_number(high)}")
    _floating("check_uniform_bounds", bound)


def _uniform_bounds(dtype: torch.dtype, low: float, high: float) -> None:
    """PyTorch's uniform_ checks, in its order: both bounds within the dtype's range (NaN is not),
    ``from <= to``, and ``to - from`` (in double) within the dtype's maximum."""
    info = torch.finfo(dtype)
    for name, value in (("from", low), ("to", high)):
        if not info.min <= value <= info.max:
            raise RuntimeError(f"{name} is out of bounds for {_CPP_NAMES[dtype]}")
    if low > high:
        raise RuntimeError(f"uniform_ expects to return a [from, to) range, but found from={_number(low)} "
                           f"> to={_number(high)}")
    if high - low > info.max:
        raise RuntimeError(f"uniform_ expects to-from <= std::numeric_limits<{_TYPE_NAMES[dtype]}>::max(), but "
                           f"found to={_number(high)} and from={_number(low)} which result in to-from to exceed "
                           f"the limit")


@check("randint", "randint_like", "random")
def _random_complex(bound: dict) -> None:
    """Integers drawn into a complex dtype: PyTorch's bounds check has no case for it."""
    dtype = bound.get("dtype")
    if dtype is None and isinstance(bound.get("self"), torch.Tensor):
        dtype = bound["self"].dtype
    given = any(k in bound for k in ("to", "high", "from", "low"))
    # (a schema's default dtype is a ScalarType number: randint's long)
    if isinstance(dtype, torch.dtype) and dtype.is_complex and given:
        raise RuntimeError("check_random_bounds handles only integral, floating-point and boolean types")


@check("empty_strided")
def _empty_strided(bound: dict) -> None:
    size, stride = bound["size"], bound["stride"]
    if len(size) != len(stride):
        raise RuntimeError(f"dimensionality of sizes ({len(size)}) must match dimensionality of strides "
                           f"({len(stride)})")


@check("randn")
def _randn(bound: dict) -> None:
    _floating("normal_kernel_cpu", bound)


@check("exponential")
def _exponential(bound: dict) -> None:
    lambd = bound.get("lambd", 1.0)
    if lambd <= 0:
        raise RuntimeError(f"exponential_ expects lambda > 0.0, but found lambda={_number(lambd)}")
    _floating("exponential_cpu", bound)


def _floating(kernel: str, bound: dict) -> None:
    """A floating-point sampler given an integer dtype (``rand(dtype=torch.int64)``): PyTorch has
    no kernel for it."""
    dtype = bound.get("dtype")
    if dtype is None and isinstance(bound.get("self"), torch.Tensor) and "size" not in bound:
        dtype = bound["self"].dtype
    if dtype in _SCALAR_NAMES:
        raise NotImplementedError(f'"{kernel}" not implemented for \'{_SCALAR_NAMES[dtype]}\'')


@check("lerp", when=("end",))
def _lerp_dtypes(bound: dict) -> None:
    dtype = bound["self"].dtype
    for name in ("end", "weight"):
        other = bound.get(name)
        if isinstance(other, torch.Tensor) and other.dtype != dtype:
            raise RuntimeError(f"expected dtype {_CPP_NAMES.get(dtype, dtype)} for `{name}` but got dtype "
                               f"{_CPP_NAMES.get(other.dtype, other.dtype)}")


_TYPE_NAMES = {**_SCALAR_NAMES, torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float32: "Float",
               torch.float64: "Double", torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble"}


@check("index_fill", when=("value",))
def _index_fill_value(bound: dict) -> None:
    value, dtype = bound.get("value"), bound["self"].dtype
    if isinstance(value, complex) and not dtype.is_complex:
        raise RuntimeError("index_fill_(): Converting complex Scalar to non-complex type is not supported")


@check("index_put", "_index_put_impl", when=("values",))
def _index_put_dtypes(bound: dict) -> None:
    values, dtype = bound.get("values"), bound["self"].dtype
    if isinstance(values, torch.Tensor) and values.dtype != dtype:
        # PyTorch checks that values broadcast to the indexed shape first, which can depend on a
        # mask's values: on this error path the CPU kernel is asked (a read of small arguments)
        reference = {name: bound[name] for name in ("self", "indices", "values", "accumulate") if name in bound}
        error = _cpu_verdict(torch.ops.aten.index_put.default, (), reference)
        if isinstance(error, RuntimeError) and str(error).startswith("shape mismatch"):
            raise error
        raise RuntimeError(f"Index put requires the source and destination dtypes match, got "
                           f"{_TYPE_NAMES.get(dtype, dtype)} for the destination and "
                           f"{_TYPE_NAMES.get(values.dtype, values.dtype)} for the source.")


# PyTorch's deprecation warning for a uint8 mask (IndexingUtils.h), once per uint8 index per call
_BYTE_MASK = "indexing with dtype torch.uint8 is now deprecated, please use a dtype torch.bool instead."
_MASK_INDEXING = ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_")


@check("index", "index_put", "_index_put_impl")
def _byte_mask(bound: dict) -> None:
    for index in bound.get("indices") or ():
        if isinstance(index, torch.Tensor) and index.dtype == torch.uint8:
            warn_at_caller(_BYTE_MASK, UserWarning)


def _bool_masks(op, reference: tuple) -> tuple:
    """An indexing op's reference arguments with its uint8 masks made bool (the same check,
    without the meta kernel's warning, which would come on a program's first call only)."""
    args, kwargs = reference

    def convert(indices):
        return [i.bool() if isinstance(i, torch.Tensor) and i.dtype == torch.uint8 else i for i in indices]

    if "indices" in kwargs:
        return args, {**kwargs, "indices": convert(kwargs["indices"])}
    if len(args) > 1 and isinstance(args[1], (list, tuple)):
        return (args[0], convert(args[1]), *args[2:]), kwargs
    return reference


def warn_at_caller(message: str, category=UserWarning) -> None:
    """``warnings.warn`` attributed to the first frame outside torch and torchtpu: the user's line,
    where a warning of PyTorch's C++ kernels is attributed (so the default filter shows it once
    per line of user code, as on the CPU)."""
    level, frame = 2, sys._getframe(1)  # stacklevel 2: warn_at_caller's caller
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, category, stacklevel=level)


def _library_dirs() -> tuple:
    import torchtpu

    return tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, torchtpu))


_LIBRARY_DIRS = _library_dirs()


@check("nonzero", when=("out",))
def _nonzero_out(bound: dict) -> None:
    out = bound.get("out")
    if isinstance(out, torch.Tensor) and out.dtype != torch.int64:
        raise RuntimeError(f"nonzero: Expected out tensor to have scalar type Long but got scalar type "
                           f"{_TYPE_NAMES.get(out.dtype, out.dtype)}")


@check("cat", when=("out",))
def _cat_out_overlap(bound: dict) -> None:
    out = bound.get("out")
    if isinstance(out, torch.Tensor) and any(_overlap(out, t) for t in bound.get("tensors", ())):
        raise RuntimeError("unsupported operation: some elements of the input tensor and the written-to tensor "
                           "refer to a single memory location. Please clone() the tensor before performing the "
                           "operation.")


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors view one storage (an ``out=`` resized first may then overlap)."""
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


def _self_overlapping(t: torch.Tensor) -> bool:
    """Whether two of ``t``'s elements are one memory location (an expanded tensor)."""
    return any(s == 0 and n > 1 for n, s in zip(t.shape, t.stride()))


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' elements share memory (the spans of their storage they address meet)."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage()._cdata != b.untyped_storage()._cdata:
        return False

    def span(t):
        start = t.storage_offset() * t.element_size()
        extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0) + 1
        return start, start + extent * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


@check("multinomial")
def _multinomial(bound: dict) -> None:
    probs, n, out = bound["self"], bound.get("num_samples"), bound.get("out")
    if not probs.dtype.is_floating_point:
        raise RuntimeError(f"multinomial only supports floating-point dtypes for input, got: "
                           f"{_TYPE_NAMES.get(probs.dtype, probs.dtype)}")
    if isinstance(out, torch.Tensor) and out.dtype != torch.int64:
        raise RuntimeError(f"multinomial expects Long tensor out, got: {_TYPE_NAMES.get(out.dtype, out.dtype)}")
    if n <= 0:
        raise RuntimeError("cannot sample n_sample <= 0 samples")
    if probs.dim() not in (1, 2):
        raise RuntimeError("prob_dist must be 1 or 2 dim")
    categories = probs.shape[-1]
    if not bound.get("replacement") and n > categories:
        raise RuntimeError("cannot sample n_sample > prob_dist.size(-1) samples without replacement")
    if categories > 2 ** 24:
        raise RuntimeError("number of categories cannot exceed 2^24")


@check("bucketize", when=("boundaries",))
def _bucketize(bound: dict) -> None:
    boundaries = bound["boundaries"]
    if boundaries.dim() != 1:
        raise RuntimeError(f"boundaries tensor must be 1 dimension, but got dim({boundaries.dim()})")


@check("complex")
def _complex_parts(bound: dict) -> None:
    real, imag = bound["real"], bound["imag"]
    if real.dtype != imag.dtype and real.dtype.is_floating_point and imag.dtype.is_floating_point:
        raise RuntimeError(f"Expected object of scalar type {_TYPE_NAMES.get(real.dtype)} but got scalar type "
                           f"{_TYPE_NAMES.get(imag.dtype)} for second argument")


@check("masked_scatter")
def _masked_scatter_mask(bound: dict) -> None:
    mask = bound["mask"]
    if mask.dtype != torch.bool:
        raise RuntimeError(f"masked_scatter_ only supports boolean masks, but got mask with dtype "
                           f"{_TYPE_NAMES.get(mask.dtype, mask.dtype)}")


@check("as_strided_scatter")
def _as_strided_bounds(bound: dict) -> None:
    self, size, stride = bound["self"], list(bound["size"]), list(bound["stride"])
    offset = bound.get("storage_offset") or 0
    if any(n == 0 for n in size):
        return
    itemsize = self.element_size()
    needed = itemsize * (offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1)
    have = self.numel() * itemsize
    if needed > have:
        raise RuntimeError(f"setStorage: sizes {size}, strides {stride}, storage offset {offset}, and itemsize "
                           f"{itemsize} requiring a storage size of {needed} are out of bounds for storage of "
                           f"size {have}")


@check("convolution", "_convolution", when=("padding",))
def _convolution_padding(bound: dict) -> None:
    if any(p < 0 for p in bound["padding"]):
        raise RuntimeError("negative padding is not supported")
