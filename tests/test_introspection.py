"""torch.tpu.compiler.hlo / cost_analysis / explain: the XLA programs of a function and why it split."""

import contextlib
import inspect
import os

import pytest
import torch

from torchtpu.compile import introspect
from torchtpu.config import config

compiler = torch.tpu.compiler


def affine(x, w):
    return x @ w + 1


def with_break(x):
    y = x.sin()
    torch._dynamo.graph_break()
    return y * 2


def with_print(x):
    y = x.cos()
    print("introspection test: graph break here")
    return y + 1


def scale(x, n):
    return x * n


def _inputs(*shapes):
    return [torch.linspace(-1, 1, int(torch.tensor(s).prod())).reshape(s).to("tpu") for s in shapes]


def test_hlo_stablehlo_has_the_ops():
    text = compiler.hlo(affine, *_inputs((4, 8), (8, 3)))
    assert "graph 1 of 1" in text
    assert "stablehlo.dot_general" in text and "stablehlo.add" in text
    assert "tensor<4x8xf32>" in text and "tensor<4x3xf32>" in text


def test_hlo_optimized_is_xla_hlo():
    text = compiler.hlo(affine, *_inputs((4, 8), (8, 3)), stage="optimized")
    assert "HloModule" in text and "ENTRY" in text


def test_hlo_bad_stage_and_no_program():
    with pytest.raises(ValueError, match="stage"):
        compiler.hlo(affine, *_inputs((4, 8), (8, 3)), stage="llvm")
    with pytest.raises(RuntimeError, match="no XLA program"):
        compiler.hlo(lambda n: n + 1, 3)


def test_hlo_returns_every_graph_of_a_graph_break():
    text = compiler.hlo(with_break, *_inputs((5,)))
    assert "graph 1 of 2" in text and "graph 2 of 2" in text
    assert "stablehlo.sine" in text and "stablehlo.multiply" in text


def test_hlo_includes_the_backward_graph():
    x, w = _inputs((4, 8), (8, 3))
    w.requires_grad_(True)
    text = compiler.hlo(affine, x, w)
    assert "(forward)" in text and "(backward)" in text
    assert w.grad is None  # the backward ran without accumulating into the user's tensors


def test_hlo_of_a_module():
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 3).to("tpu")
    text = compiler.hlo(layer, *_inputs((2, 8)))
    assert "stablehlo.dot_general" in text and "(forward)" in text


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.GELU(),
                               torch.nn.Linear(16, 3)).to("tpu")


def _train_step(model):
    def step(x):  # a training step as users write it: backward inside
        loss = model(x).square().mean()
        loss.backward()
        return loss.detach()
    return step


# A model's parameters reached through a closure once left the backward graph uncompiled, and
# hlo, explain and cost_analysis failed on a missing dump of it.
@pytest.mark.parametrize("case", ["closure_forward", "training_step", "eval_no_grad"])
def test_introspection_of_a_model_with_parameters(case):
    model = _mlp()
    x, = _inputs((4, 8))
    if case == "closure_forward":
        fn = lambda t: model(t).sum()  # noqa: E731
        kinds = ["forward", "backward"]
    elif case == "training_step":
        fn = _train_step(model)
        # dynamo breaks the graph at backward(); what follows it is a graph of its own
        kinds = ["forward", "backward", "inference"]
    else:
        model.eval()
        fn = lambda t: model(t).sum()  # noqa: E731
        kinds = ["inference"]
    before = [p.grad for p in model.parameters()]
    context = torch.no_grad() if case == "eval_no_grad" else contextlib.nullcontext()
    with context:
        text = compiler.hlo(fn, x)
        optimized = compiler.hlo(fn, x, stage="optimized")
        costs = compiler.cost_analysis(fn, x)
        explanation = compiler.explain(fn, x)
    for i, kind in enumerate(kinds, 1):
        assert f"graph {i} of {len(kinds)}: torchtpu_{kind}_" in text and f"({kind})" in text
        assert f"({kind})" in optimized
    assert "stablehlo.dot_general" in text
    assert [c["kind"] for c in costs] == kinds
    assert all(c["flops"] > 0 for c in costs[:2])
    breaks = 1 if case == "training_step" else 0
    assert explanation.graph_count == 1 + breaks and len(explanation.graph_breaks) == breaks
    assert [p.split("_")[1] for p in explanation.programs] == kinds
    if case == "closure_forward":
        assert [p.grad for p in model.parameters()] == before  # gradients returned, not accumulated


def test_hlo_leaves_the_users_compiled_function_alone():
    x, w = _inputs((4, 8), (8, 3))
    compiled = torch.compile(affine, backend="tpu")
    expected = affine(x.cpu(), w.cpu())
    torch.testing.assert_close(compiled(x, w).cpu(), expected)
    reasons = compiler.recompile_reasons()
    compiler.hlo(compiled, x, w)  # accepts the torch.compile result, compiles a fresh copy
    misses = compiler.cache_stats()["misses"]
    torch.testing.assert_close(compiled(x, w).cpu(), expected)
    assert compiler.cache_stats()["misses"] == misses  # the user's executable was reused
    assert compiler.recompile_reasons() == reasons


def test_dump_dir_writes_stablehlo(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "dump_dir", str(tmp_path))
    x, w = _inputs((3, 8), (8, 2))
    out = torch.compile(lambda a, b: (a @ b).relu(), backend="tpu")(x, w)
    torch.testing.assert_close(out.cpu(), (x.cpu() @ w.cpu()).relu())
    files = [f for f in os.listdir(tmp_path) if f.endswith(".stablehlo.mlir")]
    assert files
    assert any("stablehlo.dot_general" in (tmp_path / f).read_text() for f in files)
    text = compiler.hlo(affine, x, w)  # hlo uses the user's dump dir, and it keeps being set
    assert config.dump_dir == str(tmp_path) and "stablehlo.dot_general" in text


def test_cost_analysis_counts_matmul_flops():
    costs = compiler.cost_analysis(torch.matmul, *_inputs((64, 128), (128, 32)))
    assert len(costs) == 1
    cost = costs[0]
    assert cost["graph"].startswith("torchtpu_inference_") and cost["kind"] == "inference"
    assert cost["inputs"] == "float32[64,128], float32[128,32]"
    expected = 2 * 64 * 128 * 32
    assert abs(cost["flops"] - expected) <= 0.1 * expected
    assert cost["bytes accessed"] >= 4 * (64 * 128 + 128 * 32 + 64 * 32)


def test_explain_reports_a_graph_break_in_plain_words():
    report = compiler.explain(with_print, *_inputs((6,)))
    assert report.graph_count == 2 and len(report.programs) == 2
    assert len(report.graph_breaks) == 1
    line = inspect.getsourcelines(with_print)[1] + 2  # the print() line
    sentence = report.graph_breaks[0]
    assert f"{__file__}:{line} in with_print" in sentence and "print" in sentence
    text = str(report)
    assert "2 graphs (1 graph break)" in text and sentence in text


def test_explain_reports_recompilations():
    compiler.clear_recompile_reasons()
    compiled = torch.compile(scale, backend="tpu")
    for shape in [(4, 8), (5, 8)]:
        (x,) = _inputs(shape)
        torch.testing.assert_close(compiled(x, 2).cpu(), x.cpu() * 2)
    report = compiler.explain(scale, x, 2)
    assert report.graph_count == 1 and report.graph_breaks == []
    assert len(report.recompilations) == 1
    sentence = report.recompilations[0]
    assert sentence.startswith("recompiled `scale` (") and __file__ in sentence
    assert "dimension 0 of tensor `x` changed from 4 to 5" in sentence
    assert sentence in str(report)
    compiler.clear_recompile_reasons()


@pytest.mark.parametrize("guard, sentence", [
    ("0/0: tensor 'x' size mismatch at index 1. expected 8, actual 5",
     "dimension 1 of tensor `x` changed from 8 to 5"),
    ("0/1: tensor 'x' dtype mismatch. expected Float, actual Double",
     "the dtype of tensor `x` changed from Float to Double"),
    ("0/3: tensor 'x' requires_grad mismatch. expected requires_grad=0", "tensor `x` now requires grad"),
    ("0/2: n == 2                      # return x * n  # t.py:4 in f\nUser stack trace:", "`n` is no longer 2"),
    ("0/0: L['self'].training == True  # x", "`self.training` is no longer True"),
    ("0/0: ___check_obj_id(L['m'], 1234)  # m(x)", "the guard `___check_obj_id(L['m'], 1234)` failed"),
])
def test_guard_sentences(guard, sentence):
    assert introspect._guard_sentence(guard) == sentence


def test_recompile_groups_one_per_recompilation():
    entries = [{"function": "f (a.py:1)", "reason": r} for r in
               ["0/0: first", "0/1: second", "0/0: second-old", "0/2: third", "0/1: x", "0/0: y"]]
    assert introspect._recompile_groups(entries) == [
        ("f (a.py:1)", "0/0: first"), ("f (a.py:1)", "0/1: second"), ("f (a.py:1)", "0/2: third")]
