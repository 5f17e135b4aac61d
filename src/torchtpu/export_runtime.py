"""Load and run a StableHLO artifact written by ``torchtpu.export``, with JAX alone.

This module imports only the standard library, NumPy and JAX: no torch, no torchtpu. Importing
it as ``torchtpu.export_runtime`` would import torchtpu's package (and so torch), so a deployment
without PyTorch copies this one file next to its code (``torchtpu.export`` also writes a copy,
``load.py``, into every artifact directory) and imports it from there::

    import load                         # the artifact's own copy of this module
    program = load.load("mlp.stablehlo")
    y = program(x)                      # x: a NumPy or JAX array; y: JAX arrays

An artifact is a directory:

- ``model.jaxexport``: the program, ``jax.export.Exported.serialize()``'s bytes (StableHLO with
  JAX's calling convention; portable across JAX versions within JAX's compatibility window);
- ``weights.npz``: its parameters, buffers and constants by name (dtypes NumPy cannot store,
  bfloat16 and float8, are stored as unsigned integers of their width and viewed back on load);
- ``manifest.json``: the inputs (names, shapes with symbolic dimensions by name, dtypes), the
  outputs, the weights' dtypes, and the versions it was made with;
- ``model.mlir``: the StableHLO text, to read (the program is ``model.jaxexport``).

The program is called as ``exported.call(weights, *inputs)``; without this module::

    import json, numpy as np, jax
    exported = jax.export.deserialize(bytearray(open("mlp.stablehlo/model.jaxexport", "rb").read()))
    dtypes = {k: w["dtype"] for k, w in json.load(open("mlp.stablehlo/manifest.json"))["weights"].items()}
    weights = {k: v.view(jax.numpy.dtype(dtypes[k])) for k, v in np.load("mlp.stablehlo/weights.npz").items()}
    y = exported.call(weights, x)   # (and jax_enable_x64 for a program with 64-bit types)
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

FORMAT = "torchtpu-stablehlo"
VERSION = 1
PROGRAM_FILE = "model.jaxexport"
WEIGHTS_FILE = "weights.npz"
MANIFEST_FILE = "manifest.json"
MLIR_FILE = "model.mlir"
LOADER_FILE = "load.py"

_64BIT = ("int64", "uint64", "float64", "complex128")


def stored_dtype(dtype: np.dtype) -> np.dtype:
    """How ``weights.npz`` holds an array of ``dtype``: as itself, or (bfloat16, float8: dtypes
    NumPy's format does not know) as unsigned integers of the same width."""
    dtype = np.dtype(dtype)
    if dtype.kind in "biufc":  # NumPy's own kinds: bool, ints, floats, complex
        return dtype
    return np.dtype(f"uint{dtype.itemsize * 8}")


def _dtype(name: str) -> np.dtype:
    return np.dtype(jax.numpy.dtype(name))  # knows bfloat16 and the float8 formats (ml_dtypes)


def load_weights(path: str, manifest: dict[str, Any] | None = None) -> dict[str, np.ndarray]:
    """The weights of the artifact at ``path`` by name, in their own dtypes."""
    if manifest is None:
        manifest = read_manifest(path)
    with np.load(os.path.join(path, WEIGHTS_FILE)) as stored:
        weights = {name: stored[name] for name in stored.files}
    for name, info in manifest["weights"].items():
        dtype = _dtype(info["dtype"])
        if weights[name].dtype != dtype:
            weights[name] = weights[name].view(dtype)
    return weights


def read_manifest(path: str) -> dict[str, Any]:
    with open(os.path.join(path, MANIFEST_FILE)) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is not a torchtpu StableHLO artifact (its {MANIFEST_FILE} says format "
                         f"{manifest.get('format')!r})")
    if manifest.get("version", 0) > VERSION:
        raise ValueError(f"{path} was written in format version {manifest['version']}; this loader reads "
                         f"versions up to {VERSION}: use the load.py written into the artifact")
    return manifest


def needs_x64(manifest: dict[str, Any]) -> bool:
    """Whether the program's inputs, outputs or weights have 64-bit types (JAX then needs
    ``jax_enable_x64``, or it would pass them as 32-bit and the call would refuse them)."""
    entries = [*manifest["inputs"], *manifest["outputs"], *manifest["weights"].values()]
    return any(entry["dtype"] in _64BIT for entry in entries)


class Program:
    """A loaded artifact: ``program(*inputs)`` runs it (on JAX's default device)."""

    def __init__(self, exported, weights: dict[str, Any], manifest: dict[str, Any]):
        self.exported = exported  # the jax.export.Exported
        self.weights = weights
        self.manifest = manifest

    def __call__(self, *inputs):
        return self.exported.call(self.weights, *inputs)

    def mlir(self) -> str:
        """The program's StableHLO, as text."""
        return self.exported.mlir_module()

    @property
    def input_shapes(self) -> list[tuple]:
        """Each input's shape: ints, and the names of symbolic (dynamic) dimensions."""
        return [tuple(entry["shape"]) for entry in self.manifest["inputs"]]

    def __repr__(self) -> str:
        shapes = ", ".join(f"{e['name']}: {e['dtype']}[{', '.join(map(str, e['shape']))}]"
                           for e in self.manifest["inputs"])
        return f"Program({shapes}; {len(self.weights)} weights; platforms {list(self.exported.platforms)})"


def load(path: str, *, device_put: bool = True) -> Program:
    """Load the artifact directory ``path``. ``device_put``: move the weights to JAX's default
    device once, here (else each call transfers them). Turns on ``jax_enable_x64`` when the
    program has 64-bit inputs, outputs or weights."""
    manifest = read_manifest(path)
    if needs_x64(manifest) and not jax.config.jax_enable_x64:
        jax.config.update("jax_enable_x64", True)
    with open(os.path.join(path, PROGRAM_FILE), "rb") as f:
        data = bytearray(f.read())
    try:
        exported = jax.export.deserialize(data)
    except ImportError as exc:  # jax.export reads the program with flatbuffers, not a jax dependency
        raise ImportError(f"loading {path} needs flatbuffers: pip install flatbuffers ({exc})") from exc
    weights: dict[str, Any] = load_weights(path, manifest)
    if device_put:
        weights = jax.device_put(weights)
    return Program(exported, weights, manifest)


__all__ = ["Program", "load", "load_weights", "needs_x64", "read_manifest", "stored_dtype"]
