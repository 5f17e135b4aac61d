"""``torchtpu export``: a ``torch.export`` program to a StableHLO artifact (``torchtpu.export``).

The program is a file ``torch.export.save`` wrote (``.pt2``), or ``module:name`` / ``file.py:name``
naming an ``ExportedProgram`` or a function of no arguments that returns one. Importing this
module imports nothing heavy: the ``torchtpu`` command builds its parser from it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("export", help="a torch.export program (.pt2, or module:name) to a StableHLO artifact "
                                      "that runs in JAX without PyTorch (docs/export.md)")
    p.add_argument("program", help="a file torch.export.save wrote (.pt2), or module:name / file.py:name of an "
                                   "ExportedProgram or of a function returning one")
    p.add_argument("-o", "--output", help="the artifact directory (default: the program's name + .stablehlo)")
    p.add_argument("--platform", action="append", dest="platforms", metavar="NAME",
                   help="a JAX platform to lower for (cpu, tpu, cuda, rocm); repeat for a multi-platform "
                        "artifact (default: torchtpu's platform)")
    p.add_argument("--print-mlir", action="store_true", help="also print the StableHLO text")
    p.set_defaults(fn=run)
    return p


def _program(spec: str):
    import torch

    if ":" not in spec or os.path.exists(spec):
        return torch.export.load(spec), os.path.splitext(os.path.basename(spec))[0]
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        loader = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(where))[0], where)
        module = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    value = getattr(module, name)
    if callable(value) and not isinstance(value, torch.export.ExportedProgram):
        value = value()
    return value, name


def run(args) -> int:
    from torchtpu import export

    try:
        program, stem = _program(args.program)
    except (OSError, ImportError, AttributeError, RuntimeError) as exc:
        print(f"torchtpu export: cannot read {args.program}: {exc}", file=sys.stderr)
        return 2
    try:
        artifact = export.to_stablehlo(program, platforms=tuple(args.platforms) if args.platforms else None)
    except (export.UnsupportedOpError, TypeError, NotImplementedError) as exc:
        print(exc, file=sys.stderr)
        return 1
    path = artifact.save(args.output or f"{stem}.stablehlo")
    m = artifact.manifest
    if args.print_mlir:
        print(artifact.mlir_module())
    nbytes = sum(w.nbytes for w in artifact.weights.values())
    print(f"wrote {path}")
    for entry in m["inputs"]:
        print(f"  input  {entry['name']}: {entry['dtype']}[{', '.join(map(str, entry['shape']))}]")
    for i, entry in enumerate(m["outputs"]):
        print(f"  output {i}: {entry['dtype']}[{', '.join(map(str, entry['shape']))}]")
    for name, constraints in m["dimensions"].items():
        print(f"  dimension {name}" + (f" ({', '.join(constraints)})" if constraints else ""))
    print(f"  {len(artifact.weights)} weights, {nbytes / 2**20:.1f} MiB; platforms {', '.join(m['platforms'])}")
    print(f"load it without torch: python -c \"import sys; sys.path.insert(0, '{path}'); import load; "
          f"print(load.load('{path}'))\"")
    return 0
