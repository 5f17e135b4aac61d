"""A small script with three deliberate problems for the MCP tests (tests/test_mcp.py):
- a CPU fallback: ``demo_agent::scale`` has a CPU kernel only;
- a recompile: the compiled ``step`` sees a new batch size on each call;
- a graph break: ``print`` inside the compiled function.
"""

import sys

import torch


@torch.library.custom_op("demo_agent::scale", mutates_args=(), device_types="cpu")
def scale(x: torch.Tensor) -> torch.Tensor:
    return x * 3 + 1


def model(x):
    y = torch.relu(x) * 2
    print("step")
    return y.sum()


def example():
    """The function convention of the function tools: (fn, args)."""
    return model, (torch.randn(8, 4, device="tpu"),)


def train_step():
    """For bench: (step, args), one training step per call."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 4).to("tpu")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(8, 4, device="tpu")

    def step(x):
        loss = net(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step, (x,)


if __name__ == "__main__":
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    compiled = torch.compile(model)
    for n in range(steps):
        x = torch.randn(8 + n, 4, device="tpu")
        compiled(scale(x))
        torch.tpu.synchronize()
