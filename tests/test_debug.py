"""``torchtpu.debug.compare_with_cpu`` finds a deliberately wrong lowering, by op and module."""

import dataclasses

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from torchtpu import debug
from torchtpu.eager import native_kernels, register

aten = torch.ops.aten


@pytest.fixture
def wrong_lowering(monkeypatch):
    """``wrong_lowering(op, fn)``: the eager kernel of ``op`` runs ``fn(correct_lowering, *args)``."""

    def inject(op, fn):
        kernel = register.kernels()[op]
        correct = kernel.lowering
        monkeypatch.setattr(kernel, "lowering",
                            dataclasses.replace(correct, fn=lambda *a, **k: fn(correct.fn, *a, **k)))
        monkeypatch.setattr(kernel, "_jitted", {})  # drop the jitted programs of the correct lowering
        native_kernels.forget()  # and those the native kernel learned from them

    yield inject
    native_kernels.forget()  # (it learned the wrong ones meanwhile)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        self.head = nn.Tanh()

    def forward(self, x):
        return self.head(self.mlp(x))


@pytest.fixture
def net_and_input():
    torch.manual_seed(0)
    return Net().to("tpu"), torch.randn(5, 8).to("tpu")


def test_all_ops_match(net_and_input):
    assert debug.compare_with_cpu(*net_and_input) is None


def test_finds_wrong_gelu_with_module_path(net_and_input, wrong_lowering):
    model, x = net_and_input
    wrong_lowering(aten.gelu.default, lambda gelu, x, approximate="none": gelu(x, approximate) * 1.01)
    report = debug.compare_with_cpu(model, x)
    assert report is not None
    assert report.op == "aten.gelu.default"
    assert report.module_path == "mlp.1"
    assert report.ops_checked >= 1  # the first Linear's ops matched
    with torch.no_grad():
        expected = torch.nn.functional.gelu(model.mlp[0](x).cpu())
    assert_close(report.cpu_value, expected)
    assert_close(report.tpu_value, expected * 1.01)
    assert report.max_abs_diff == pytest.approx(float((expected * 0.01).abs().max()), rel=1e-4)
    text = str(report)
    assert "aten.gelu.default" in text and "mlp.1" in text and "max abs diff" in text


def test_module_path_through_bound_method(net_and_input, wrong_lowering):
    model, x = net_and_input
    wrong_lowering(aten.tanh.default, lambda tanh, x: -tanh(x))
    report = debug.compare_with_cpu(model.forward, x)
    assert (report.op, report.module_path) == ("aten.tanh.default", "head")


def test_finds_wrong_op_in_plain_function(wrong_lowering):
    wrong_lowering(aten.tanh.default, lambda tanh, x: tanh(x) + 0.5)
    a = torch.randn(3, 4)

    def fn(v):
        return (v * 2).tanh().sum()

    report = debug.compare_with_cpu(fn, a.to("tpu"))
    assert (report.op, report.module_path) == ("aten.tanh.default", "")
    assert_close(report.cpu_value, (a * 2).tanh())
    assert report.first_index == (0, 0)


def test_inplace_op_compared_on_its_inputs(wrong_lowering):
    wrong_lowering(aten.tanh.default, lambda tanh, x: tanh(x) * 2)
    a = torch.randn(6)
    x = a.to("tpu")
    report = debug.compare_with_cpu(lambda v: v.tanh_(), x)
    assert report.op == "aten.tanh_.default"
    assert_close(report.cpu_value, a.tanh())  # the CPU ran on the values before the tpu op changed them
    assert_close(report.tpu_value, a.tanh() * 2)


def test_finds_wrong_backward_op(net_and_input, wrong_lowering):
    model, x = net_and_input
    wrong_lowering(aten.gelu_backward.default, lambda grad, g, x, approximate="none": grad(g, x, approximate) + 1)

    def step(m, v):
        m(v).sum().backward()

    report = debug.compare_with_cpu(step, model, x)
    assert report.op == "aten.gelu_backward.default"
    assert report.module_path == "backward (GeluBackward0)"


def test_tolerances(wrong_lowering):
    wrong_lowering(aten.tanh.default, lambda tanh, x: tanh(x) * (1 + 1e-4))
    x = torch.rand(16).to("tpu") + 0.5
    assert debug.compare_with_cpu(torch.tanh, x).op == "aten.tanh.default"  # float32 default rtol 1.3e-6
    assert debug.compare_with_cpu(torch.tanh, x, rtol=1e-3, atol=1e-5) is None
    with pytest.raises(ValueError, match="both rtol and atol"):
        debug.compare_with_cpu(torch.tanh, x, rtol=1e-3)


def test_integer_ops_compared_exactly(wrong_lowering):
    wrong_lowering(aten.add.Tensor, lambda add, a, b, alpha=1: add(a, b, alpha=alpha) + (a == 7))
    x = torch.arange(10).to("tpu")
    report = debug.compare_with_cpu(lambda v: v + 1, x)
    assert report.op == "aten.add.Tensor" and report.first_index == (7,)
    assert (report.tpu_value[7].item(), report.cpu_value[7].item()) == (9, 8)


def test_random_ops_not_compared():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)).to("tpu").train()
    assert debug.compare_with_cpu(model, torch.randn(4, 8).to("tpu")) is None


def test_factory_ops_compared(wrong_lowering):
    wrong_lowering(aten.ones.default, lambda ones, *a, **k: ones(*a, **k) * 2)
    report = debug.compare_with_cpu(lambda: torch.ones(3, device="tpu"))
    assert report.op == "aten.ones.default"
    assert_close(report.cpu_value, torch.ones(3))


def test_cpu_code_rejected():
    with pytest.raises(ValueError, match="no op ran on a tpu tensor"):
        debug.compare_with_cpu(torch.sin, torch.randn(3))
