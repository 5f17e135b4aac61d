"""Weight-only int8 for the serving engines (``torchtpu.integrations.int8``), against CPU float math."""

import torch

from torchtpu.integrations.int8 import dequantize_rows, int8_linear, quantize_layer, quantize_rows


def test_rows_round_trip_within_half_a_step():
    w = torch.randn(48, 32, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3, 48)[:, None]
    w[5] = 0  # an all-zero row keeps a finite scale
    q, scale = quantize_rows(w.to("tpu"))
    assert q.dtype == torch.int8 and q.device.type == "tpu" and scale.shape == (48,)
    assert q.abs().max().item() == 127 and torch.isfinite(scale.cpu()).all()
    back = dequantize_rows(q, scale).cpu()
    assert ((back - w).abs() <= scale.cpu()[:, None] / 2 + 1e-7).all()
    ref_q, ref_scale = quantize_rows(w)  # the same numbers on the CPU
    assert torch.equal(q.cpu(), ref_q) and torch.allclose(scale.cpu(), ref_scale)


def test_int8_linear_matches_the_dequantized_float_layer():
    gen = torch.Generator().manual_seed(1)
    layer = torch.nn.Linear(64, 24).to("tpu")
    quantize_layer(layer)
    assert layer.weight.dtype == torch.int8 and not layer.weight.requires_grad
    assert layer.weight.untyped_storage().nbytes() == 64 * 24  # a quarter of float32
    x = torch.randn(5, 64, generator=gen)
    got = int8_linear(x.to("tpu"), layer.weight, layer.weight_scale, layer.bias).cpu()
    want = torch.nn.functional.linear(x, dequantize_rows(layer.weight.cpu(), layer.weight_scale.cpu()),
                                      layer.bias.detach().cpu())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    bf16 = int8_linear(x.to("tpu", torch.bfloat16), layer.weight, layer.weight_scale, None)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float().cpu(), want - layer.bias.detach().cpu(), rtol=2e-2, atol=5e-2)
