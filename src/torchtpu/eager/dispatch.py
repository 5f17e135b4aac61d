"""Eager execution: one PrivateUse1 kernel per lowered aten overload.

A kernel reads its tensor arguments' arrays, calls the lowering through a ``jax.jit`` cached per
(op, static arguments) — JAX's own cache handles shapes and dtypes — and wraps the results as
``tpu`` tensors. In-place (``add_``) and ``out=`` overloads reuse the functional lowering and
write the result back through the bridge, so views and aliases see the update.

This is the hot path: everything derivable from the op's schema is computed once, at
registration, into ``_Signature``; a call walks its arguments once.

A view argument (a slice, a transpose, a reshape of another shape than its storage's array) is
read **inside the op's program**: the call passes the storage's array and the view's offset, and
the key says how to read it (``_View``: shape, strides, dtype). A separate gather program per
view geometry was one more XLA compilation per new shape (a small GPT's decode loop, whose
sequence grows by one each step, compiled 32 programs per step; 21 with the reads inside the
ops: ``benchmarks/decode_compiles.py``) and one more launch and copy per call (``weight.t()``
in every ``nn.Linear``); inside the op, XLA fuses the read.
"""

from __future__ import annotations

import functools
import math
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchtpu.device import bridge
from torchtpu.eager import argument_errors, modes
from torchtpu.eager.fused import Deferred
from torchtpu.eager.views import resize
from torchtpu.ops import checks, precision
from torchtpu.ops.registry import Lowering
from torchtpu.runtime import placement, platform, rng, state
from torchtpu.runtime.compat import ArrayImpl, OpOverload
from torchtpu.runtime.dtypes import TORCH_TO_JAX, scalar_type_name, to_torch_dtype
from torchtpu import caches, metrics

_TENSOR, _LIST, _INDICES, _SCALAR, _STATIC = range(5)
_PY_SCALARS = (bool, int, float, complex)
_PLAIN_TENSOR = torch.Tensor
_op_counts = metrics.ops  # metrics.count_op, inlined on the hot path
_SOLE_OWNER_REFS = bridge.SOLE_OWNER_REFS  # (counted at the call site: see its comment)
_NOT_DONATABLE = object()  # cached for a key whose result is not the target's shape and dtype


class _Dyn:
    """Placeholder in a static key for one dynamic (array) argument."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<array>"


DYN = _Dyn()


class _Strided:
    """Placeholder for one dynamic array read from a tensor laid out otherwise than contiguously
    (its strides: the program's outputs may follow them, as PyTorch's do)."""

    __slots__ = ("strides", "_hash")

    def __init__(self, strides: tuple):
        self.strides = strides
        self._hash = hash((_Strided, strides))

    def __eq__(self, other):
        return other.__class__ is _Strided and self.strides == other.strides

    def __hash__(self):
        return self._hash

    def __repr__(self) -> str:
        return f"<array {self.strides}>"


def _arg_kind(arg) -> int:
    text = str(arg.type)
    if text in ("Tensor", "Optional[Tensor]"):
        return _TENSOR
    if text == "List[Tensor]":
        return _LIST
    if text == "List[Optional[Tensor]]":  # index lists (x[idx], index_put): CPU indices allowed
        return _INDICES
    if text in ("number", "Optional[number]"):
        return _SCALAR
    return _STATIC


class _Signature:
    """What a kernel needs to know about an overload's arguments, derived once from its schema."""

    def __init__(self, op: OpOverload, static_scalars: bool = False, dynamic: tuple[str, ...] = ()):
        schema = op._schema

        def kind(arg):
            if arg.name in dynamic:  # a float passed as a value (Lowering.dynamic)
                return _SCALAR
            k = _arg_kind(arg)
            return _STATIC if (k == _SCALAR and static_scalars) else k

        self.positional = [kind(a) for a in schema.arguments if not a.kwarg_only]
        self.keyword = {a.name: kind(a) for a in schema.arguments if a.kwarg_only}
        self.out_names = tuple(a.name for a in schema.arguments if a.is_out)
        returns = schema.returns
        self.returns_list = len(returns) == 1 and str(returns[0].type) == "List[Tensor]"
        self.returns_tuple = len(returns) > 1
        self.returns_none = len(returns) == 0
        self.device_arg = any(a.name == "device" for a in schema.arguments)
        # (position among the positional arguments, or None if keyword-only; name) of a Generator
        self.generator = next(((None if a.kwarg_only else i, a.name) for i, a in enumerate(schema.arguments)
                               if str(a.type) == "Optional[Generator]"), None)


class _Float(float):
    """A static float in a jit key: unequal to the int of the same value (4.0 == 4 and they hash
    alike, so arange(0.0, 4.0) and arange(0, 4) would share a program). NaN equals NaN here."""

    __slots__ = ()

    def __eq__(self, other):
        return type(other) is _Float and (float(self) == float(other) or (math.isnan(self) and math.isnan(other)))

    def __ne__(self, other):
        return not self.__eq__(other)

    def __hash__(self):
        return hash((_Float, float(self)))


def _freeze(value):
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    if type(value) is float:
        return _Float(value)
    return value


def _thaw(value):
    if type(value) is _Float:
        return float(value)
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


def device_mismatch(a: torch.device, b: torch.device) -> RuntimeError:
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, {a} and {b}!")


class ListKey(tuple):
    """Key entry for a ``Tensor[]`` argument: DYN, a ``_View`` or None per element."""

    __slots__ = ()


class _View:
    """Key entry for a view read inside the op's program: two dynamic values (the storage's
    array and the view's offset) and this geometry. Strides of size-1 dims are normalised (they
    address nothing), so ``logits[:, -1]`` of a growing sequence is one geometry."""

    __slots__ = ("shape", "strides", "dtype", "_hash")

    def __init__(self, shape: tuple, strides: tuple, dtype):
        self.shape, self.strides, self.dtype = shape, strides, dtype
        self._hash = hash((_View, shape, strides, dtype))

    def __eq__(self, other):
        return other.__class__ is _View and self.shape == other.shape and self.strides == other.strides \
            and self.dtype == other.dtype

    def __ne__(self, other):
        return not self.__eq__(other)

    def __hash__(self):
        return self._hash

    def __repr__(self) -> str:
        return f"<view {self.shape} {self.strides} {self.dtype}>"

    def read(self, array, offset):
        """The view's elements, traced into the op's program (the bridge's gather, inlined)."""
        return bridge._gather(tuple(array.shape), array.dtype, self.shape, self.strides, self.dtype)(array, offset)


@functools.lru_cache(maxsize=16384)
def _view(shape: tuple, strides: tuple, dtype) -> _View:
    contiguous = bridge._strides_of(shape)
    return _View(shape, tuple(c if n == 1 else s for n, s, c in zip(shape, strides, contiguous)), dtype)


class Call:
    """One call's arguments, split into the static key and the dynamic arrays; ``device`` is the
    index of the tpu device the tensor arguments are on (None if there are none).

    ``key`` is ``(positional entries, keyword (name, entry) pairs)``; an entry is DYN for one
    array, a ``_View`` for a view read inside the program (two dynamic values: its storage's
    array and its offset), a ``ListKey`` for a list of tensors, or the static value itself
    (lists as tuples).
    """

    __slots__ = ("key", "dyn", "device", "read", "fold")

    def __init__(self, sig: _Signature, args, kwargs, concrete: bool = False):
        dyn: list = []
        self.device = None
        self.read = bridge.read_computed if concrete else bridge.read
        self.fold = fold = not concrete  # views are read inside the jitted program (see _View)
        kinds = sig.positional
        nkinds = len(kinds)
        take = self._take
        positional = []
        for i, a in enumerate(args):
            kind = kinds[i] if i < nkinds else _STATIC
            if a.__class__ is _PLAIN_TENSOR and (kind == _TENSOR or kind == _SCALAR):
                # the common case inline: a plain tensor on this call's tpu device
                index = a.get_device()
                if index >= 0 and (self.device is None or self.device == index):
                    self.device = index
                    positional.append(_read_into(a, dyn) if fold else _append(dyn, self.read(a)))
                    continue
            positional.append(take(kind, a, dyn))
        positional = tuple(positional)
        keyword = tuple([(name, take(sig.keyword.get(name, _STATIC), a, dyn)) for name, a in kwargs.items()]) \
            if kwargs else ()
        self.key = (positional, keyword)
        self.dyn = dyn

    def _take(self, kind, a, dyn):
        if kind == _TENSOR or kind == _SCALAR:
            if a is None:
                return None
            if isinstance(a, torch.Tensor):
                if self.fold and a.get_device() >= 0:
                    self._check_device(a)
                    return _read_into(a, dyn)
                dyn.append(self._array(a))
            elif isinstance(a, _PY_SCALARS):
                dyn.append(_scalar(a))  # weakly typed: a Python number to the lowering
            else:
                return _freeze(a)
            return DYN
        if kind == _LIST or kind == _INDICES:
            pattern = []
            for t in a:
                if t is None:
                    pattern.append(None)
                elif kind == _INDICES and t.get_device() < 0 and t.device.type == "cpu":
                    # as on CUDA, a CPU index tensor may index a device tensor: it is sent over
                    dyn.append(transfer_to_device(t, self.device or 0))
                    pattern.append(DYN)
                elif self.fold and t.get_device() >= 0:
                    self._check_device(t)
                    pattern.append(_read_into(t, dyn))
                else:
                    dyn.append(self._array(t))
                    pattern.append(DYN)
            return ListKey(pattern)
        if isinstance(a, torch.Tensor):  # a Tensor in an untyped slot
            dyn.append(self._array(a))
            return DYN
        return _freeze(a)

    def _check_device(self, t: torch.Tensor) -> None:
        index = t.get_device()
        if self.device is None:
            self.device = index
        elif self.device != index:
            raise device_mismatch(torch.device("tpu", self.device), t.device)

    def _array(self, t: torch.Tensor):
        index = t.get_device()  # -1 on the CPU; cheaper than t.device.type on this hot path
        if index >= 0:
            if self.device is None:
                self.device = index
            elif self.device != index:
                raise device_mismatch(torch.device("tpu", self.device), t.device)
            return self.read(t)
        if t.dim() == 0 and t.device.type == "cpu":
            # PyTorch lets a CPU 0-d tensor join any device's op as a scalar
            return _host_scalar(t.item(), t.dtype)
        raise device_mismatch(torch.device("tpu", self.device or 0), t.device)


def _append(dyn: list, value):
    dyn.append(value)
    return DYN


def _read_into(t: torch.Tensor, dyn: list):
    """Append what the jitted program needs to read ``t`` to ``dyn``; returns its key entry.

    The storage's array itself when ``t`` is all of it (DYN), else the array and ``t``'s offset
    with the view's geometry (a ``_View``, read inside the program); in DEFER_AND_FUSE a deferred
    value is read so too (the program is recorded reading it, as the native kernel records it).
    Everything else takes ``bridge.read``: storages holding no computed array (none yet, or a
    deferred value outside DEFER_AND_FUSE), lazy conjugate/negation bits, other dtypes
    (``view.dtype``, bytes after ``torch.load``), and every read while a graph is captured
    (``bridge.read`` reports it).
    """
    array = getattr(t.untyped_storage(), bridge.ATTR, None)
    if (array.__class__ is ArrayImpl or array.__class__ is Deferred and modes.deferring()) \
            and array.dtype == TORCH_TO_JAX.get(t.dtype) and not (t.is_conj() or t.is_neg()) \
            and not bridge.capturing:
        dyn.append(array)
        shape = t.shape
        if array.shape == shape and t.is_contiguous() and t.storage_offset() == 0:
            return DYN
        dyn.append(_scalar(t.storage_offset()))
        return _view(tuple(shape), t.stride(), array.dtype)
    dyn.append(bridge.read(t))
    return DYN if t.is_contiguous() else _Strided(t.stride())


# Scalars as cached device values: JAX converts a Python number or numpy scalar argument on every
# call (2-3 us); a training step passes the same few literals (0.5, 1.0, lr) thousands of times.
# Uncommitted 0-d arrays on the platform's first device, so they join an op on any tpu:N.

def _zero_sign(value):
    return repr(value) if value == 0 else None  # 0.0 and -0.0 are equal keys otherwise


def _scalar(value):
    """A Python number as a weakly typed 0-d array, as JAX would make it, from a bounded cache."""
    try:
        return _cached_scalar(type(value), value, _zero_sign(value))
    except (OverflowError, TypeError):  # out of int64 range (PyTorch errors later) or unhashable
        return value


def _host_scalar(value, dtype: torch.dtype):
    """A CPU 0-d tensor's value (joining a tpu op) as a 0-d array of its dtype, cached."""
    return _cached_host_scalar(value, dtype, _zero_sign(value))


@functools.lru_cache(maxsize=4096)
def _cached_scalar(kind, value, sign):
    with placement.default():
        return jax.numpy.asarray(value)


@functools.lru_cache(maxsize=4096)
def _cached_host_scalar(value, dtype, sign):
    with placement.default():
        return jax.numpy.asarray(np.asarray(value, dtype=TORCH_TO_JAX[dtype]))


def transfer_to_device(t: torch.Tensor, index: int):
    from torchtpu.eager.transfer import to_device

    return to_device(t, index)


def rebuild(key, dyn):
    """Inverse of ``Call`` (and of ``ForeachKernel``'s reader): the lowering's (args, kwargs)
    from a static key and the dynamic values, in order. Lists may nest (a foreach op's lists)."""
    it = iter(dyn)

    def value(k):
        if k is DYN or k.__class__ is _Strided:
            return next(it)
        if k.__class__ is _View:
            return k.read(next(it), next(it))
        if isinstance(k, ListKey):
            return [None if p is None else value(p) for p in k]
        return _thaw(k)

    positional, keyword = key
    args = [value(k) for k in positional]
    kwargs = {name: value(k) for name, k in keyword}
    return args, kwargs


class Kernel:
    """The eager kernel of one functional overload with a lowering."""

    learn = False  # set by the native kernel (csrc/eager.cpp) for one call: report it in ``last``
    last = None  # (program, dynamic values) of that call

    def __init__(self, lowering: Lowering):
        self.op = lowering.op
        self.lowering = lowering
        self.sig = _Signature(self.op, lowering.static_scalars, lowering.dynamic)
        self.name = str(self.op)
        self.dots = lowering.dots  # its programs follow (and key on) the matmul precision setting
        returns = self.op._schema.returns
        self.single = len(returns) == 1 and not isinstance(returns[0].type, torch.ListType)
        self._jitted = caches.LRU("eager_kernels", "kernel_cache_size")  # bounded: static keys hold shapes
        self._donating = caches.LRU("eager_donating_kernels", "kernel_cache_size")  # in-place variants

    def compiled(self, key, device_index: int | None, setting: str | None = None, call: tuple | None = None):
        """The jitted program for a call's static ``key``; ``setting``: the matmul precision of an
        op with dots (None for the others), pinned while it is traced. Programs are also keyed on
        ``torch.get_default_dtype()``: a lowering reads it while traced (a factory's dtype, what
        int / int or a Python float promotes to), and JAX would reuse the trace after
        ``torch.set_default_dtype``. A new program's first ``call`` (args, kwargs) is checked by
        PyTorch's meta kernel first (``argument_errors.validate``)."""
        cache_key = (key, device_index, setting, _default_dtype())
        fn = self._jitted.get(cache_key)
        if fn is None:
            layouts = None
            if call is not None:
                layouts = _layouts(argument_errors.validate(self.op, *call))
            fn = self._build(key, device_index, setting)
            if layouts is not None:  # its outputs are laid out as PyTorch lays them out (channels_last, ...)
                fn = _LaidOut(fn, layouts, self._build(key, device_index, setting, orders=layouts))
            self._jitted[cache_key] = fn
        return fn

    def _build(self, key, device_index, setting, donate: bool = False, orders: tuple | None = None):
        """The program of a call ``key``; ``orders``: outputs transposed into these memory orders
        (``_LaidOut.fn``, the native kernel's program for outputs not laid out contiguously)."""
        lowering, plat, what = self.lowering, platform.platform(), f"the lowering of {self.name}"

        def compute(op_key, dyn):
            args, kwargs = rebuild(key, dyn)
            with precision.tracing(setting, what):
                if not lowering.checked:
                    return _in_memory_order(lowering.call(op_key, args, kwargs, plat), orders)
                with checks.collecting(self.name) as found:  # its index checks: one code, returned last
                    out = _in_memory_order(lowering.call(op_key, args, kwargs, plat), orders)
                return (*out, checks.code(found)) if isinstance(out, (tuple, list)) else (out, checks.code(found))

        if lowering.random:
            def run(seed_hi, seed_lo, offset, *dyn):
                return compute(rng.make_key(seed_hi, seed_lo, offset), dyn)
        else:
            def run(*dyn):
                return compute(None, dyn)

        run.__name__ = self.name.replace(".", "_")
        if not self.lowering.jit:
            return run
        donated = (0,) if donate else ()
        if device_index is None:
            return jax.jit(run, donate_argnums=donated)
        sharding = placement.sharding(device_index)
        return jax.jit(run, out_shardings=sharding, donate_argnums=donated)

    def run(self, args, kwargs):
        """Run the lowering on ``args``; returns (device index, raw JAX outputs)."""
        index, out, _ = self._run(args, kwargs)
        return index, out

    def _run(self, args, kwargs, in_memory_order: bool = False):
        """``run``, and the memory layouts PyTorch gives the outputs (None: contiguous);
        ``in_memory_order``: laid-out outputs come transposed into their layouts (``_LaidOut.fn``)."""
        lowering = self.lowering
        generator = None
        if lowering.random and self.sig.generator is not None:
            args, kwargs, generator = _take_generator(self.sig.generator, args, kwargs)
        if not lowering.jit and modes.deferring():
            modes.flush("data_dependent")  # the output shape depends on values: they must exist
            call = Call(self.sig, args, kwargs, concrete=True)
        else:
            call = Call(self.sig, args, kwargs)
        index = call.device
        setting = precision.setting() if self.dots else None
        if index is None:  # a factory: the device comes from its arguments or the current one
            index = _device_index(call, kwargs, self.sig)
            fn = self.compiled(call.key, index, setting, (args, kwargs))
        else:
            fn = self._jitted.get((call.key, None, setting, _default_dtype())) or \
                self.compiled(call.key, None, setting, (args, kwargs))
        dyn = call.dyn
        if self.learn:
            self.learn, self.last = False, (fn, dyn)
        if lowering.random:
            dyn = (*rng.next_key_args(index, generator), *dyn)
        _op_counts[self.name] += 1
        if fn.__class__ is not _LaidOut:
            return index, self._execute(fn, dyn, index), None
        return index, self._execute(fn.fn if in_memory_order else fn.logical, dyn, index), fn.layouts

    def _execute(self, fn, dyn, index):
        """Run the program ``fn`` in the current mode; a checked op's code is handed to
        ``checks.defer`` (read now where launches block, else at the next synchronisation)."""
        out = modes.execute(self, fn, dyn, index)
        if not self.lowering.checked:
            return out
        if not bridge.capturing:  # (a captured program's code would be read once, at capture)
            checks.defer(out[-1], modes.current().mode is _BLOCKING)
        return out[0] if self.single else tuple(out[:-1])

    def __call__(self, *args, **kwargs):
        index, out, layouts = self._run(args, kwargs, in_memory_order=True)
        if layouts is not None:
            return wrap_outputs(out, index, self.sig, layouts, in_memory_order=True)
        return wrap_outputs(out, index, self.sig)

    def run_inplace(self, args, kwargs):
        """``run`` for an in-place variant, which writes the result into ``args[0]``: when that
        tensor is its whole storage and nothing else holds the storage's array, the array is
        donated, so XLA updates it in place instead of copying it (a write of a few rows into a
        large buffer, e.g. a KV cache, then costs the rows, not the buffer)."""
        lowering, target = self.lowering, args[0]
        array = getattr(target.untyped_storage(), bridge.ATTR, None)
        if (array.__class__ is not ArrayImpl or sys.getrefcount(array) > _SOLE_OWNER_REFS
                or array.shape != target.shape or target.storage_offset()  # a view: its base is shared
                or not lowering.jit or lowering.random or bridge.capturing or modes.deferring()):
            return self.run(args, kwargs)
        call = Call(self.sig, args, kwargs)
        dyn = call.dyn
        # args[0] must reach the program as the array itself (not a view's read), and only once.
        if call.key[0][0] is not DYN or dyn[0] is not array or any(a is array for a in dyn[1:]):
            return self.run(args, kwargs)
        del array
        setting = precision.setting() if self.dots else None
        cache_key = (call.key, setting, _default_dtype())  # (the default dtype: as in ``compiled``)
        fn = self._donating.get(cache_key)
        if fn is None:
            argument_errors.validate(self.op, args, kwargs)
            fn = self._donating[cache_key] = self._build_donating(call.key, setting, dyn)
        if fn is _NOT_DONATABLE:
            return self.run(args, kwargs)
        _op_counts[self.name] += 1
        return call.device, self._execute(fn, dyn, call.device)

    def _build_donating(self, key, setting, dyn):
        """The program donating its first argument, or _NOT_DONATABLE when the result could not
        reuse it (another shape or dtype: the in-place op then fails, and must fail with the
        target intact)."""
        fn = self._build(key, None, setting, donate=True)
        out = jax.eval_shape(fn, *dyn)
        if self.lowering.checked:
            out = out[0]
        same = isinstance(out, jax.ShapeDtypeStruct) and out.shape == dyn[0].shape and out.dtype == dyn[0].dtype
        return fn if same else _NOT_DONATABLE


def _take_generator(slot, args, kwargs):
    """A random op's ``generator`` argument, taken out (None in its place): the key is drawn
    from it before the call, and the op's program does not depend on which generator it was."""
    position, name = slot
    if position is not None and position < len(args):
        generator = args[position]
        if generator is not None:
            args = (*args[:position], None, *args[position + 1:])
    else:
        generator = kwargs.get(name)
        if generator is not None:
            kwargs = {**kwargs, name: None}
    return args, kwargs, generator


def _device_index(call: Call, kwargs, sig: _Signature) -> int:
    if call.device is not None:
        return call.device
    device = kwargs.get("device") if sig.device_arg else None
    if device is not None:
        device = torch.device(device)
        if device.type == "tpu":
            return device.index if device.index is not None else _current_device()
    return _current_device()


_current_device = state.current_device
_BLOCKING = modes.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
_default_dtype = torch.get_default_dtype


def wrap_outputs(out, index: int, sig: _Signature, layouts: tuple | None = None, in_memory_order: bool = False):
    """The raw outputs as tpu tensors; ``layouts``: each output's memory order (dims from the
    outermost) where PyTorch does not make it contiguous (a channels_last result), else None;
    ``in_memory_order``: those outputs are already transposed into it (``_LaidOut.fn``'s)."""
    if sig.returns_none:
        return None
    if in_memory_order and layouts is not None:
        wrapped = wrap_laid_out(out, index, layouts)
        return list(wrapped) if sig.returns_list else wrapped
    if isinstance(out, (tuple, list)):
        orders = layouts or (None,) * len(out)
        wrapped = [None if o is None else bridge.wrap(o, index, _strides(o, order)) for o, order in zip(out, orders)]
        return wrapped if sig.returns_list else tuple(wrapped)  # (None: an undefined tensor)
    return bridge.wrap(out, index, _strides(out, layouts[0]) if layouts else None)


def _strides(array, order: tuple | None) -> tuple | None:
    """The strides that lay ``array``'s shape out in memory ``order`` (None: contiguous)."""
    if order is None or len(order) != len(array.shape):
        return None
    return bridge.dense_layout(array.shape, bridge.strides_in_order(array.shape, order))


class _LaidOut:
    """A program whose outputs PyTorch lays out otherwise than contiguously: ``layouts`` holds
    each output's memory order (None for a contiguous one), from its meta kernel. ``fn`` is the
    program with each such output transposed into its order inside it, which the op's kernels run
    (``Kernel.__call__``, the native kernel; the outputs then only need wrapping:
    ``bridge.wrap_in_memory_order``); called (``logical``), the outputs keep their logical shapes,
    for the callers that write them elsewhere (in-place variants, ``run``)."""

    __slots__ = ("logical", "fn", "layouts", "__weakref__")  # (JAX keeps weak references to traced functions)

    def __init__(self, logical, layouts: tuple, in_memory_order):
        self.logical, self.layouts, self.fn = logical, layouts, in_memory_order

    def __call__(self, *dyn):
        return self.logical(*dyn)


def wrap_laid_out(out, index: int, layouts: tuple):
    """``_LaidOut.fn``'s outputs (already in their memory orders, ``layouts``) as tpu tensors: one
    tensor, or a tuple (also the native kernel's wrap for them)."""
    if isinstance(out, (tuple, list)):
        return tuple(None if o is None else bridge.wrap_in_memory_order(o, index, order)
                     for o, order in zip(out, _padded(layouts, len(out))))
    return bridge.wrap_in_memory_order(out, index, layouts[0])


def _padded(orders: tuple, n: int) -> tuple:
    """``orders`` for ``n`` outputs: the lowering's outputs past the schema's have none."""
    return (*orders, *(None,) * (n - len(orders)))


def _in_memory_order(out, orders: tuple | None):
    """A lowering's outputs, each with a memory order in ``orders`` (of its rank: the order is
    the meta kernel's for the first call's outputs) transposed into it."""
    if orders is None:
        return out

    def laid_out(o, order):
        return o if order is None or o is None or len(order) != o.ndim else jnp.transpose(o, order)

    if isinstance(out, (tuple, list)):
        items = [laid_out(o, order) for o, order in zip(out, _padded(orders, len(out)))]
        return items if isinstance(out, list) else tuple(items)
    return laid_out(out, orders[0])


def _layouts(meta) -> tuple | None:
    """The memory order of each of a meta kernel's outputs that is dense but not contiguous (None
    for the others); None if all are contiguous. An order, not strides: a program serves every
    shape its key allows, and the strides follow from the order and the shape."""
    if meta is None:
        return None
    outs = meta if isinstance(meta, (tuple, list)) else (meta,)
    orders = tuple(bridge.memory_order(o.stride()) if isinstance(o, torch.Tensor)
                   and bridge.dense_layout(o.shape, o.stride()) is not None else None for o in outs)
    return orders if any(o is not None for o in orders) else None


class InplaceKernel:
    """``op_(self, ...)``: the functional kernel's result written back into ``self``."""

    def __init__(self, functional: Kernel):
        self.functional = functional

    def __call__(self, self_tensor, *args, **kwargs):
        _, out = self.functional.run_inplace((self_tensor, *args), kwargs)
        if out.dtype != TORCH_TO_JAX[self_tensor.dtype]:
            _check_cast(out.dtype, self_tensor.dtype, self.functional.name)
        bridge.write(self_tensor, out)
        return self_tensor


class MutatingKernel:
    """An op that also writes arguments other than ``self``/``out`` (``Lowering.mutates``): the
    lowering returns their new values after the op's outputs; they are written back here."""

    def __init__(self, functional: Kernel):
        self.functional = functional
        names = functional.lowering.mutates
        schema = functional.op._schema
        arguments = schema.arguments
        self.targets = [(i, a.name) for i, a in enumerate(arguments) if a.name in names]
        self.nout = len(schema.returns)
        # a return that aliases a written argument (``-> Tensor(a!)``) is that argument, as in PyTorch
        written = {_alias_set(a): (i, a.name) for i, a in enumerate(arguments)
                   if _alias_set(a) is not None and a.alias_info.is_write}
        self.aliased = [written.get(_alias_set(r)) for r in schema.returns]

    def __call__(self, *args, **kwargs):
        index, out, layouts = self.functional._run(args, kwargs)
        values = iter(out[self.nout:])
        for position, name in self.targets:
            target = _argument(args, kwargs, position, name)
            if isinstance(target, (list, tuple)):  # a written Tensor[]: one value per element, flat
                for t in target:
                    bridge.write(t, next(values))
            elif target is not None:
                bridge.write(target, next(values))
            else:
                next(values)
        if self.nout == 0:
            return None
        if self.aliased[0] is not None and self.nout == 1:
            return _argument(args, kwargs, *self.aliased[0])
        if layouts is not None:
            layouts = layouts[:self.nout]
        return wrap_outputs(tuple(out[:self.nout]) if self.nout > 1 else out[0], index, self.functional.sig,
                            layouts)


def _argument(args, kwargs, position: int, name: str):
    return args[position] if position < len(args) else kwargs.get(name)


def _alias_set(arg) -> str | None:
    """The alias set a schema argument or return is in (``a`` of ``Tensor(a!)``), or None."""
    info = arg.alias_info
    return min(info.before_set) if info is not None and info.before_set else None


class ForeachKernel:
    """A functional ``_foreach_*`` overload: every element in one jitted call (``ops/foreach.py``).

    PyTorch's own fallback for a new device loops in C++ over the per-tensor op, so an optimizer
    step was one eager op per parameter per update term (AdamW on 29 parameters: 240 ops). Tensor
    lists and scalar lists are dynamic (an optimizer's bias corrections change every step); other
    arguments are static.
    """

    def __init__(self, lowering: Lowering):
        self.op = lowering.op
        self.lowering = lowering  # derived from the per-tensor op's (ops/foreach.py)
        self.name = str(self.op)
        self.static_scalars = lowering.static_scalars
        self._jitted = caches.LRU("foreach_kernels", "kernel_cache_size")

    def _take(self, a, dyn, reader: Call):
        if isinstance(a, torch.Tensor):  # read as any op reads it (device checks, CPU scalars)
            dyn.append(reader._array(a))
            return DYN
        if isinstance(a, (list, tuple)):
            return ListKey(self._take(x, dyn, reader) for x in a)
        if isinstance(a, _PY_SCALARS) and not self.static_scalars:
            dyn.append(a)  # a Python number, weakly typed (scalar lists change every step: not cached)
            return DYN
        return _freeze(a)

    def run(self, args, kwargs):
        dyn: list = []
        reader = Call.__new__(Call)  # its argument reader only
        reader.device, reader.read = None, bridge.read
        key = (tuple(self._take(a, dyn, reader) for a in args),
               tuple((name, self._take(a, dyn, reader)) for name, a in kwargs.items()))
        if reader.device is None:
            raise RuntimeError(f"tpu: {self.name} got no tpu tensors")
        cache_key = (key, _default_dtype())  # traced in (promotion of Python floats): as in ``Kernel.compiled``
        fn = self._jitted.get(cache_key)
        if fn is None:
            fn = self._jitted[cache_key] = self._build(key)
        _op_counts[self.name] += 1
        return reader.device, modes.execute(self, fn, dyn, reader.device)

    def _build(self, key):
        lowering, plat = self.lowering, platform.platform()

        def run(*dyn):
            args, kwargs = rebuild(key, dyn)
            return list(lowering.call(None, args, kwargs, plat))

        run.__name__ = self.name.replace(".", "_")
        return jax.jit(run)

    def __call__(self, *args, **kwargs):
        index, out = self.run(args, kwargs)
        return [bridge.wrap(o, index) for o in out]


class ForeachInplaceKernel:
    """``_foreach_op_(self, ...)``: the functional foreach kernel's results written into ``self``."""

    def __init__(self, functional: ForeachKernel):
        self.functional = functional

    def __call__(self, targets, *args, **kwargs):
        _, out = self.functional.run((targets, *args), kwargs)
        for t, value in zip(targets, out):
            if value.dtype != TORCH_TO_JAX[t.dtype]:
                _check_cast(value.dtype, t.dtype, self.functional.name)
        for t, value in zip(targets, out):
            bridge.write(t, value)


class OutKernel:
    """``op.out(..., out=...)``: the functional kernel's results written into the out tensors."""

    def __init__(self, functional: Kernel, out_names: tuple[str, ...]):
        self.functional = functional
        self.out_names = out_names

    def __call__(self, *args, **kwargs):
        outs = [kwargs.pop(name) for name in self.out_names]
        _, result = self.functional.run(args, kwargs)
        results = result if isinstance(result, (tuple, list)) else (result,)
        if len(outs) == 1 and isinstance(outs[0], (list, tuple)):  # Tensor[] out= (split_with_sizes_copy)
            if len(outs[0]) != len(results):
                raise RuntimeError(f"{self.functional.name}: expected an out= argument of size {len(results)}, "
                                   f"got size {len(outs[0])}")
            self._write(outs[0], results)
            return None  # these overloads return nothing
        self._write(outs, results)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _write(self, outs, results) -> None:
        for out, value in zip(outs, results):
            if out.device.type != "tpu":
                raise device_mismatch(torch.device("tpu", 0), out.device)
            _check_cast(value.dtype, out.dtype, self.functional.name)
            if tuple(out.shape) != tuple(value.shape):
                resize(out, value.shape)
            bridge.write(out, value)


class FactoryOutKernel:
    """A factory's ``out=`` overload (``arange.start_out``, ``linspace.out``, ``range.out``,
    ``randperm.generator_out``): the functional kernel run in ``out``'s dtype, written as
    PyTorch's own kernels write it. They resize ``out`` to the result's length only when its
    element count differs (``exact``: whenever its shape is not the length's, as randperm does);
    otherwise the values fill ``out``'s elements in order, whatever its shape and strides (a
    narrowed or transposed view keeps its geometry and its neighbours keep their values).
    ``warn``: warn of a resize of a non-empty ``out``, as arange does."""

    def __init__(self, functional: Kernel, exact: bool = False, warn: bool = False):
        self.functional = functional
        self.exact = exact
        self.warn = warn

    def __call__(self, *args, **kwargs):
        out = kwargs.pop("out")
        if out.device.type != "tpu":
            raise device_mismatch(torch.device("tpu", 0), out.device)
        _, value = self.functional.run(args, {**kwargs, "dtype": out.dtype})
        shape = tuple(value.shape)
        if tuple(out.shape) != shape:
            if self.exact or out.numel() != math.prod(shape):
                if self.warn and out.numel():
                    warnings.warn(f"The number of elements in the out tensor of shape {list(out.shape)} is "
                                  f"{out.numel()} which does not match the computed number of elements "
                                  f"{shape[0]}. Note that this may occur as a result of rounding error. The out "
                                  f"tensor will be resized to a tensor of shape ({shape[0]},).", UserWarning,
                                  stacklevel=2)
                resize(out, shape)
            else:
                value = bridge.apply(bridge._reshape(tuple(out.shape)), value)
        if not self.exact and any(s == 0 and n > 1 for n, s in zip(out.shape, out.stride())):
            # TensorIterator's check of arange/linspace/logspace/range (randperm has none)
            raise RuntimeError("unsupported operation: more than one element of the written-to tensor refers to a "
                               "single memory location. Please clone() the tensor before performing the operation.")
        bridge.write(out, value)
        return out


def _check_cast(from_dtype, to_dtype: torch.dtype, name: str) -> None:
    src = to_torch_dtype(from_dtype)
    if src != to_dtype and not torch.can_cast(src, to_dtype):
        raise RuntimeError(f"result type {scalar_type_name(src)} can't be cast to the desired output type "
                           f"{scalar_type_name(to_dtype)}")
