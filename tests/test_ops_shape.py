"""Shape ops on tpu against PyTorch CPU: copies, cat/stack, flips, padding, triangles, *_scatter,
the *_copy view ops, and the lowerings compiled graphs use for views."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from torchtpu.ops import registry
from torchtpu.ops import shape as shape_ops
from tpu_compare import check

aten = torch.ops.aten
pytestmark = pytest.mark.usefixtures("no_fallback")


def noncontig(*shape, dtype=torch.float32):
    """A transposed (non-contiguous) tensor of ``shape``."""
    base = torch.randn(*reversed(shape)) if dtype.is_floating_point else torch.randint(-5, 5, tuple(reversed(shape)))
    t = base.to(dtype).permute(*reversed(range(len(shape))))
    assert not t.is_contiguous() or len(shape) < 2
    return t


INPUTS = {
    "float": lambda: torch.randn(3, 4),
    "int64": lambda: torch.randint(-9, 9, (3, 4)),
    "bool": lambda: torch.rand(3, 4) > 0.5,
    "noncontig": lambda: noncontig(3, 4),
}


@pytest.mark.parametrize("kind", INPUTS)
def test_clone_and_contiguous(kind):
    x = INPUTS[kind]()
    check(lambda t: t.clone(), x)
    check(lambda t: t.t().contiguous(), x)
    check(lambda t: t.clone(), torch.tensor(2.5))
    check(lambda t: t.clone(), torch.zeros(0, 3))


def test_clone_is_a_copy():
    x = torch.arange(4.0, device="tpu")
    y = x.clone()
    y.add_(1)
    assert_close(x.cpu(), torch.arange(4.0))


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.bool, torch.int32])
def test_to_dtype(dtype):
    check(lambda t: t.to(dtype), torch.randn(3, 4) * 3)
    check(lambda t: t.to(dtype), noncontig(2, 3))


def test_cat():
    a, b = torch.randn(2, 3), torch.randn(4, 3)
    check(lambda x, y: torch.cat([x, y]), a, b)
    check(lambda x, y: torch.cat([x, y], dim=-1), a, torch.randn(2, 5))
    check(lambda x, y: torch.cat([x, y], 1), noncontig(3, 2), torch.randn(3, 4))
    check(lambda x, y: torch.cat([x, y]), torch.randint(0, 5, (2,)), torch.randn(3))  # promotes to float
    check(lambda x, y: torch.cat([x, y]), torch.rand(2) > 0.5, torch.rand(3) > 0.5)
    check(lambda x, y: torch.cat([x, y]), torch.randn(2, 3), torch.zeros(0))  # legacy: 1-d empty skipped
    check(lambda x, y: torch.cat([x, y]), torch.zeros(0, 3), torch.randn(2, 3))
    check(lambda x: torch.cat([x]), torch.randn(3))


def test_stack():
    check(lambda x, y: torch.stack([x, y]), torch.randn(2, 3), torch.randn(2, 3))
    check(lambda x, y: torch.stack([x, y], -1), noncontig(2, 3), torch.randn(2, 3))
    check(lambda x, y: torch.stack([x, y]), torch.tensor(1), torch.tensor(2.0))


def test_cat_backward():
    a = torch.randn(2, 3, requires_grad=True)
    b = torch.randn(4, 3, requires_grad=True)
    g = torch.randn(6, 3)
    torch.cat([a, b]).backward(g)
    ta, tb = a.detach().to("tpu").requires_grad_(), b.detach().to("tpu").requires_grad_()
    torch.cat([ta, tb]).backward(g.to("tpu"))
    assert_close(ta.grad.cpu(), a.grad)
    assert_close(tb.grad.cpu(), b.grad)


@pytest.mark.parametrize("kind", INPUTS)
def test_flip_roll_repeat(kind):
    x = INPUTS[kind]()
    check(lambda t: t.flip(0), x)
    check(lambda t: t.flip(0, -1), x)
    check(lambda t: t.roll(2), x)
    check(lambda t: t.roll((1, -3), (0, 1)), x)
    check(lambda t: t.repeat(2, 1, 3), x)
    check(lambda t: t.rot90(1, (0, 1)), x)


def test_flip_roll_repeat_edge():
    check(lambda t: t.flip(0), torch.tensor(3.0))
    check(lambda t: t.repeat(2, 2), torch.tensor(3.0))
    check(lambda t: t.roll(1), torch.zeros(0))
    check(lambda t: t.repeat(2, 0), torch.randn(3))
    with pytest.raises(RuntimeError):
        torch.randn(2, 3, device="tpu").repeat(2)


def test_constant_pad():
    x = torch.randn(2, 3, 4)
    check(lambda t: F.pad(t, (1, 2)), x)
    check(lambda t: F.pad(t, (1, 2, 0, 1, 1, 0), value=2.5), x)
    check(lambda t: F.pad(t, (-1, 1, 1, -2)), x)  # negative pads crop
    check(lambda t: F.pad(t, (1, 1), value=7), torch.randint(0, 4, (2, 3)))
    check(lambda t: F.pad(t, (2, 1)), noncontig(3, 4))


@pytest.mark.parametrize("mode", ["reflect", "replicate"])
@pytest.mark.parametrize("pad", [(2, 1), (1, 2, 2, 0), (1, 1, 0, 2, 1, 1)])
def test_reflect_replicate_pad_and_grad(mode, pad):
    n = len(pad) // 2
    x = torch.randn(2, 2, *([4] * n), requires_grad=True)
    out = F.pad(x, pad, mode=mode)
    g = torch.randn_like(out)
    out.backward(g)
    tx = x.detach().to("tpu").requires_grad_()
    tout = F.pad(tx, pad, mode=mode)
    assert_close(tout.cpu(), out.detach())
    tout.backward(g.to("tpu"))
    assert_close(tx.grad.cpu(), x.grad)


def test_negative_reflect_replicate_pad():
    x = torch.randn(2, 3, 4, 4)
    check(lambda t: F.pad(t, (-4, 5, 0, 0), mode="replicate"), x)
    check(lambda t: F.pad(t, (5, -4, -2, 3), mode="replicate"), x)
    check(lambda t: F.pad(t, (-1, 2, 1, -2), mode="reflect"), x)


def test_reflect_pad_too_large_raises():
    with pytest.raises(RuntimeError):
        F.pad(torch.randn(1, 2, 3, device="tpu"), (3, 0), mode="reflect")


@pytest.mark.parametrize("kind", INPUTS)
def test_tril_triu(kind):
    x = INPUTS[kind]()
    for k in (-1, 0, 2):
        check(lambda t: t.tril(k), x)
        check(lambda t: t.triu(k), x)
    check(lambda t: t.tril(), torch.randn(2, 3, 3))
    check(lambda t: t.triu(), torch.zeros(0, 3))


def test_diag_embed_and_diag():
    x = torch.randn(2, 3)
    check(lambda t: torch.diag_embed(t), x)
    check(lambda t: torch.diag_embed(t, 1), x)
    check(lambda t: torch.diag_embed(t, -2, 0, 2), x)
    check(lambda t: torch.diag_embed(t), torch.randint(0, 5, (4,)))
    check(lambda t: torch.diag(t), torch.randn(4))
    check(lambda t: torch.diag(t, 1), torch.randn(3, 4))


def test_scatter_family():
    x = torch.randn(4, 5)
    check(lambda t, s: torch.diagonal_scatter(t, s), x, torch.randn(4))
    check(lambda t, s: torch.diagonal_scatter(t, s, 1), x, torch.randn(4))
    check(lambda t, s: torch.diagonal_scatter(t, s, -2, 1, 0), x, torch.randn(3))
    check(lambda t, s: torch.slice_scatter(t, s, 1, 1, 5, 2), x, torch.randn(4, 2))
    check(lambda t, s: torch.slice_scatter(t, s), x, torch.randn(4, 5))
    check(lambda t, s: torch.slice_scatter(t, s, 0, -2), x, torch.randn(2, 5))
    check(lambda t, s: torch.select_scatter(t, s, 0, -1), x, torch.randn(5))
    check(lambda t, s: torch.select_scatter(t, s, 1, 2), noncontig(4, 5), torch.randn(4))
    check(lambda t, s: torch.as_strided_scatter(t, s, (2, 2), (1, 3), 2), x, torch.randn(2, 2))
    check(lambda t, s: torch.as_strided_scatter(t, s, (2, 2), (5, 1)), x, torch.randn(2, 2))
    check(lambda t, s: torch.select_scatter(t, s, 0, 1), torch.randint(0, 3, (3, 2)), torch.tensor([7, 8]))


def test_composite_splits():
    x = torch.randn(7, 4)
    check(lambda t: t.tensor_split(3), x)
    check(lambda t: t.tensor_split([1, 5], dim=0), x)
    check(lambda t: [s.contiguous() for s in t.split([3, 4])], x)
    check(lambda t: [s * 1 for s in t.unbind(1)], x)
    check(lambda a, b: torch.meshgrid(a, b, indexing="ij"), torch.randn(3), torch.randn(4))
    check(lambda a, b: [m.contiguous() for m in torch.meshgrid(a, b, indexing="xy")], torch.randn(3), torch.randn(4))


COPY_OPS = [
    (aten.expand_copy.default, (torch.randn(3, 1), [2, 3, 4])),
    (aten.permute_copy.default, (torch.randn(2, 3, 4), [2, 0, 1])),
    (aten.transpose_copy.int, (torch.randn(2, 3), 0, 1)),
    (aten.t_copy.default, (torch.randn(2, 3),)),
    (aten.view_copy.default, (torch.randn(2, 6), [3, -1])),
    (aten.view_copy.dtype, (torch.randn(2, 4), torch.int32)),
    (aten.view_copy.dtype, (torch.randn(2, 4), torch.int16)),
    (aten.view_copy.dtype, (torch.randn(2, 4, dtype=torch.float16), torch.float32)),
    (aten.slice_copy.Tensor, (torch.randn(5, 3), 0, 1, 100, 2)),
    (aten.slice_copy.Tensor, (torch.randn(5, 3), 1, -2)),
    (aten.select_copy.int, (torch.randn(5, 3), 1, -1)),
    (aten.unsqueeze_copy.default, (torch.randn(5, 3), -1)),
    (aten.squeeze_copy.dims, (torch.randn(1, 3, 1), [0, 1, 2])),
    (aten.squeeze_copy.default, (torch.randn(1, 3, 1),)),
    (aten.squeeze_copy.dim, (torch.randn(1, 3, 1), -1)),
    (aten.diagonal_copy.default, (torch.randn(3, 4, 5), 1, 2, 0)),
    (aten.unfold_copy.default, (torch.randn(3, 7), 1, 3, 2)),
    (aten.split_with_sizes_copy.default, (torch.randn(5, 3), [2, 3])),
    (aten.split_copy.Tensor, (torch.randn(5, 3), 2)),
    (aten.unbind_copy.int, (torch.randn(2, 3), 1)),
    (aten.alias_copy.default, (torch.randn(2),)),
    (aten.detach_copy.default, (torch.tensor(1.5),)),
    (aten.narrow_copy.default, (torch.randn(4, 5), 1, 1, 3)),
]


@pytest.mark.parametrize("op,args", COPY_OPS, ids=[f"{op}-{i}" for i, (op, _) in enumerate(COPY_OPS)])
def test_copy_ops(op, args):
    check(lambda *a: op(*a), *args)


def test_copy_ops_into_a_list_out():
    """``split_with_sizes_copy(..., out=[...])`` as FSDP2 unpacks an all-gather: the outs are
    strided views into other tensors; the op writes them and returns None."""
    def run(device):
        x = torch.arange(24.0).view(2, 12).to(device)
        a, b = torch.zeros(2, 8, device=device), torch.zeros(8, 2, device=device)
        assert torch.split_with_sizes_copy(x, [4, 8], dim=1, out=[a[:, 2:6], b.t()]) is None
        torch.unbind_copy(x.view(2, 2, 6)[:, 0, :2], 0, out=[a[0, :2], a[1, 6:]])
        return a.cpu(), b.cpu()

    for got, want in zip(run("tpu"), run("cpu")):
        torch.testing.assert_close(got, want)
    with pytest.raises(RuntimeError, match="out= argument of size 2"):
        torch.split_with_sizes_copy(torch.zeros(4, device="tpu"), [2, 2], out=[torch.zeros(2, device="tpu")])


def _jnp(a):
    return jnp.asarray(a.numpy()) if isinstance(a, torch.Tensor) else a


VIEW_CASES = [
    (aten.view.default, (torch.randn(2, 6), [4, -1])),
    (aten._unsafe_view.default, (torch.randn(2, 6), [12])),
    (aten.view.dtype, (torch.randn(2, 4), torch.int32)),
    (aten.permute.default, (torch.randn(2, 3, 4), [1, 2, 0])),
    (aten.transpose.int, (torch.randn(2, 3, 4), -1, 0)),
    (aten.t.default, (torch.randn(2, 3),)),
    (aten.expand.default, (torch.randn(3, 1), [2, -1, 4])),
    (aten.slice.Tensor, (torch.randn(6, 3), 0, -4, None, 2)),
    (aten.slice.Tensor, (torch.randn(6, 3), 1, 5, 10)),
    (aten.select.int, (torch.randn(6, 3), 1, -2)),
    (aten.unsqueeze.default, (torch.randn(6, 3), 1)),
    (aten.squeeze.dims, (torch.randn(1, 3, 1), [0, -1])),
    (aten.squeeze.default, (torch.randn(1, 3, 1),)),
    (aten.as_strided.default, (torch.randn(4, 5), [3, 2], [1, 5], 2)),
    (aten.alias.default, (torch.randn(3),)),
    (aten.diagonal.default, (torch.randn(3, 4), -1)),
    (aten.unfold.default, (torch.randn(2, 8), -1, 4, 3)),
    (aten.split_with_sizes.default, (torch.randn(5, 3), [1, 4])),
    (aten.split.Tensor, (torch.randn(5, 3), 2, 0)),
    (aten.unbind.int, (torch.randn(2, 3), 0)),
    (aten._to_copy.default, (torch.randn(2, 3),)),
]


@pytest.mark.parametrize("op,args", VIEW_CASES, ids=[f"{op}-{i}" for i, (op, _) in enumerate(VIEW_CASES)])
def test_view_lowerings_match_torch(op, args):
    expected = op(*args)
    got = registry.for_graph(op).call(None, [_jnp(a) for a in args], {})
    if isinstance(expected, (list, tuple)):
        assert len(got) == len(expected)
        pairs = zip(got, expected)
    else:
        pairs = [(got, expected)]
    for g, e in pairs:
        assert_close(torch.from_numpy(np.asarray(g).copy()), e)


def test_to_copy_lowering_casts():
    x = jnp.asarray([1.7, -2.2])
    out = registry.for_graph(aten._to_copy.default).fn(x, dtype=torch.int64, device=torch.device("cpu"))
    assert_close(torch.from_numpy(np.array(out)), torch.tensor([1.7, -2.2]).to(torch.int64))


def test_view_ops_are_views_in_eager():
    """Eager must keep views as metadata: every view overload is declared a view (its eager kernel
    shares the base's storage), and the graph-only ones get no eager kernel at all."""
    from torchtpu.eager import register

    kernels = register.kernels()
    for op in shape_ops._VIEWS:
        assert registry.LOWERINGS[op].view, op
        assert op not in kernels or not hasattr(kernels[op], "lowering"), op  # never a computing kernel
    graph_only = {aten._to_copy.default, aten.zeros_like.default, aten.full_like.default, aten.alias.default,
                  aten.detach.default}
    assert graph_only <= set(registry.GRAPH_ONLY)
    assert not graph_only & set(registry.LOWERINGS)


@pytest.mark.parametrize("make", [lambda x: x.t(), lambda x: x.permute(1, 0), lambda x: x[1:, ::2],
                                  lambda x: x.unsqueeze(0).expand(2, 3, 4), lambda x: x.diagonal(),
                                  lambda x: x.view(torch.int32), lambda x: x.unfold(1, 2, 1),
                                  lambda x: x.split(1)[2], lambda x: x.unbind(1)[3]],
                         ids=["t", "permute", "slice", "expand", "diagonal", "view_dtype", "unfold", "split",
                              "unbind"])
def test_eager_views_share_storage(make):
    x = torch.arange(12.0).reshape(3, 4)
    t = x.to("tpu")
    v, expected = make(t), make(x)
    assert v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    assert (v.shape, v.stride(), v.storage_offset()) == (expected.shape, expected.stride(), expected.storage_offset())
    assert_close(v.cpu(), expected)


def _compiled_shape_fn(x, i):
    y = torch.cat([x[i], x.gather(1, i[:, None].expand(-1, 4)), x.flip(0)[:2]]).roll(1, 0)
    z = F.pad(x[None], (1, 1), mode="reflect").tril()[0]
    w = x.clone()
    w[i] = 0.0
    return y.sum() + z.sum() + w.scatter_add(0, i[:, None].expand(-1, 4), x[:2]).sort(dim=1, stable=True)[0] \
        + x.t().contiguous().view(-1)[:4] + torch.full_like(x, 2)


def test_under_torch_compile():
    x, i = torch.randn(3, 4), torch.tensor([0, 2])
    got = torch.compile(_compiled_shape_fn, backend="tpu")(x.to("tpu"), i.to("tpu"))
    assert_close(got.cpu(), _compiled_shape_fn(x, i))
