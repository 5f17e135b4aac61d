"""PyTorch semantics on tpu, each checked against the same code on the CPU:
views alias their base, in-place ops, out=, type promotion, broadcasting, zero-size and 0-d
tensors, and autograd through all of it."""

import pytest
import torch
from torch.testing import assert_close

pytestmark = pytest.mark.usefixtures("each_eager_mode")


def both(fn, *tensors):
    """Run ``fn`` on CPU copies and on tpu copies of ``tensors``; return (cpu, tpu-moved-back)."""
    cpu = fn(*[t.clone() for t in tensors])
    tpu = fn(*[t.to("tpu") for t in tensors])
    return cpu, tpu


def check(fn, *tensors, **tol):
    cpu, tpu = both(fn, *tensors)
    if isinstance(cpu, (tuple, list)):
        for c, t in zip(cpu, tpu):
            assert_close(t.cpu(), c, **tol)
    else:
        assert_close(tpu.cpu(), cpu, **tol)


def test_tensor_is_plain_and_on_tpu():
    x = torch.randn(4, 5, device="tpu")
    assert type(x) is torch.Tensor
    assert x.device == torch.device("tpu", 0)
    assert x.is_contiguous() and x.shape == (4, 5)


# ---------------------------------------------------------------- views alias their base

def _index_add(x):
    x[0].add_(1)
    return x


def _t_mul(x):
    x.t().mul_(2)
    return x


def _view_setitem(x):
    x.view(-1)[3] = 5
    return x


def _slice_fill(x):
    x[:, 1:3].fill_(7)
    return x


def _chain(x):
    v = x.transpose(0, 1)[1:]
    v.mul_(3)
    x[2].sub_(1)
    return x, v


def _diagonal(x):
    x.diagonal().zero_()
    return x


def _select_then_base(x):
    row = x[1]
    x.add_(10)  # the base changes: the existing view sees it
    return row.clone(), x


def _unsqueeze_expand_read(x):
    return x.unsqueeze(0).expand(3, -1, -1) * 2


def _narrow_copy(x):
    x.narrow(1, 0, 2).copy_(torch.ones(4, 2, device=x.device))
    return x


def _split_inplace(x):
    a, b = x.split(2)
    b.mul_(-1)
    return x


def _permute_contiguous(x):
    return x.reshape(2, 2, 5).permute(2, 0, 1).contiguous()


VIEW_CASES = [_index_add, _t_mul, _view_setitem, _slice_fill, _chain, _diagonal, _select_then_base,
              _unsqueeze_expand_read, _narrow_copy, _split_inplace, _permute_contiguous]


@pytest.mark.parametrize("fn", VIEW_CASES, ids=lambda f: f.__name__.strip("_"))
def test_views_alias_base(fn):
    check(fn, torch.randn(4, 5))


def test_view_shares_storage_and_base():
    x = torch.randn(3, 4, device="tpu")
    v = x.t()
    assert v._base is x
    assert torch._C._storage_address(v) == torch._C._storage_address(x)
    assert v.stride() == (1, 4)


def test_detach_shares_data():
    x = torch.randn(3, device="tpu", requires_grad=True)
    d = x.detach()
    d.add_(1)
    assert_close(x.detach().cpu(), d.cpu())


def test_dtype_view_bits():
    x = torch.tensor([1.0, -2.0], device="tpu")
    assert_close(x.view(torch.int32).cpu(), torch.tensor([1.0, -2.0]).view(torch.int32))


# ---------------------------------------------------------------- in-place, out=, promotion

def test_inplace_ops_match_cpu():
    def fn(x, y):
        x.add_(y, alpha=2)
        x.mul_(0.5)
        x.clamp_(-1, 1)
        x.sub_(1)
        return x

    check(fn, torch.randn(4, 5), torch.randn(4, 5))


def test_inplace_write_donates_a_sole_owned_buffer(each_eager_mode):
    """An in-place op on a whole tensor nothing else holds updates its buffer in place (no copy of
    the whole tensor per write: a KV cache); held arrays, views and aliases still see PyTorch's
    semantics; an in-place op that fails leaves its target intact. (A buffer of 2**14 elements or
    more: below that the native eager path writes a small target by copying, which costs less
    than the donating call through Python.)"""
    from torchtpu.device import bridge

    cache = torch.zeros(64, 256, device="tpu")
    rows = torch.tensor([3, 60], device="tpu")
    if each_eager_mode != "DEFER_AND_FUSE":  # deferred ops run later, fused: nothing to donate now
        pointer = bridge.read(cache).unsafe_buffer_pointer()
        cache.index_copy_(0, rows, torch.ones(2, 256, device="tpu"))
        assert bridge.read(cache).unsafe_buffer_pointer() == pointer
    else:
        cache.index_copy_(0, rows, torch.ones(2, 256, device="tpu"))
    row = cache[3]  # a view: sees the next in-place write of its base
    held = bridge.read_computed(cache)  # another holder of the array: it must not be donated away
    cache.add_(cache)
    assert held[3, 0] == 1 and row.cpu().tolist() == [2.0] * 256
    expect = torch.zeros(64, 256).index_copy_(0, torch.tensor([3, 60]), torch.ones(2, 256)) * 2
    assert_close(cache.cpu(), expect)
    ints = torch.ones(3, dtype=torch.long, device="tpu")
    with pytest.raises(RuntimeError, match="can't be cast to the desired output type Long"):
        ints.add_(torch.full((3,), 0.5, device="tpu"))
    assert ints.cpu().tolist() == [1, 1, 1]


def test_inplace_broadcast():
    check(lambda x, y: x.add_(y), torch.randn(4, 5), torch.randn(5))


def test_inplace_int_with_float_raises_like_cpu():
    x = torch.ones(3, dtype=torch.int64, device="tpu")
    with pytest.raises(RuntimeError, match="can't be cast to the desired output type"):
        x.add_(1.5)


def test_out_variant():
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    out_cpu = torch.empty(3, 4)
    torch.add(a, b, out=out_cpu)
    out = torch.empty(3, 4, device="tpu")
    result = torch.add(a.to("tpu"), b.to("tpu"), out=out)
    assert result is out
    assert_close(out.cpu(), out_cpu)


def test_out_variant_resizes_empty_out():
    a = torch.randn(2, 3)
    out = torch.empty(0, device="tpu")
    torch.mul(a.to("tpu"), 2, out=out)
    assert out.shape == (2, 3)
    assert_close(out.cpu(), a * 2)


def test_out_variant_into_view():
    a = torch.randn(4, 4)
    base_cpu = torch.zeros(4, 8)
    torch.exp(a, out=base_cpu[:, 2:6])
    base = torch.zeros(4, 8, device="tpu")
    torch.exp(a.to("tpu"), out=base[:, 2:6])
    assert_close(base.cpu(), base_cpu)


PROMOTION = [
    (torch.int32, torch.float32), (torch.int64, torch.float64), (torch.bool, torch.int32),
    (torch.float16, torch.float32), (torch.bfloat16, torch.float16), (torch.uint8, torch.int8),
    (torch.int32, torch.int64), (torch.float32, torch.complex64),
]


@pytest.mark.parametrize("a,b", PROMOTION, ids=str)
def test_type_promotion_tensors(a, b):
    x = torch.ones(3, dtype=a) * 2 if a != torch.bool else torch.tensor([True, False, True])
    y = torch.ones(3, dtype=b) * 3 if b != torch.bool else torch.tensor([True, True, False])
    assert (x.to("tpu") + y.to("tpu")).dtype == (x + y).dtype
    assert (x.to("tpu") * y.to("tpu")).dtype == (x * y).dtype
    check(lambda p, q: p + q, x, y)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float16, torch.bool, torch.bfloat16])
@pytest.mark.parametrize("scalar", [2, 2.5, True])
def test_type_promotion_with_python_scalars(dtype, scalar):
    x = torch.ones(3, dtype=dtype)
    assert (x.to("tpu") * scalar).dtype == (x * scalar).dtype
    check(lambda t: t * scalar, x)


def test_zero_dim_tensor_promotes_like_a_scalar():
    x = torch.ones(3, dtype=torch.float32)
    s = torch.tensor(2.0, dtype=torch.float64)
    assert (x.to("tpu") * s.to("tpu")).dtype == torch.float32
    i = torch.ones(3, dtype=torch.int32)
    assert (i.to("tpu") * s.to("tpu")).dtype == (i * s).dtype


def test_cpu_zero_dim_tensor_mixes_like_cuda():
    x = torch.randn(3)
    assert_close((x.to("tpu") * torch.tensor(3.0)).cpu(), x * 3)


def test_broadcasting():
    check(lambda a, b: a * b + 1, torch.randn(4, 1, 3), torch.randn(5, 1))


# ---------------------------------------------------------------- zero-size and 0-d

def test_zero_size_tensors():
    check(lambda x: (x + 1) * 2, torch.randn(0, 3))
    x = torch.empty(0, 4, device="tpu")
    assert x.shape == (0, 4) and x.cpu().shape == (0, 4)
    assert torch.ones(2, 0, device="tpu").sum().item() == 0


def test_zero_dim_tensors():
    check(lambda x: x * 2 + 1, torch.tensor(3.0))
    x = torch.tensor(3.5, device="tpu")
    assert x.dim() == 0 and x.item() == 3.5
    assert_close(x.sum(0).cpu(), torch.tensor(3.5))
    assert_close(x.sum(-1).cpu(), torch.tensor(3.5))


# ---------------------------------------------------------------- transfers and printing

@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                                   torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64])
def test_round_trip_every_dtype(dtype):
    x = (torch.randn(5, 3) * 10).to(dtype) if dtype != torch.complex64 else torch.randn(5, 3, dtype=dtype)
    y = x.to("tpu")
    assert y.dtype == dtype and y.device.type == "tpu"
    assert_close(y.cpu(), x)
    assert_close(x.to("tpu", non_blocking=True).cpu(), x)


def test_to_device_and_dtype():
    x = torch.randn(3, 4)
    y = x.to("tpu", torch.float64)
    assert y.dtype == torch.float64
    assert_close(y.cpu(), x.double())


def test_tensor_factory_item_tolist_print():
    x = torch.tensor([[1.5, 2.0], [3.0, 4.0]], device="tpu")
    assert x.device.type == "tpu"
    assert x[1, 0].item() == 3.0
    assert x.tolist() == [[1.5, 2.0], [3.0, 4.0]]
    text = repr(x)
    assert "device='tpu:0'" in text and "1.5000" in text


def test_non_contiguous_to_cpu():
    x = torch.randn(4, 6)
    assert_close(x.to("tpu").t()[1:3].cpu(), x.t()[1:3])


def test_model_to_tpu():
    model = torch.nn.Linear(4, 3)
    ref = model(torch.ones(2, 4))
    model.to("tpu")
    assert model.weight.device.type == "tpu"
    assert_close(model(torch.ones(2, 4, device="tpu")).cpu(), ref, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- autograd

def test_autograd_through_views_and_inplace():
    def run(device):
        torch.manual_seed(0)
        w = torch.randn(4, 5).to(device).requires_grad_()
        x = torch.randn(4, 5).to(device)
        y = (w * x).t()
        z = y.clone()
        z[1:3].mul_(2)
        loss = (z * z).sum() + y.exp().mean()
        loss.backward()
        return loss.detach().cpu(), w.grad.cpu()

    cpu_loss, cpu_grad = run("cpu")
    tpu_loss, tpu_grad = run("tpu")
    assert_close(tpu_loss, cpu_loss, rtol=1e-5, atol=1e-5)
    assert_close(tpu_grad, cpu_grad, rtol=1e-5, atol=1e-5)


def test_autograd_leaf_grad_on_tpu():
    x = torch.randn(3, device="tpu", requires_grad=True)
    (x * x).sum().backward()
    assert x.grad.device.type == "tpu"
    assert_close(x.grad.cpu(), 2 * x.detach().cpu())


def test_complex_real_views_alias():
    def fn(c):
        r = torch.view_as_real(c)
        r[0, 1, 0] = 7.0
        back = torch.view_as_complex(r)
        return c, back * 2

    check(fn, torch.randn(3, 2, dtype=torch.complex64))


def test_cpu_index_tensors_index_a_tpu_tensor():
    idx = torch.tensor([0, 2])

    def fn(x):
        y = x[idx, 1:] * 2
        x[idx] = 0.5
        return x, y, x[x > 0.4]

    check(fn, torch.rand(4, 5))


def test_lazy_conjugate_and_negation_bits():
    def fn(c):
        lazy = c.conj()
        view = lazy[1:]  # a view keeps the bit
        out = torch.empty_like(c)
        out.conj().copy_(c)  # writing through a conjugated view stores the conjugate
        return lazy.clone(), view * 2, lazy.resolve_conj(), torch._neg_view(c).clone(), out

    check(fn, torch.randn(3, 2, dtype=torch.complex64))


def test_equal_returns_a_python_bool():
    a = torch.randn(3)
    t = a.to("tpu")
    assert torch.equal(t, t) is True
    assert torch.equal(t, t + 1) is False and torch.equal(t, t[:2]) is False
    nan = torch.tensor([float("nan")])
    assert torch.equal(nan.to("tpu"), nan.to("tpu")) == torch.equal(nan, nan)


def test_inference_mode_views_of_normal_tensors():
    x = torch.randn(3, 4, device="tpu")
    linear = torch.nn.Linear(4, 2).to("tpu")
    with torch.inference_mode():
        view = x.t()
        out = linear(x)
    assert not view.is_inference() and out.is_inference()  # as on the CPU
    torch.testing.assert_close(out.cpu(), linear.cpu()(x.cpu()).detach())


def test_buffer_donation_refcount_rule_holds_on_this_interpreter():
    """Donation decides "nothing else holds this array" by sys.getrefcount at the call site
    (device/bridge.py: SOLE_OWNER_REFS); a new interpreter that counts otherwise must fail here,
    not corrupt a shared buffer."""
    from torchtpu.device import bridge

    assert bridge.sole_owner_refs_hold()
    x = torch.zeros(64, device="tpu")
    array = x.untyped_storage()._jax
    import sys

    assert sys.getrefcount(array) == bridge.SOLE_OWNER_REFS  # the storage, this local, the argument
