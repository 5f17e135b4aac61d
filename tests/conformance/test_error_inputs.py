"""PyTorch's error inputs on ``tpu``: every OpInfo's ``error_inputs`` (the calls PyTorch's own
``test_errors`` expects to raise) must raise on ``tpu`` what they raise on the CPU.

A lowering that JAX refuses must surface PyTorch's exception type, not JAX's ``TypeError`` or
``ValueError``, and a call PyTorch refuses must not compute an answer (``eager/argument_errors.py``).
Each error input runs on the CPU first; one that the CPU accepts (an error of another device) is
not compared. ``KNOWN`` lists what still differs, strictly: a fixed entry fails until removed.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db

from torchtpu.eager import argument_errors

# (op name, index of the error input among the op's): why it still differs on tpu
KNOWN = {
}

OPS = [op for op in op_db if op.error_inputs_func is not None]


def _on_cpu(sample):
    """The sample's call with its tpu tensors copied to the CPU, views of one storage kept views
    of one copy (an ``out=`` that overlaps an input still does)."""
    converted = argument_errors._reference_args((sample.input, *sample.args), sample.kwargs, "cpu")
    if converted is None:  # too large to keep the aliasing cheaply: plain copies
        converted = torch.utils._pytree.tree_map(
            lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, ((sample.input, *sample.args), sample.kwargs))
    (first, *args), kwargs = converted
    return first, args, kwargs


def _outcome(op, first, args, kwargs):
    try:
        result = op(first, *args, **kwargs)
        torch.utils._pytree.tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, result)
    except Exception as exc:  # noqa: BLE001 - the exception is what is compared
        return exc
    return None


@pytest.mark.parametrize("op", OPS, ids=[f"{op.name}.{op.variant_test_name}".rstrip(".") for op in OPS])
def test_error_inputs_raise_what_the_cpu_raises(op):
    with torch.tpu.cpu_fallback_enabled(False):
        error_inputs = list(op.error_inputs("tpu"))
    differences = []
    for i, error_input in enumerate(error_inputs):
        sample = error_input.sample_input
        expected = _outcome(op, *_on_cpu(sample))  # before the tpu call: an out= may be resized
        if expected is None:
            continue  # an error of another device (CUDA's): nothing to compare
        with torch.tpu.cpu_fallback_enabled(False):
            got = _outcome(op, sample.input, sample.args, sample.kwargs)
        # an instance of the CPU's type, as PyTorch's test_errors checks (assertRaises): an index
        # found out of bounds on the device is an IndexError and a RuntimeError (ops/checks.py)
        same = got is not None and isinstance(got, type(expected))
        if same == ((op.name, i) in KNOWN):
            what = "no error" if got is None else f"{type(got).__name__}: {str(got).splitlines()[0][:160]}"
            differences.append(f"error input {i}: the CPU raises {type(expected).__name__}: "
                               f"{str(expected).splitlines()[0][:160]}; tpu: {what}"
                               + (" (listed in KNOWN: remove it)" if same else ""))
    assert not differences, "\n".join(differences)
