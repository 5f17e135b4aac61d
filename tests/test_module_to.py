"""``Module.to("tpu")`` moves each Parameter in place, as on CUDA: tied weights stay tied, an
optimizer built before the move trains the moved model, and state dicts load either way."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 11, dim: int = 8):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.emb(tokens))))


def _model() -> TiedLM:
    torch.manual_seed(0)
    return TiedLM()


@pytest.mark.parametrize("move", [lambda m: m.to("tpu"), lambda m: m.tpu(), lambda m: m.to(device="tpu:0"),
                                  lambda m: m.to("tpu").to(torch.float64), lambda m: m.to("tpu", torch.float64)],
                         ids=["to", "tpu", "to_device_kw", "to_then_dtype", "to_device_and_dtype"])
def test_parameters_move_in_place(move):
    model = _model()
    before = {name: p for name, p in model.named_parameters()}
    moved = move(model)
    assert moved is model
    assert model.head.weight is model.emb.weight  # still tied
    assert len(list(model.parameters())) == 3  # emb/head shared, mix.weight, mix.bias
    for name, p in model.named_parameters():
        assert p is before[name], name  # the same Parameter objects, now on tpu
        assert p.device.type == "tpu" and isinstance(p, nn.Parameter) and p.requires_grad


def test_back_to_cpu_keeps_the_objects():
    model = _model()
    weight = model.emb.weight
    model.to("tpu").cpu()
    assert model.emb.weight is weight and model.head.weight is weight and weight.device.type == "cpu"


def test_grad_moves_with_the_parameter():
    model = _model()
    model(torch.tensor([1, 2])).sum().backward()
    grad = model.mix.weight.grad.clone()
    model.to("tpu")
    assert model.mix.weight.grad.device.type == "tpu"
    torch.testing.assert_close(model.mix.weight.grad.cpu(), grad)


def _train(model, opt, device, steps=5):
    tokens = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], device=device)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.AdamW])
def test_optimizer_built_before_to_trains_the_moved_model(opt_cls):
    cpu_model = _model()
    cpu_losses = _train(cpu_model, opt_cls(cpu_model.parameters(), lr=0.1), "cpu")

    model = _model()
    opt = opt_cls(model.parameters(), lr=0.1)  # before the move, as many scripts do
    model.to("tpu")
    losses = _train(model, opt, "tpu")
    assert losses[-1] < losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(cpu_losses), rtol=1e-4, atol=1e-5)
    for p in opt.param_groups[0]["params"]:
        assert p.device.type == "tpu"
    torch.testing.assert_close(model.emb.weight.detach().cpu(), cpu_model.emb.weight.detach(), rtol=1e-4,
                               atol=1e-5)


@pytest.mark.parametrize("assign", [False, True])
def test_load_state_dict_into_tpu_model(assign, tmp_path):
    source = _model()
    source.mix.weight.data.add_(1.0)
    torch.save(source.state_dict(), tmp_path / "ckpt.pt")
    state = torch.load(tmp_path / "ckpt.pt", map_location="tpu" if assign else "cpu")

    model = TiedLM().to("tpu")
    model.load_state_dict(state, assign=assign)
    reference = TiedLM()
    reference.load_state_dict(torch.load(tmp_path / "ckpt.pt"), assign=assign)
    # tying survives loading exactly as on the CPU (assign=True replaces each Parameter there too)
    assert (model.head.weight is model.emb.weight) == (reference.head.weight is reference.emb.weight)
    for name, p in model.named_parameters():
        assert p.device.type == "tpu" and isinstance(p, nn.Parameter), name
        torch.testing.assert_close(p.detach().cpu(), source.state_dict()[name])
    out = model(torch.tensor([1, 2], device="tpu"))
    torch.testing.assert_close(out.detach().cpu(), source(torch.tensor([1, 2])).detach(), rtol=1e-5, atol=1e-5)


def test_tied_checkpoint_holds_one_matrix(tmp_path):
    model = _model().to("tpu")
    with torch.no_grad():
        model.emb.weight.mul_(2.0)
    state = model.state_dict()
    assert state["emb.weight"].untyped_storage().data_ptr() == state["head.weight"].untyped_storage().data_ptr()
    torch.save(state, tmp_path / "tied.pt")
    loaded = torch.load(tmp_path / "tied.pt", map_location="cpu")
    torch.testing.assert_close(loaded["emb.weight"], loaded["head.weight"])


def test_shallow_copy_compatibility_matches_dense_backends():
    cpu, tpu = torch.zeros(2), torch.zeros(2, device="tpu")
    assert torch._has_compatible_shallow_copy_type(cpu, tpu)
    assert torch._has_compatible_shallow_copy_type(tpu, cpu)
    assert not torch._has_compatible_shallow_copy_type(torch.zeros(2, device="meta"), tpu)
