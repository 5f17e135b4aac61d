"""Capture and replay (``torch.tpu.graph``, ``TPUGraph``, ``make_graphed_callables``) and the
whole-step program (``torch.tpu.compile_step``), checked against eager ``tpu`` and torch CPU."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from torchtpu.graphs import CaptureError


def _cpu(t):
    return t.detach().cpu()


def test_replay_computes_what_the_region_would_and_capture_runs_nothing():
    x = torch.randn(8, 16, device="tpu")
    w = torch.randn(16, 16, device="tpu")
    out = torch.zeros(8, 16, device="tpu")
    count = torch.zeros((), device="tpu")
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        y = torch.relu(x @ w) * 2 + 1
        out.copy_(y)
        count.add_(1)
    assert _cpu(out).abs().sum() == 0 and count.item() == 0  # nothing ran, as with CUDA graphs
    for _ in range(3):
        x.copy_(torch.randn(8, 16))  # new data goes into the static input
        g.replay()
        expected = torch.relu(_cpu(x) @ _cpu(w)) * 2 + 1
        torch.testing.assert_close(_cpu(out), expected)
        torch.testing.assert_close(_cpu(y), expected)  # a static output made in the region
    assert count.item() == 3  # an in-place update of a tensor from before the capture, once per replay


def test_replay_reads_tensors_changed_outside_the_graph():
    w = torch.ones(4, device="tpu")
    out = torch.empty(4, device="tpu")
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        out.copy_(w * 3)
    w.mul_(2)  # changed after the capture, by an eager op: the replay reads the new value
    g.replay()
    torch.testing.assert_close(_cpu(out), torch.full((4,), 6.0))


def test_random_ops_draw_fresh_numbers_each_replay_as_eager_would():
    torch.tpu.manual_seed(7)
    eager = [_cpu(torch.rand(5, device="tpu")) for _ in range(3)]
    torch.tpu.manual_seed(7)
    out = torch.empty(5, device="tpu")
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        out.copy_(torch.rand(5, device="tpu"))
    replays = []
    for _ in range(3):
        g.replay()
        replays.append(_cpu(out))
    for a, b in zip(eager, replays):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("body, named", [
    (lambda x: x.sum().item(), "_local_scalar_dense"),
    (lambda x: torch.nonzero(x), "nonzero"),
    (lambda x: print(x), "host"),
])
def test_what_a_program_cannot_hold_raises_at_capture_naming_it(body, named):
    x = torch.randn(6, device="tpu")
    before = _cpu(x)
    with pytest.raises(CaptureError, match=named):
        with torch.tpu.graph(torch.tpu.TPUGraph()):
            x.mul_(2)
            body(x)
    torch.testing.assert_close(_cpu(x), before)  # the aborted capture changed nothing
    torch.testing.assert_close(_cpu(x * 1), before)  # and eager work goes on


def test_host_copy_into_a_static_input_inside_the_region_is_refused():
    x = torch.zeros(3, device="tpu")
    with pytest.raises(CaptureError, match="host data"):
        with torch.tpu.graph(torch.tpu.TPUGraph()):
            x.copy_(torch.ones(3))


def _mlp(device, dropout=0.0):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(12, 24), torch.nn.Tanh()] + ([torch.nn.Dropout(dropout)] if dropout else []) + \
        [torch.nn.Linear(24, 3)]
    return torch.nn.Sequential(*layers).to(device)


def _data(n=20, batch=6):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 12, generator=g), torch.randn(batch, 3, generator=g)) for _ in range(n)]


def _train(device, data, make_opt, compiled=False, accumulate=1, clip=None, schedule=False, dropout=0.0):
    model = _mlp(device, dropout)
    opt = make_opt(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + 0.1 * i)) if schedule else None

    def step(x, y):
        total = 0
        for xs, ys in zip(x.chunk(accumulate), y.chunk(accumulate)):  # gradient accumulation
            loss = F.mse_loss(model(xs), ys) / accumulate
            loss.backward()
            total = total + loss.detach()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    run = torch.tpu.compile_step(step) if compiled else step
    losses = []
    for x, y in data:
        losses.append(run(x.to(device), y.to(device)))
        if sched is not None:
            sched.step()
    return [float(loss) for loss in losses], model, run


@pytest.mark.parametrize("case", ["adamw_clip_schedule_accumulate", "sgd_momentum", "adam_dropout"])
def test_compile_step_matches_eager_tpu_and_cpu_over_20_steps(case):
    data = _data()
    if case == "adamw_clip_schedule_accumulate":
        kw = dict(make_opt=lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1), accumulate=2, clip=0.5,
                  schedule=True)
    elif case == "sgd_momentum":
        kw = dict(make_opt=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True))
    else:
        kw = dict(make_opt=lambda p: torch.optim.Adam(p, lr=1e-2), dropout=0.2)
    torch.tpu.manual_seed(3)
    eager, eager_model, _ = _train("tpu", data, **kw)
    torch.tpu.manual_seed(3)
    captured, model, run = _train("tpu", data, compiled=True, **kw)
    torch.testing.assert_close(captured, eager, rtol=1e-5, atol=0)  # same seed: the same dropout masks
    for a, b in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(_cpu(a), _cpu(b), rtol=1e-5, atol=1e-6)
    if not kw.get("dropout"):
        cpu, _, _ = _train("cpu", data, **kw)
        torch.testing.assert_close(captured, cpu, rtol=1e-5, atol=0)
    assert run.programs == 1 and run.recaptures == []  # the LR schedule is read from a tensor, not recaptured


def test_compile_step_captures_again_when_a_constant_hyperparameter_or_shape_changes():
    data = _data(6)
    losses, model, run = _train("tpu", data[:3], make_opt=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                                compiled=True)
    opt = next(c.cell_contents for c in run.fn.__closure__ if isinstance(c.cell_contents, torch.optim.SGD))
    reference = copy.deepcopy(model).cpu()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    ref_opt.load_state_dict(opt.state_dict())
    for group in (opt.param_groups[0], ref_opt.param_groups[0]):
        group["lr"] = 0.01  # a Python number: a constant of the captured program
    x, y = data[3]
    got = float(run(x.to("tpu"), y.to("tpu")))
    expected = F.mse_loss(reference(x), y)
    expected.backward()
    ref_opt.step()
    assert got == pytest.approx(expected.item(), rel=1e-5)
    assert any("lr" in r and "0.05" in r and "0.01" in r for r in run.recaptures)
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(_cpu(a), b.detach(), rtol=1e-5, atol=1e-6)
    run(torch.randn(4, 12, device="tpu"), torch.randn(4, 3, device="tpu"))  # a new shape: warm-up, then its own program
    run(torch.randn(4, 12, device="tpu"), torch.randn(4, 3, device="tpu"))
    assert any("new input signature" in r for r in run.recaptures) and run.programs == 2


def test_a_graph_refuses_to_replay_a_changed_hyperparameter_or_replaced_parameter():
    model = _mlp("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(6, 12, device="tpu"), torch.randn(6, 3, device="tpu")

    def step():
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    step()  # warm-up: the momentum buffers exist before the capture
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        step()
    g.replay()
    opt.param_groups[0]["lr"] = 0.2
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['lr'\] changed from 0.1 to 0.2"):
        g.replay()
    opt.param_groups[0]["lr"] = 0.1
    model[0].weight.data = torch.zeros(24, 12, device="tpu")
    with pytest.raises(RuntimeError, match="parameters are other tensors"):
        g.replay()


def test_optimizer_without_warm_up_or_capturable_is_refused_at_capture():
    model = _mlp("tpu")
    x = torch.randn(6, 12, device="tpu")
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(CaptureError, match="warm-up"):
        with torch.tpu.graph(torch.tpu.TPUGraph()):
            model(x).sum().backward()
            sgd.step()
    adam = torch.optim.Adam(model.parameters())
    with pytest.raises(CaptureError, match="capturable=True"):
        with torch.tpu.graph(torch.tpu.TPUGraph()):
            model(x).sum().backward()
            adam.step()


_OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
}


def _deep_mlp(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.LayerNorm(32), torch.nn.GELU(),
                               torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 3)).to(device)


def _train_graphed(device, data, make_opt, input_grad, set_to_none, graphed=False):
    """An ordinary training loop on a module (``make_graphed_callables`` on tpu when ``graphed``):
    a new batch each step, the loss read every step."""
    model = _deep_mlp(device)
    opt = make_opt(model.parameters())
    if graphed:
        sample = torch.zeros(6, 12, device=device, requires_grad=input_grad)
        model = torch.tpu.make_graphed_callables(model, (sample,), num_warmup_iters=2)
    losses, input_grads = [], []
    for x, y in data:
        x = x.detach().to(device).requires_grad_(input_grad)
        loss = F.mse_loss(model(x), y.to(device))
        opt.zero_grad(set_to_none=set_to_none)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if input_grad:
            input_grads.append(x.grad.cpu())
    return losses, input_grads, [_cpu(p) for p in model.parameters()]


@pytest.mark.parametrize("set_to_none", [False, True], ids=["zero_grad_keeps", "zero_grad_none"])
@pytest.mark.parametrize("input_grad", [False, True], ids=["input", "input_requires_grad"])
@pytest.mark.parametrize("optimizer", list(_OPTIMIZERS))
def test_make_graphed_callables_trains_like_cpu_over_20_steps(optimizer, input_grad, set_to_none):
    # A graphed module's replayed backward once returned views of its static gradients: autograd
    # kept one as ``param.grad``, the next replay wrote into it, and zero_grad(set_to_none=False)
    # loops added every gradient twice from the second step on.
    data = _data(20)
    expected = _train_graphed("cpu", data, _OPTIMIZERS[optimizer], input_grad, set_to_none)
    got = _train_graphed("tpu", data, _OPTIMIZERS[optimizer], input_grad, set_to_none, graphed=True)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(got[1] + got[2], expected[1] + expected[2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


class _WithLoss(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        return F.mse_loss(self.model(x), y)


@pytest.mark.parametrize("how", ["one_module", "chained_callables"])
def test_a_module_graphed_with_its_loss_trains_like_cpu(how):
    data = _data(20)

    def train(device, graphed):
        model = _deep_mlp(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        xs, ys = torch.zeros(6, 12, device=device), torch.zeros(6, 3, device=device)
        if not graphed:
            step = _WithLoss(model)
        elif how == "one_module":
            step = torch.tpu.make_graphed_callables(_WithLoss(model), (xs, ys))
        else:  # as torch.cuda's docs chain them: the loss's sample input requires grad
            net, loss_fn = torch.tpu.make_graphed_callables(
                (model, lambda out, y: F.mse_loss(out, y)),
                ((xs,), (torch.zeros(6, 3, device=device, requires_grad=True), ys)))
            step = lambda x, y: loss_fn(net(x), y)  # noqa: E731
        losses = []
        for x, y in data:
            loss = step(x.to(device), y.to(device))
            opt.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, [_cpu(p) for p in model.parameters()]

    expected, got = train("cpu", False), train("tpu", True)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(got[1], expected[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_graphed_outputs_and_gradients_are_not_overwritten_by_the_next_replay():
    model = torch.tpu.make_graphed_callables(_mlp("tpu"), (torch.zeros(6, 12, device="tpu"),))
    x1, x2 = torch.randn(6, 12, device="tpu"), torch.randn(6, 12, device="tpu")
    out1 = model(x1)
    kept = out1.detach().cpu()
    out1.sum().backward()
    grad1 = model[0].weight.grad.cpu()
    held = model[0].weight.grad
    model.zero_grad(set_to_none=True)
    model(x2).sum().backward()
    torch.testing.assert_close(out1.detach().cpu(), kept)  # the first call's output, as it was
    torch.testing.assert_close(held.cpu(), grad1)  # the first backward's gradient, as it was
    assert not torch.equal(model[0].weight.grad.cpu(), grad1)


def test_graphed_function_gradients_match_autograd():
    w = torch.randn(5, 5, device="tpu", requires_grad=True)

    def fn(x):
        return torch.tanh(x @ w).sum(dim=1)

    graphed = torch.tpu.make_graphed_callables(fn, (torch.randn(3, 5, device="tpu", requires_grad=True),),
                                              num_warmup_iters=1)
    x = torch.randn(3, 5, requires_grad=True)
    out = graphed(x.detach().to("tpu").requires_grad_())
    assert out.shape == (3,)
    (wc := w.detach().cpu().requires_grad_())
    expected = torch.tanh(x @ wc).sum(dim=1)
    torch.testing.assert_close(_cpu(out), expected.detach(), rtol=1e-5, atol=1e-6)


def test_a_compiled_function_in_a_captured_region_is_refused():
    fn = torch.compile(lambda t: t * 2 + 1, backend="tpu")
    x = torch.randn(4, device="tpu")
    fn(x)
    with pytest.raises(CaptureError, match="torch.compile"):
        with torch.tpu.graph(torch.tpu.TPUGraph()):
            fn(x)
