"""``torchtpu.export``: torch.export programs to StableHLO artifacts that run in JAX without torch.

Four models (a CNN, an MLP, a small transformer encoder layer, and an embedding with int64 ids
and bfloat16 weights) are exported once, with a dynamic batch dimension, and saved; a fresh interpreter that imports no torch loads each
artifact (through the ``load.py`` written into it, and through bare ``jax.export``) and runs it
at several batch sizes against torch's outputs, saved beside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch import nn
from torch.export import Dim, export

from torchtpu import export as tpu_export
from torchtpu import export_runtime

BATCHES = (1, 3, 8)  # exported at batch 2
TOLERANCE = 1e-5


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = nn.functional.max_pool2d(torch.relu(self.bn(self.conv1(x))), 2)
        x = torch.relu(self.conv2(x))
        return self.fc(nn.functional.adaptive_avg_pool2d(x, 1).flatten(1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 5))

    def forward(self, x):
        return self.net(x).log_softmax(-1)


def _transformer():
    return nn.TransformerEncoderLayer(d_model=16, nhead=4, dim_feedforward=32, dropout=0.1, batch_first=True)


class Embedding(nn.Module):
    """int64 inputs and bfloat16 weights: the loader turns on x64 and views the weights back."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 8).to(torch.bfloat16)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        return self.head(self.embed(ids).float())


MODELS = {  # name -> (module factory, one example's shape; None: int64 token ids of length 7)
    "cnn": (CNN, (3, 16, 16)),
    "mlp": (MLP, (12,)),
    "transformer": (_transformer, (6, 16)),
    "embedding": (Embedding, None),
}


def _example(name: str, batch: int, gen: torch.Generator | None = None) -> torch.Tensor:
    shape = MODELS[name][1]
    if shape is None:
        return torch.randint(0, 50, (batch, 7), generator=gen)
    return torch.randn(batch, *shape, generator=gen)


def _export(name: str, max_batch: int = 1024):
    torch.manual_seed(0)
    model = MODELS[name][0]().eval()
    if name == "cnn":  # BatchNorm with statistics of its own, not the identity
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
    ep = export(model, (_example(name, 2),), dynamic_shapes=({0: Dim("batch", max=max_batch)},))
    return model, ep


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """Each model exported and saved, with inputs and torch's outputs at each batch size."""
    root = tmp_path_factory.mktemp("export")
    made = {}
    for name in MODELS:
        model, ep = _export(name)
        artifact = tpu_export.to_stablehlo(ep)
        path = artifact.save(root / name)
        gen = torch.Generator().manual_seed(1)
        cases = {}
        with torch.no_grad():
            for b in BATCHES:
                x = _example(name, b, gen)
                cases[f"x{b}"] = x.numpy()
                cases[f"y{b}"] = model(x).numpy()
        np.savez(root / f"{name}_cases.npz", **cases)
        made[name] = (Path(path), artifact)
    return root, made


_NO_TORCH = textwrap.dedent("""
    import importlib.util, json, sys
    import numpy as np
    import jax

    root, names, batches, tol = sys.argv[1], sys.argv[2].split(","), [int(b) for b in sys.argv[3].split(",")], float(sys.argv[4])
    worst = {}
    for name in names:
        path = f"{root}/{name}"
        spec = importlib.util.spec_from_file_location("load", f"{path}/load.py")  # the artifact's own loader
        load = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(load)
        program = load.load(path)
        # and by hand, as docs/export.md shows: jax.export and NumPy only
        exported = jax.export.deserialize(bytearray(open(f"{path}/model.jaxexport", "rb").read()))
        manifest = json.load(open(f"{path}/manifest.json"))
        weights = {k: v.view(jax.numpy.dtype(manifest["weights"][k]["dtype"]))
                   for k, v in np.load(f"{path}/weights.npz").items()}
        cases = np.load(f"{root}/{name}_cases.npz")
        worst[name] = 0.0
        for b in batches:
            x, want = cases[f"x{b}"], cases[f"y{b}"]
            for got in (program(x), exported.call(weights, x)):
                got = np.asarray(got)
                assert got.shape == want.shape, (name, b, got.shape, want.shape)
                np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"{name} at batch {b}")
                worst[name] = max(worst[name], float(np.abs(got - want).max()))
    print(json.dumps({"worst": worst, "x64": jax.config.jax_enable_x64, "torch": "torch" in sys.modules,
                      "torch_modules": sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "torchtpu"))}))
""")


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHTPU_")}
    env.pop("XLA_FLAGS", None)
    env.pop("PYTHONPATH", None)  # nothing of the source tree: the artifact alone
    return env


def test_models_run_in_jax_without_torch_at_several_batch_sizes(artifacts, tmp_path):
    root, made = artifacts
    script = tmp_path / "run_without_torch.py"
    script.write_text(_NO_TORCH)
    proc = subprocess.run([sys.executable, "-I", "-B", str(script), str(root), ",".join(made),
                           ",".join(map(str, BATCHES)), str(TOLERANCE)],
                          check=False, capture_output=True, text=True, timeout=240, env=_clean_env(),
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["torch"] is False and result["torch_modules"] == []
    assert set(result["worst"]) == set(MODELS)
    assert result["x64"] is True  # load.load turned it on for the embedding's int64 ids


def test_artifact_files_mlir_and_symbolic_batch(artifacts):
    _, made = artifacts
    for name, (path, artifact) in made.items():
        assert sorted(os.listdir(path)) == sorted([export_runtime.PROGRAM_FILE, export_runtime.WEIGHTS_FILE,
                                                   export_runtime.MANIFEST_FILE, export_runtime.MLIR_FILE,
                                                   export_runtime.LOADER_FILE])
        mlir = artifact.mlir_module()
        assert "stablehlo." in mlir and "func.func public @main" in mlir
        assert (path / export_runtime.MLIR_FILE).read_text() == mlir
        # the batch is one symbolic dimension, shared by the input and the output
        *_, x_aval = artifact.exported.in_avals
        batch = x_aval.shape[0]
        assert not isinstance(batch, int), name
        assert artifact.exported.out_avals[0].shape[0] == batch
        manifest = json.loads((path / export_runtime.MANIFEST_FILE).read_text())
        entry, = manifest["inputs"]
        assert entry["shape"][0] == str(batch)
        assert entry["dtype"] == ("int64" if name == "embedding" else "float32")
        assert manifest["dimensions"] == {str(batch): [f"{batch} <= 1024"]}
        # weights are arguments, not constants: they are the module's state
        assert artifact.weights and all(w.dtype == np.float32 for k, w in artifact.weights.items()
                                        if k != "embed.weight")
    embed = made["embedding"][1].weights["embed.weight"]
    assert embed.dtype == jnp.bfloat16
    stored = np.load(made["embedding"][0] / export_runtime.WEIGHTS_FILE)["embed.weight"]
    assert stored.dtype == np.uint16  # NumPy's format has no bfloat16; the manifest names it
    assert export_runtime.load_weights(str(made["embedding"][0]))["embed.weight"].tobytes() == embed.tobytes()
    cnn = made["cnn"][1]
    assert "bn.num_batches_tracked" not in cnn.weights  # unread in eval(): no int64 argument
    assert {"bn.running_mean", "bn.running_var", "conv1.weight"} <= set(cnn.weights)


def test_batch_range_is_checked_at_call():
    model, ep = _export("mlp", max_batch=4)
    artifact = tpu_export.to_stablehlo(ep)
    assert artifact.manifest["dimensions"] == {"x_dim0": ["x_dim0 <= 4"]}
    x = torch.randn(4, 12)
    np.testing.assert_allclose(np.asarray(artifact(x)), model(x).detach().numpy(), rtol=TOLERANCE, atol=TOLERANCE)
    with pytest.raises(Exception, match="x_dim0"):
        artifact(torch.randn(5, 12))


@torch.library.custom_op("torchtpu_export_test::mystery", mutates_args=())
def _mystery(x: torch.Tensor) -> torch.Tensor:
    return x.sin() * 2


@_mystery.register_fake
def _(x):
    return torch.empty_like(x)


class _Unlowerable(nn.Module):
    def forward(self, x):
        return torch.ops.torchtpu_export_test.mystery(x).relu() + 1


def test_op_without_lowering_fails_at_export_naming_it():
    ep = export(_Unlowerable(), (torch.randn(3, 4),))
    with pytest.raises(tpu_export.UnsupportedOpError, match=r"torchtpu_export_test\.mystery\.default") as info:
        tpu_export.to_stablehlo(ep)
    assert info.value.ops == ["torchtpu_export_test.mystery.default"]
    assert "no lowering" in str(info.value)


def test_random_op_is_refused():
    ep = export(nn.Dropout(0.5).train(), (torch.randn(3, 4),))
    with pytest.raises(tpu_export.UnsupportedOpError, match="random"):
        tpu_export.to_stablehlo(ep)


def test_cli_writes_a_loadable_artifact(tmp_path, capsys):
    """``torchtpu export`` (in this process: the parser and the command are what the console script
    runs; a fresh process would only add torch's import time)."""
    from torchtpu import cli

    model, ep = _export("mlp")
    program = tmp_path / "mlp.pt2"
    torch.export.save(ep, program)
    out = tmp_path / "mlp.stablehlo"
    assert cli.main(["export", str(program), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed
    assert "input  x: float32[x_dim0, 12]" in printed
    assert "dimension x_dim0 (x_dim0 <= 1024)" in printed
    loaded = export_runtime.load(str(out))
    x = torch.randn(5, 12)
    np.testing.assert_allclose(np.asarray(loaded(x.numpy())), model(x).detach().numpy(),
                               rtol=TOLERANCE, atol=TOLERANCE)


def test_cli_names_the_op_it_cannot_lower(tmp_path, capsys):
    from torchtpu import cli

    program = tmp_path / "bad.pt2"
    torch.export.save(export(_Unlowerable(), (torch.randn(3, 4),)), program)
    assert cli.main(["export", str(program), "-o", str(tmp_path / "bad.stablehlo")]) == 1
    assert "torchtpu_export_test.mystery.default" in capsys.readouterr().err
    assert not (tmp_path / "bad.stablehlo").exists()
