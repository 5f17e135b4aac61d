"""torch.autocast("tpu") follows PyTorch's CUDA cast policy, in eager (both modes) and compiled,
forward and backward; torch.amp.GradScaler("tpu") works for float16.

The reference for the policy is CUDA's autocast itself, run on fake CUDA tensors
(``FakeTensorMode``: no GPU needed), so every expected dtype comes from PyTorch, not from a list
typed here. Training is compared with CPU autocast (whose policy differs from CUDA's, see
``test_gpt_trains_under_bf16_autocast_like_cpu_autocast``).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensorMode

from test_training_parity import TinyTransformer

LOW = (torch.bfloat16, torch.float16)


# ---------------------------------------------------------------- the reference: CUDA's policy

@contextlib.contextmanager
def _cuda_autocast(dtype):
    """CUDA's autocast switched on directly (torch.autocast("cuda") refuses without a GPU)."""
    enabled, previous = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_dtype("cuda", dtype)
    torch.set_autocast_enabled("cuda", True)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", previous)
        torch.clear_autocast_cache()


def cuda_dtypes(fn, args, dtype, compiled: bool = False):
    """The output dtypes of ``fn`` under CUDA's autocast, on fake CUDA tensors shaped as ``args``
    (or the message of the error it raises). ``compiled``: as torch.compile traces it, with the
    Python dispatcher on: Python decompositions of composite overloads then run beneath the
    autocast key (``upsample_bilinear2d.vec`` computes in its input's dtype), on every device."""
    with FakeTensorMode(), (enable_python_dispatcher() if compiled else contextlib.nullcontext()):
        fakes = [torch.empty(a.shape, dtype=a.dtype, device="cuda") if isinstance(a, torch.Tensor) else a
                 for a in args]
        with _cuda_autocast(dtype):
            try:
                return _dtypes(fn(*fakes))
            except RuntimeError as exc:  # e.g. promote under float16 autocast given a bfloat16 input
                return str(exc).splitlines()[0]


def _dtypes(out):
    return tuple(o.dtype for o in out) if isinstance(out, (tuple, list)) else (out.dtype,)


def f32(*shape):
    return torch.randn(*shape)


def bf(*shape):
    return torch.randn(*shape, dtype=torch.bfloat16)


def idx(*shape, high=4):
    return torch.randint(0, high, shape)


# One entry per op: (name, fn, CPU args). The classes are CUDA's (ATen/autocast_mode.h).
CASES = [
    # lower_precision_fp
    ("mm", torch.mm, (f32(3, 4), f32(4, 5))),
    ("matmul", torch.matmul, (f32(2, 3, 4), f32(4, 5))),
    ("bmm", torch.bmm, (f32(2, 3, 4), f32(2, 4, 5))),
    ("linear", F.linear, (f32(3, 4), f32(5, 4), f32(5))),
    ("addmm", torch.addmm, (f32(5), f32(3, 4), f32(4, 5))),
    ("baddbmm", torch.baddbmm, (f32(2, 3, 5), f32(2, 3, 4), f32(2, 4, 5))),
    ("addbmm", torch.addbmm, (f32(3, 5), f32(2, 3, 4), f32(2, 4, 5))),
    ("mv", torch.mv, (f32(3, 4), f32(4))),
    ("addmv", torch.addmv, (f32(3), f32(3, 4), f32(4))),
    ("addr", torch.addr, (f32(3, 4), f32(3), f32(4))),
    ("einsum", lambda a, b: torch.einsum("ij,jk->ik", a, b), (f32(3, 4), f32(4, 5))),
    ("chain_matmul", lambda a, b, c: torch.linalg.multi_dot([a, b, c]), (f32(2, 3), f32(3, 4), f32(4, 2))),
    ("conv1d", F.conv1d, (f32(1, 2, 8), f32(3, 2, 3))),
    ("conv2d", F.conv2d, (f32(1, 2, 6, 6), f32(3, 2, 3, 3), f32(3))),
    ("conv_transpose2d", F.conv_transpose2d, (f32(1, 2, 4, 4), f32(2, 3, 3, 3))),
    ("prelu", F.prelu, (f32(2, 3, 4), f32(3))),
    ("sdpa", F.scaled_dot_product_attention, (f32(1, 2, 4, 8), f32(1, 2, 4, 8), f32(1, 2, 4, 8))),
    ("mixed linear", F.linear, (bf(3, 4), f32(5, 4))),
    # fp32
    ("exp", torch.exp, (bf(3, 4),)),
    ("log", torch.log, (bf(3, 4).abs() + 1,)),
    ("pow", lambda x: torch.pow(x, 2), (bf(3, 4),)),
    ("rsqrt", torch.rsqrt, (bf(3, 4).abs() + 1,)),
    ("softplus", F.softplus, (bf(3, 4),)),
    ("layer_norm", lambda x, w, b: F.layer_norm(x, (4,), w, b), (bf(3, 4), bf(4), bf(4))),
    ("group_norm", lambda x: F.group_norm(x, 2), (bf(2, 4, 3),)),
    ("rms_norm", lambda x: F.rms_norm(x, (4,)), (bf(3, 4),)),
    ("mse_loss", F.mse_loss, (bf(3, 4), bf(3, 4))),
    ("l1_loss", F.l1_loss, (bf(3, 4), bf(3, 4))),
    ("nll_loss", F.nll_loss, (bf(3, 4), idx(3))),
    ("kl_div", lambda a, b: F.kl_div(a, b, reduction="batchmean"), (bf(3, 4), bf(3, 4).softmax(-1))),
    ("bce_with_logits", F.binary_cross_entropy_with_logits, (bf(3, 4), bf(3, 4).sigmoid())),
    ("cosine_similarity", F.cosine_similarity, (bf(3, 4), bf(3, 4))),
    ("cdist", torch.cdist, (bf(3, 4), bf(5, 4))),
    ("logsumexp", lambda x: torch.logsumexp(x, -1), (bf(3, 4),)),
    ("upsample_bilinear2d", lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), (bf(1, 2, 3, 3),)),
    # fp32_set_opt_dtype
    ("softmax", lambda x: torch.softmax(x, -1), (bf(3, 4),)),
    ("log_softmax", lambda x: torch.log_softmax(x, -1), (bf(3, 4),)),
    ("sum", torch.sum, (bf(3, 4),)),
    ("sum dim", lambda x: x.sum(-1), (bf(3, 4),)),
    ("prod", torch.prod, (bf(3, 4),)),
    ("cumsum", lambda x: torch.cumsum(x, 0), (bf(3, 4),)),
    ("vector_norm", torch.linalg.vector_norm, (bf(3, 4),)),
    ("softmax given a dtype", lambda x: torch.softmax(x, -1, dtype=torch.bfloat16), (f32(3, 4),)),
    ("sum given a dtype", lambda x: torch.sum(x, dtype=torch.float64), (bf(3, 4),)),
    # fp32_append_dtype
    ("norm.Scalar", lambda x: torch.ops.aten.norm.Scalar(x, 2), (bf(3, 4),)),
    # promote
    ("addcmul", torch.addcmul, (f32(3, 4), bf(3, 4), bf(3, 4))),
    ("addcdiv", torch.addcdiv, (bf(3, 4), f32(3, 4), bf(3, 4).abs() + 1)),
    ("atan2", torch.atan2, (bf(3, 4), f32(3, 4))),
    ("dot", torch.dot, (f32(4), bf(4))),
    ("cross", torch.linalg.cross, (f32(2, 3), bf(2, 3))),
    ("scatter_add", lambda x, i, s: x.scatter_add(0, i, s), (bf(3, 4), idx(2, 4, high=3), f32(2, 4))),
    ("index_put", lambda x, i, v: x.index_put((i,), v), (bf(4, 3), idx(2), f32(2, 3))),
    # not listed: run in their inputs' dtypes
    ("relu", torch.relu, (f32(3, 4),)),
    ("gelu bf16", F.gelu, (bf(3, 4),)),
    ("add mixed", torch.add, (f32(3, 4), bf(3, 4))),
    ("mean", torch.mean, (bf(3, 4),)),
    ("embedding", F.embedding, (idx(5, high=4), f32(4, 3))),
]


def _tpu(args):
    return [a.to("tpu") if isinstance(a, torch.Tensor) else a for a in args]


@pytest.fixture(params=["DEFER_NEVER", pytest.param("DEFER_AND_FUSE", marks=pytest.mark.slow)])
def policy_mode(request):
    """The per-op policy sweep in both eager modes; the fused half (114 cases, where the dtypes
    come from the same C++ autocast kernels) runs in the slow sweep to keep CI in its budget."""
    with torch.tpu.set_eager_mode(getattr(torch.tpu.EagerMode, request.param)):
        yield request.param


@pytest.mark.usefixtures("policy_mode", "no_fallback")
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("name, fn, args", CASES, ids=[c[0] for c in CASES])
def test_eager_output_dtypes_follow_cudas_policy(name, fn, args, dtype):
    expected = cuda_dtypes(fn, args, dtype)
    with torch.autocast("tpu", dtype=dtype):
        if isinstance(expected, str):
            with pytest.raises(RuntimeError, match=expected):
                fn(*_tpu(args))
            return
        out = fn(*_tpu(args))
    assert _dtypes(out) == expected
    for o in out if isinstance(out, tuple) else (out,):
        o.cpu()  # it computes (DEFER_AND_FUSE: runs the recording)


@pytest.mark.usefixtures("no_fallback")
@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_compiled_output_dtypes_follow_cudas_policy(dtype):
    """Dynamo traces the autocast block itself: the cast policy is in the graph it hands us, as
    it is in the graph of a CUDA model."""
    cases = [c for c in CASES if not isinstance(cuda_dtypes(c[1], c[2], dtype), str)]  # no errors

    def every_case(*flat):
        outs, it = [], iter(flat)
        with torch.autocast("tpu", dtype=dtype):
            for _, fn, args in cases:
                outs.append(fn(*[next(it) for _ in args]))
        return outs

    flat = [a for _, _, args in cases for a in _tpu(args)]
    got = torch.compile(every_case, backend="tpu", fullgraph=True)(*flat)
    for (name, fn, args), out in zip(cases, got):
        assert _dtypes(out) == cuda_dtypes(fn, args, dtype, compiled=True), name


def test_mm_computes_in_the_autocast_dtype():
    a, b = f32(16, 32), f32(32, 8)
    with torch.autocast("tpu", dtype=torch.bfloat16):
        out = a.to("tpu") @ b.to("tpu")
    torch.testing.assert_close(out.cpu(), a.bfloat16() @ b.bfloat16())  # fp32 accumulation, as CPU's


def test_every_op_with_a_cuda_autocast_kernel_has_a_tpu_one():
    names = torch._C._dispatch_get_all_op_names()
    cuda = {n for n in names if torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastCUDA")}
    tpu = {n for n in names if torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastPrivateUse1")}
    cuda_only = {n for n in cuda if "cudnn" in n}  # cuDNN's own kernels
    assert tpu == cuda - cuda_only


def test_binary_cross_entropy_is_banned_as_on_cuda():
    x, y = f32(3).sigmoid().to("tpu"), f32(3).sigmoid().to("tpu")
    with torch.autocast("tpu"), pytest.raises(RuntimeError, match="unsafe to autocast"):
        F.binary_cross_entropy(x, y)


def test_state_queries_and_default_dtype():
    assert torch.get_autocast_dtype("tpu") == torch.bfloat16  # the MXU's type, not PyTorch's float16
    assert not torch.is_autocast_enabled("tpu")
    x = f32(4, 4).to("tpu")
    with torch.autocast("tpu"):
        assert torch.is_autocast_enabled("tpu")
        assert (x @ x).dtype == torch.bfloat16
        with torch.autocast("tpu", enabled=False):
            assert not torch.is_autocast_enabled("tpu")
            assert (x @ x).dtype == torch.float32
        with torch.autocast("tpu", dtype=torch.float16):
            assert (x @ x).dtype == torch.float16
        assert (x @ x).dtype == torch.bfloat16
    assert (x @ x).dtype == torch.float32
    assert not torch.is_autocast_enabled("tpu")


def test_disabled_inside_a_compiled_function():
    x = f32(4, 4).to("tpu")

    @torch.compile(backend="tpu", fullgraph=True)
    def fn(x):
        with torch.autocast("tpu", dtype=torch.bfloat16):
            a = x @ x
            with torch.autocast("tpu", enabled=False):
                b = x @ x
        return a, b

    a, b = fn(x)
    assert (a.dtype, b.dtype) == (torch.bfloat16, torch.float32)


@pytest.mark.usefixtures("no_fallback")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_backward_saves_low_precision_and_grads_stay_fp32(compiled):
    """Parameters keep fp32 gradients; values match CPU run with CUDA's casts written out."""
    torch.manual_seed(0)
    w, b, x = f32(8, 6).requires_grad_(), f32(8).requires_grad_(), f32(5, 6)

    def loss_fn(w, b, x):
        with torch.autocast("tpu", dtype=torch.bfloat16):
            h = F.linear(x, w, b)                         # bf16
            return torch.log_softmax(h, -1).sum()         # fp32

    run = torch.compile(loss_fn, backend="tpu") if compiled else loss_fn
    wt, bt = w.detach().to("tpu").requires_grad_(), b.detach().to("tpu").requires_grad_()
    loss = run(wt, bt, x.to("tpu"))
    loss.backward()
    assert loss.dtype == torch.float32 and wt.grad.dtype == bt.grad.dtype == torch.float32

    h = F.linear(x.bfloat16(), w.bfloat16(), b.bfloat16())  # the same casts, on the CPU
    ref = torch.log_softmax(h.float(), -1).sum()
    ref.backward()
    torch.testing.assert_close(loss.cpu(), ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(wt.grad.cpu(), w.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(bt.grad.cpu(), b.grad, rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------- GradScaler's ops and GradScaler

def _unscale_case():
    grads = [torch.tensor([1.0, -2.0, 3.0]), torch.tensor([4.0, 8.0], dtype=torch.float16),
             torch.tensor([[0.5, float("inf")], [1.0, 2.0]]), torch.tensor([float("nan")], dtype=torch.bfloat16)]
    return grads, torch.zeros(()), torch.full((), 0.25)


@pytest.mark.usefixtures("each_eager_mode", "no_fallback")
@pytest.mark.parametrize("bad", [False, True], ids=["finite", "inf_and_nan"])
def test_non_finite_check_and_unscale_matches_cpu(bad):
    grads, found, inv = _unscale_case()
    if not bad:
        grads = [torch.nan_to_num(g, nan=1.0, posinf=1.0) for g in grads]
    tpu = [g.to("tpu") for g in grads]
    found_t, inv_t = found.to("tpu"), inv.to("tpu")
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
    torch._amp_foreach_non_finite_check_and_unscale_(tpu, found_t, inv_t)
    assert found_t.item() == found.item() == float(bad)
    for t, c in zip(tpu, grads):
        torch.testing.assert_close(t.cpu(), c, equal_nan=True)


@pytest.mark.usefixtures("each_eager_mode", "no_fallback")
def test_update_scale_matches_cpu():
    found_seq = [0, 0, 1, 0, 0, 0, 1, 1, 0]
    cpu = [torch.full((), 1024.0), torch.zeros((), dtype=torch.int32)]
    tpu = [t.to("tpu") for t in cpu]
    for found in found_seq:
        f = torch.full((), float(found))
        out_c = torch._amp_update_scale_(*cpu, f, 2.0, 0.5, 2)
        out_t = torch._amp_update_scale_(*tpu, f.to("tpu"), 2.0, 0.5, 2)
        assert out_t is tpu[0] and out_c is cpu[0]
        assert (tpu[0].item(), tpu[1].item()) == (cpu[0].item(), cpu[1].item())
    huge = [torch.full((), 3e38).to("tpu"), torch.ones((), dtype=torch.int32).to("tpu")]
    torch._amp_update_scale_(*huge, torch.zeros((), device="tpu"), 2.0, 0.5, 2)
    assert huge[0].item() == pytest.approx(3e38)  # an overflowing growth keeps the scale


def test_out_and_functional_forms_match_cpu():
    grads, found, inv = _unscale_case()
    results = {}
    for device in ("cpu", "tpu"):
        found_d = found.to(device)
        out = [torch.empty_like(g, device=device) for g in grads]
        torch.ops.aten._amp_foreach_non_finite_check_and_unscale.out([g.to(device) for g in grads], found_d,
                                                                     inv.to(device), out=out)
        scale, tracker = torch.ops.aten._amp_update_scale(torch.full((), 8.0, device=device),
                                                          torch.ones((), dtype=torch.int32, device=device),
                                                          found_d, 2.0, 0.5, 2)
        scale_out = torch.empty((), device=device)
        tracker_d = torch.ones((), dtype=torch.int32, device=device)
        torch.ops.aten._amp_update_scale.out(torch.full((), 8.0, device=device), tracker_d,
                                             torch.zeros((), device=device), 2.0, 0.5, 2, out=scale_out)
        results[device] = ([o.cpu() for o in out], found_d.item(), scale.item(), tracker.item(),
                           scale_out.item(), tracker_d.item())
    for t, c in zip(results["tpu"][0], results["cpu"][0]):
        torch.testing.assert_close(t, c, equal_nan=True)
    assert results["tpu"][1:] == results["cpu"][1:]
    with pytest.raises(RuntimeError, match="found_inf must be a float tensor"):
        torch._amp_foreach_non_finite_check_and_unscale_([f32(2).to("tpu")], torch.zeros((), dtype=torch.float64,
                                                         device="tpu"), inv.to("tpu"))


def test_scaler_ops_in_a_compiled_function():
    @torch.compile(backend="tpu")
    def unscale_and_update(grads, found, inv, scale, tracker):
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        torch._amp_update_scale_(scale, tracker, found, 2.0, 0.5, 3)

    grads, found, inv = _unscale_case()
    state = [torch.full((), 64.0), torch.ones((), dtype=torch.int32)]
    tpu_grads, tpu_found, tpu_state = [g.to("tpu") for g in grads], found.to("tpu"), [s.to("tpu") for s in state]
    unscale_and_update(tpu_grads, tpu_found, inv.to("tpu"), *tpu_state)
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
    torch._amp_update_scale_(*state, found, 2.0, 0.5, 3)
    for t, c in zip(tpu_grads, grads):
        torch.testing.assert_close(t.cpu(), c, equal_nan=True)
    assert [tpu_found.item(), tpu_state[0].item(), tpu_state[1].item()] == \
        [found.item(), state[0].item(), state[1].item()]


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))

    def forward(self, x):
        return self.net(x)


def _fp16_scaler_run(device: str, poison_step: int | None, steps: int = 6):
    torch.manual_seed(0)
    model = MLP().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 10, growth_interval=2)
    gen = torch.Generator().manual_seed(3)
    record = []
    for step in range(steps):
        x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        with torch.autocast(device, dtype=torch.float16):
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
        opt.zero_grad()
        scaler.scale(loss).backward()
        if step == poison_step:
            model.net[0].weight.grad[0, 0] = float("inf")
        before = model.net[2].weight.detach().cpu().clone()
        scaler.step(opt)
        scaler.update()
        skipped = torch.equal(before, model.net[2].weight.detach().cpu())
        record.append((loss.item(), scaler.get_scale(), skipped))
    return record


@pytest.mark.usefixtures("each_eager_mode", "no_fallback")
def test_grad_scaler_float16_training_matches_cpu_and_skips_inf_steps():
    cpu, tpu = _fp16_scaler_run("cpu", 3), _fp16_scaler_run("tpu", 3)
    assert [r[1:] for r in tpu] == [r[1:] for r in cpu]  # the same scales, the same skipped step
    assert [r[2] for r in tpu] == [False, False, False, True, False, False]
    assert tpu[3][1] == tpu[2][1] / 2  # backed off after the inf
    for (lc, _, _), (lt, _, _) in zip(cpu, tpu):
        assert lt == pytest.approx(lc, rel=1e-2)  # fp16: 11-bit mantissa, and CPU's fp16 policy differs


# ---------------------------------------------------------------- acceptance: a GPT under bf16 autocast

STEPS = 20
# The bound: bf16 keeps 8 significant bits (unit roundoff 2^-8 = 0.39 %). A loss computed after a
# few bf16 matmuls carries a few such roundoffs, and the two runs differ in policy too: CPU
# autocast runs softmax and layer_norm in bf16 where CUDA's policy (ours) runs them in fp32, and
# XLA and ATen round and accumulate in different orders. 2 % is five bf16 roundoffs, so any wrong
# op in the forward (step 0) or a broken backward (later steps, and the learning check) fails it.
# Measured on XLA:CPU: at most 0.06 % apart (eager, fused and compiled). This small model is about
# as close to its fp32 run, so the loss cannot tell cast policies apart: the dtype tests above do
# that, and the loop asserts bf16 logits and an fp32 loss at every step.
RTOL = 2e-2


def _gpt_batch(gen):
    start = torch.randint(0, 64, (4, 1), generator=gen)
    idx = (start + torch.arange(17)) % 64  # each sequence counts up from a random start: learnable
    return idx[:, :-1], idx[:, 1:]


def _train_gpt(device: str, compiled: bool = False) -> list[float]:
    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    forward = torch.compile(model, backend="tpu") if compiled else model
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x, y = _gpt_batch(gen)
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = forward(x.to(device))
            loss = F.cross_entropy(logits.flatten(0, 1), y.to(device).flatten())
        assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def cpu_gpt_losses():
    return _train_gpt("cpu")


@pytest.mark.usefixtures("each_eager_mode", "no_fallback")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gpt_trains_under_bf16_autocast_like_cpu_autocast(cpu_gpt_losses, compiled, each_eager_mode):
    if compiled and each_eager_mode != "DEFER_NEVER":
        pytest.skip("compiled graphs run the same way in every eager mode")
    tpu = _train_gpt("tpu", compiled)
    for step, (c, t) in enumerate(zip(cpu_gpt_losses, tpu)):
        assert math.isfinite(t) and abs(t - c) <= RTOL * abs(c), f"step {step}: cpu {c} vs tpu {t}"
    assert tpu[-1] < 0.8 * tpu[0]  # it learns
