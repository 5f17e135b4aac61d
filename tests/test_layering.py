"""The layers import downward only: no import cycle between the packages of ``src/torchtpu``
(function-local imports count: one that climbs a layer is a cycle in disguise)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import torchtpu

ROOT = Path(torchtpu.__file__).parent


def _unit(module: str) -> str:
    """The package a module belongs to: ``torchtpu.eager.dispatch`` -> ``eager``; a top-level
    module (``torchtpu.metrics``) is its own unit."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "torchtpu"


def _imports(path: Path, module: str) -> set[str]:
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("torchtpu"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if target.startswith("torchtpu"):
                found.add(target)
                found.update(f"{target}.{a.name}" for a in node.names)  # `from torchtpu import metrics`
    return found


def _graph() -> dict[str, set[str]]:
    units = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        module = "torchtpu." + ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        source = _unit(module) if module != "torchtpu" else "torchtpu"
        if source == "torchtpu" or module.count(".") == 1 and _unit(module) not in units:
            source = module  # a top-level module is a node of its own
        for target in _imports(path, module):
            parts = target.split(".")
            if len(parts) < 2:
                continue
            dest = parts[1] if parts[1] in units else ".".join(parts[:2])
            dest = dest if parts[1] in units else f"torchtpu.{parts[1]}"
            if dest != source:
                graph.setdefault(source, set()).add(dest)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycle_between_packages():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle)


def _module_graph() -> dict[str, set[str]]:
    """Module -> the torchtpu modules it imports, function-local imports included.

    ``from package import name`` is an edge to ``package.name`` when that is a module, else to the
    package's ``__init__``. (A module's import of a sibling through its package does not count as
    an edge to the package's ``__init__``: Python runs that first either way, and what could close
    a cycle is what the ``__init__`` itself imports, which is drawn.)"""
    modules = {"torchtpu." + ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
               for p in ROOT.rglob("*.py")}

    def resolve(target: str) -> str | None:
        parts = target.split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in modules:
                return ".".join(parts[:n])
        return None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        found: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(resolve(a.name) for a in node.names if a.name.startswith("torchtpu"))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    target = f"{base}.{node.module}" if node.module else base
                else:
                    target = node.module or ""
                if target.startswith("torchtpu"):
                    found.update(f"{target}.{a.name}" if f"{target}.{a.name}" in modules else resolve(target)
                                 for a in node.names)
        graph[module] = {t for t in found if t is not None and t != module}
    return graph


def test_no_import_cycle_between_modules():
    """Inside a package too, the modules import one way: function-local imports count, as above (an
    import deferred to a function still makes the two modules one unit to read, test and change)."""
    cycle = _cycle(_module_graph())
    assert cycle is None, "import cycle between modules: " + " -> ".join(cycle)


def test_runtime_imports_without_the_layers_above():
    code = ("import sys, torchtpu.runtime, torchtpu.runtime.platform, torchtpu.runtime.streams, "
            "torchtpu.runtime.memory, torchtpu.runtime.errors, torchtpu.runtime.rng, torchtpu.runtime.state; "
            "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('torchtpu.') and "
            "m.split('.')[1] in ('eager', 'ops')}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PATH": ""})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
