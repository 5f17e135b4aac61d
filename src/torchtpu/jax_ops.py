"""``torchtpu.jax_op`` (also ``torch.tpu.jax_op``): a JAX function, a Pallas kernel included, as a
``torch.library`` custom op (this module is ``jax_ops``: a submodule named ``jax_op`` would replace
the package's ``jax_op`` function once imported)::

    @torchtpu.jax_op("mylib::rms_norm")
    def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
        return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + eps) * w   # JAX arrays in and out

The schema comes from the type hints (PyTorch's ``infer_schema``: ``Tensor``, ``Optional[Tensor]``,
``int``, ``float``, ``bool``, ``list[int]``, a tuple of Tensors for several outputs). Tensors
arrive as ``jax.Array``; every other argument is a static Python value, part of the program's key.

One mechanism serves every path: the op's lowering is registered in the op registry
(``ops/registry.py``), so eager ``tpu`` tensors run it as a cached ``jax.jit`` program like any
aten op (and the fused mode records it into its program), and ``torch.compile(backend="tpu")``
lowers the custom op's FX node through the same function. The fake kernel is ``jax.eval_shape``.
Autograd is a second custom op, ``<name>_backward``, registered the same way: ``jax.vjp`` of the
function (inputs saved, the forward recomputed inside the backward program), or the ``backward=``
JAX function given. Gradients flow to ``Tensor`` arguments of floating or complex dtype.

CPU tensors run the same function through JAX's CPU backend (so the op works, and can be checked
against a PyTorch reference, off the device); tensors on other devices raise PyTorch's error.
"""

from __future__ import annotations

import re
from typing import Callable

import jax
import jax.numpy as jnp
import torch

from torchtpu import caches
from torchtpu.eager import register
from torchtpu.ops import registry
from torchtpu.runtime.dtypes import to_jax_dtype, to_torch_dtype

_libs: list[torch.library.Library] = []  # kept alive: a Library's definitions die with it


def jax_op(name: str | Callable | None = None, *, backward: Callable | None = None):
    """Decorator: the JAX function ``fn`` as the custom op ``name`` ("namespace::op"; default from
    ``fn``'s module and qualified name). ``backward(grad, *args)``: a JAX function returning one
    gradient (or None) per Tensor argument; without it, gradients come from ``jax.vjp``."""
    if callable(name):  # bare @jax_op
        return JaxOp(name, None, None)
    return lambda fn: JaxOp(fn, name, backward)


def _auto_name(fn: Callable) -> str:
    def clean(text: str) -> str:
        return re.sub(r"\W", "_", text.replace("<locals>.", ""))

    return f"{clean(fn.__module__)}::{clean(fn.__qualname__)}"


def _schema(fn: Callable, name: str) -> str:
    try:
        return torch.library.infer_schema(fn, mutates_args=())
    except ValueError as e:
        raise ValueError(f"torchtpu.jax_op({name!r}): cannot infer the op's schema from {fn.__qualname__}'s type "
                         f"hints: {e}. Annotate every parameter (torch.Tensor, Optional[torch.Tensor], int, "
                         f"float, bool, list[int]) and the return (torch.Tensor or a tuple of them).") from None


def _tensor(x) -> bool:
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct))  # tracers are jax.Arrays


def _differentiable(x) -> bool:
    return _tensor(x) and jnp.issubdtype(x.dtype, jnp.inexact)


class JaxOp:
    """A JAX function registered as a custom op; calling it calls the op (``.op``, an OpOverload)."""

    def __init__(self, fn: Callable, name: str | None, backward: Callable | None):
        self.fn, self.user_backward = fn, backward
        self.name = name or _auto_name(fn)
        if "::" not in self.name:
            raise ValueError(f"torchtpu.jax_op: the op name must be 'namespace::name', got {self.name!r}")
        namespace, short = self.name.split("::", 1)
        schema = _schema(fn, self.name)
        lib = torch.library.Library(namespace, "FRAGMENT")
        _libs.append(lib)
        lib.define(short + schema)
        self.op = getattr(getattr(torch.ops, namespace), short).default
        self.arg_names = [a.name for a in self.op._schema.arguments]
        self.tensor_slots = [i for i, a in enumerate(self.op._schema.arguments)
                             if str(a.type) in ("Tensor", "Optional[Tensor]")]
        self.multiple = len(self.op._schema.returns) > 1
        args = schema[1:schema.index(") ->")]
        lib.define(f"{short}_backward(Tensor[] grad_outputs{', ' + args if args else ''}) -> Tensor[]")
        self.backward_op = getattr(getattr(torch.ops, namespace), short + "_backward").default
        self._register(lib)
        self.__wrapped__, self.__doc__ = fn, fn.__doc__

    def _register(self, lib: torch.library.Library) -> None:
        registry.lowering(self.op)(self.forward)
        registry.lowering(self.backward_op)(self.backward)
        for op in (self.op, self.backward_op):
            register.add(op)  # the tpu kernel, if the eager kernels exist already
            torch.library.register_fake(op, _Fake(self, op), lib=lib)
            lib.impl(op._schema.name.split("::")[1], _CpuKernel(self, op), "CPU")
        torch.library.register_autograd(self.op, self._autograd_backward, setup_context=_setup_context, lib=lib)

    def __call__(self, *args, **kwargs):
        return self.op(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<torchtpu.jax_op {self.name}>"

    # ------------------------------------------------------------ the JAX side (lowerings)

    def _values(self, args, kwargs, skip: int = 0) -> dict:
        """The forward's arguments by name (schema defaults filled in)."""
        schema_args = self.op._schema.arguments
        values = dict(zip(self.arg_names, args[skip:]))
        values.update(kwargs)
        for a in schema_args:
            if a.name not in values and a.has_default_value():
                values[a.name] = a.default_value
        return values

    def forward(self, *args, **kwargs):
        """The op's lowering: the user's function on JAX arrays."""
        out = self.fn(**self._values(args, kwargs))
        return tuple(out) if self.multiple else out

    def backward(self, grad_outputs, *args, **kwargs):
        """The backward op's lowering: gradients of the differentiable Tensor arguments, in order."""
        values = self._values(args, kwargs)
        names = [self.arg_names[i] for i in self.tensor_slots if _differentiable(values[self.arg_names[i]])]
        cotangent = tuple(grad_outputs) if self.multiple else grad_outputs[0]
        if self.user_backward is not None:
            return self._user_gradients(cotangent, values, names)

        def fn(*diff):
            return self.forward(**{**values, **dict(zip(names, diff))})

        try:
            out, pullback = jax.vjp(fn, *[values[n] for n in names])
        except (ValueError, NotImplementedError, TypeError) as e:
            raise NotImplementedError(
                f"torchtpu.jax_op {self.name}: jax.vjp cannot differentiate this function ({e}); Pallas "
                f"kernels have no reverse-mode rule: pass backward= to jax_op") from e
        cotangent = jax.tree.map(lambda g, o: g.astype(o.dtype), cotangent, out)
        return list(pullback(cotangent))

    def _user_gradients(self, cotangent, values: dict, names: list[str]) -> list:
        grads = self.user_backward(cotangent, **values)
        grads = tuple(grads) if isinstance(grads, (tuple, list)) else (grads,)
        slots = [self.arg_names[i] for i in self.tensor_slots]
        if len(grads) != len(slots):
            raise RuntimeError(f"torchtpu.jax_op {self.name}: backward returned {len(grads)} gradients, expected "
                               f"one per Tensor argument ({', '.join(slots)})")
        by_name = dict(zip(slots, grads))
        result = []
        for n in names:
            g, x = by_name[n], values[n]
            g = jnp.zeros(x.shape, x.dtype) if g is None else jnp.asarray(g)
            if g.shape != x.shape:
                raise RuntimeError(f"torchtpu.jax_op {self.name}: backward's gradient for {n} has shape "
                                   f"{tuple(g.shape)}, expected {tuple(x.shape)}")
            result.append(g.astype(x.dtype))
        return result

    # ------------------------------------------------------------ the torch side (autograd)

    def _autograd_backward(self, ctx, *grads):
        tensors = list(ctx.saved_tensors)
        args = [tensors.pop(0) if marker is _SAVED else marker for marker in ctx.template]
        flat = self.backward_op(list(grads), *args, **ctx.keyword)  # unused outputs' grads come as zeros
        keyword = [ctx.keyword.get(a.name) for a in self.op._schema.arguments[len(args):]]
        values, result, it = args + keyword, [None] * len(args), iter(flat)
        for i in self.tensor_slots:
            a = values[i]
            if isinstance(a, torch.Tensor) and (a.is_floating_point() or a.is_complex()):
                grad = next(it)
                if i < len(args):  # PyTorch takes gradients of positional inputs only
                    result[i] = grad
        return tuple(result)


_SAVED = object()  # a saved tensor's place in the forward's arguments


def _setup_context(ctx, inputs, output, keyword_only_inputs=None) -> None:
    ctx.template = [_SAVED if isinstance(a, torch.Tensor) else a for a in inputs]
    ctx.keyword = dict(keyword_only_inputs or {})  # kept as given: gradients reach positional inputs only
    ctx.save_for_backward(*[a for a in inputs if isinstance(a, torch.Tensor)])


def _split(values: dict, convert: Callable) -> tuple[dict, dict]:
    """(tensor arguments converted, static arguments) of a call's named values."""
    tensors, statics = {}, {}
    for name, v in values.items():
        if isinstance(v, torch.Tensor):
            tensors[name] = convert(v)
        elif isinstance(v, (list, tuple)) and v and all(isinstance(t, torch.Tensor) for t in v):
            tensors[name] = [convert(t) for t in v]
        else:
            statics[name] = v
    return tensors, statics


def _device(values: dict) -> torch.device:
    for v in values.values():
        if isinstance(v, torch.Tensor):
            return v.device
        if isinstance(v, (list, tuple)) and v and isinstance(v[0], torch.Tensor):
            return v[0].device
    return torch.device("cpu")


def _lowering(jop: JaxOp, op) -> Callable:
    return jop.forward if op is jop.op else jop.backward


def _freeze(value):
    return tuple(_freeze(v) for v in value) if isinstance(value, (list, tuple)) else value


class _Fake:
    """The fake (meta) kernel: ``jax.eval_shape`` of the lowering on the inputs' shapes and dtypes."""

    def __init__(self, jop: JaxOp, op):
        self.jop, self.op, self.lowering = jop, op, _lowering(jop, op)

    def __call__(self, *args, **kwargs):
        skip = 1 if self.op is self.jop.backward_op else 0
        values = self.jop._values(args, kwargs, skip)
        if skip:
            values["grad_outputs"] = args[0]
        device = _device(values)
        tensors, statics = _split(values, lambda t: jax.ShapeDtypeStruct(tuple(int(s) for s in t.shape),
                                                                           to_jax_dtype(t.dtype)))
        out = jax.eval_shape(lambda ts: _call(self.lowering, skip, {**statics, **ts}), tensors)
        return _to_torch(out, lambda s: torch.empty(s.shape, dtype=to_torch_dtype(s.dtype), device=device))


def _call(lowering: Callable, skip: int, values: dict):
    if skip:
        values = dict(values)
        return lowering(values.pop("grad_outputs"), **values)
    return lowering(**values)


def _to_torch(out, convert: Callable):
    if isinstance(out, (tuple, list)):
        return type(out)(convert(o) for o in out)
    return convert(out)


class _CpuKernel:
    """CPU tensors: the lowering through JAX's CPU backend, one cached ``jax.jit`` per static key."""

    def __init__(self, jop: JaxOp, op):
        self.jop, self.op, self.lowering = jop, op, _lowering(jop, op)
        self._jitted = caches.LRU("jax_op_cpu", "kernel_cache_size")

    def __call__(self, *args, **kwargs):
        skip = 1 if self.op is self.jop.backward_op else 0
        values = self.jop._values(args, kwargs, skip)
        if skip:
            values["grad_outputs"] = args[0]
        cpu = jax.devices("cpu")[0]
        tensors, statics = _split(values, lambda t: jax.device_put(jax.dlpack.from_dlpack(t.detach().contiguous()), cpu))
        key = tuple((k, _freeze(v)) for k, v in statics.items())
        fn = self._jitted.get(key)
        if fn is None:
            fn = self._jitted[key] = jax.jit(lambda ts: _call(self.lowering, skip, {**statics, **ts}))
        out = fn(tensors)
        return _to_torch(out, lambda a: torch.from_dlpack(a).clone())  # a copy: never alias a JAX buffer


__all__ = ["JaxOp", "jax_op"]
