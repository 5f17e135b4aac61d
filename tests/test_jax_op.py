"""torchtpu.jax_op: JAX functions and Pallas kernels as torch custom ops, checked against PyTorch
CPU references in eager (both modes), fused and compiled, forward and backward."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import pytest
import torch
from jax.experimental import pallas as pl

import torchtpu

# ---------------------------------------------------------------- the ops under test


@torchtpu.jax_op("test_jax_op::rms_norm")
def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rms_norm_reference(x, w, eps=1e-6):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


@torchtpu.jax_op("test_jax_op::scale_shift_stats")
def scale_shift_stats(x: torch.Tensor, shift: Optional[torch.Tensor], dims: list[int], *,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    y = x * scale if shift is None else x * scale + shift
    return y, jnp.tanh(y).sum(axis=tuple(dims))


def _matmul_kernel(a_ref, b_ref, o_ref):
    o_ref[...] = a_ref[...] @ b_ref[...]


def pallas_matmul(a, b, block: int = 8):
    """A blocked matmul in Pallas (interpret mode: runs on XLA:CPU)."""
    m, n = a.shape[0], b.shape[1]
    assert m % block == 0 and n % block == 0, "the grid covers whole blocks only"
    return pl.pallas_call(
        _matmul_kernel, out_shape=jax.ShapeDtypeStruct((m, n), a.dtype), grid=(m // block, n // block),
        in_specs=[pl.BlockSpec((block, a.shape[1]), lambda i, j: (i, 0)),
                  pl.BlockSpec((b.shape[0], block), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((block, block), lambda i, j: (i, j)), interpret=True)(a, b)


def _matmul_backward(g, a, b):
    return pallas_matmul(g, b.T), pallas_matmul(a.T, g)  # the kernel serves its own backward


@torchtpu.jax_op("test_jax_op::pallas_matmul", backward=_matmul_backward)
def pallas_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return pallas_matmul(a, b)


def _leaves(*tensors, device):
    return [t.detach().to(device).requires_grad_() for t in tensors]


def _check(fn, reference, *inputs, rtol=1.3e-6, atol=1e-5):
    """fn on tpu against reference on CPU: outputs and the gradients of every input."""
    got_in, ref_in = _leaves(*inputs, device="tpu"), _leaves(*inputs, device="cpu")
    got, ref = fn(*got_in), reference(*ref_in)
    got, ref = (got if isinstance(got, tuple) else (got,)), (ref if isinstance(ref, tuple) else (ref,))
    sum(g.float().sum() * (i + 1) for i, g in enumerate(got)).backward()
    sum(r.float().sum() * (i + 1) for i, r in enumerate(ref)).backward()
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.detach().cpu(), r.detach(), rtol=rtol, atol=atol)
    for g, r in zip(got_in, ref_in):
        torch.testing.assert_close(g.grad.cpu(), r.grad, rtol=rtol, atol=atol)


# ---------------------------------------------------------------- eager, both modes


@pytest.mark.usefixtures("no_fallback")
def test_plain_jax_function_eager(each_eager_mode):
    x, w = torch.randn(6, 16), torch.randn(16)
    _check(lambda a, b: rms_norm(a * 2, b, 1e-5), lambda a, b: rms_norm_reference(a * 2, b, 1e-5), x, w)


@pytest.mark.usefixtures("no_fallback")
def test_tuple_outputs_optional_and_static_arguments(each_eager_mode):
    x, shift = torch.randn(4, 8), torch.randn(8)

    def reference(a, s):
        y = a * 0.5 + s
        return y, torch.tanh(y).sum(1)

    _check(lambda a, s: scale_shift_stats(a, s, [1], scale=0.5), reference, x, shift)
    out, stats = scale_shift_stats(x.to("tpu"), None, [0], scale=2.0)  # another static key: None, dims, scale
    torch.testing.assert_close(stats.cpu(), torch.tanh(x * 2).sum(0))


@pytest.mark.usefixtures("no_fallback")
def test_pallas_kernel_eager(each_eager_mode):
    a, b = torch.randn(16, 16), torch.randn(16, 24)
    _check(pallas_mm, torch.mm, a, b, rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------- compiled


@pytest.mark.usefixtures("no_fallback")
def test_compiled_forward_and_backward():
    torch._dynamo.reset()
    step = torch.compile(lambda x, w, a, b: (rms_norm(x, w).sum(1), pallas_mm(a, b)), backend="tpu",
                         fullgraph=True)
    x, w, a, b = torch.randn(8, 16), torch.randn(16), torch.randn(8, 16), torch.randn(16, 8)
    _check(step, lambda x, w, a, b: (rms_norm_reference(x, w).sum(1), a @ b), x, w, a, b, rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------- CPU tensors, errors, API


def test_cpu_tensors_run_through_jax():
    x, w = torch.randn(3, 8, requires_grad=True), torch.randn(8)
    out = rms_norm(x, w)
    out.sum().backward()
    ref_x = x.detach().clone().requires_grad_()
    rms_norm_reference(ref_x, w).sum().backward()
    torch.testing.assert_close(out.detach(), rms_norm_reference(x.detach(), w))
    torch.testing.assert_close(x.grad, ref_x.grad)


def test_opcheck():
    # autograd registration on CPU tensors: PyTorch's check knows CPU/CUDA/XPU only. (test_schema
    # is left out: 14 s, and the schema is PyTorch's own inference from the type hints)
    x, w = torch.randn(3, 8, requires_grad=True), torch.randn(8)
    torch.library.opcheck(rms_norm.op, (x, w, 1e-5), test_utils=("test_faketensor", "test_autograd_registration"))
    torch.library.opcheck(rms_norm.op, (x.detach().to("tpu"), w.to("tpu"), 1e-5), test_utils=("test_faketensor",))


def test_missing_type_hints_are_a_clear_error():
    with pytest.raises(ValueError, match=r"jax_op\('test_jax_op::untyped'\).*Parameter w must have a type annotation"):
        @torchtpu.jax_op("test_jax_op::untyped")
        def untyped(x: torch.Tensor, w) -> torch.Tensor:
            return x

    with pytest.raises(ValueError, match="No return type annotation"):
        @torchtpu.jax_op("test_jax_op::no_return")
        def no_return(x: torch.Tensor):
            return x


def test_pallas_without_backward_says_to_pass_one():
    @torchtpu.jax_op("test_jax_op::pallas_no_backward")
    def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return pallas_matmul(a, b)

    a, b = _leaves(torch.randn(8, 8), torch.randn(8, 8), device="tpu")
    with pytest.raises(NotImplementedError, match="pass backward= to jax_op"):
        mm(a, b).sum().backward()


def test_public_names_and_auto_name():
    assert torch.tpu.jax_op is torchtpu.jax_op

    @torchtpu.jax_op
    def doubled(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    assert doubled.name.endswith("test_jax_op::test_public_names_and_auto_name_doubled")
    torch.testing.assert_close(doubled(torch.arange(3.0, device="tpu")).cpu(), torch.tensor([0.0, 2.0, 4.0]))
