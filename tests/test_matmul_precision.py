"""torch.set_float32_matmul_precision drives XLA's precision of fp32 dots and convolutions on tpu,
in eager, fused and compiled programs, and a change of setting recompiles only programs with dots.

XLA:CPU computes fp32 whatever the precision, so these tests read the programs themselves: every
program JAX lowers is dumped (``jax_dump_ir_to``) and its dots' and convolutions' precision
configs are checked. Shapes are unique to each test, so each program is compiled (and dumped)
for the first time in it.
"""

from __future__ import annotations

import os
import re
import threading

import jax
import pytest
import torch
import torch.nn.functional as F
from jax import lax

from torchtpu.ops import precision

EXPECTED = {"highest": "HIGHEST", "high": "HIGH", "medium": "DEFAULT"}
# one match per dot (``precision = [HIGH, HIGH]``) or convolution (``precision_config = [#stablehlo<...>, ...]``)
_PRECISION = re.compile(r"precision(?: = \[|_config = \[#stablehlo<precision )(HIGHEST|HIGH|DEFAULT)\b")


class Dumps:
    """The programs JAX lowers from now on: name → list of their dots' precisions, per program."""

    def __init__(self, path: str):
        self.path = path
        self.seen: set[str] = set()

    def new(self) -> list[tuple[str, list[str]]]:
        """(program name, precisions of its dots and convolutions) of each program lowered since
        the last call, in order."""
        found = []
        for name in sorted(os.listdir(self.path)):
            if name in self.seen or not name.endswith(".mlir"):
                continue
            self.seen.add(name)
            with open(os.path.join(self.path, name)) as f:
                found.append((name, _PRECISION.findall(f.read())))
        return found

    def named(self, part: str) -> list[list[str]]:
        """The precisions of each new program whose name contains ``part``."""
        return [p for name, p in self.new() if part in name]


@pytest.fixture
def dumps(tmp_path):
    previous = jax.config.read("jax_dump_ir_to")
    jax.config.update("jax_dump_ir_to", str(tmp_path))
    try:
        yield Dumps(str(tmp_path))
    finally:
        jax.config.update("jax_dump_ir_to", previous)


@pytest.fixture(autouse=True)
def restore_setting():
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


def tpu(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype).to("tpu")


def test_default_is_pytorchs_highest():
    assert torch.get_float32_matmul_precision() == "highest"
    assert precision.setting() == "highest"
    assert precision.matmul_precision() == lax.Precision.HIGHEST


def test_the_mapping():
    assert precision.PRECISIONS == {"highest": lax.Precision.HIGHEST, "high": lax.Precision.HIGH,
                                    "medium": lax.Precision.DEFAULT}


# Each case: (program name part, a call on fresh shapes of its own); the seed keeps shapes unique.
def _cases(seed: int):
    n = 10 + seed
    return [
        ("aten_mm", lambda: tpu(n, 3) @ tpu(3, 5)),
        ("aten_bmm", lambda: torch.bmm(tpu(2, n, 3), tpu(2, 3, 4))),
        ("aten_addmm", lambda: F.linear(tpu(n, 6), tpu(7, 6), tpu(7))),
        ("aten_baddbmm", lambda: torch.baddbmm(tpu(2, n, 4), tpu(2, n, 3), tpu(2, 3, 4))),
        ("aten_convolution", lambda: F.conv2d(tpu(1, 2, n, n), tpu(3, 2, 3, 3))),
        ("aten_mv", lambda: torch.mv(tpu(n, 4), tpu(4))),
    ]


@pytest.mark.parametrize("seed, setting", [(0, "highest"), (1, "high"), (2, "medium")])
def test_eager_ops_use_the_global_setting(dumps, seed, setting):
    torch.set_float32_matmul_precision(setting)
    for part, call in _cases(seed):
        call().cpu()
        programs = dumps.named(part)
        assert programs, f"{part}: no program compiled"
        assert set(programs[-1]) == {EXPECTED[setting]}, (part, programs)


def test_the_block_setting_and_its_scope(dumps):
    a, b = tpu(21, 4), tpu(4, 6)
    with torch.tpu.matmul_precision("high"):
        assert precision.setting() == "high"
        assert torch.get_float32_matmul_precision() == "highest"  # torch's global is left alone
        (a @ b).cpu()
        assert dumps.named("aten_mm") == [["HIGH"]]
        with torch.tpu.matmul_precision("medium"):  # nested: the inner block wins
            (a @ b).cpu()
            assert dumps.named("aten_mm") == [["DEFAULT"]]
        (a @ b).cpu()  # back to the outer block's: compiled already
        assert dumps.named("aten_mm") == []
    assert precision.setting() == "highest"
    (a @ b).cpu()  # and outside: the first program again
    assert dumps.named("aten_mm") == [["HIGHEST"]]
    with pytest.raises(RuntimeError, match="Invalid precision 'fast'"):
        with torch.tpu.matmul_precision("fast"):
            pass


def test_the_block_is_per_thread():
    seen = {}
    with torch.tpu.matmul_precision("medium"):
        thread = threading.Thread(target=lambda: seen.setdefault("other", precision.setting()))
        thread.start()
        thread.join()
        seen["here"] = precision.setting()
    assert seen == {"other": "highest", "here": "medium"}


def test_a_change_recompiles_only_the_ops_with_dots(dumps):
    a, b = tpu(22, 5), tpu(5, 22)
    for setting in ("highest", "high"):
        torch.set_float32_matmul_precision(setting)
        (a @ b).cpu(), torch.relu(a).cpu(), (a + 1).cpu()
    names = [name for name, _ in dumps.new()]
    count = {op: sum(op in n for n in names) for op in ("aten_mm", "aten_relu", "aten_add")}
    assert count == {"aten_mm": 2, "aten_relu": 1, "aten_add": 1}, names  # mm once per setting
    torch.set_float32_matmul_precision("highest")
    (a @ b).cpu()  # the first setting's program is still cached
    assert dumps.new() == []


def test_backward_follows_the_block_it_was_called_in(dumps):
    """Autograd runs a tpu backward pass on its own device thread: it still sees the caller's block."""
    w = tpu(7, 23).requires_grad_()
    x = tpu(23, 9)
    seen = []
    w.register_hook(lambda g: seen.append(precision.setting()))
    with torch.tpu.matmul_precision("medium"):
        (w @ x).sum().backward()
    assert seen == ["medium"]
    programs = dumps.named("aten_mm")
    assert len(programs) == 2 and all(set(p) == {"DEFAULT"} for p in programs), programs  # forward, grad of w


def test_fused_programs_keep_the_setting_each_op_was_recorded_with(dumps):
    a, b = tpu(24, 3), tpu(3, 24)
    with torch.tpu.set_eager_mode("defer_and_fuse"):
        with torch.tpu.matmul_precision("high"):
            y = torch.relu(a @ b)
        z = (y @ a).cpu()  # recorded outside the block, and run after it
    assert z.shape == (24, 3)
    programs = dumps.named("program")
    assert len(programs) == 1
    assert sorted(programs[0]) == ["HIGH", "HIGHEST"]


def test_compiled_graphs_follow_the_setting_and_cache_per_setting(dumps):
    from torchtpu.compile import cache

    fn = torch.compile(lambda x, w: torch.relu(x @ w) + 1, backend="tpu")
    x, w = tpu(25, 4), tpu(4, 2)
    got = {}
    for setting in ("highest", "high", "medium"):
        with torch.tpu.matmul_precision(setting):
            fn(x, w).cpu()
        got[setting] = dumps.named("torchtpu_")
    assert got == {"highest": [["HIGHEST"]], "high": [["HIGH"]],
                   "medium": [["DEFAULT"]]}
    before = cache.cache_stats()
    for setting in ("highest", "high", "medium"):
        with torch.tpu.matmul_precision(setting):
            fn(x, w).cpu()
    after = cache.cache_stats()
    assert after["misses"] == before["misses"] and after["hits"] - before["hits"] == 3
    assert dumps.new() == []
    # torch's global setting too (dynamo guards it itself and retraces, as it does on CUDA)
    torch.set_float32_matmul_precision("medium")
    fn(x, w).cpu()
    assert dumps.named("torchtpu_") == [["DEFAULT"]]


def test_compiled_graphs_without_dots_ignore_the_setting():
    from torchtpu.compile import cache

    fn = torch.compile(lambda x: torch.tanh(x) * 2, backend="tpu")
    x = tpu(26, 3)
    fn(x).cpu()
    before = cache.cache_stats()
    with torch.tpu.matmul_precision("medium"):
        fn(x).cpu()
    after = cache.cache_stats()
    assert after["misses"] == before["misses"] and after["hits"] == before["hits"] + 1


def test_compiled_training_step_forward_and_backward(dumps):
    model = torch.nn.Sequential(torch.nn.Linear(27, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).to("tpu")
    step = torch.compile(lambda x: model(x).square().sum(), backend="tpu")
    with torch.tpu.matmul_precision("high"):
        step(tpu(5, 27)).backward()
    programs = [p for name, p in dumps.new() if "torchtpu_" in name]
    assert len(programs) == 2  # forward and backward graphs
    assert all(p and set(p) == {"HIGH"} for p in programs), programs


def test_a_lowering_with_dots_must_say_so():
    with precision.tracing(None, "the lowering of aten::my_op"):
        with pytest.raises(RuntimeError, match=r"the lowering of aten::my_op asks .* dots=True"):
            precision.matmul_precision()
    with precision.tracing("medium"):
        assert precision.matmul_precision() == lax.Precision.DEFAULT
    assert precision.matmul_precision() == lax.Precision.HIGHEST  # outside a program: the setting


def test_an_eager_kernel_of_an_unmarked_lowering_raises():
    """The guard is wired into the eager executor: a lowering with dots but without dots=True."""
    import dataclasses

    from torchtpu.eager import dispatch
    from torchtpu.ops import registry

    unmarked = dataclasses.replace(registry.LOWERINGS[torch.ops.aten.mm.default], dots=False)
    kernel = dispatch.Kernel(unmarked)
    with pytest.raises(RuntimeError, match=r"the lowering of aten.mm.default asks .* dots=True"):
        kernel(tpu(28, 2), tpu(2, 3))


# ---------------------------------------------------------------- attention and the fused loss
# SDPA's fused op, flex_attention's HOPs and F.linear_cross_entropy's chunked op compute their
# own dots (not through mm): they follow the setting too, eager and compiled, forward and backward.

TOLERANCE = {"highest": dict(rtol=1e-5, atol=1e-5), "medium": dict(rtol=1e-2, atol=1e-2)}  # bf16: 8 bits


def _score_mod(s, b, h, i, j):
    return s - (i - j).abs() * 0.1


def _llm_kernels(q, k, v, x, w, t):
    """SDPA, flex_attention and the chunked linear cross-entropy: (their outputs, a loss of all)."""
    from torch.nn import LinearCrossEntropyOptions
    from torch.nn.attention.flex_attention import flex_attention

    # compiled, each kernel is a graph of its own: each must carry the setting in its key
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch._dynamo.graph_break()
    flex = flex_attention(q, k, v, score_mod=_score_mod)
    torch._dynamo.graph_break()
    outs = (sdpa, flex, F.linear_cross_entropy(x, w, t, options=LinearCrossEntropyOptions()))
    return outs, sum(o.sum() for o in outs)


def _llm_inputs(seed: int) -> list[torch.Tensor]:
    """CPU inputs of ``_llm_kernels`` on shapes of their own (``seed``)."""
    gen = torch.Generator().manual_seed(seed)
    n = 29 + seed
    return [*(torch.randn(1, 2, n, 8, generator=gen) for _ in range(3)), torch.randn(n, 6, generator=gen),
            torch.randn(11, 6, generator=gen), torch.randint(0, 11, (n,), generator=gen)]


def _run_llm(fn, inputs, device: str, setting: str = "highest", grads: bool = True):
    """``fn``'s outputs (and the gradients of its float inputs) on ``device`` at ``setting``."""
    leaves = [x.detach().to(device).requires_grad_(grads and x.is_floating_point()) for x in inputs]
    with torch.tpu.matmul_precision(setting):
        outs, loss = fn(*leaves)
        if grads:
            loss.backward()
    return [o.detach().cpu() for o in outs] + [x.grad.cpu() for x in leaves if x.grad is not None]


def _precisions(dumps, parts: list[str]) -> list[list[str]]:
    """For each name part, the precisions of the dots of the programs compiled since the last call."""
    new = dumps.new()
    return [sorted({p for name, ps in new if part in name for p in ps}) for part in parts]


def _check_llm_kernels(dumps, fn, inputs, parts):
    """At each setting: results match the CPU's (the looser tolerance under "medium"; gradients:
    the "highest" ones, as CPU flex_attention has no backward); the programs' dots have its
    precision; a change of setting compiles them again, a return to one does not."""
    cpu_outs = _run_llm(_llm_kernels, inputs, "cpu", grads=False)
    reference = _run_llm(fn, inputs, "tpu")
    for got, expected in zip(reference, cpu_outs):
        torch.testing.assert_close(got, expected, **TOLERANCE["highest"])
    assert _precisions(dumps, parts) == [["HIGHEST"]] * len(parts)
    medium = _run_llm(fn, inputs, "tpu", "medium")
    for got, expected in zip(medium, cpu_outs + reference[3:], strict=True):
        torch.testing.assert_close(got, expected, **TOLERANCE["medium"])
    assert _precisions(dumps, parts) == [["DEFAULT"]] * len(parts)
    _run_llm(fn, inputs, "tpu")
    assert _precisions(dumps, parts) == [[]] * len(parts)


@pytest.mark.usefixtures("no_fallback")
def test_llm_kernels_follow_the_setting_eager(dumps):
    parts = ["fused_attention_overrideable_default", "fused_attention_overrideable_backward",
             "flex_attention_forward", "flex_attention_backward", "linear_cross_entropy_batch_chunked"]
    _check_llm_kernels(dumps, _llm_kernels, _llm_inputs(0), parts)


@pytest.mark.slow  # six graphs traced and compiled twice: 20 s on the loaded 2-core machine
@pytest.mark.usefixtures("no_fallback")
def test_llm_kernels_follow_the_setting_compiled(dumps):
    fn = torch.compile(_llm_kernels, backend="tpu")
    _check_llm_kernels(dumps, fn, _llm_inputs(1), ["torchtpu_"])  # three forward and three backward graphs


def test_low_precision_attention_is_unaffected(dumps):
    """bf16 inputs compute in fp32 inside the kernel, at HIGHEST whatever the setting (as a bf16 mm)."""
    q = tpu(1, 2, 35, 8, dtype=torch.bfloat16)
    with torch.tpu.matmul_precision("medium"):
        F.scaled_dot_product_attention(q, q, q).cpu()
    assert dumps.named("fused_attention_overrideable") == [["HIGHEST", "HIGHEST"]]
