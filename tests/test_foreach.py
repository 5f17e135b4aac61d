"""``_foreach_*`` ops (what optimizers use for multi-tensor updates) against PyTorch's CPU results,
driven by PyTorch's own foreach OpInfo databases: functional and in-place variants, in both eager
modes, plus an optimizer step and the one-op-per-update-term property that makes them fast."""

import pytest
import torch
from torch.testing import assert_close
from torch.testing._internal.common_methods_invocations import (
    foreach_binary_op_db, foreach_other_op_db, foreach_pointwise_op_db, foreach_reduce_op_db,
    foreach_unary_op_db)

from torchtpu import metrics

OPS = [op for op in foreach_unary_op_db + foreach_binary_op_db + foreach_pointwise_op_db
       + foreach_reduce_op_db + foreach_other_op_db]
SAMPLES = 4  # the first samples of each op (deterministic generators); lists of 3 tensors


def _to(value, device):
    if isinstance(value, torch.Tensor):
        return value.detach().clone().to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def _run(fn, sample, device):
    inputs, args, kwargs = _to(sample.input, device), _to(sample.args, device), _to(sample.kwargs, device)
    try:
        return inputs, fn(inputs, *args, **kwargs), None
    except Exception as exc:  # noqa: BLE001 - compared with the CPU's own error below
        return inputs, None, exc


def _check(variant, samples):
    for sample in samples:
        cpu_inputs, expected, cpu_error = _run(variant, sample, "cpu")
        tpu_inputs, actual, tpu_error = _run(variant, sample, "tpu")
        if cpu_error is not None:  # the same kind of error as PyTorch, e.g. an int result cast
            assert tpu_error is not None and type(tpu_error) is type(cpu_error), (cpu_error, tpu_error)
            continue
        assert tpu_error is None, tpu_error
        if expected is None:  # in place: the inputs are the result
            expected, actual = cpu_inputs, tpu_inputs
        assert_close(_to(actual, "cpu"), expected, equal_nan=True, atol=1e-5, rtol=1e-4)


# int64 mostly checks errors and promotion, which do not depend on the eager mode: DEFER_NEVER only
CASES = [("DEFER_NEVER", torch.float32), ("DEFER_AND_FUSE", torch.float32), ("DEFER_NEVER", torch.int64)]


@pytest.mark.usefixtures("no_fallback")
@pytest.mark.parametrize("mode,dtype", CASES, ids=[f"{m}-{str(d).removeprefix('torch.')}" for m, d in CASES])
@pytest.mark.parametrize("op", OPS, ids=[op.name for op in OPS])
def test_foreach_op_matches_cpu(op, mode, dtype):
    with torch.tpu.set_eager_mode(getattr(torch.tpu.EagerMode, mode)):
        _check_op(op, dtype)


def _check_op(op, dtype):
    if dtype not in op.supported_dtypes("cpu"):
        pytest.skip(f"{op.name} does not support {dtype} on the CPU")
    samples = []
    for sample in op.sample_inputs("cpu", dtype, num_input_tensors=[3]):
        samples.append(sample)
        if len(samples) == SAMPLES:
            break
    for variant in (op.op, op.inplace_variant):
        if variant is not None:
            _check(variant, samples)


def test_an_update_term_is_one_op_for_all_parameters():
    params = [torch.randn(5, 3, device="tpu"), torch.randn(7, device="tpu"), torch.randn(2, 2, device="tpu")]
    grads = [torch.randn_like(p) for p in params]
    before = metrics.ops.copy()
    torch._foreach_add_(params, grads, alpha=-0.1)
    counted = metrics.ops - before
    assert dict(counted) == {"aten._foreach_add.List": 1}


def test_foreach_rejects_mixed_devices_like_cuda():
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch._foreach_add([torch.ones(2, device="tpu")], [torch.ones(2)])


@pytest.mark.usefixtures("each_eager_mode")
@pytest.mark.parametrize("name", ["AdamW", "Adam", "SGD", "RMSprop", "Adagrad"])
def test_foreach_optimizer_steps_match_cpu(name):
    torch.manual_seed(0)
    cpu = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    tpu = [torch.nn.Parameter(p.detach().to("tpu")) for p in cpu]
    kwargs = {"lr": 0.1, "foreach": True}
    if name == "SGD":
        kwargs["momentum"] = 0.9
    opt_cpu, opt_tpu = getattr(torch.optim, name)(cpu, **kwargs), getattr(torch.optim, name)(tpu, **kwargs)
    for step in range(3):
        for pc, pt in zip(cpu, tpu):
            grad = torch.randn_like(pc)
            pc.grad, pt.grad = grad, grad.to("tpu")
        opt_cpu.step()
        opt_tpu.step()
    for pc, pt in zip(cpu, tpu):
        assert_close(pt.detach().cpu(), pc.detach(), atol=1e-5, rtol=1e-5)
