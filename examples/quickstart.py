"""torchtpu quickstart: the ``tpu`` device, tensors on it, autograd, and the three eager modes.

    python examples/quickstart.py
"""

import torch  # `import torch` loads torchtpu: the `tpu` device is ready

import torchtpu

# The device, and the truth about what backs it (XLA:CPU on a laptop, a TPU or GPU elsewhere).
print(f"tpu available: {torch.tpu.is_available()}, {torch.tpu.device_count()} device(s), "
      f"backed by {torch.tpu.get_device_name()}")

# Tensors: create them on the device, or move them there. They are plain torch.Tensors.
x = torch.randn(4, 3, device="tpu")
w = torch.ones(3, 2).to("tpu")
y = torch.relu(x @ w) + 1
print(y.device, y.dtype, tuple(y.shape))
print(y.cpu())  # .cpu() (or .item(), .tolist()) waits for the result and copies it to the host

# In-place ops and views behave as in PyTorch: writing through a view updates its base.
x[0].zero_()
assert x.cpu()[0].abs().sum().item() == 0

# Autograd works as usual.
a = torch.randn(5, device="tpu", requires_grad=True)
(a.sin() * a).sum().backward()
torch.testing.assert_close(a.grad.cpu(), (a.detach().sin() + a.detach() * a.detach().cos()).cpu())

# Eager modes: how each op runs.
#  DEFER_NEVER (default): each op is dispatched at once and runs asynchronously.
#  DEFER_NEVER_AND_LAUNCH_BLOCKING: each op is waited for, so an error points at the op that caused it.
#  DEFER_AND_FUSE: ops are recorded and run as one fused XLA program when a value is needed.
print("default eager mode:", torch.tpu.eager_mode.name)
for mode in torch.tpu.EagerMode:
    with torch.tpu.set_eager_mode(mode):
        z = (x * 2 + 1).exp().sum(dim=1)
        print(f"  {mode.name:<32} {z.cpu().tolist()}")

# Wait for all queued work (for timing), then look at what ran: ops, CPU fallbacks, transfers.
torch.tpu.synchronize()
torchtpu.metrics.report()
