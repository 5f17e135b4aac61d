"""LiteRT-Torch: a model trained on ``tpu`` converts to ``.tflite`` and runs in the LiteRT interpreter.

A small conv net takes a few SGD steps on ``tpu`` (its twin takes the same steps on CPU: the weights
must agree), is converted with ``litert_torch.convert``, written as a ``.tflite`` flatbuffer, and
run by ``ai_edge_litert``'s interpreter. Tolerance against the torch model's own output: 1e-6
absolute (measured about 1.5e-7; the interpreter runs XNNPACK's float32 kernels).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

litert_torch = pytest.importorskip("litert_torch", reason="the litert extra is not installed (pip install 'torchtpu[litert]')")
interpreter = pytest.importorskip("ai_edge_litert.interpreter",
                                  reason="the litert extra is not installed (pip install 'torchtpu[litert]')")

ATOL = 1e-6


def tiny_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
        torch.nn.Linear(8 * 4 * 4, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def train(model: torch.nn.Module, device: str, steps: int = 5) -> list[float]:
    """A few SGD steps on fixed random data (generated on CPU, so both devices see the same)."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 3, 8, 8, generator=gen), torch.randint(0, 4, (16,), generator=gen)
    x, y = x.to(device), y.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def trained():
    """(model trained on tpu, its initial weights' twin trained on CPU, tpu losses)."""
    model = tiny_net().to("tpu")
    twin = tiny_net()
    initial = copy.deepcopy(twin)
    losses = train(model, "tpu")
    cpu_losses = train(twin, "cpu")
    np.testing.assert_allclose(losses, cpu_losses, rtol=1e-5)
    for (name, p), q, p0 in zip(model.named_parameters(), twin.parameters(), initial.parameters()):
        assert not torch.equal(q, p0), f"{name} did not train"
        torch.testing.assert_close(p.detach().cpu(), q.detach(), atol=1e-5, rtol=1e-5, msg=name)
    return model.eval(), losses


def run_tflite(path, x: np.ndarray) -> np.ndarray:
    """Run the exported flatbuffer through the LiteRT interpreter's default signature."""
    interp = interpreter.Interpreter(model_path=str(path))
    runner = interp.get_signature_runner()
    (name,) = interp.get_signature_list()["serving_default"]["inputs"]
    (out,) = runner(**{name: x}).values()
    return out


def test_trained_on_tpu_converts_to_tflite(trained, tmp_path):
    model, losses = trained
    assert losses[-1] < losses[0]
    cpu_model = copy.deepcopy(model).to("cpu")
    sample = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    edge = litert_torch.convert(cpu_model, (sample,))
    path = tmp_path / "tiny_net.tflite"
    edge.export(str(path))
    assert path.stat().st_size > 0
    with torch.no_grad():
        expected = cpu_model(sample).numpy()
    np.testing.assert_allclose(run_tflite(path, sample.numpy()), expected, atol=ATOL, rtol=0)
    np.testing.assert_allclose(edge(sample.numpy()), expected, atol=ATOL, rtol=0)


def test_converts_while_on_tpu(trained):
    """The model and the sample input may stay on ``tpu``: export reads the weights from the device."""
    model, _ = trained
    sample = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    edge = litert_torch.convert(model, (sample.to("tpu"),))
    with torch.no_grad():
        expected = model(sample.to("tpu")).cpu().numpy()
    np.testing.assert_allclose(edge(sample.numpy()), expected, atol=ATOL, rtol=0)
