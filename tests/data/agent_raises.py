import torch

x = torch.ones(2, device="tpu")
raise ValueError("deliberate failure for the MCP tests")
