"""The ``tpu`` torch.compile backend: results against PyTorch CPU eager, caching, routing, mutation."""

import copy
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import torchtpu.compile as tpu_compile
from torchtpu.device import bridge

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from models import GPT, MLP, AdamWTrainStep, GPTConfig, eager_adamw_losses, gpt_batch  # noqa: E402

tpu_compile.install()
stats = tpu_compile.compiler.cache_stats

# torch 2.11/2.12 cannot set dynamo's default backend: there Inductor hands tpu graphs to the tpu
# backend (compile/routing.py), so routing by the default, and Inductor's error, do not exist.
from torch._dynamo.backends import registry as _dynamo_registry  # noqa: E402

needs_settable_default = pytest.mark.skipif(
    not hasattr(_dynamo_registry, "set_default_backend"),
    reason="torch < 2.13 has no settable default backend (torch._dynamo set_default_backend)")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def tpu(*tensors):
    out = tuple(t.detach().to("tpu").requires_grad_(t.requires_grad) for t in tensors)
    return out if len(out) > 1 else out[0]


def compiled(fn, **kwargs):
    return torch.compile(fn, backend="tpu", **kwargs)


# ---------------------------------------------------------------- backend and routing

def test_backend_registered():
    assert "tpu" in torch._dynamo.list_backends()


def test_simple_graph_matches_cpu(no_fallback):
    def f(x, w):
        return F.gelu(x @ w).softmax(-1).sum(0) * 2 - x.mean()

    x, w = torch.randn(6, 8), torch.randn(8, 8)
    before = stats()
    out = compiled(f, fullgraph=True)(*tpu(x, w))
    assert out.device.type == "tpu"
    assert_close(out.cpu(), f(x, w), rtol=1e-5, atol=1e-5)
    after = stats()
    assert after["requests"] == before["requests"] + 1
    assert after["misses"] == before["misses"] + 1


def test_default_backend_picks_tpu_for_tpu_tensors(no_fallback):
    def f(x):
        return torch.sin(x) + 1

    x = torch.randn(5)
    before = stats()["requests"]
    assert_close(torch.compile(f)(tpu(x)).cpu(), f(x))
    assert stats()["requests"] == before + 1


@needs_settable_default
def test_default_backend_routes_cpu_graphs_to_inductor(monkeypatch):
    from torchtpu.compile import routing

    seen = []

    def fake_inductor(mode, options):
        def compile_graph(gm, example_inputs):
            seen.append((mode, [t.device.type for t in example_inputs]))
            return gm.forward

        return compile_graph

    monkeypatch.setattr(routing, "_inductor", fake_inductor)
    x = torch.randn(4)
    assert_close(torch.compile(lambda t: t * 3)(x), x * 3)
    assert seen == [(None, ["cpu"])]


@needs_settable_default
def test_explicit_inductor_on_tpu_compiles_with_the_tpu_backend(caplog):
    from torchtpu.compile import routing

    routing._log_inductor_rerouted.cache_clear()
    x = torch.randn(4)
    with caplog.at_level("WARNING", logger="torchtpu.compile"):
        out = torch.compile(lambda t: t * 3, backend="inductor")(tpu(x))
    assert_close(out.cpu(), x * 3)
    assert sum('backend="inductor") was given a graph on tpu' in r.getMessage() for r in caplog.records) == 1


def test_graph_break_runs_eager_tpu(no_fallback):
    def f(x):
        y = x * 2
        torch._dynamo.graph_break()
        return y.cos() + 1

    x = torch.randn(3, 4)
    before = stats()["misses"]
    assert_close(compiled(f)(tpu(x)).cpu(), f(x))
    assert stats()["misses"] == before + 2  # two graphs around the break


def test_zero_dim_empty_and_non_contiguous(no_fallback):
    def f(x, s, e):
        return (x.t() * s).sum(1), e + 1

    x, s, e = torch.randn(4, 3), torch.tensor(2.5), torch.randn(0, 3)
    out, empty = compiled(f)(tpu(x), tpu(s), tpu(e))
    ref, ref_empty = f(x, s, e)
    assert_close(out.cpu(), ref)
    assert empty.shape == (0, 3)


def test_int_and_bool_dtypes(no_fallback):
    def f(a, b):
        return (a * 3 + b).sum(), (a > 2) & (b < 5)

    a, b = torch.arange(12).reshape(3, 4), torch.arange(12, 0, -1).reshape(3, 4)
    got = compiled(f)(tpu(a), tpu(b))
    for g, r in zip(got, f(a, b)):
        assert g.dtype == r.dtype
        assert_close(g.cpu(), r)


def test_cpu_scalar_tensor_input(no_fallback):
    def f(x, scale):
        return x * scale

    x = torch.randn(3)
    assert_close(compiled(f)(tpu(x), torch.tensor(3.0)).cpu(), x * 3)


# ---------------------------------------------------------------- autograd

def test_forward_backward_matches_cpu(no_fallback):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    ref = model(x).pow(2).mean()
    ref.backward()
    m = copy.deepcopy(model).to("tpu")
    m.zero_grad()
    loss = compiled(lambda t: m(t).pow(2).mean())(tpu(x))
    loss.backward()
    assert_close(loss.cpu(), ref.detach())
    for p, q in zip(m.parameters(), model.parameters()):
        assert_close(p.grad.cpu(), q.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("masked", [False, True])
def test_sdpa_causal_and_masked_with_grads(no_fallback, masked):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 6, 8, requires_grad=True) for _ in range(3))
    mask = torch.rand(6, 6) > 0.3 if masked else None
    mask = mask | torch.eye(6, dtype=torch.bool) if masked else None

    def f(q, k, v, mask):
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    ref = f(q, k, v, mask)
    ref.sum().backward()
    tq, tk, tv = tpu(q, k, v)
    out = compiled(f)(tq, tk, tv, tpu(mask) if masked else None)
    out.sum().backward()
    assert_close(out.detach().cpu(), ref.detach(), rtol=1e-4, atol=1e-5)
    for a, b in ((tq, q), (tk, k), (tv, v)):
        assert_close(a.grad.cpu(), b.grad, rtol=1e-4, atol=1e-5)


def test_checkpoint_matches_cpu(no_fallback):
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)

    def f(b, t):
        return torch.utils.checkpoint.checkpoint(b, t, use_reentrant=False).sum()

    f(block, x).backward()
    b2, x2 = copy.deepcopy(block).to("tpu"), tpu(x)
    b2.zero_grad()
    compiled(f)(b2, x2).backward()
    assert_close(x2.grad.cpu(), x.grad, rtol=1e-4, atol=1e-5)
    assert_close(b2[0].weight.grad.cpu(), block[0].weight.grad, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- grad modes and module modes

def test_no_grad_inference_mode_and_eval(no_fallback):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5), nn.ReLU()).eval()
    m = copy.deepcopy(model).to("tpu")
    x = torch.randn(3, 6)
    ref = model(x)
    fn = compiled(m)
    with torch.no_grad():
        out = fn(tpu(x))
    assert not out.requires_grad
    assert_close(out.cpu(), ref.detach())
    with torch.inference_mode():
        assert_close(fn(tpu(x)).cpu(), ref.detach())


def test_dropout_same_seed_same_result(no_fallback):
    f = compiled(lambda t: F.dropout(t, 0.5, training=True))
    x = tpu(torch.ones(64, 64))
    torch.tpu.manual_seed(123)
    a = f(x).cpu()
    b = f(x).cpu()
    torch.tpu.manual_seed(123)
    c = f(x).cpu()
    assert_close(a, c)
    assert not torch.equal(a, b)  # the RNG advances between calls
    assert set(a.unique().tolist()) <= {0.0, 2.0}  # kept elements scaled by 1 / (1 - p)
    assert 0.4 < (a == 0).float().mean().item() < 0.6


# ---------------------------------------------------------------- input mutation

def test_batchnorm_running_stats_updated(no_fallback):
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(4)
    x = torch.randn(8, 4)
    ref = bn(x)
    b2 = nn.BatchNorm1d(4).to("tpu")
    out = compiled(b2)(tpu(x))
    assert_close(out.detach().cpu(), ref.detach(), rtol=1e-5, atol=1e-5)
    assert_close(b2.running_mean.cpu(), bn.running_mean)
    assert_close(b2.running_var.cpu(), bn.running_var)
    assert b2.num_batches_tracked.item() == 1


def test_in_place_update_of_an_input(no_fallback):
    # (that the buffer is donated is checked in a fresh process: test_compile_cache.py)
    def update(p, g):
        with torch.no_grad():
            p.mul_(0.5).add_(g)

    p, g = torch.randn(16), torch.randn(16)
    tp = tpu(p)
    fn = compiled(update)
    fn(tp, tpu(g))
    assert_close(tp.cpu(), p * 0.5 + g)
    view = tp[2:]  # a second tensor on the same storage still sees every update
    fn(tp, tpu(g))
    assert_close(view.cpu(), ((p * 0.5 + g) * 0.5 + g)[2:])


def test_fullgraph_train_step_donates_its_parameter_buffers(no_fallback):
    # Regression: under dynamo's frame hook the reference count of every input looked shared,
    # so a fullgraph training step donated nothing and XLA copied every parameter each step.
    class Regression(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = MLP(8, 16, 4)

        def forward(self, x, y):
            return F.mse_loss(self.mlp(x), y)

    torch.manual_seed(0)
    model = Regression()
    step = AdamWTrainStep(copy.deepcopy(model).to("tpu"))
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    nbuffers = 3 * len(step.params)  # each parameter, its exp_avg and its exp_avg_sq
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        fn = torch.compile(step, backend="tpu", fullgraph=True)
        fn(tpu(x), tpu(y))
        before = stats()["donated_buffers"]
        fn(tpu(x), tpu(y))
        assert stats()["donated_buffers"] - before >= nbuffers
        third = fn(tpu(x), tpu(y)).item()
    assert_close(third, eager_adamw_losses(model, [(x, y)] * 3)[2], rtol=1e-5, atol=1e-6)


def test_mutated_input_held_elsewhere_is_not_donated(no_fallback):
    def update(p):
        p.add_(1)

    tp = tpu(torch.zeros(4))
    keep = bridge.read(tp)  # someone else holds the array: it must survive
    before = stats()["donated_buffers"]
    compiled(update)(tp)
    assert stats()["donated_buffers"] == before
    assert not keep.is_deleted()
    assert_close(tp.cpu(), torch.ones(4))


def test_mutation_through_a_view(no_fallback):
    def f(x):
        x[1:].mul_(3)
        return x.sum()

    x = torch.arange(6.0)
    tx = tpu(x)
    out = compiled(f)(tx)
    ref = f(x)
    assert_close(out.cpu(), ref)
    assert_close(tx.cpu(), x)


# ---------------------------------------------------------------- shapes, recompilation, caches

def test_new_shape_recompiles_and_records_the_reason(no_fallback):
    tpu_compile.compiler.clear_recompile_reasons()
    fn = compiled(lambda t: t.exp().sum(0), dynamic=False)
    before = stats()
    for n in (3, 3, 5):
        x = torch.randn(n, 2)
        assert_close(fn(tpu(x)).cpu(), x.exp().sum(0))
    after = stats()
    assert after["misses"] - before["misses"] == 2
    assert after["hits"] - before["hits"] == 1
    reasons = tpu_compile.compiler.recompile_reasons()
    assert reasons and any("size" in r["reason"] for r in reasons), reasons


def test_dynamic_compiles_per_concrete_shape(no_fallback):
    fn = compiled(lambda t: (t * t.shape[0]).sum(0), dynamic=True)
    before = stats()
    for n in (3, 4, 3):
        x = torch.randn(n, 2)
        assert_close(fn(tpu(x)).cpu(), (x * n).sum(0))
    after = stats()
    assert after["misses"] - before["misses"] == 2  # one executable per shape
    assert after["hits"] - before["hits"] == 1


def test_clear_cache_drops_executables(no_fallback):
    fn = compiled(lambda t: t + 2)
    x = tpu(torch.randn(3))
    fn(x)
    before = stats()
    fn(x)
    assert stats()["hits"] == before["hits"] + 1
    tpu_compile.compiler.clear_cache()
    assert_close(fn(x).cpu(), x.cpu() + 2)
    assert stats()["misses"] == before["misses"] + 1


def test_custom_compiler_options():
    fn = lambda t: t * 2 + 1  # noqa: E731
    x = torch.randn(3)
    previous = tpu_compile.compiler.custom_compiler_options({"xla_cpu_enable_fast_math": False})
    try:
        assert_close(torch.compile(fn, backend="tpu")(tpu(x)).cpu(), fn(x))
    finally:
        tpu_compile.compiler.custom_compiler_options(previous)
    torch._dynamo.reset()
    assert_close(torch.compile(fn, backend="tpu", options={"xla_cpu_enable_fast_math": False})(tpu(x)).cpu(), fn(x))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="no_such_xla_option"):
        torch.compile(fn, backend="tpu", options={"no_such_xla_option": 1})(tpu(x))


# ---------------------------------------------------------------- training

def test_train_step_with_graph_breaks_matches_cpu(no_fallback):
    torch.manual_seed(0)
    model = MLP(8, 16, 4)
    batches = [(torch.randn(6, 8), torch.randn(6, 4)) for _ in range(3)]
    loss_fn = lambda m, x, y: F.mse_loss(m(x), y)  # noqa: E731

    def run(m, device, compile_):
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

        def step(x, y):
            loss = loss_fn(m, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        fn = compiled(step) if compile_ else step
        return [fn(x.to(device), y.to(device)).item() for x, y in batches]

    ref = run(copy.deepcopy(model), "cpu", False)
    got = run(copy.deepcopy(model).to("tpu"), "tpu", True)
    assert_close(got, ref, rtol=1e-5, atol=1e-6)


def _gpt_train(config: GPTConfig, batch: int, steps: int) -> tuple[list[float], list[float]]:
    torch.manual_seed(0)
    model = GPT(config)
    batches = [gpt_batch(config, batch) for _ in range(steps)]
    ref = eager_adamw_losses(copy.deepcopy(model), batches)
    train_step = AdamWTrainStep(copy.deepcopy(model).to("tpu"))
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        fn = torch.compile(train_step, backend="tpu", fullgraph=True)
        got = [fn(x.to("tpu"), y.to("tpu")).item() for x, y in batches]
    return got, ref


def test_gpt_train_step_fullgraph_matches_cpu(no_fallback):
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, d_model=64)
    before = stats()
    got, ref = _gpt_train(cfg, batch=4, steps=5)
    assert_close(got, ref, rtol=1e-3, atol=0)
    assert stats()["misses"] - before["misses"] == 1  # one graph: forward, backward and AdamW


@pytest.mark.slow
def test_gpt_train_step_full_size_matches_cpu(no_fallback):
    cfg = GPTConfig(vocab_size=1024, block_size=128, n_layer=4, n_head=4, d_model=256)
    got, ref = _gpt_train(cfg, batch=8, steps=20)
    assert_close(got, ref, rtol=1e-3, atol=0)


def test_runs_on_the_inputs_device(no_fallback):
    x = torch.randn(4, 3)
    out = compiled(lambda t: (t * 2).sum(0))(x.to("tpu:1"))
    assert out.device == torch.device("tpu", 1)
    assert_close(out.cpu(), (x * 2).sum(0))


@needs_settable_default
def test_default_backend_passes_xla_options(no_fallback):
    fn = torch.compile(lambda t: t - 1, options={"xla_cpu_enable_fast_math": False})
    x = torch.randn(3)
    assert_close(fn(tpu(x)).cpu(), x - 1)


@needs_settable_default
def test_default_backend_drops_inductor_options_on_tpu(no_fallback):
    """Libraries tuned for Inductor (TorchTitan's flex_attention) pass Inductor settings; on tpu
    they are dropped, not handed to XLA as unknown compile options, and XLA options still pass."""
    options = {"max_autotune": True, "triton.cudagraphs": False, "xla_cpu_enable_fast_math": False}
    fn = torch.compile(lambda t: t * 3 + 1, options=options)
    x = torch.randn(3)
    assert_close(fn(tpu(x)).cpu(), x * 3 + 1)


def test_foreach_adamw_step_inside_compile_matches_cpu():
    """Optimizers' multi-tensor (_foreach_*) updates, whose Scalar args map to keyword args of the
    per-tensor ops (addcmul's value), inside a compiled step."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(8, 8)
    model = torch.nn.Linear(8, 8).to("tpu")
    model.load_state_dict(ref.state_dict())
    opts = [torch.optim.AdamW(m.parameters(), foreach=True) for m in (ref, model)]
    x = torch.randn(4, 8)
    xt = x.to("tpu")

    @torch.compile(backend="tpu")
    def step():
        loss = model(xt).square().mean()
        loss.backward()
        opts[1].step()
        opts[1].zero_grad()
        return loss

    for _ in range(3):
        loss = step()
        expected = ref(x).square().mean()
        expected.backward()
        opts[0].step()
        opts[0].zero_grad()
        torch.testing.assert_close(loss.cpu(), expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.weight.detach().cpu(), ref.weight.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(torch.torch_version.TorchVersion(torch.__version__) < "2.13",
                    reason="torch < 2.13 drops _linalg_check_errors from compiled graphs (on CPU too)")
def test_linalg_error_checks_run_inside_compiled_graphs(no_fallback):
    # aot_autograd wraps _linalg_check_errors in with_effects; the graph runs it as a host check.
    fn = torch.compile(torch.linalg.inv, backend="tpu")
    a = torch.randn(3, 3) + 3 * torch.eye(3)
    assert_close(fn(tpu(a)).cpu(), torch.linalg.inv(a), rtol=1e-4, atol=1e-5)
    with pytest.raises(Exception, match="singular|LinAlgError"):
        fn(torch.zeros(3, 3, device="tpu")).cpu()


def test_shape_checks_on_unbacked_sizes_compile(no_fallback):
    # vLLM's sampler (log-probs) compiles a function that torch._check's an unbacked batch size:
    # its graph holds aten._assert_scalar, checked while the graph is traced.
    @torch.compile(backend="tpu")
    def count(x, values):
        torch._check(x.shape[0] >= 1)
        torch._check(x.shape[0] == values.shape[0])
        return (x >= values).sum(-1)

    for rows in (3, 5):
        x = torch.randn(rows, 64)
        v = x[:, :1].clone()
        xt, vt = tpu(x), tpu(v)
        torch._dynamo.decorators.mark_unbacked(xt, 0)
        torch._dynamo.decorators.mark_unbacked(vt, 0)
        assert torch.equal(count(xt, vt).cpu(), (x >= v).sum(-1))


def test_random_op_after_a_graph_break(no_fallback):
    # After a graph break dynamo runs our eager kernels; compiling one must not trace into
    # ml_dtypes (jax calls it): that crashed with InternalTorchDynamoError.
    def f(x):
        y = x * 2
        torch._dynamo.graph_break()
        return y + torch.rand(x.shape, device=x.device).ge(0)

    x = torch.randn(5)
    assert_close(torch.compile(f, backend="tpu")(tpu(x)).cpu(), x * 2 + 1)


def test_complex_views_and_bilinear_in_compiled_graphs(no_fallback):
    def f(x, w, a, b):
        z = torch.view_as_complex(x) * 2
        return torch.view_as_real(z).sum(-1), F.bilinear(a, b, w)

    x, w, a, b = torch.randn(3, 4, 2), torch.randn(5, 4, 6), torch.randn(2, 4), torch.randn(2, 6)
    actual = compiled(f)(tpu(x), tpu(w), tpu(a), tpu(b))
    for got, want in zip(actual, f(x, w, a, b)):
        assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
