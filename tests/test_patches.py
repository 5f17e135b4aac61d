"""``torchtpu.patches``: every process-wide change torchtpu makes is in one table, made as late as
it can be, listed while applied, and undone by its undo.

The checks run in fresh processes: ``import torch`` (which imports torchtpu through the backend
autoload) is compared with the same program under ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``, target by
target and over the namespaces torchtpu could reach, so a change made outside the table shows up
as a difference too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from torchtpu import patches

# What may differ right after ``import torch``: a new entry here is a visible decision.
AT_IMPORT = {"dynamo.import_hook", "dlpack.exports"}

# Resolves a table target without importing anything, and fingerprints it so that two processes
# can be compared (functions by module and qualified name, lists item by item).
_PROBE = r'''
import atexit, inspect, json, sys

def resolve(target):
    path, _, key = target.partition("[")
    parts = path.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in sys.modules:
            value = sys.modules[".".join(parts[:n])]
            break
    else:
        return "<not imported>"
    for name in parts[n:]:  # static lookups: torch's module __getattr__ would import torch._dynamo
        try:
            value = inspect.getattr_static(value, name)
        except AttributeError:
            return "<absent>"
    if value is atexit:  # its handlers cannot be listed (and the runtime, JAX, registers its own)
        return "<atexit>"
    if key:
        key = key.rstrip("]")
        hits = [v for k, v in value.items() if str(k) == key]
        return fingerprint(hits[0]) if hits else "<absent>"
    return fingerprint(value)

def fingerprint(value):
    if isinstance(value, (list, tuple)):
        return [fingerprint(v) for v in value]
    if isinstance(value, (str, int, bool, type(None))):
        return value
    if isinstance(value, float):
        return repr(value)  # nan != nan
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    return f"<{type(value).__module__}.{type(value).__qualname__}>"

NAMESPACES = ("torch", "torch.Tensor", "torch.utils.dlpack", "torch.nn.functional", "torch.cuda",
              "torch._TorchCompileInductorWrapper", "torch.autograd.profiler.record_function",
              "torch.nn.attention.flex_attention", "torch._dynamo.backends.registry", "sys")

def snapshot(table):
    out = {"targets": {t: resolve(t) for p in table for t in p.targets}, "names": {}}
    for space in NAMESPACES:
        obj = sys.modules.get(space)
        if obj is None:
            base = sys.modules.get(space.rsplit(".", 1)[0])
            obj = inspect.getattr_static(base, space.rsplit(".", 1)[1], None) if base is not None else None
        if obj is None:
            continue
        for name, value in list(vars(obj).items()):
            if space == "sys" and name not in ("excepthook", "meta_path", "path_hooks", "displayhook"):
                continue
            if name == "_queued_calls":  # torch.cuda's: stack traces of the program itself
                continue
            out["names"][f"{space}.{name}"] = fingerprint(value)
    return out
'''


def _run(body: str, autoload: bool) -> dict:
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="1" if autoload else "0")
    code = (_PROBE + "\nfrom torchtpu.patches import TABLE\n" if autoload else
            _PROBE + "\nimport importlib.util, sys\n"
            "spec = importlib.util.spec_from_file_location('_table', %r)\n"
            "_table = importlib.util.module_from_spec(spec); sys.modules['_table'] = _table\n"
            "spec.loader.exec_module(_table); TABLE = _table.TABLE\n" % patches.__file__) + body
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _differences(with_us: dict, without: dict, allowed: set[str]) -> list[str]:
    found = [f"{t}: {without['targets'][t]!r} -> {v!r}" for t, v in with_us["targets"].items()
             if t not in allowed and v != without["targets"][t]]
    for name, value in without["names"].items():
        owner = {t for t in allowed if name == t}
        if not owner and with_us["names"].get(name) != value:
            found.append(f"{name}: {value!r} -> {with_us['names'].get(name)!r}")
    for name in with_us["names"].keys() - without["names"].keys():
        if "tpu" not in name.lower():  # new names: only the device registration's (torch.tpu, Tensor.tpu)
            found.append(f"{name}: new")
    return found


def _targets(names) -> set[str]:
    return {t for name in names for t in patches.get(name).targets}


def test_the_table_is_complete_and_resolvable():
    assert len({p.name for p in patches.TABLE}) == len(patches.TABLE)
    known = {patches.IMPORT, patches.DYNAMO_IMPORT, patches.FIRST_USE, patches.TRACE, patches.MULTIPROCESS,
             patches.ENGINE}
    for p in patches.TABLE:
        assert p.when in known and p.why and p.versions and p.targets, p
        for spec in (p.apply, p.undo):
            if spec is not None:
                assert callable(patches._function(spec)), spec
        assert (p.apply is None) == (p.when == patches.ENGINE), p.name  # only engines' sites make their own
    assert {p.name for p in patches.TABLE if p.when == patches.IMPORT} == AT_IMPORT


def test_import_torch_leaves_every_target_as_shipped():
    """A program that imports torch and never touches tpu: nothing changed but the import-time entries."""
    body = "import torch\nprint(json.dumps(snapshot(TABLE)))"
    with_us, without = _run(body, True), _run(body, False)
    assert _differences(with_us, without, _targets(AT_IMPORT)) == []
    assert with_us["targets"]["sys.meta_path"] != without["targets"]["sys.meta_path"]  # the hook waits for dynamo


def test_applied_after_tpu_use_and_undo_restores():
    setup = ("import torch\n{use}import torch._dynamo\nimport torch.nn.attention.flex_attention\n"
             "import torch._higher_order_ops.flex_attention\n")
    used = _run(setup.format(use="torch.ones(2, device='tpu').sum().item()\n") + r'''
from torchtpu import patches
applied = patches.applied()
before = snapshot(TABLE)
for name in reversed(applied):
    if patches.get(name).undo is not None:
        patches.undo(name)
print(json.dumps({"applied": applied, "before": before, "after": snapshot(TABLE), "left": patches.applied()}))
''', True)
    without = _run(setup.format(use="") + "print(json.dumps(snapshot(TABLE)))", False)
    expected = {"inductor.tpu_guard", "flex_attention.kernels", "flex_attention.validate_device",
                "dynamo.tpu_backend", "dynamo.default_backend", "dynamo.skip_files", "dlpack.exports"}
    assert expected <= set(used["applied"])
    assert "dynamo.import_hook" not in used["applied"]  # it left sys.meta_path when dynamo was imported
    changed = _targets(expected - {"dlpack.exports"})
    assert all(used["before"]["targets"][t] != without["targets"][t] for t in changed), "applied, yet unchanged"
    assert used["left"] == [n for n in used["applied"] if patches.get(n).undo is None]
    assert _differences(used["after"], without, _targets(used["left"])) == []


def test_engine_free_changes_apply_only_where_they_are_wanted():
    from torchtpu.runtime import multiprocess

    # profiler.record_function: only during a trace (test_profiler checks the spans).
    assert "profiler.record_function" not in patches.applied()
    # multiprocess.excepthook: only after joining a multi-process runtime.
    if multiprocess.joined() is None:
        assert "multiprocess.excepthook" not in patches.applied()


def test_record_function_patch_undoes():
    import torch

    cls = torch.autograd.profiler.record_function
    enter, exit_ = cls.__dict__["__enter__"], cls.__dict__["__exit__"]
    patches.apply("profiler.record_function")
    try:
        assert cls.__dict__["__enter__"] is not enter and "profiler.record_function" in patches.applied()
        with torch.autograd.profiler.record_function("span"):
            pass
    finally:
        patches.undo("profiler.record_function")
    assert cls.__dict__["__enter__"] is enter and cls.__dict__["__exit__"] is exit_
    assert "profiler.record_function" not in patches.applied()


def test_excepthook_patch_undoes():
    previous = sys.excepthook
    if not patches.apply("multiprocess.excepthook"):
        pytest.skip("this JAX has no jax._src.api.clean_up")
    try:
        assert sys.excepthook is not previous
    finally:
        patches.undo("multiprocess.excepthook")
    assert sys.excepthook is previous


def test_info_lists_the_applied_patches(capsys):
    import torch

    from torchtpu import cli

    torch.ones(1, device="tpu")
    lines = cli.patch_lines()
    assert lines[0].startswith(f"patches applied in this process: {len(patches.applied())} of {len(patches.TABLE)}")
    for name in patches.applied():
        assert any(line.split()[0] == name for line in lines[1:])
