"""Private PyTorch and JAX APIs are reached through one door, ``torchtpu.runtime.compat``.

The scan reads every module of ``src/torchtpu`` (AST): a reference to ``torch``, ``jax`` or
``jaxlib`` with a ``_``-prefixed component (``torch._C._foo``, ``from torch._ops import ...``,
``import jax._src.api``, ``from torch.utils import _pytree``, and names bound by those imports)
anywhere but in ``compat`` fails, so a new private API is a visible decision: an entry in
``compat.TABLE`` (with why and its versions), or a line here. Op names under ``torch.ops`` are not
private APIs (``torch.ops.aten._to_copy`` is an op); what follows an op overload is
(``..._handle``).
"""

from __future__ import annotations

import ast
import contextvars
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchtpu
from torchtpu.runtime import compat

ROOT = Path(torchtpu.__file__).parent
COMPAT = Path(compat.__file__)
LIBRARIES = ("torch", "jax", "jaxlib")

# Files not moved to compat yet, and how many distinct private names each still uses: a count
# may go down (lower it), never up. Being rewritten or edited elsewhere now:
NOT_MIGRATED_YET: dict[str, int] = {}


def _private(parts: list[str]) -> bool:
    return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts)


def _chain(node: ast.AST) -> list[str] | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def private_references(source: str) -> set[str]:
    """The private torch/jax/jaxlib names ``source`` reaches, as full dotted names."""
    tree = ast.parse(source)
    found: set[str] = set()
    bound: dict[str, str] = {}  # local name -> the dotted name it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in LIBRARIES:
                    if _private(parts):
                        found.add(alias.name)
                    bound[alias.asname or parts[0]] = alias.name if alias.asname else parts[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in LIBRARIES:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    if _private(full.split(".")):
                        found.add(full)
                    bound[alias.asname or alias.name] = full
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = _chain(node)
            if not chain or chain[0] not in bound:
                continue
            full = bound[chain[0]].split(".") + chain[1:]
            checked = full[5:] if full[:2] == ["torch", "ops"] else full  # an op's own name is public
            if _private(checked):
                found.add(".".join(full))
    # one name per symbol: up to the last private component and the name after it
    # (``jax._src.config.x.value`` is ``jax._src.config``, ``registry._BACKENDS.pop`` is ``_BACKENDS.pop``)
    found = {_symbol(name.split(".")) for name in found}
    return {name for name in found if not any(other.startswith(name + ".") for other in found)}


def _symbol(parts: list[str]) -> str:
    last = max(i for i, p in enumerate(parts) if _private([p]))
    return ".".join(parts[:last + 2])


def _scan() -> dict[str, set[str]]:
    result = {}
    for path in sorted(ROOT.rglob("*.py")):
        if path == COMPAT:
            continue
        names = private_references(path.read_text())
        if names:
            result[path.relative_to(ROOT).as_posix()] = names
    return result


def test_private_apis_only_through_compat():
    found = _scan()
    unexpected = {f: sorted(n) for f, n in found.items() if f not in NOT_MIGRATED_YET}
    assert not unexpected, (
        "private torch/jax APIs outside torchtpu/runtime/compat.py (add an entry to compat.TABLE, "
        f"with why, and import it from there): {unexpected}")
    grown = {f: sorted(found.get(f, ())) for f, allowed in NOT_MIGRATED_YET.items() if len(found.get(f, ())) > allowed}
    assert not grown, f"files not migrated yet use more private names than before (move them to compat): {grown}"
    gone = [f for f in NOT_MIGRATED_YET if (ROOT / f).exists() and f not in found]
    assert not gone, f"these use no private name any more (or are gone): drop them from NOT_MIGRATED_YET: {gone}"


@pytest.mark.parametrize("source, expected", [
    ("import torch\nx = torch._C._foo", {"torch._C._foo"}),
    ("from torch import _C\n_C._bar()", {"torch._C._bar"}),
    ("from torch._ops import OpOverload", {"torch._ops.OpOverload"}),
    ("import jax._src.api", {"jax._src.api"}),
    ("import torch.utils._pytree as pytree\npytree.tree_map", {"torch.utils._pytree.tree_map"}),
    ("from torch.utils import _pytree\n", {"torch.utils._pytree"}),
    ("import torch\ntorch.ops.aten._to_copy.default", set()),
    ("import torch\ntorch.ops.aten.set_.source_Storage_storage_offset._handle.redispatch_boxed",
     {"torch.ops.aten.set_.source_Storage_storage_offset._handle.redispatch_boxed"}),
    ("import torch\ntorch.nn.functional.relu; torch.__version__", set()),
    ("import numpy as np\nnp._private", set()),
])
def test_the_scan_finds_private_references(source, expected):
    assert private_references(source) == expected


def test_every_entry_resolves_on_the_installed_versions():
    missing = []
    for entry in compat.TABLE:
        try:
            value = compat.resolve(entry.name)
        except compat.PrivateAPIError as exc:
            missing.append(str(exc))
            continue
        if value is None and (compat.available(entry.name) or not entry.optional):
            missing.append(f"{entry.name} ({entry.target}, {entry.versions}) is None")
    assert not missing, "\n".join(missing)
    assert len({e.name for e in compat.TABLE}) == len(compat.TABLE), "an entry name is listed twice"
    assert all(e.why and e.library in compat.TESTED for e in compat.TABLE)


def test_a_missing_name_says_which_and_what_to_do(monkeypatch):
    entry = compat.Private("gone", "torch:_C._no_such_function_anywhere", "an example")
    monkeypatch.setitem(compat._BY_NAME, "gone", entry)
    with pytest.raises(compat.PrivateAPIError, match=r"torch\._C\._no_such_function_anywhere \(an example\), "
                                                      r"which torch 2\.\d+ does not have.*tested with torch 2\.11 to 2\.14"):
        compat.gone  # noqa: B018
    later = compat.Private("later", "torch:_C._no_such_function_anywhere", "an example", since="99.0", optional=True)
    monkeypatch.setitem(compat._BY_NAME, "later", later)
    assert compat.resolve("later") is None


def test_the_tested_versions_are_pyprojects():
    text = (ROOT.parent.parent / "pyproject.toml").read_text()
    first, last = compat.TESTED["torch"]
    assert f'"torch>={first},<2.{int(last.split(".")[1]) + 1}"' in text
    assert f'"jax>={compat.TESTED["jax"][0]}.' in text and f'<0.{int(compat.TESTED["jax"][1].split(".")[1]) + 1}"' in text


def test_the_autograd_stash_still_carries_the_callers_context():
    """``autograd_caller_context``: inside a backward pass, the contextvars of backward()'s caller."""
    var = contextvars.ContextVar("probe")
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            caller = compat.autograd_caller_context()
            seen.append(None if caller is None else caller.get(var, None))
            return grad * 2

    x = torch.ones(2, requires_grad=True)
    var.set("caller's")
    Probe.apply(x).sum().backward()
    assert seen == ["caller's"]
    assert compat.autograd_caller_context() is None  # outside a backward pass


def test_import_torch_resolves_nothing_costly():
    """A module imported at ``import torch`` takes a name needing dynamo, Inductor, sympy or JAX
    at its point of use: at its top, that name would import seconds of modules into every program."""
    code = ("import sys, torch; from torchtpu.runtime import compat; "
            "print(sorted(m for m in ('torch._dynamo', 'jax', 'torch.utils._sympy', 'torch._inductor') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_set_storage_below_backend_sets_storage_sizes_and_strides():
    storage = torch.arange(6.0).untyped_storage()
    t = torch.empty(0)
    cpu = compat.DispatchKeySet(compat.DispatchKey.CPU)
    compat.set_storage_below_backend(cpu, t, storage, 1, [2, 2], [2, 1])
    assert t.untyped_storage().data_ptr() == storage.data_ptr()
    assert t.tolist() == [[1.0, 2.0], [3.0, 4.0]]


def test_new_capsule_makes_a_dlpack_capsule_torch_imports():
    """``new_capsule``: a capsule of a hand-built DLManagedTensor (here a CPU one over 3 floats)."""
    import ctypes

    class Device(ctypes.Structure):
        _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]

    class DataType(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]

    class Tensor(ctypes.Structure):
        _fields_ = [("data", ctypes.c_void_p), ("device", Device), ("ndim", ctypes.c_int), ("dtype", DataType),
                    ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                    ("byte_offset", ctypes.c_uint64)]

    class Managed(ctypes.Structure):
        _fields_ = [("dl_tensor", Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]

    data, shape = (ctypes.c_float * 3)(1.0, 2.0, 3.0), (ctypes.c_int64 * 1)(3)
    managed = Managed()
    managed.dl_tensor.data = ctypes.addressof(data)
    managed.dl_tensor.device = Device(1, 0)  # kDLCPU
    managed.dl_tensor.ndim = 1
    managed.dl_tensor.dtype = DataType(2, 32, 1)  # float32
    managed.dl_tensor.shape = shape
    t = torch.from_dlpack(compat.new_capsule(ctypes.addressof(managed), b"dltensor", None))
    assert t.tolist() == [1.0, 2.0, 3.0] and t.data_ptr() == ctypes.addressof(data)
