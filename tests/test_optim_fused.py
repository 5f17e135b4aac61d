"""Fused optimizers (``fused=True``) on tpu: the same steps as PyTorch's fused CPU kernels, on the
device (the CPU fallback is off), including grad scaling and a skipped step after an overflow."""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.usefixtures("no_fallback")

CASES = [
    (torch.optim.Adam, dict(lr=1e-2)),
    (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True)),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.AdamW, dict(lr=torch.tensor(1e-2), weight_decay=0.1, amsgrad=True)),
    (torch.optim.SGD, dict(lr=0.1)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, maximize=True)),
]


def _train(device: str, opt_cls, kwargs, dtype=torch.float32, steps=4):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).to(dtype)
    data = torch.randn(8, 6).to(dtype)
    model.to(device)
    kwargs = {k: (v.to(device) if isinstance(v, torch.Tensor) and device != "cpu" and k != "lr" else v)
              for k, v in kwargs.items()}
    opt = opt_cls(model.parameters(), fused=True, **kwargs)
    for _ in range(steps):
        opt.zero_grad()
        model(data.to(device)).square().mean().backward()
        opt.step()
    state = [{k: v.cpu() for k, v in s.items() if isinstance(v, torch.Tensor)} for s in opt.state.values()]
    return [p.detach().cpu() for p in model.parameters()], state


@pytest.mark.parametrize("opt_cls,kwargs", CASES, ids=lambda c: getattr(c, "__name__", None) or
                         ",".join(f"{k}={v}" for k, v in c.items() if k != "lr") or "plain")
def test_fused_step_matches_cpu_fused(opt_cls, kwargs):
    want_params, want_state = _train("cpu", opt_cls, copy.deepcopy(kwargs))
    got_params, got_state = _train("tpu", opt_cls, copy.deepcopy(kwargs))
    for got, want in zip(got_params, want_params):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for got, want in zip(got_state, want_state):
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_bfloat16_parameters_compute_in_float32():
    want, _ = _train("cpu", torch.optim.AdamW, dict(lr=1e-2), dtype=torch.bfloat16)
    got, _ = _train("tpu", torch.optim.AdamW, dict(lr=1e-2), dtype=torch.bfloat16)
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g, w, rtol=1.6e-2, atol=1e-5)  # one bf16 ulp


@pytest.mark.parametrize("op", [torch._fused_adamw_, torch._fused_sgd_])
@pytest.mark.parametrize("found", [0.0, 1.0])
def test_grad_scale_unscales_grads_and_found_inf_skips_the_step(op, found):
    def run(device):
        torch.manual_seed(1)
        p, g, s1, s2 = (torch.randn(4, 3) for _ in range(4))
        p, g, s1, s2 = (t.to(device) for t in (p, g, s1, s2.abs()))  # exp_avg_sq is never negative
        scale = torch.tensor(4.0, device=device)
        inf = torch.tensor(found, device=device)
        if op is torch._fused_adamw_:
            op([p], [g], [s1], [s2], [], [torch.tensor(3.0, device=device)], lr=0.1, beta1=0.9, beta2=0.99,
               weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False, grad_scale=scale, found_inf=inf)
        else:
            op([p], [g], [s1], weight_decay=0.01, momentum=0.9, lr=0.1, dampening=0.0, nesterov=False,
               maximize=False, is_first_step=False, grad_scale=scale, found_inf=inf)
        return [t.cpu() for t in (p, g, s1, s2)]

    for got, want in zip(run("tpu"), run("cpu")):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_scheduled_learning_rate_is_a_value_not_a_new_program():
    from torchtpu import metrics

    def run(device):
        torch.manual_seed(2)
        model = torch.nn.Linear(4, 3).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (step + 1))
        x = torch.randn(5, 4).to(device)
        for step in range(5):
            if step == 2:
                metrics.reset()
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
            sched.step()
        return [p.detach().cpu() for p in model.parameters()]

    want = run("cpu")
    got = run("tpu")
    built = metrics.snapshot()["eager_compiles"]
    assert built["compilations"] + built["persistent_hits"] == 0, built  # steps 3-5: three new lr values
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
