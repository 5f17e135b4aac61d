"""Warm start (compile/warm.py): aot_autograd's graphs reused from PyTorch's AOTAutograd cache.

In one process: ``torch._dynamo.reset()`` makes dynamo trace again, and aot_autograd then finds
the entry the first compilation wrote, as a new process would (tests/test_compile_cache.py checks
a second process; the slow test here checks PyTorch's Dynamo cache across processes).
"""

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from cache_dirs import fresh_cache_dir
from torchtpu.compile import warm
from torchtpu.config import _warm_start, config

compiler = torch.tpu.compiler


@pytest.fixture
def aot_cache(tmp_path, monkeypatch):
    """A fresh AOTAutograd cache directory (PyTorch reads the variable at every lookup)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(config, "warm_start", "aot")
    torch._dynamo.reset()
    yield tmp_path / "aotautograd"
    torch._dynamo.reset()


def _delta(before: dict) -> dict:
    after = compiler.cache_stats()
    return {k: after[k] - before[k] for k in after if k.startswith("warm_")}


def _compiled(fn, *args):
    torch._dynamo.reset()  # dynamo traces again, as in a new process
    before = compiler.cache_stats()
    out = torch.compile(fn, backend="tpu")(*args)
    return out, _delta(before)


def mlp(x, w):
    return torch.nn.functional.gelu(x @ w).softmax(-1)


def test_second_compilation_reuses_the_graph(aot_cache):
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    out1, first = _compiled(mlp, x.to("tpu"), w.to("tpu"))
    out2, second = _compiled(mlp, x.to("tpu"), w.to("tpu"))
    assert (first["warm_misses"], first["warm_writes"]) == (1, 1)
    assert (second["warm_hits"], second["warm_loads"], second["warm_misses"]) == (1, 1, 0)
    torch.testing.assert_close(out1.cpu(), mlp(x, w))
    torch.testing.assert_close(out2.cpu(), mlp(x, w))
    # another shape, or another graph, is another entry
    _, shape = _compiled(mlp, torch.randn(5, 8).to("tpu"), w.to("tpu"))
    _, graph = _compiled(lambda x, w: torch.tanh(x @ w), x.to("tpu"), w.to("tpu"))
    assert shape["warm_misses"] == 1 and shape["warm_hits"] == 0
    assert graph["warm_misses"] == 1 and graph["warm_hits"] == 0
    assert len(os.listdir(aot_cache)) == 3


def test_training_graph_reuses_forward_and_backward(aot_cache):
    def loss_fn(x, w):
        return (torch.tanh(x @ w) ** 2).mean()

    x, w = torch.randn(4, 8), torch.randn(8, 3)
    expected = w.clone().requires_grad_()
    loss_fn(x, expected).backward()
    for hits in (0, 1):
        wt = w.to("tpu").requires_grad_()
        loss, delta = _compiled(loss_fn, x.to("tpu"), wt)
        loss.backward()
        assert delta["warm_hits"] == hits
        torch.testing.assert_close(loss.cpu(), loss_fn(x, w))
        torch.testing.assert_close(wt.grad.cpu(), expected.grad)


def test_dynamic_shapes_entry_serves_other_sizes(aot_cache):
    def scaled(x, w):
        return torch.nn.functional.gelu(x @ w) * x.shape[0]

    w = torch.randn(8, 3)
    for n, hits in ((4, 0), (6, 1)):
        torch._dynamo.reset()
        x = torch.randn(n, 8)
        before = compiler.cache_stats()
        out = torch.compile(scaled, backend="tpu", dynamic=True)(x.to("tpu"), w.to("tpu"))
        assert _delta(before)["warm_hits"] == hits
        torch.testing.assert_close(out.cpu(), scaled(x, w))


def test_unreadable_entry_warns_and_traces_again(aot_cache):
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    _compiled(mlp, x.to("tpu"), w.to("tpu"))
    for root, _, files in os.walk(aot_cache):
        for name in files:
            with open(os.path.join(root, name), "wb") as f:
                f.write(b"\x00garbage\xff" * 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, delta = _compiled(mlp, x.to("tpu"), w.to("tpu"))
    torch.testing.assert_close(out.cpu(), mlp(x, w))
    assert delta["warm_errors"] == 1 and delta["warm_hits"] == 0 and delta["warm_misses"] == 1
    assert any("unreadable entry of the AOTAutograd cache" in str(c.message) for c in caught)


def test_entry_of_another_key_is_not_reused(aot_cache, monkeypatch):
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    _compiled(mlp, x.to("tpu"), w.to("tpu"))
    monkeypatch.setattr(warm, "_FORMAT", warm._FORMAT + 1)  # as another torchtpu would
    _, delta = _compiled(mlp, x.to("tpu"), w.to("tpu"))
    assert delta["warm_misses"] == 1 and delta["warm_hits"] == 0


def test_key_follows_options_and_decompositions():
    table = {torch.ops.aten.gelu.default: None}
    assert warm.key({}, table) == warm.key({}, dict(table))
    assert warm.key({}, table) != warm.key({"xla_cpu_enable_fast_math": True}, table)
    assert warm.key({}, table) != warm.key({}, {torch.ops.aten.silu.default: None})


def test_off_skips_the_cache(aot_cache, monkeypatch):
    monkeypatch.setattr(config, "warm_start", "off")
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    out, delta = _compiled(mlp, x.to("tpu"), w.to("tpu"))
    torch.testing.assert_close(out.cpu(), mlp(x, w))
    assert not any(delta.values())
    assert not aot_cache.exists()


def test_prune_keeps_the_newest_entries(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    root = tmp_path / "aotautograd"
    for i in range(5):
        (root / f"entry{i}").mkdir(parents=True)
        os.utime(root / f"entry{i}", (1000 + i, 1000 + i))
    assert warm.prune(2) == 3
    assert sorted(os.listdir(root)) == ["entry3", "entry4"]
    assert warm.prune(0) == 0


def test_setting_values():
    assert [_warm_start(v) for v in ("1", "aot", "on", "dynamo", "0", "off")] == \
        ["aot", "aot", "aot", "dynamo", "off", "off"]
    with pytest.raises(ValueError, match="aot"):
        _warm_start("sometimes")


# A child process for the Dynamo cache: compiles a small training step, prints stats and results.
DYNAMO_CHILD = textwrap.dedent("""
    import json
    import torch
    import torchtpu.compile as tpu_compile

    tpu_compile.install()

    def step(x, w):
        loss = (torch.tanh(x @ w) ** 2).mean()
        loss.backward()
        return loss.detach()

    x = torch.linspace(-1, 1, 32).reshape(4, 8)
    w = torch.linspace(0, 1, 24).reshape(8, 3).to("tpu").requires_grad_()
    loss = torch.compile(step, backend="tpu")(x.to("tpu"), w)
    print("RESULT" + json.dumps(dict(loss=loss.item(), grad=w.grad.cpu().tolist(), **tpu_compile.compiler.cache_stats())))
""")


@pytest.mark.slow
def test_dynamo_mode_reuses_dynamo_and_aot_work_across_processes(tmp_path):
    import json

    env = {**os.environ, "TORCHTPU_CACHE_DIR": str(fresh_cache_dir(tmp_path)), "TORCHTPU_PLATFORM": "cpu",
           "TORCHTPU_WARM_START": "dynamo", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "torch")}
    env.pop("TORCH_CACHING_PRECOMPILE", None)
    results = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", DYNAMO_CHILD], env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
        results.append(json.loads(line[len("RESULT"):]))
    first, second = results
    assert first["warm_writes"] >= 1 and first["warm_loads"] == 0
    assert second["warm_loads"] >= 1 and second["warm_misses"] == 0  # not even aot_autograd's lookup ran
    assert (second["loss"], second["grad"]) == (first["loss"], first["grad"])
    assert os.listdir(tmp_path / "torch" / "dynamo")
