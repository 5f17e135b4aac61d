"""nn ops on tpu vs PyTorch CPU: forward, gradients (loss.backward()), and short training runs."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytestmark = pytest.mark.usefixtures("no_fallback")

TOL = {torch.float32: dict(atol=1e-5, rtol=1.3e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float64: dict(atol=1e-10, rtol=1e-10)}


def _tpu(t):
    if isinstance(t, torch.Tensor):
        return t.detach().to("tpu").requires_grad_(t.requires_grad)
    return t


def _leaves(args):
    return [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]


def _flat(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def check(fn, *args, grad=True, tol=None, **tol_kw):
    """``fn`` on CPU and on tpu gives the same outputs and, for float inputs, the same gradients."""
    dtype = next(a.dtype for a in args if isinstance(a, torch.Tensor))
    tol = {**TOL.get(dtype, TOL[torch.float32]), **(tol or {}), **tol_kw}
    cpu_args = [a.detach().clone().requires_grad_(grad and a.is_floating_point()) if isinstance(a, torch.Tensor)
                else a for a in args]
    tpu_args = [_tpu(a) for a in cpu_args]
    cpu_out, tpu_out = _flat(fn(*cpu_args)), _flat(fn(*tpu_args))
    assert len(cpu_out) == len(tpu_out)
    for c, t in zip(cpu_out, tpu_out):
        if isinstance(c, torch.Tensor):
            assert t.device.type == "tpu"
            torch.testing.assert_close(t.cpu(), c, **tol)
    if not grad or not _leaves(cpu_args):
        return
    gen = torch.Generator().manual_seed(1)
    loss_cpu = loss_tpu = 0
    for c, t in zip(cpu_out, tpu_out):
        if isinstance(c, torch.Tensor) and c.requires_grad:
            seed = torch.randn(c.shape, generator=gen, dtype=torch.float32).to(c.dtype)
            loss_cpu = loss_cpu + (c * seed).sum()
            loss_tpu = loss_tpu + (t * seed.to("tpu")).sum()
    loss_cpu.backward()
    loss_tpu.backward()
    for c, t in zip(_leaves(cpu_args), _leaves(tpu_args)):
        assert (t.grad is None) == (c.grad is None)
        if c.grad is not None:
            assert t.grad.device.type == "tpu"
            torch.testing.assert_close(t.grad.cpu(), c.grad, **tol)


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32).to(dtype)


# ---------------------------------------------------------------- activations

ACTIVATIONS = {
    "relu": F.relu,
    "relu6": F.relu6,
    "threshold": lambda x: F.threshold(x, 0.3, -2.0),
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "mish": F.mish,
    "elu": lambda x: F.elu(x, alpha=0.7),
    "celu": lambda x: F.celu(x, alpha=1.5),
    "selu": F.selu,
    "leaky_relu": lambda x: F.leaky_relu(x, 0.2),
    "hardtanh": lambda x: F.hardtanh(x, -0.5, 0.8),
    "softplus": lambda x: F.softplus(x, beta=2, threshold=3),
    "hardswish": F.hardswish,
    "hardsigmoid": F.hardsigmoid,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "softshrink": lambda x: F.softshrink(x, 0.4),
    "hardshrink": lambda x: F.hardshrink(x, 0.4),
    "logsigmoid": F.logsigmoid,
    "glu": lambda x: F.glu(x, -1),
    "logit": lambda x: torch.logit(x.sigmoid(), eps=0.1),
}


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_activation(name):
    # 4 * randn reaches every branch (|x| > 3 for hardswish, x*beta > threshold for softplus)
    x = randn(6, 8) * 4
    check(ACTIVATIONS[name], x)


@pytest.mark.parametrize("name", ["relu", "gelu", "gelu_tanh", "silu", "hardswish", "elu", "leaky_relu"])
def test_activation_bf16_noncontiguous(name):
    x = (randn(8, 6) * 4).to(torch.bfloat16).t()
    check(ACTIVATIONS[name], x)


@pytest.mark.parametrize("name", ["relu", "gelu", "sigmoid", "softplus"])
def test_activation_0d_and_empty(name):
    check(ACTIVATIONS[name], torch.tensor(-1.5))
    check(ACTIVATIONS[name], torch.tensor(0.7))
    check(ACTIVATIONS[name], torch.randn(0, 3))


def test_relu_int():
    x = torch.tensor([-3, 0, 5], dtype=torch.int64)
    check(F.relu, x, grad=False)


def test_prelu():
    x = randn(4, 3, 5)
    check(F.prelu, x, torch.tensor([0.1, -0.3, 0.5]))
    check(F.prelu, x, torch.tensor([0.25]))


# ---------------------------------------------------------------- softmax

@pytest.mark.parametrize("fn", [F.softmax, F.log_softmax], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_softmax(fn, dim):
    check(lambda x: fn(x, dim), randn(3, 4, 5) * 3)


@pytest.mark.parametrize("fn", [F.softmax, F.log_softmax], ids=["softmax", "log_softmax"])
def test_softmax_0d_bf16_noncontiguous(fn):
    check(lambda x: fn(x, 0), torch.tensor(2.5))
    check(lambda x: fn(x, -1), torch.tensor(2.5))
    check(lambda x: fn(x, 1), randn(5, 7, dtype=torch.bfloat16).t())


def test_safe_softmax_masked_row():
    x = randn(3, 4)
    x[1] = float("-inf")
    x[2, :2] = float("-inf")
    check(lambda t: torch.ops.aten._safe_softmax(t, -1), x, grad=False)


# ---------------------------------------------------------------- normalisation

@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm(affine, dtype):
    x = randn(4, 5, 6, dtype=dtype) * 2 + 1
    w = randn(5, 6, seed=1, dtype=dtype) if affine else None
    b = randn(5, 6, seed=2, dtype=dtype) if affine else None
    check(lambda x, w, b: F.layer_norm(x, (5, 6), w, b, eps=1e-4), x, w, b)


def test_layer_norm_saved_stats():
    x = randn(3, 8)
    out_cpu = torch.ops.aten.native_layer_norm(x, [8], None, None, 1e-5)
    out_tpu = torch.ops.aten.native_layer_norm(x.to("tpu"), [8], None, None, 1e-5)
    for c, t in zip(out_cpu, out_tpu):
        torch.testing.assert_close(t.cpu(), c)
    low = torch.ops.aten.native_layer_norm(x.to(torch.bfloat16).to("tpu"), [8], None, None, 1e-5)
    assert low[0].dtype == torch.bfloat16 and low[1].dtype == low[2].dtype == torch.float32  # as meta


@pytest.mark.parametrize("affine", [True, False])
def test_group_norm(affine):
    x = randn(2, 6, 4, 3) * 3
    w, b = (randn(6, seed=1), randn(6, seed=2)) if affine else (None, None)
    check(lambda x, w, b: F.group_norm(x, 3, w, b), x, w, b)


def test_group_norm_bf16():
    check(lambda x: F.group_norm(x, 2), randn(2, 4, 5, dtype=torch.bfloat16))


@pytest.mark.parametrize("shape", [(4, 3), (4, 3, 5), (2, 3, 4, 4)])
def test_batch_norm_functional_train_and_eval(shape):
    x = randn(*shape) * 2 + 0.5
    w, b = randn(3, seed=1), randn(3, seed=2)
    rm, rv = randn(3, seed=3), randn(3, seed=4).abs() + 0.5
    check(lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True), x, w, b)
    check(lambda x, w, b: F.batch_norm(x, rm.to(x.device), rv.to(x.device), w, b, training=False), x, w, b)


def test_batch_norm_legit_ops():
    aten = torch.ops.aten
    x = randn(4, 3, 5)
    rm, rv = torch.zeros(3), torch.ones(3)
    check(lambda x, rm, rv: aten._native_batch_norm_legit_functional(x, None, None, rm, rv, True, 0.1, 1e-5),
          x, rm, rv, grad=False)
    check(lambda x: aten._native_batch_norm_legit(x, None, None, True, 0.1, 1e-5), x, grad=False)
    check(lambda x, rm, rv: aten._native_batch_norm_legit_no_training(x, None, None, rm, rv, 0.1, 1e-5)[0],
          x, rm, rv, grad=False)


def test_batch_norm_no_update():
    x, rm, rv = randn(4, 3, 5), randn(3, seed=1), randn(3, seed=2).abs() + 0.5
    check(lambda x, w, rm, rv: torch.ops.aten._batch_norm_no_update(x, w, None, rm, rv, 0.1, 1e-5)[0],
          x, randn(3, seed=3), rm, rv, grad=False)


def test_weight_norm_interface():
    v, g = randn(4, 3, 2), randn(4, 1, 1, seed=1)
    check(lambda v, g: torch.ops.aten._weight_norm_interface(v, g, 0), v, g)
    check(lambda v, g: torch.ops.aten._weight_norm_interface(v, g, 2), v, randn(1, 1, 2, seed=1))


def test_batch_norm_module_updates_running_stats():
    cpu = nn.BatchNorm2d(3)
    dev = copy.deepcopy(cpu).to("tpu")
    x = randn(2, 3, 4, 4) * 2 + 1
    check(lambda t: (cpu if t.device.type == "cpu" else dev)(t), x)
    torch.testing.assert_close(dev.running_mean.cpu(), cpu.running_mean)
    torch.testing.assert_close(dev.running_var.cpu(), cpu.running_var)
    cpu.eval(), dev.eval()
    check(lambda t: (cpu if t.device.type == "cpu" else dev)(t), x)


# ---------------------------------------------------------------- dropout and embedding

def test_dropout_train():
    x = torch.ones(200, 50).to("tpu").requires_grad_()
    y = F.dropout(x, 0.3, training=True)
    kept = y.detach().cpu() != 0
    frac = kept.float().mean().item()
    assert 0.65 < frac < 0.75
    torch.testing.assert_close(y.detach().cpu()[kept], torch.full((int(kept.sum()),), 1 / 0.7))
    y.sum().backward()
    torch.testing.assert_close(x.grad.cpu(), kept.float() / 0.7)


def test_dropout_eval_and_edge_p():
    x = randn(4, 5)
    check(lambda t: F.dropout(t, 0.5, training=False), x)
    check(lambda t: F.dropout(t, 0.0, training=True), x)
    check(lambda t: F.dropout(t, 1.0, training=True), x)


def test_native_dropout_deterministic_with_seed():
    x = torch.ones(64).to("tpu")
    torch.manual_seed(5)
    a = F.dropout(x, 0.5).cpu()
    torch.manual_seed(5)
    b = F.dropout(x, 0.5).cpu()
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("padding_idx,freq", [(None, False), (2, False), (None, True)])
def test_embedding(padding_idx, freq):
    w = randn(7, 4)
    idx = torch.tensor([[0, 2, 2], [6, 1, 2]])
    check(lambda w, i: F.embedding(i, w, padding_idx=padding_idx, scale_grad_by_freq=freq), w, idx)


# ---------------------------------------------------------------- losses

@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_cross_entropy(reduction):
    x = randn(6, 5) * 2
    t = torch.tensor([0, 4, 2, -100, 1, 3])
    w = randn(5, seed=3).abs()
    check(lambda x: F.cross_entropy(x, t.to(x.device), reduction=reduction), x)
    check(lambda x: F.cross_entropy(x, t.to(x.device), weight=w.to(x.device), reduction=reduction), x)
    check(lambda x: F.nll_loss(F.log_softmax(x, 1), t.clamp(min=0).to(x.device), ignore_index=2,
                               reduction=reduction), x)


def test_cross_entropy_unbatched_and_label_smoothing():
    check(lambda x: F.cross_entropy(x, torch.tensor(3, device=x.device)), randn(5))
    t = torch.tensor([0, 4, 2, 1])
    check(lambda x: F.cross_entropy(x, t.to(x.device), label_smoothing=0.1), randn(4, 5))


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_nll_loss2d(reduction):
    x = F.log_softmax(randn(2, 4, 3, 5), 1)
    t = torch.randint(0, 4, (2, 3, 5), generator=torch.Generator().manual_seed(0))
    t[0, 0, 0] = -100
    check(lambda x: F.nll_loss(x, t.to(x.device), reduction=reduction), x)


LOSSES = {
    "mse": lambda x, t, reduction: F.mse_loss(x, t, reduction=reduction),
    "l1": lambda x, t, reduction: F.l1_loss(x, t, reduction=reduction),
    "smooth_l1": lambda x, t, reduction: F.smooth_l1_loss(x, t, reduction=reduction, beta=0.5),
    "smooth_l1_beta0": lambda x, t, reduction: F.smooth_l1_loss(x, t, reduction=reduction, beta=0.0),
    "huber": lambda x, t, reduction: F.huber_loss(x, t, reduction=reduction, delta=0.7),
    "soft_margin": lambda x, t, reduction: F.soft_margin_loss(x, t.detach().sign(), reduction=reduction),
    "bce": lambda x, t, reduction: F.binary_cross_entropy(x.sigmoid(), t.sigmoid(), reduction=reduction),
    "bce_weight": lambda x, t, reduction: F.binary_cross_entropy(x.sigmoid(), t.sigmoid(), reduction=reduction,
                                                                 weight=torch.linspace(0.5, 2, 5, device=x.device)),
    "bce_logits": lambda x, t, reduction: F.binary_cross_entropy_with_logits(x, t.sigmoid(), reduction=reduction),
}


@pytest.mark.parametrize("name", LOSSES)
def test_pointwise_loss(name):
    check(lambda x, t: LOSSES[name](x, t, "mean"), randn(4, 5), randn(4, 5, seed=1))


@pytest.mark.parametrize("reduction", ["none", "sum"])
@pytest.mark.parametrize("name", ["mse", "huber", "bce_weight"])
def test_pointwise_loss_reductions(name, reduction):
    # the reductions are shared by every pointwise loss: a few losses cover them
    check(lambda x, t: LOSSES[name](x, t, reduction), randn(4, 5), randn(4, 5, seed=1))


@pytest.mark.parametrize("p,reduction", [(1, "mean"), (2, "none"), (1, "sum")])
def test_multi_margin_loss(p, reduction):
    t = torch.tensor([0, 3, 2, 4])
    w = torch.linspace(0.5, 2, 5)
    check(lambda x: F.multi_margin_loss(x, t.to(x.device), p=p, margin=0.7, reduction=reduction), randn(4, 5))
    check(lambda x: F.multi_margin_loss(x, t.to(x.device), weight=w.to(x.device), reduction=reduction), randn(4, 5))
    check(lambda x: F.multi_margin_loss(x, torch.tensor(1, device=x.device)), randn(5))


def test_embedding_max_norm_renormalises_weight():
    w = randn(6, 3) * 2
    idx = torch.tensor([0, 2, 2, 5])
    w_cpu, w_tpu = w.clone(), w.to("tpu")
    out_cpu = F.embedding(idx, w_cpu, max_norm=1.5)
    out_tpu = F.embedding(idx.to("tpu"), w_tpu, max_norm=1.5)
    torch.testing.assert_close(out_tpu.cpu(), out_cpu)
    torch.testing.assert_close(w_tpu.cpu(), w_cpu)  # embedding_renorm_ rewrote the referenced rows in place


def test_bce_saturated():
    x = torch.tensor([0.0, 1.0, 0.5])
    t = torch.tensor([1.0, 0.0, 1.0])
    check(lambda x, t: F.binary_cross_entropy(x, t), x, t, grad=False)


# ---------------------------------------------------------------- convolution

CONVS = [  # (input shape, weight shape, kwargs)
    ((2, 3, 10), (4, 3, 3), dict()),
    ((2, 4, 11), (6, 2, 3), dict(stride=2, padding=1, dilation=2, groups=2)),
    ((2, 3, 8, 9), (5, 3, 3, 3), dict(padding=1)),
    ((2, 4, 9, 8), (4, 2, 3, 2), dict(stride=(2, 1), padding=(1, 0), dilation=(1, 2), groups=2)),
    ((3, 8, 8), (4, 3, 3, 3), dict(padding="same")),  # unbatched
    ((1, 2, 5, 6, 4), (3, 2, 2, 3, 2), dict(stride=(1, 2, 1), padding=1)),
]


@pytest.mark.parametrize("case", range(len(CONVS)))
def test_conv(case):
    xs, ws, kw = CONVS[case]
    fn = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[len(ws) - 2]
    x, w, b = randn(*xs), randn(*ws, seed=1), randn(ws[0], seed=2)
    check(lambda x, w, b: fn(x, w, b, **kw), x, w, b, atol=1e-4, rtol=1e-4)


TCONVS = [
    ((2, 4, 7), (4, 3, 3), dict(stride=2, padding=1, output_padding=1)),
    ((2, 4, 5, 6), (4, 3, 3, 3), dict(stride=2, padding=1, output_padding=(1, 0), groups=2)),
    ((1, 2, 4, 5), (2, 3, 2, 3), dict(stride=(1, 2), dilation=2)),
    ((1, 2, 3, 4, 3), (2, 2, 2, 2, 2), dict(stride=2)),
]


@pytest.mark.parametrize("case", range(len(TCONVS)))
def test_conv_transpose(case):
    xs, ws, kw = TCONVS[case]
    fn = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[len(ws) - 2]
    groups = kw.get("groups", 1)
    x, w, b = randn(*xs), randn(*ws, seed=1), randn(ws[1] * groups, seed=2)
    check(lambda x, w, b: fn(x, w, b, **kw), x, w, b, atol=1e-4, rtol=1e-4)


def test_conv_bf16_no_bias():
    x, w = randn(2, 3, 6, 6, dtype=torch.bfloat16), randn(4, 3, 3, 3, dtype=torch.bfloat16, seed=1)
    check(lambda x, w: F.conv2d(x, w, padding=1), x, w, atol=5e-2, rtol=2e-2)


# ---------------------------------------------------------------- pooling

MAXPOOLS = [
    dict(kernel_size=2),
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=3, stride=2, ceil_mode=True),
    dict(kernel_size=(2, 3), stride=(1, 2), padding=(1, 1), dilation=(2, 1)),
]


@pytest.mark.parametrize("kw", MAXPOOLS, ids=range(len(MAXPOOLS)))
def test_max_pool2d(kw):
    x = randn(2, 3, 7, 8)
    check(lambda x: F.max_pool2d(x, return_indices=True, **kw), x)


def test_max_pool_1d_3d_and_unbatched():
    check(lambda x: F.max_pool1d(x, 3, 2, 1), randn(2, 3, 9))
    check(lambda x: F.max_pool3d(x, 2, return_indices=True), randn(1, 2, 4, 5, 4))
    check(lambda x: F.max_pool2d(x, 2), randn(3, 6, 6))


def test_max_pool2d_int_and_bf16():
    x = torch.randint(-50, 50, (1, 2, 6, 6), generator=torch.Generator().manual_seed(0))
    check(lambda x: F.max_pool2d(x, 2, return_indices=True), x, grad=False)
    check(lambda x: F.max_pool2d(x, 3, 1), randn(1, 2, 6, 6, dtype=torch.bfloat16))


AVGPOOLS = [
    dict(kernel_size=2),
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=3, stride=2, padding=1, count_include_pad=False),
    dict(kernel_size=3, stride=2, ceil_mode=True),
    dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
    dict(kernel_size=(2, 3), stride=1, divisor_override=4),
]


@pytest.mark.parametrize("kw", AVGPOOLS, ids=range(len(AVGPOOLS)))
def test_avg_pool2d(kw):
    check(lambda x: F.avg_pool2d(x, **kw), randn(2, 3, 7, 8))


def test_avg_pool_1d_3d():
    check(lambda x: F.avg_pool1d(x, 3, 2, 1), randn(2, 3, 9))
    check(lambda x: F.avg_pool3d(x, 2, ceil_mode=True), randn(1, 2, 5, 4, 5))


@pytest.mark.parametrize("out", [(1, 1), (3, 3), (4, 5), (7, 2)])
def test_adaptive_avg_pool2d(out):
    check(lambda x: F.adaptive_avg_pool2d(x, out), randn(2, 3, 7, 9))


@pytest.mark.parametrize("out", [(1, 1), (3, 4), (7, 2)])
def test_adaptive_max_pool2d(out):
    check(lambda x: F.adaptive_max_pool2d(x, out, return_indices=True), randn(2, 3, 7, 9))


def test_adaptive_max_pool3d():
    check(lambda x: F.adaptive_max_pool3d(x, (2, 3, 1), return_indices=True), randn(1, 2, 5, 7, 3))


def test_adaptive_avg_pool3d_bf16():
    check(lambda x: F.adaptive_avg_pool3d(x, (2, 3, 1)), randn(1, 2, 5, 7, 3))
    check(lambda x: F.adaptive_avg_pool2d(x, 3), randn(1, 2, 7, 7, dtype=torch.bfloat16))


# ---------------------------------------------------------------- upsampling

UPSAMPLES = [
    dict(size=(7, 9), mode="nearest"),
    dict(scale_factor=2, mode="nearest"),
    dict(scale_factor=1.7, mode="nearest"),
    dict(size=(5, 11), mode="nearest-exact"),
    dict(size=(7, 9), mode="bilinear", align_corners=False),
    dict(size=(7, 9), mode="bilinear", align_corners=True),
    dict(scale_factor=1.5, mode="bilinear"),
    dict(size=(2, 3), mode="bilinear"),
    dict(size=(7, 9), mode="bicubic", align_corners=False),
    dict(scale_factor=0.6, mode="bicubic", align_corners=True),
]


@pytest.mark.parametrize("kw", UPSAMPLES, ids=range(len(UPSAMPLES)))
def test_upsample2d(kw):
    check(lambda x: F.interpolate(x, **kw), randn(2, 3, 4, 5))


def test_upsample_1d_3d():
    check(lambda x: F.interpolate(x, size=9, mode="linear"), randn(2, 3, 4))
    check(lambda x: F.interpolate(x, scale_factor=3, mode="nearest"), randn(2, 3, 4))
    check(lambda x: F.interpolate(x, size=(3, 5, 4), mode="trilinear"), randn(1, 2, 2, 3, 4))
    check(lambda x: F.interpolate(x, scale_factor=2, mode="nearest"), randn(1, 2, 2, 3, 2))


# ---------------------------------------------------------------- distances

@pytest.mark.parametrize("p", [2.0, 1.0, 0.5, 3.0, float("inf"), 0.0])
def test_cdist(p):
    x1, x2 = randn(2, 5, 4), randn(2, 6, 4, seed=1)
    x2[0, 0] = x1[0, 0]  # a zero distance: the gradient there is defined as 0
    check(lambda a, b: torch.cdist(a, b, p=p), x1, x2)


@pytest.mark.parametrize("p", [2.0, 1.0, 0.5, float("inf")])
def test_pdist(p):
    x = randn(5, 3)
    x[3] = x[1]  # a zero distance
    check(lambda x: F.pdist(x, p), x)


def test_cdist_matmul_form():
    check(lambda a, b: torch.cdist(a, b), randn(30, 4), randn(27, 4, seed=1), atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- attention

@pytest.mark.parametrize("kind", ["plain", "causal", "bool_mask", "float_mask"])
def test_sdpa(kind):
    q, k, v = randn(2, 3, 5, 8), randn(2, 3, 6, 8, seed=1), randn(2, 3, 6, 8, seed=2)
    mask = None
    if kind == "bool_mask":
        mask = torch.rand(5, 6, generator=torch.Generator().manual_seed(3)) > 0.3
        mask[:, 0] = True
    elif kind == "float_mask":
        mask = randn(5, 6, seed=4)

    def fn(q, k, v):
        m = mask.to(q.device) if mask is not None else None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=kind == "causal")

    check(fn, q, k, v, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- training

def _train(model, batches, steps=3):
    # eps above the fp32 noise of grads that are exactly zero in exact arithmetic (the
    # attention key bias): Adam would otherwise amplify that noise to full-size steps
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    losses = []
    for x, y in batches[:steps]:
        opt.zero_grad()
        loss = F.cross_entropy(model(x).reshape(-1, 7), y.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _compare_training(model, batches):
    dev = copy.deepcopy(model).to("tpu")
    cpu_losses = _train(model, batches)
    tpu_losses = _train(dev, [(x.to("tpu"), y.to("tpu")) for x, y in batches])
    torch.testing.assert_close(torch.tensor(tpu_losses), torch.tensor(cpu_losses), rtol=1e-4, atol=0)
    for (name, p_cpu), p_tpu in zip(model.named_parameters(), dev.parameters()):
        torch.testing.assert_close(p_tpu.detach().cpu(), p_cpu.detach(), rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")


def test_train_mlp():
    torch.manual_seed(0)
    # few distinct parameter shapes: every (op, shape) pair compiles once, and compiling dominates
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 32), nn.SiLU(),
                          nn.Dropout(0.0), nn.Linear(32, 7))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 32, generator=g), torch.randint(0, 7, (16,), generator=g)) for _ in range(3)]
    _compare_training(model, batches)


class TinyTransformer(nn.Module):
    def __init__(self, vocab=7, dim=16, heads=2, seq=7):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.1)
        self.block = nn.TransformerEncoderLayer(dim, heads, dim, dropout=0.0, batch_first=True,
                                                activation="gelu", norm_first=True)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, tokens):
        h = self.embed(tokens) + self.pos
        return self.head(self.block(h, src_mask=self.mask, is_causal=True))


def test_train_transformer_block():
    torch.manual_seed(0)
    model = TinyTransformer()
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, 7, (3, 7), generator=g), torch.randint(0, 7, (3, 7), generator=g))
               for _ in range(3)]
    _compare_training(model, batches)


# ---------------------------------------------------------------- grid sampling

@pytest.mark.parametrize("mode,align_corners", [("bilinear", False), ("bilinear", True), ("nearest", False)])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
def test_grid_sample(mode, padding_mode, align_corners):
    x = randn(2, 3, 5, 6)
    grid = randn(2, 4, 3, 2, seed=1) * 1.5  # reaches outside [-1, 1]
    check(lambda x, g: F.grid_sample(x, g, mode=mode, padding_mode=padding_mode, align_corners=align_corners),
          x, grid, atol=1e-5, rtol=1e-4)



def test_float_activation_rejects_integers():
    with pytest.raises(RuntimeError, match="not implemented for"):
        F.gelu(torch.tensor([1, 2]).to("tpu"))


def test_nll_loss_unbatched_none_reduction_is_0d():
    x, t = torch.randn(5).log_softmax(0), torch.tensor(2)
    for reduction in ("none", "mean", "sum"):
        expected = torch.nn.functional.nll_loss(x, t, reduction=reduction)
        got = torch.nn.functional.nll_loss(x.to("tpu"), t.to("tpu"), reduction=reduction)
        assert got.shape == expected.shape
        torch.testing.assert_close(got.cpu(), expected)


# ---------------------------------------------------------------- normalisation and margin-loss edge cases

def test_group_norm_empty_batch():
    check(lambda x, w, b: F.group_norm(x, 1, w, b), torch.zeros(0, 2), randn(2), randn(2, seed=1))
    check(lambda x: torch.ops.aten.native_group_norm(x, None, None, 0, 6, 4, 3, 1e-5), torch.zeros(0, 6, 4),
          grad=False)


def test_multi_margin_loss_0d_and_1d_targets():
    for reduction in ("none", "mean", "sum"):
        check(lambda x: F.multi_margin_loss(x, torch.tensor(0, device=x.device), reduction=reduction), randn(()))
        # a 1-element target keeps its shape under reduction="none", as on the CPU
        check(lambda x: F.multi_margin_loss(x, torch.tensor([3], device=x.device), p=2, reduction=reduction),
              randn(5))


MULTILABEL_TARGETS = torch.tensor([[3, 0, -1, 1], [1, 1, 2, -1], [-1, 2, 0, 1], [0, 1, 2, 3]])


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_multilabel_margin_loss(reduction):
    t = MULTILABEL_TARGETS  # labels end at the first -1; a repeated label counts twice, as on the CPU
    check(lambda x: F.multilabel_margin_loss(x, t.to(x.device), reduction=reduction), randn(4, 4) * 2)
    check(lambda x: F.multilabel_margin_loss(x, t[1].to(x.device), reduction=reduction), randn(4) * 2)
    check(lambda x: F.multilabel_margin_loss(x, torch.tensor(0, device=x.device), reduction=reduction), randn(()))


def test_multilabel_margin_loss_forward_is_target():
    x, t = randn(4, 4), MULTILABEL_TARGETS
    check(lambda x: torch.ops.aten.multilabel_margin_loss_forward(x, t.to(x.device), 0), x, grad=False)


def test_multilabel_margin_loss_noncontiguous():
    x = randn(4, 6)[:, ::2]
    t = torch.tensor([[2, 0, -1], [1, 1, 2], [-1, 2, 0], [0, 1, 2]])
    check(lambda x: F.multilabel_margin_loss(x, t.to(x.device)), x)


# ---------------------------------------------------------------- attention (the CPU flash kernel's op)

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@pytest.mark.parametrize("kind", ["plain", "causal_tall", "float_mask", "scale"])
def test_flash_attention_for_cpu(kind):
    q = randn(2, 3, 7 if kind == "causal_tall" else 4, 8)
    k, v = randn(2, 3, 5, 8, seed=1), randn(2, 3, 5, 8, seed=2)
    mask = None
    if kind == "float_mask":
        mask = randn(4, 5, seed=3)
        mask[1] = -float("inf")  # a fully masked row: zeros out, logsumexp 0, as on the CPU

    def fn(q, k, v):
        m = mask.to(q.device) if mask is not None else None
        return FLASH(q, k, v, is_causal=kind == "causal_tall", attn_mask=m, scale=0.3 if kind == "scale" else None)

    check(fn, q, k, v, atol=1e-5, rtol=1e-4)


def test_flash_attention_for_cpu_bf16_logsumexp_is_float32():
    q, k, v = (randn(1, 2, 3, 4, seed=s, dtype=torch.bfloat16) for s in range(3))
    out, lse = FLASH(q.to("tpu"), k.to("tpu"), v.to("tpu"))
    cpu_out, cpu_lse = FLASH(q, k, v)
    assert out.dtype == torch.bfloat16 and lse.dtype == cpu_lse.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), cpu_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.cpu(), cpu_lse, atol=1e-2, rtol=1e-2)


# ---------------------------------------------------------------- recurrent layers (fused cells)

def _check_module(module, *inputs, atol=1e-5, rtol=1e-4):
    """A module on CPU and its copy on tpu: same outputs, input gradients and parameter gradients."""
    module.zero_grad(set_to_none=True)
    dev = copy.deepcopy(module).to("tpu")
    cpu_in = [x.detach().clone().requires_grad_() for x in inputs]
    tpu_in = [x.detach().to("tpu").requires_grad_() for x in inputs]
    cpu_out, tpu_out = module(*cpu_in), dev(*tpu_in)
    flat_cpu, flat_tpu = [], []
    for c, t in zip(_flat(cpu_out), _flat(tpu_out)):
        flat_cpu += _flat(c)
        flat_tpu += _flat(t)
    loss_cpu = loss_tpu = 0
    for i, (c, t) in enumerate(zip(flat_cpu, flat_tpu)):
        torch.testing.assert_close(t.detach().cpu(), c.detach(), atol=atol, rtol=rtol)
        seed = randn(*c.shape, seed=10 + i)
        loss_cpu, loss_tpu = loss_cpu + (c * seed).sum(), loss_tpu + (t * seed.to("tpu")).sum()
    loss_cpu.backward()
    loss_tpu.backward()
    for c, t in zip(cpu_in, tpu_in):
        torch.testing.assert_close(t.grad.cpu(), c.grad, atol=atol, rtol=rtol)
    for (name, c), t in zip(module.named_parameters(), dev.parameters()):
        torch.testing.assert_close(t.grad.cpu(), c.grad, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kw", [dict(), dict(num_layers=2, bidirectional=True, batch_first=True),
                                dict(bias=False), dict(proj_size=3)])
def test_lstm(kw):
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 5, **kw)
    x = randn(3, 6, 4)
    _check_module(lstm, x)
    layers = kw.get("num_layers", 1) * (2 if kw.get("bidirectional") else 1)
    h0 = randn(layers, 6 if not kw.get("batch_first") else 3, kw.get("proj_size") or 5, seed=1)
    c0 = randn(layers, 6 if not kw.get("batch_first") else 3, 5, seed=2)
    _check_module(_WithState(lstm), x, h0, c0)


@pytest.mark.parametrize("kw", [dict(), dict(num_layers=2, bidirectional=True), dict(bias=False)])
def test_gru(kw):
    torch.manual_seed(0)
    _check_module(nn.GRU(4, 5, **kw), randn(3, 6, 4))


class _WithState(nn.Module):
    """An LSTM (cell) taking its (h, c) state as two arguments."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x, h, c):
        return self.module(x, (h, c))


@pytest.mark.parametrize("bias", [True, False])
def test_rnn_cells(bias):
    torch.manual_seed(0)
    x, h, c = randn(6, 4), randn(6, 5, seed=1), randn(6, 5, seed=2)
    _check_module(nn.GRUCell(4, 5, bias=bias), x, h)
    _check_module(_WithState(nn.LSTMCell(4, 5, bias=bias)), x, h, c)
    _check_module(nn.GRUCell(4, 5, bias=bias), x[0])  # unbatched, zero initial state


def test_lstm_cell_bf16():
    torch.manual_seed(0)
    cell = nn.LSTMCell(4, 5).to(torch.bfloat16)
    dev = copy.deepcopy(cell).to("tpu")
    x = randn(6, 4, dtype=torch.bfloat16)
    for c, t in zip(cell(x), dev(x.to("tpu"))):
        assert t.dtype == torch.bfloat16
        torch.testing.assert_close(t.cpu(), c, atol=2e-2, rtol=2e-2)


class _Output(nn.Module):
    """One output of a module that returns several."""

    def __init__(self, module, index):
        super().__init__()
        self.module, self.index = module, index

    def forward(self, *args):
        return self.module(*args)[self.index]


@pytest.mark.parametrize("index", [0, 1])
def test_fused_lstm_cell_backward_with_one_grad(index):
    # autograd passes an undefined grad_hy (or grad_cy) when only the other output is used
    torch.manual_seed(0)
    _check_module(_Output(nn.LSTMCell(4, 5), index), randn(6, 4))


# ---------------------------------------------------------------- CTC loss

def _ctc_case(concatenated: bool):
    torch.manual_seed(0)
    log_probs = torch.randn(12, 4, 6).log_softmax(-1)
    input_lengths, target_lengths = [12, 10, 3, 0], [5, 0, 4, 2]  # sample 2 cannot align: infinite loss
    if concatenated:
        targets = torch.randint(1, 6, (sum(target_lengths),))
    else:
        targets = torch.randint(1, 6, (4, 5))
    return log_probs, targets, input_lengths, target_lengths


@pytest.mark.parametrize("concatenated", [False, True])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_ctc_loss(concatenated, reduction):
    log_probs, targets, il, tl = _ctc_case(concatenated)
    check(lambda lp: F.ctc_loss(lp, targets.to(lp.device), il, tl, reduction=reduction, zero_infinity=True),
          log_probs, atol=1e-5, rtol=1e-4)
    finite = [0, 1]  # without zero_infinity the impossible alignment gives inf and NaN gradients
    check(lambda lp: F.ctc_loss(lp[:, finite], targets[finite].to(lp.device) if not concatenated else
                                targets[:5].to(lp.device), il[:2], tl[:2], reduction=reduction),
          log_probs, atol=1e-5, rtol=1e-4)


def test_ctc_loss_tensor_lengths_and_blank():
    log_probs, targets, il, tl = _ctc_case(False)
    targets = torch.where(targets == 5, 0, targets)  # blank=5: labels use 0..4
    check(lambda lp: F.ctc_loss(lp, targets.to(lp.device), torch.tensor(il, device=lp.device),
                                torch.tensor(tl, device=lp.device), blank=5, zero_infinity=True),
          log_probs, atol=1e-5, rtol=1e-4)


def test_ctc_loss_log_alpha_and_float64():
    log_probs, targets, il, tl = _ctc_case(False)
    for dtype in (torch.float32, torch.float64):
        lp = log_probs.to(dtype)
        nll, alpha = torch.ops.aten._ctc_loss(lp, targets, il, tl)
        nll_t, alpha_t = torch.ops.aten._ctc_loss(lp.to("tpu"), targets.to("tpu"), il, tl)
        assert nll_t.dtype == alpha_t.dtype == dtype and alpha_t.shape == alpha.shape
        torch.testing.assert_close(nll_t.cpu(), nll)
        for b, (n, m) in enumerate(zip(il, tl)):  # the CPU leaves the states past a sample's lengths unset
            torch.testing.assert_close(alpha_t.cpu()[b, :n, :2 * m + 1], alpha[b, :n, :2 * m + 1])


# ---------------------------------------------------------------- rrelu

def test_rrelu_with_noise_functional():
    x, noise = randn(6, 7), torch.zeros(6, 7)
    aten = torch.ops.aten
    out, new_noise = aten.rrelu_with_noise_functional(x.to("tpu"), noise.to("tpu"), 0.1, 0.3, False)
    torch.testing.assert_close(out.cpu(), aten.rrelu_with_noise(x, noise.clone(), 0.1, 0.3, False))
    torch.testing.assert_close(new_noise.cpu(), noise)  # eval mode leaves the noise alone
    out, new_noise = aten.rrelu_with_noise_functional(x.to("tpu"), noise.to("tpu"), 0.1, 0.3, True)
    out, new_noise = out.cpu(), new_noise.cpu()
    negative = x <= 0
    assert torch.all(new_noise[~negative] == 1)
    assert torch.all((new_noise[negative] >= 0.1) & (new_noise[negative] < 0.3))
    torch.testing.assert_close(out, x * new_noise)


# ---------------------------------------------------------------- ops that write their arguments

@pytest.mark.usefixtures("each_eager_mode")
@pytest.mark.parametrize("op", ["_native_batch_norm_legit", "native_batch_norm", "_batch_norm_with_update"])
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_writes_running_stats(no_fallback, op, training):
    if op == "_batch_norm_with_update" and not training:
        pytest.skip("_batch_norm_with_update always trains")
    torch.manual_seed(0)
    x, w, b = torch.randn(4, 3, 5), torch.randn(3), torch.randn(3)
    stats = [torch.randn(3), torch.rand(3) + 0.5]
    tpu_stats = [s.to("tpu") for s in stats]
    args = (training,) if op != "_batch_norm_with_update" else ()
    expected = getattr(torch.ops.aten, op)(x, w, b, *stats, *args, 0.1, 1e-5)
    actual = getattr(torch.ops.aten, op)(x.to("tpu"), w.to("tpu"), b.to("tpu"), *tpu_stats, *args, 0.1, 1e-5)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a.cpu(), e, rtol=1e-5, atol=1e-5)
    for a, e in zip(tpu_stats, stats):  # the running statistics were updated in place, as on the CPU
        torch.testing.assert_close(a.cpu(), e, rtol=1e-5, atol=1e-6)


def test_native_batch_norm_without_running_stats(no_fallback):
    x = torch.randn(4, 3, 5)
    expected = torch.ops.aten.native_batch_norm(x, None, None, None, None, True, 0.1, 1e-5)
    actual = torch.ops.aten.native_batch_norm(x.to("tpu"), None, None, None, None, True, 0.1, 1e-5)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a.cpu(), e, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("each_eager_mode")
def test_rrelu_training_writes_its_noise_and_its_gradient_is_the_noise(no_fallback):
    x = torch.randn(64, device="tpu", requires_grad=True)
    noise = torch.zeros(64, device="tpu")
    y = torch.ops.aten.rrelu_with_noise(x, noise, 0.1, 0.3, True)
    y.sum().backward()
    n, xc = noise.cpu(), x.detach().cpu()
    assert ((n >= 0.1) & (n <= 0.3) | (xc > 0)).all() and (n[xc > 0] == 1).all()
    torch.testing.assert_close(y.detach().cpu(), xc * n)
    torch.testing.assert_close(x.grad.cpu(), n)
