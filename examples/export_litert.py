"""Train a small model on ``tpu``, convert it to LiteRT (``.tflite``) and check it in the interpreter.

A conv net learns to tell four random prototype images apart (SGD on ``tpu``), is converted with
``litert_torch.convert``, written to a ``.tflite`` file, loaded back by the LiteRT interpreter
(``ai_edge_litert``) and compared with the torch model. Nothing is downloaded.

    pip install 'torchtpu[litert]'
    python examples/export_litert.py [--steps 50] [--out /tmp/tiny_net.tflite]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch  # `import torch` loads torchtpu

try:
    import litert_torch
    from ai_edge_litert.interpreter import Interpreter
except ImportError as error:
    raise SystemExit(f"{error}. This example needs the litert extra: pip install 'torchtpu[litert]'") from None


def tiny_net() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
        torch.nn.Linear(16 * 8 * 8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def batch(prototypes: torch.Tensor, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy copies of the prototypes, with their class as label."""
    labels = torch.randint(0, len(prototypes), (n,), generator=gen)
    return prototypes[labels] + 3.0 * torch.randn(n, *prototypes.shape[1:], generator=gen), labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", default="/tmp/tiny_net.tflite")
    args = parser.parse_args()

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    prototypes = torch.randn(4, 3, 16, 16, generator=gen)
    model = tiny_net().to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    start = time.perf_counter()
    for step in range(args.steps):
        x, y = batch(prototypes, 32, gen)
        loss = torch.nn.functional.cross_entropy(model(x.to("tpu")), y.to("tpu"))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}")
    print(f"trained on tpu ({torch.tpu.get_device_name()}) in {time.perf_counter() - start:.1f} s")

    model = model.eval().to("cpu")   # convert from CPU (a model left on tpu converts too)
    x, y = batch(prototypes, 64, gen)
    start = time.perf_counter()
    edge = litert_torch.convert(model, (x,))
    edge.export(args.out)
    print(f"converted in {time.perf_counter() - start:.1f} s -> {args.out}")

    interp = Interpreter(model_path=args.out)
    runner = interp.get_signature_runner()
    (name,) = interp.get_signature_list()["serving_default"]["inputs"]
    (logits,) = runner(**{name: x.numpy()}).values()
    with torch.no_grad():
        expected = model(x).numpy()
    print(f"tflite accuracy {(logits.argmax(1) == y.numpy()).mean():.2f}; "
          f"max |tflite - torch| = {np.abs(logits - expected).max():.2e} "
          f"(logits up to {np.abs(expected).max():.1f})")


if __name__ == "__main__":
    main()
