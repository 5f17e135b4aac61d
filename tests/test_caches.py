"""Bounded caches: many distinct shapes leave every cache at its limit (LRU), with the dropped
entries counted in ``torchtpu.metrics``; an evicted entry is rebuilt when needed again."""

import contextlib
import io
import re

import pytest
import torch

from torchtpu import caches, metrics
from torchtpu.config import config
from torchtpu.eager import fused, register

aten = torch.ops.aten
FUSE = torch.tpu.EagerMode.DEFER_AND_FUSE


@contextlib.contextmanager
def _limits(**limits):
    saved = {name: getattr(config, name) for name in limits}
    for name, value in limits.items():
        setattr(config, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


def _evictions() -> dict:
    return metrics.snapshot()["cache_evictions"]


def _delta(before: dict, name: str) -> int:
    return _evictions().get(name, 0) - before.get(name, 0)


def test_lru_drops_the_least_recently_used():
    with _limits(kernel_cache_size=3):
        lru = caches.LRU("torchtpu_test_lru", "kernel_cache_size")
        before = _evictions()
        for k in "abc":
            lru[k] = k.upper()
        assert lru.get("a") == "A"  # now the most recent: b goes first
        lru["d"] = "D"
        assert "b" not in lru and lru.keys() == ["c", "a", "d"]
        assert _delta(before, "torchtpu_test_lru") == 1
        assert lru.get("b") is None and lru.get("b", 0) == 0
        with pytest.raises(KeyError):
            lru["b"]
        config.kernel_cache_size = 1  # a lower limit applies at the next insertion
        lru["e"] = "E"
        assert lru.keys() == ["e"] and _delta(before, "torchtpu_test_lru") == 4
        config.kernel_cache_size = 0  # no limit
        for i in range(100):
            lru[i] = i + 1
        assert len(lru) == 101
    assert re.search(r"\d+\s+torchtpu_test_lru", metrics.report(file=io.StringIO()))


# 10,000 shapes take ~20 s on 2 shared cores; CI runs 1,000 (60 times the kernel cache's limit)
@pytest.mark.parametrize("shapes", [1_000, pytest.param(10_000, marks=pytest.mark.slow)])
def test_many_shapes_leave_kernel_and_shape_caches_at_their_limit(shapes):
    """Recording (DEFER_AND_FUSE) builds a kernel's jitted program and the op's output shapes per
    shape without compiling anything, so 10,000 shapes take seconds."""
    kernel = register.kernels()[aten.zeros.default]
    foreach = register.kernels()[aten._foreach_neg.default]
    base = torch.zeros(1, device="tpu")
    foreach_before = len(foreach._jitted)
    before = _evictions()
    with _limits(kernel_cache_size=16, fused_shape_cache_size=64):
        with torch.tpu.set_eager_mode(FUSE):
            for n in range(1, shapes + 1):
                torch.zeros(n, device="tpu")  # the size is a static argument: a program per shape
            for n in range(1, 41):
                torch._foreach_neg([base] * n)  # a program per list length
            assert len(kernel._jitted) == 16
            assert len(foreach._jitted) == 16
            assert len(fused._avals_cache) == 64
        assert _delta(before, "eager_kernels") >= shapes - 16
        assert _delta(before, "foreach_kernels") >= 40 - 16 - foreach_before
        assert _delta(before, "fused_shapes") >= shapes + 40 - 64
        # the most recent entries stay; an evicted one is rebuilt and still right
        assert ((shapes,),) in {key[0] for key, *_ in kernel._jitted.keys()}
        assert torch.zeros(3, device="tpu").cpu().tolist() == [0.0, 0.0, 0.0]
    snap = metrics.snapshot()["cache_evictions"]
    assert snap["eager_kernels"] >= shapes - 16
    assert re.search(r"\d+\s+eager_kernels", metrics.report(file=io.StringIO()))


def test_fused_programs_stay_at_their_limit():
    """Each distinct shape here compiles a fused program (a real XLA compilation), so fewer."""
    before = _evictions()
    compiled = fused.stats()["programs_compiled"]
    with _limits(fused_program_cache_size=4):
        with torch.tpu.set_eager_mode(FUSE):
            for n in range(1, 13):
                x = torch.arange(n, dtype=torch.float32, device="tpu")
                assert (x * 2 + 1).sum().item() == n * n  # sum of the first n odd numbers
            assert len(fused._programs) <= 4
            assert fused.stats()["programs_cached"] == len(fused._programs)
            again = torch.arange(1, dtype=torch.float32, device="tpu")  # evicted: compiled again
            assert (again * 2 + 1).sum().item() == 1
    assert fused.stats()["programs_compiled"] - compiled >= 13
    assert _delta(before, "fused_programs") >= 13 - 4
