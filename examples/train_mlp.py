"""Train a small MLP classifier in eager mode on ``tpu`` (two interleaved spirals).

    python examples/train_mlp.py [--device tpu] [--steps 300]
"""

import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def spirals(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Two spirals of ``n`` points each, with noise: a task a linear model cannot solve."""
    t = torch.rand(n, generator=generator) * 3 * math.pi + 0.5
    arm = torch.stack([t * torch.cos(t), t * torch.sin(t)], dim=1) / (3 * math.pi)
    noise = 0.02 * torch.randn(2 * n, 2, generator=generator)
    x = torch.cat([arm, -arm]) + noise
    y = torch.cat([torch.zeros(n, dtype=torch.long), torch.ones(n, dtype=torch.long)])
    return x, y


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="tpu")
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    x, y = spirals(1000, gen)
    x, y = x.to(args.device), y.to(args.device)  # the whole data set lives on the device

    model = nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))
    model = model.to(args.device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    start = time.perf_counter()
    for step in range(args.steps + 1):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0:  # .item() waits for the device: read the loss only now and then
            print(f"step {step:4d}  loss {loss.item():.4f}")
    elapsed = time.perf_counter() - start

    with torch.no_grad():
        accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
    print(f"accuracy {accuracy:.3f} on {args.device}, {args.steps / elapsed:.1f} steps/s")


if __name__ == "__main__":
    main()
