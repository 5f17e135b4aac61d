"""Helpers the op tests share: run a function on CPU inputs and on their tpu copies, compare."""

import torch
from torch.testing import assert_close


def to_tpu(a):
    """``a`` with every tensor (in lists and tuples too) copied to tpu, keeping requires_grad."""
    if isinstance(a, torch.Tensor):
        return a.to("tpu").requires_grad_(a.requires_grad)
    if isinstance(a, (list, tuple)):
        return type(a)(to_tpu(v) for v in a)
    return a


def same(tpu, cpu):
    """A tpu result (or a list/tuple of them) equals the CPU one: values, dtype, shape."""
    if isinstance(cpu, (list, tuple)):
        assert len(tpu) == len(cpu)
        for t, c in zip(tpu, cpu):
            same(t, c)
        return
    assert tpu.device.type == "tpu"
    assert_close(tpu.cpu(), cpu, equal_nan=True)


def check(fn, *args):
    """``fn`` on CPU ``args`` and on their tpu copies give the same values, dtypes and shapes."""
    same(fn(*to_tpu(args)), fn(*args))
