"""``torch.export`` programs to StableHLO that runs in JAX without PyTorch.

``to_stablehlo(exported_program)`` lowers an ``ExportedProgram`` with the same machinery as the
``tpu`` backend of ``torch.compile``: the backend's decompositions (``run_decompositions``), then
the core-aten graph as one JAX function built from the op registry (``compile/graph.py``'s
``GraphFunction``). ``jax.export`` serialises that function; its weights (parameters, buffers,
lifted constants) are arguments of the program, not constants in it, and are saved beside it.
``torch.export``'s dynamic dimensions (``Dim``) become ``jax.export`` symbolic dimensions, with
their ranges as constraints, so one artifact serves every size in range.

The artifact (``StableHLO.save(path)``, a directory) loads in a process without torch through
``export_runtime.py`` (NumPy and JAX only, copied into the artifact as ``load.py``); see
``docs/export.md``. What an artifact does not hold: random ops (export in ``eval()`` mode),
updates of buffers (a forward that writes its buffers) and torchtpu's device-side index checks
(an out-of-bounds index clamps, as in plain XLA).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
import sympy
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from torchtpu import export_runtime as runtime
from torchtpu.compile import collectives, flex_attention
from torchtpu.compile import graph as graph_lowering
from torchtpu.ops import checks, precision, registry
from torchtpu.runtime import platform as tpu_platform
from torchtpu.runtime.compat import HigherOrderOperator, OpOverload
from torchtpu.runtime.compat import pytree as torch_pytree
from torchtpu.runtime.dtypes import to_jax_dtype

aten = torch.ops.aten


class UnsupportedOpError(NotImplementedError):
    """The program has ops torchtpu cannot lower to StableHLO (``ops``: their names)."""

    def __init__(self, ops: list[str], why: str):
        self.ops = ops
        super().__init__(f"torchtpu.export: cannot lower {', '.join(ops)} to StableHLO: {why}")


# ---------------------------------------------------------------- shape ops

def _sym_size(x, dim):
    return x.shape[dim]  # under symbolic shapes, a jax.export dimension expression


def _sym_numel(x):
    return math.prod(x.shape)


def _sym_stride(x, dim):  # a contiguous array's (the only layout a JAX array has)
    return math.prod(x.shape[dim + 1:] if dim >= 0 else x.shape[x.ndim + dim + 1:])


def _nothing(*args, **kwargs):
    return None


# torch.export's shape ops and runtime assertions, as Python on the traced values: sizes are
# jax.export dimensions there, and the assertions were checked by torch.export for the range
# of each dimension (which the program's symbolic-shape constraints carry).
_GRAPH_CALLABLES = {
    getattr(getattr(aten, name), overload): fn
    for name, overload, fn in [
        ("sym_size", "int", _sym_size), ("sym_numel", "default", _sym_numel), ("sym_stride", "int", _sym_stride),
        ("_assert_scalar", "default", _nothing), ("_assert_tensor_metadata", "default", _nothing),
        ("sym_constrain_range", "default", _nothing), ("sym_constrain_range_for_size", "default", _nothing)]
    if hasattr(aten, name) and hasattr(getattr(aten, name), overload)
}


def _prepare(gm: torch.fx.GraphModule) -> None:
    """Replace the graph's shape ops by their Python forms; refuse ops that cannot be lowered,
    naming every one of them."""
    missing: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if target in _GRAPH_CALLABLES:
            node.target = _GRAPH_CALLABLES[target]
        elif isinstance(target, OpOverload):
            if collectives.is_collective(target):
                missing[str(target)] = "a collective, which a single-device program cannot hold"
                continue
            low = registry.for_graph(target)
            if low is None or not graph_lowering.has_lowering(target):
                missing[str(target)] = "torchtpu has no lowering and no decomposition for it"
            elif low.random:
                missing[str(target)] = "a random op (export the module in eval() mode)"
            elif not low.jit:
                missing[str(target)] = "its output shape depends on its inputs' values"
        elif isinstance(target, HigherOrderOperator) and flex_attention.lowering_for(target) is None:
            missing[str(target.name())] = "a higher-order operator torchtpu does not lower"
    if missing:
        reasons = sorted(set(missing.values()))
        why = reasons[0] if len(reasons) == 1 else "; ".join(f"{op}: {r}" for op, r in sorted(missing.items()))
        raise UnsupportedOpError(sorted(missing), why)
    gm.recompile()


# ---------------------------------------------------------------- symbolic shapes

def _dimension_names(placeholders: list[torch.fx.Node]) -> dict[sympy.Symbol, str]:
    """A name for each symbol of the inputs' shapes: ``{input}_dim{i}`` of its first plain
    occurrence (torch.export's own names, ``s77``, carry no meaning), else the symbol's own."""
    names: dict[sympy.Symbol, str] = {}
    symbols: list[sympy.Symbol] = []
    for node in placeholders:
        for i, size in enumerate(node.meta["val"].shape):
            if isinstance(size, torch.SymInt):
                expr = size.node.expr
                if isinstance(expr, sympy.Symbol) and expr not in names:
                    names[expr] = f"{node.name}_dim{i}"
                symbols += [s for s in sorted(expr.free_symbols, key=str) if s not in symbols]
    for s in symbols:
        names.setdefault(s, str(s))
    return names


def _constraints(ep: ExportedProgram, names: dict[sympy.Symbol, str]) -> list[str]:
    from torchtpu.runtime.compat import sympy_int_oo as int_oo

    found = []
    for symbol, name in names.items():
        vr = ep.range_constraints.get(symbol)
        if vr is None:
            continue
        if vr.lower != -int_oo and int(vr.lower) > 1:  # jax.export assumes >= 1
            found.append(f"{name} >= {int(vr.lower)}")
        if vr.upper != int_oo:
            found.append(f"{name} <= {int(vr.upper)}")
    return found


def _evaluate(expr, dims: dict):
    """A sympy size expression of torch.export as a jax.export dimension expression."""
    from torchtpu.runtime.compat import SympyFloorDiv as FloorDiv, SympyMod as Mod, SympyPythonMod as PythonMod

    if expr.is_Integer:
        return int(expr)
    if expr.is_Symbol:
        return dims[expr]
    if isinstance(expr, sympy.Add):
        return sum((_evaluate(a, dims) for a in expr.args), 0)
    if isinstance(expr, sympy.Mul):
        return math.prod(_evaluate(a, dims) for a in expr.args)
    if isinstance(expr, FloorDiv):
        return _evaluate(expr.args[0], dims) // _evaluate(expr.args[1], dims)
    if isinstance(expr, (Mod, PythonMod)):
        return _evaluate(expr.args[0], dims) % _evaluate(expr.args[1], dims)
    raise NotImplementedError(f"torchtpu.export: a dynamic size {expr} that jax.export shapes cannot express "
                              f"(sums, products, floor division and remainders of dimensions can be)")


def _shape(size, dims: dict) -> tuple:
    return tuple(_evaluate(s.node.expr, dims) if isinstance(s, torch.SymInt) else int(s) for s in size)


# ---------------------------------------------------------------- the artifact

def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    dtype = to_jax_dtype(t.dtype)
    if runtime.stored_dtype(dtype) == dtype:
        return t.numpy()
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    return t.view(bits).numpy().view(dtype)


def _dtype_name(dtype) -> str:
    return np.dtype(dtype).name


def _jsonable_structure(tree):
    """Whether the outputs' structure is one JAX knows: tuples, lists and string-keyed dicts (else
    the outputs are returned as a flat tuple)."""
    if isinstance(tree, int):
        return True
    if type(tree) in (tuple, list):
        return all(_jsonable_structure(t) for t in tree)
    if type(tree) is dict:
        return all(isinstance(k, str) and _jsonable_structure(v) for k, v in tree.items())
    return False


@dataclass
class StableHLO:
    """An exported program: ``exported`` (a ``jax.export.Exported``: ``.call(weights, *inputs)``,
    ``.mlir_module()``, ``.serialize()``), its ``weights`` by name, and what ``save`` writes."""

    exported: jax.export.Exported
    weights: dict[str, np.ndarray]
    manifest: dict[str, Any] = field(default_factory=dict)

    def mlir_module(self) -> str:
        """The StableHLO text."""
        return self.exported.mlir_module()

    def __call__(self, *inputs):
        """Run it here (torch tensors are read as NumPy arrays); JAX arrays out."""
        inputs = [_numpy(x) if isinstance(x, torch.Tensor) else x for x in inputs]
        return self.exported.call(self.weights, *inputs)

    def save(self, path: str | os.PathLike) -> str:
        """Write the artifact directory (``export_runtime`` describes it); returns its path."""
        try:
            program = self.exported.serialize()
        except ImportError as exc:  # jax.export's serialisation imports flatbuffers, not a jax dependency
            raise ImportError(f"torchtpu.export: saving needs flatbuffers: pip install 'torchtpu[export]' "
                              f"({exc})") from exc
        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, runtime.PROGRAM_FILE), "wb") as f:
            f.write(program)
        stored = {name: w.view(runtime.stored_dtype(w.dtype)) for name, w in self.weights.items()}
        np.savez(os.path.join(path, runtime.WEIGHTS_FILE), **stored)
        with open(os.path.join(path, runtime.MANIFEST_FILE), "w") as f:
            json.dump(self.manifest, f, indent=1)
        with open(os.path.join(path, runtime.MLIR_FILE), "w") as f:
            f.write(self.mlir_module())
        shutil.copyfile(runtime.__file__, os.path.join(path, runtime.LOADER_FILE))
        return path


def _jax_platform(name: str) -> str:
    if name != "gpu":
        return name
    return jax.devices("gpu")[0].client.platform  # cuda or rocm


def to_stablehlo(exported_program: ExportedProgram, *, platforms: tuple[str, ...] | None = None) -> StableHLO:
    """``exported_program`` (``torch.export.export``'s) as a StableHLO program and its weights.

    ``platforms``: the JAX platforms it is lowered for (``"cpu"``, ``"tpu"``, ``"cuda"``, ...;
    several give one multi-platform artifact); by default torchtpu's platform. Raises
    ``UnsupportedOpError`` naming each op that cannot be lowered."""
    if not isinstance(exported_program, ExportedProgram):
        raise TypeError(f"to_stablehlo takes a torch.export.ExportedProgram, not {type(exported_program).__name__}")
    from torchtpu.compile.decompositions import decompositions

    registry.load_all()
    ep = exported_program.run_decompositions(decompositions())
    gm = ep.graph_module
    _prepare(gm)
    try:
        fn = graph_lowering.GraphFunction(gm)
    except graph_lowering.MissingLowering as exc:  # _prepare finds these first; kept for a clear error
        raise UnsupportedOpError([str(exc)], "no lowering") from None

    signature = ep.graph_signature
    specs = signature.input_specs
    placeholders = fn.placeholders
    if len(specs) != len(placeholders):
        raise RuntimeError(f"torchtpu.export: {len(placeholders)} placeholders for {len(specs)} input specs")
    state = {**ep.state_dict, **ep.constants}
    weights: dict[str, np.ndarray] = {}
    inputs: list[tuple[int, torch.fx.Node]] = []  # (placeholder index, node) of each tensor input
    constants: dict[int, Any] = {}  # placeholder index -> a non-tensor user input's value (static)
    for i, (spec, node) in enumerate(zip(specs, placeholders)):
        if spec.kind == InputKind.USER_INPUT:
            if isinstance(node.meta.get("val"), torch.Tensor):
                inputs.append((i, node))
            else:
                constants[i] = getattr(spec.arg, "value", node.meta.get("val"))
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            if not node.users:  # unread (BatchNorm's num_batches_tracked in eval): not an argument
                continue
            value = state[spec.target]
            if not isinstance(value, torch.Tensor):
                raise NotImplementedError(f"torchtpu.export: input {spec.target} is a {type(value).__name__}, "
                                          f"not a tensor")
            weights[spec.target] = _numpy(value)
        else:
            raise NotImplementedError(f"torchtpu.export: a program input of kind {spec.kind.name} "
                                      f"({node.name}) is not supported")
    names = {spec.target: spec.arg.name for spec in specs if spec.target in weights}
    weight_of = {names[t]: t for t in weights}

    user_outputs = []
    for i, spec in enumerate(signature.output_specs):
        if spec.kind in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT):
            user_outputs.append(i)
        elif spec.kind in (OutputKind.BUFFER_MUTATION, OutputKind.USER_INPUT_MUTATION):
            raise NotImplementedError(
                f"torchtpu.export: the program writes its {spec.kind.name.lower().replace('_', ' ')} "
                f"{spec.target}; an exported StableHLO program returns its outputs only (is the module "
                f"in eval() mode?)")
        else:
            raise NotImplementedError(f"torchtpu.export: a program output of kind {spec.kind.name} is not supported")
    structure = torch_pytree.tree_unflatten(list(range(len(user_outputs))), ep.call_spec.out_spec)
    if not _jsonable_structure(structure):
        structure = tuple(range(len(user_outputs)))

    dim_names = _dimension_names([node for _, node in inputs])
    constraints = _constraints(ep, dim_names)
    dims: dict = {}
    if dim_names:
        symbols = list(dim_names)
        made = jax.export.symbolic_shape(", ".join(dim_names[s] for s in symbols), constraints=constraints)
        dims = dict(zip(symbols, made))
    input_specs = [jax.ShapeDtypeStruct(_shape(node.meta["val"].shape, dims), to_jax_dtype(node.meta["val"].dtype))
                   for _, node in inputs]
    weight_specs = {name: jax.ShapeDtypeStruct(w.shape, w.dtype) for name, w in weights.items()}
    setting = precision.setting() if fn.dots else None

    def program(weight_values: dict, *input_values):
        values: list[Any] = [None] * len(placeholders)
        for (i, _), value in zip(inputs, input_values):
            values[i] = value
        for i, node in enumerate(placeholders):
            if i in constants:
                values[i] = constants[i]
            elif node.name in weight_of:
                values[i] = weight_values[weight_of[node.name]]
        with precision.tracing(setting, "a lowering in torchtpu.export"), checks.suspended():
            outputs, _ = fn(None, values)
        return jax.tree.map(lambda k: outputs[user_outputs[k]], structure)

    program.__name__ = "torchtpu_export"
    if platforms is None:
        platforms = (_jax_platform(tpu_platform.platform()),)
    exported = jax.export.export(jax.jit(program), platforms=tuple(platforms))(weight_specs, *input_specs)

    def described(shape) -> list:
        return [int(s) if isinstance(s, int) else str(s) for s in shape]

    manifest = {
        "format": runtime.FORMAT,
        "version": runtime.VERSION,
        "inputs": [{"name": node.name, "shape": described(s.shape), "dtype": _dtype_name(s.dtype)}
                   for (_, node), s in zip(inputs, input_specs)],
        "outputs": [{"shape": described(a.shape), "dtype": _dtype_name(a.dtype)} for a in exported.out_avals],
        "dimensions": {name: [c for c in constraints if c.split()[0] == name] for name in dim_names.values()},
        "weights": {name: {"shape": list(w.shape), "dtype": _dtype_name(w.dtype)} for name, w in weights.items()},
        "platforms": list(exported.platforms),
        "versions": {"jax": jax.__version__, "torch": torch.__version__,
                     "calling_convention": exported.calling_convention_version},
    }
    return StableHLO(exported, weights, manifest)


def save(exported_program: ExportedProgram, path: str | os.PathLike, **kwargs) -> str:
    """``to_stablehlo(exported_program, **kwargs).save(path)``."""
    return to_stablehlo(exported_program, **kwargs).save(path)


__all__ = ["StableHLO", "UnsupportedOpError", "save", "to_stablehlo"]
