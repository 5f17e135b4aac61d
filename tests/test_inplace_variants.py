"""An in-place overload runs the functional lowering with the same arguments, whatever its name.

PyTorch's names do not always pair: ``pow_.Scalar`` is ``(Tensor self, Scalar exponent)``, the
in-place form of ``pow.Tensor_Scalar``, while ``pow.Scalar`` is ``(Scalar self, Tensor exponent)``.
Pairing by name ran ``x **= 0.5`` through ``pow.Scalar`` (refused for a 0-d ``x``: TorchTitan's
expert-parallel gradient clipping does exactly that).
"""

import pytest
import torch

pytestmark = pytest.mark.usefixtures("no_fallback")


@pytest.mark.parametrize("shape", [(), (3,)])
def test_pow_scalar_exponent_in_place(shape):
    x = torch.tensor([80.42, 4.0, 9.0])[: shape[0] if shape else 1].reshape(shape)
    t = x.to("tpu")
    t **= 0.5
    torch.testing.assert_close(t.cpu(), x ** 0.5)


def test_in_place_overloads_named_otherwise():
    a, b = torch.tensor([7.0, -7.0, 2.5]), torch.tensor([2.0, 2.0, 3.0])
    for method, args in (("pow_", (b,)), ("floor_divide_", (b,))):
        t = a.to("tpu")
        getattr(t, method)(*[x.to("tpu") for x in args])
        torch.testing.assert_close(t.cpu(), getattr(a.clone(), method)(*args))
