"""Calls PyTorch refuses are refused on ``tpu`` with PyTorch's exception, in every eager mode;
none computes an answer (``eager/argument_errors.py``). Each case runs on the CPU too: the
exception type must be the CPU's, and so must the first words of its message."""

from __future__ import annotations

import pytest
import torch

ones = torch.ones

CASES = {
    # JAX's exceptions that once reached the user
    "flip_repeated_dim": lambda d: torch.flip(ones(2, 3, device=d), (0, 0)),
    "hstack_shapes": lambda d: torch.hstack([ones(2, 3, device=d), ones(3, 3, device=d)]),
    "vstack_shapes": lambda d: torch.vstack([ones(2, 3, device=d), ones(2, 4, device=d)]),
    "dstack_shapes": lambda d: torch.dstack([ones(2, 3, device=d), ones(3, 3, device=d)]),
    "floor_complex": lambda d: torch.floor(ones(2, dtype=torch.complex64, device=d)),
    "complex_of_ints": lambda d: torch.complex(ones(2, dtype=torch.int64, device=d),
                                               ones(2, dtype=torch.int64, device=d)),
    "index_broadcast": lambda d: ones(4, 5, device=d)[torch.tensor([0, 1], device=d), torch.tensor([0, 1, 2], device=d)],
    "eye_negative": lambda d: torch.eye(-1, device=d),
    "index_empty_dim": lambda d: torch.empty(10, 0, device=d)[:, [0, 1]],
    # calls that once computed an answer
    "add_float_alpha_ints": lambda d: torch.add(ones(2, dtype=torch.int64, device=d), 1, alpha=1.1),
    "sub_complex_alpha": lambda d: torch.sub(ones(2, device=d), 1, alpha=1j),
    "add_bools_float_alpha": lambda d: torch.add(ones(2, dtype=torch.bool, device=d), ones(2, dtype=torch.bool, device=d),
                                                 alpha=1.1),
    "add_floats_bool_alpha": lambda d: torch.add(ones(2, device=d), ones(2, device=d), alpha=True),
    "clamp_no_bounds": lambda d: torch.clamp(ones(2, device=d)),
    "random_beyond_int8": lambda d: torch.empty(5, dtype=torch.int8, device=d).random_(0, 1000),
    "random_from_not_below_to": lambda d: torch.empty(5, dtype=torch.int64, device=d).random_(5, 2),
    "normal_negative_std": lambda d: torch.normal(torch.zeros(3, device=d), -1.0),
    "normal__negative_std": lambda d: torch.empty(3, device=d).normal_(0, -2.5),
    "rand_integer_dtype": lambda d: torch.rand(3, dtype=torch.int64, device=d),
    "randn_integer_dtype": lambda d: torch.randn(3, dtype=torch.int64, device=d),
    "uniform_reversed": lambda d: torch.empty(3, device=d).uniform_(1, 0),
    "exponential_negative": lambda d: torch.empty(3, device=d).exponential_(-1),
    "lerp_end_dtype": lambda d: torch.lerp(ones(2, dtype=torch.float64, device=d), ones(2, device=d), 0.5),
    "lerp_weight_dtype": lambda d: torch.lerp(ones(2, device=d), ones(2, device=d), ones(2, dtype=torch.float64, device=d)),
    "nonzero_float_out": lambda d: torch.nonzero(ones(2, device=d), out=torch.empty(0, device=d)),
    "neg_into_another_dtype": lambda d: torch.neg(ones(2, device=d), out=torch.empty(2, dtype=torch.float64, device=d)),
    "index_fill_complex": lambda d: ones(3, device=d).index_fill_(0, torch.tensor([0], device=d), 1 + 1j),
    "setitem_other_dtype": lambda d: ones(2, 2, dtype=torch.float64, device=d).__setitem__(
        (slice(None), [1]), ones(2, 1, dtype=torch.int64, device=d)),
    "cat_into_an_input": lambda d: (lambda a: torch.cat([a[:2], a[2:]], out=a))(ones(4, device=d)),
    "gather_into_overlapping_out": lambda d: (lambda b: torch.gather(torch.arange(3, device=d), 0, b[1:], out=b[:1]))(
        torch.zeros(3, dtype=torch.int64, device=d)),
    "index_select_into_expanded_out": lambda d: torch.index_select(
        ones(6, device=d), 0, torch.tensor([0, 1, 2], device=d), out=torch.empty(1, device=d).expand(3)),
    "multinomial_of_ints": lambda d: torch.multinomial(ones(4, dtype=torch.int64, device=d), 2),
    "multinomial_too_many": lambda d: torch.multinomial(ones(4, device=d), 5),
    "bucketize_2d_boundaries": lambda d: torch.bucketize(ones(3, device=d), ones(2, 2, device=d)),
    "conv_negative_padding": lambda d: torch.nn.functional.conv2d(ones(1, 1, 4, 4, device=d), ones(1, 1, 2, 2, device=d),
                                                                  padding=-1),
    "masked_scatter_byte_mask": lambda d: ones(3, device=d).masked_scatter(
        torch.ones(3, dtype=torch.uint8, device=d), ones(3, device=d)),
}


def _raised(fn, device: str) -> BaseException | None:
    try:
        result = fn(device)
        if isinstance(result, torch.Tensor):
            result.cpu()  # a deferred op raises at the latest when read
    except Exception as exc:  # noqa: BLE001 - the exception is what is compared
        return exc
    return None


@pytest.mark.parametrize("mode", ["defer_never", "defer_never_and_launch_blocking", "defer_and_fuse"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_call_pytorch_refuses_raises_pytorchs_exception(case, mode):
    expected = _raised(CASES[case], "cpu")
    assert expected is not None, "the CPU accepts this call: not a refusal"
    with torch.tpu.set_eager_mode(mode):
        got = _raised(CASES[case], "tpu")
    assert got is not None, f"tpu computed an answer where the CPU raises {expected!r}"
    assert type(got) is type(expected), f"tpu raised {got!r}, the CPU {expected!r}"
    assert str(got).split()[:3] == str(expected).split()[:3], (str(got), str(expected))


def test_the_device_works_after_a_refusal():
    with pytest.raises(RuntimeError, match="At least one of 'min' or 'max'"):
        torch.clamp(ones(2, device="tpu"))
    x = torch.arange(6.0, device="tpu")
    torch.testing.assert_close(torch.clamp(x, max=3).cpu(), torch.arange(6.0).clamp(max=3))
    torch.testing.assert_close(torch.add(x, x, alpha=2).cpu(), torch.arange(6.0) * 3)
    out = torch.empty(3, device="tpu")
    torch.testing.assert_close(torch.gather(x, 0, torch.tensor([5, 0, 1], device="tpu"), out=out).cpu(),
                               torch.tensor([5.0, 0.0, 1.0]))


def test_an_argument_error_of_a_lowering_that_pytorch_accepts_names_the_op(monkeypatch):
    # where PyTorch accepts what a lowering refuses, the error is torchtpu's and says so
    from torchtpu.eager import argument_errors

    error = argument_errors.pytorch_error(torch.ops.aten.add.Tensor, TypeError("jax says no"),
                                          (ones(2, device="tpu"), ones(2, device="tpu")), {})
    assert isinstance(error, RuntimeError)
    assert "aten.add.Tensor" in str(error) and "jax says no" in str(error)


def test_an_out_pytorch_resizes_is_accepted():
    """An out= whose dtype differs from the input's sends the call to PyTorch's CPU kernel for a
    verdict; that kernel resizes the out= copy, which must be resizable (nonzero's out= failed)."""
    x = torch.tensor([0.0, 1.0, 0.0, 2.0])
    for out_shape in ((0,), (5, 3)):
        out = torch.empty(out_shape, dtype=torch.long, device="tpu")
        torch.nonzero(x.to("tpu"), out=out)
        torch.testing.assert_close(out.cpu(), torch.nonzero(x))


def test_alpha_pytorch_accepts():
    b = torch.tensor([True, False])
    assert torch.equal(torch.add(b.to("tpu"), b.to("tpu"), alpha=True).cpu(), torch.add(b, b, alpha=True))
    i = torch.arange(4)
    assert torch.equal(torch.add(i.to("tpu"), i.to("tpu"), alpha=3).cpu(), torch.add(i, i, alpha=3))
    f = torch.arange(4.0)
    torch.testing.assert_close(torch.sub(f.to("tpu"), f.to("tpu"), alpha=0.5).cpu(), torch.sub(f, f, alpha=0.5))
