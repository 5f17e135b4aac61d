"""Indexing ops on tpu against PyTorch CPU: advanced indexing, index_*, gather/scatter, masks,
sort/topk, searchsorted, unique, bincount/histc, and gradients through them."""

import pytest
import torch
from torch.testing import assert_close
from tpu_compare import check, to_tpu

pytestmark = [pytest.mark.usefixtures("no_fallback"),
              pytest.mark.filterwarnings("ignore:index_reduce\\(\\) is in beta", "ignore:The reduce argument")]


def grads_match(fn, x, *rest):
    """d fn(x, *rest) / dx on tpu equals the CPU gradient (for a random output cotangent)."""
    cx = x.clone().requires_grad_()
    out = fn(cx, *rest)
    g = torch.randn_like(out)
    out.backward(g)
    tx = x.to("tpu").requires_grad_()
    tout = fn(tx, *to_tpu(rest))
    tout.backward(g.to("tpu"))
    assert_close(tout.detach().cpu(), out.detach())
    assert_close(tx.grad.cpu(), cx.grad)


X = torch.randn(4, 5)
NC = torch.randn(5, 4).t()  # non-contiguous
IDX = torch.tensor([0, 2, -1, 2])


# ---------------------------------------------------------------- advanced indexing

@pytest.mark.parametrize("x", [X, NC, torch.randint(-5, 5, (4, 5)), torch.rand(4, 5) > 0.5], ids=["f", "nc", "i", "b"])
def test_index_tensor(x):
    check(lambda t, i: t[i], x, IDX)
    check(lambda t, i: t[:, i], x, IDX)
    check(lambda t, i: t[None, i], x, IDX)
    check(lambda t, i, j: t[i, j], x, IDX, torch.tensor([1, 0, 4, -2]))
    check(lambda t, i: t[i[:, None], i[None, :]], x, torch.tensor([0, 3]))
    check(lambda t, i: t[i], x, torch.tensor(1))
    check(lambda t, i: t[i], x, torch.zeros(0, dtype=torch.long))


def test_index_separated_advanced_dims_go_first():
    x = torch.randn(3, 4, 5)
    check(lambda t, i, j: t[i, :, j], x, torch.tensor([0, 2]), torch.tensor([1, 4]))
    check(lambda t, i: t[..., i], x, torch.tensor([[0, 1], [2, 3]]))


def test_index_bool_mask():
    x = torch.randn(4, 5)
    check(lambda t: t[t > 0], x)
    check(lambda t, m: t[m], x, torch.tensor([True, False, True, True]))
    check(lambda t, m: t[:, m], x, torch.tensor([True, False, False, True, True]))
    check(lambda t, m: t[m], x, torch.zeros(4, 5, dtype=torch.bool))
    with pytest.raises(IndexError):
        x.to("tpu")[torch.tensor([True, False], device="tpu")]


def test_unsafe_index():
    check(lambda t, i: torch.ops.aten._unsafe_index(t, [None, i]), X, IDX)


def test_index_put():
    def put(t, i, v, acc):
        t = t.clone()
        t.index_put_((i,), v, accumulate=acc)
        return t

    check(lambda t, i, v: put(t, i, v, False), X, torch.tensor([0, 3]), torch.randn(2, 5))
    check(lambda t, i, v: put(t, i, v, True), X, torch.tensor([0, 3, 0, -1]), torch.randn(4, 5))
    check(lambda t, i, v: put(t, i, v, True), NC, torch.tensor([1, 1]), torch.tensor(2.0))
    check(lambda t, i, v: put(t, i, v, False), torch.randint(0, 9, (6,)), torch.tensor([5, 0]), torch.tensor([-1, -2]))


def test_setitem_masks_and_indices():
    def setitem(t, key, v):
        t = t.clone()
        t[key] = v
        return t

    check(lambda t: setitem(t, t > 0, 0.0), X)
    check(lambda t, v: setitem(t, t < 0, v), X, torch.tensor(-7.0))
    check(lambda t, v: setitem(t, t[:, 0] > 0, v), X, torch.randn(5))
    check(lambda t, m, v: setitem(t, m, v), X, torch.rand(4, 5) > 0.3, torch.tensor(1.5))
    check(lambda t, i: setitem(t, (i, i), 3.0), X, torch.tensor([1, 2]))
    check(lambda t: setitem(t, (slice(None), torch.tensor([0, 2], device=t.device)), 9.0), NC)
    check(lambda t: setitem(t, [1, 3], 9.0), NC)  # a list index becomes a device tensor
    check(lambda t, v: setitem(t, t > 0, v), torch.zeros(4, 5), torch.arange(0.0, 20.0)[:0] + 1)  # no True
    check(lambda t: setitem(t, (slice(None), t[0] > 0), torch.arange(4.0, device=t.device)[:, None]), X)
    check(lambda t, m: setitem(t, m, torch.arange(float(m.sum()), device=t.device)), X, X > 0.3)  # one per True


def test_index_put_mask_accumulate_and_compiled():
    def acc(t, m, v):
        return t.index_put((m,), v, accumulate=True)

    check(acc, X, X[:, 0] > 0, torch.randn(5))
    check(acc, torch.zeros(3, dtype=torch.bool), torch.tensor([True, False, True]), torch.tensor([True, False]))
    m, v = X > 0, torch.randn(int((X > 0).sum()))
    compiled = torch.compile(lambda t, m, v: t.index_put((m,), v) * 2, backend="tpu")
    assert_close(compiled(X.to("tpu"), m.to("tpu"), v.to("tpu")).cpu(), X.index_put((m,), v) * 2)


def test_index_grad():
    grads_match(lambda t, i: t[i], X, torch.tensor([0, 2, 0]))  # duplicate index accumulates
    grads_match(lambda t, i: t[:, i], X, torch.tensor([4, 1]))
    grads_match(lambda t: t[t > 0], X)


# ---------------------------------------------------------------- index_* along a dim

@pytest.mark.parametrize("x", [X, NC, torch.randint(-5, 5, (4, 5))], ids=["f", "nc", "i"])
def test_index_select(x):
    check(lambda t, i: t.index_select(0, i), x, torch.tensor([3, 0, 3]))
    check(lambda t, i: t.index_select(-1, i), x, torch.tensor([4]))
    check(lambda t, i: t.index_select(1, i), x, torch.tensor(2))
    check(lambda t, i: t.index_select(0, i), x, torch.zeros(0, dtype=torch.long))


def test_index_select_0d():
    check(lambda t, i: t.index_select(0, i), torch.tensor(3.0), torch.tensor([0]))
    grads_match(lambda t, i: t.index_select(1, i), X, torch.tensor([0, 0, 3]))


def test_index_add_copy_fill():
    i = torch.tensor([0, 2, 0])
    check(lambda t, s: t.index_add(0, i.to(t.device), s), X, torch.randn(3, 5))
    check(lambda t, s: t.index_add(1, i.to(t.device), s, alpha=2.0), NC, torch.randn(4, 3))
    check(lambda t, s: t.index_add(0, i.to(t.device), s), torch.randint(0, 5, (3, 2)), torch.randint(0, 5, (3, 2)))
    check(lambda t, s: t.index_copy(0, torch.tensor([3, 1], device=t.device), s), X, torch.randn(2, 5))
    check(lambda t: t.index_fill(1, torch.tensor([0, 4], device=t.device), -1.0), X)
    check(lambda t, v: t.index_fill(0, torch.tensor([1], device=t.device), v), X, torch.tensor(2.0))
    check(lambda t: t.index_fill(0, torch.tensor([1], device=t.device), True), torch.zeros(3, dtype=torch.bool))
    check(lambda t: t.index_add(0, torch.tensor([0], device=t.device), torch.tensor(2.0, device=t.device)),
          torch.tensor(1.0))
    grads_match(lambda t: t.index_fill(0, torch.tensor([0, 2, 0], device=t.device), 1.0), X)
    grads_match(lambda t, s: t.index_add(0, torch.tensor([0, 2, 0], device=t.device), s), X, torch.randn(3, 5))


@pytest.mark.parametrize("reduce", ["prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_index_reduce(reduce, include_self):
    i = torch.tensor([0, 2, 0, 3])
    check(lambda t, s: t.index_reduce(0, i.to(t.device), s, reduce, include_self=include_self), X, torch.randn(4, 5))


# ---------------------------------------------------------------- gather / scatter

def _rand_index(shape, high):
    return torch.randint(0, high, shape)


@pytest.mark.parametrize("x", [X, NC, torch.randint(-5, 5, (4, 5))], ids=["f", "nc", "i"])
def test_gather(x):
    check(lambda t, i: t.gather(0, i), x, _rand_index((3, 5), 4))
    check(lambda t, i: t.gather(1, i), x, _rand_index((2, 3), 5))  # index smaller than x
    check(lambda t, i: t.gather(-1, i), x, torch.zeros(4, 0, dtype=torch.long))
    check(lambda t, i: torch.take_along_dim(t, i, 1), x, _rand_index((4, 2), 5))
    check(lambda t, i: t.gather(0, i), torch.tensor(5.0), torch.tensor(0))


def test_gather_grad():
    grads_match(lambda t, i: t.gather(1, i), X, _rand_index((4, 7), 5))
    grads_match(lambda t, i: torch.take_along_dim(t, i, 0), NC, _rand_index((2, 5), 4))


def test_scatter_variants():
    i = torch.tensor([[0, 1, 2, 0, 3], [3, 2, 1, 1, 0]])  # no duplicates within a column
    src = torch.randn(2, 5)
    check(lambda t, i, s: t.scatter(0, i, s), X, i, src)
    check(lambda t, i: t.scatter(0, i, -2.5), X, i)
    check(lambda t, i, s: t.scatter(1, i[:, :3].sort(1)[0] * 0 + torch.tensor([0, 2, 4], device=t.device), s),
          NC, i, src)
    dup = torch.tensor([[0, 1, 0, 0, 3], [0, 1, 0, 2, 3]])
    check(lambda t, i, s: t.scatter_add(0, i, s), X, dup, src)
    check(lambda t, i, s: t.scatter(0, i, s, reduce="add"), X, dup, src)
    check(lambda t, i, s: t.scatter(0, i, s, reduce="multiply"), X, dup, src)
    check(lambda t, i: t.scatter(0, i, 2.0, reduce="multiply"), X, dup)
    check(lambda t, i, s: t.scatter_add(0, i, s), torch.zeros(4, 5, dtype=torch.long), dup, torch.ones(2, 5, dtype=torch.long))
    check(lambda t, i, s: t.scatter_add(0, i, s), torch.tensor(1.0), torch.tensor(0), torch.tensor(2.0))


@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce(reduce, include_self):
    dup = torch.tensor([[0, 1, 0, 0, 3], [0, 1, 0, 2, 3], [3, 3, 3, 3, 3]])
    src = torch.randn(3, 5)
    check(lambda t, i, s: t.scatter_reduce(0, i, s, reduce, include_self=include_self), X, dup, src)
    check(lambda t, i, s: t.scatter_reduce(0, i, s, reduce, include_self=include_self),
          torch.randint(-9, 9, (4, 5)), dup, torch.randint(-9, 9, (3, 5)))


def test_scatter_grad():
    i = torch.tensor([[0, 1, 2, 0, 3], [3, 2, 1, 1, 0]])
    src = torch.randn(2, 5)
    grads_match(lambda t, i, s: t.scatter_add(0, i, s), X, i, src)
    grads_match(lambda s, i, t: t.scatter_add(0, i, s), src, i, X)
    grads_match(lambda s, i, t: t.scatter(0, i, s), src, i, X)


def test_put_and_empty_index():
    check(lambda t, i, s: t.put(i, s), X, torch.tensor([0, -1, 7]), torch.randn(3))
    check(lambda t, i, s: t.put(i, s, accumulate=True), X, torch.tensor([[0, 0], [19, 7]]), torch.randn(2, 2))
    check(lambda t, i, s: t.put(i, s, accumulate=True), torch.zeros(4, dtype=torch.bool), torch.tensor([1, 1]),
          torch.tensor([True, False]))
    check(lambda t, i: t.gather(0, i), torch.randn(5), torch.zeros(2, 0, dtype=torch.long))
    check(lambda t, i: t.gather(0, i), torch.tensor(5.0), torch.tensor([0, 0]))
    check(lambda t, i, s: t.scatter_add(0, i, s), torch.randn(5), torch.zeros(2, 0, dtype=torch.long), torch.randn(2, 0))


def test_repeat_interleave():
    check(torch.repeat_interleave, torch.tensor([2, 0, 3]))
    check(torch.repeat_interleave, torch.tensor([1, 2], dtype=torch.int32))
    check(torch.repeat_interleave, torch.zeros(0, dtype=torch.long))
    check(lambda t, r: t.repeat_interleave(r, dim=0), X[:3], torch.tensor([1, 0, 2]))
    check(lambda t: t.repeat_interleave(2, dim=1), NC)
    grads_match(lambda t: t.repeat_interleave(2, dim=0), X)


def test_take():
    check(lambda t, i: t.take(i), X, torch.tensor([[0, 19], [-1, 7]]))
    check(lambda t, i: t.take(i), NC, torch.tensor([1, 5, -20]))
    check(lambda t, i: t.take(i), torch.tensor(3), torch.tensor(0))


# ---------------------------------------------------------------- masks

@pytest.mark.parametrize("x", [X, NC, torch.randint(-5, 5, (4, 5)), torch.rand(4, 5) > 0.5], ids=["f", "nc", "i", "b"])
def test_masked_fill(x):
    m = torch.rand(4, 5) > 0.5
    check(lambda t, m: t.masked_fill(m, 1), x, m)
    check(lambda t, m, v: t.masked_fill(m, v), x, m, torch.tensor(0).to(x.dtype))
    check(lambda t, m: t.masked_fill(m, 0), x, m[0])  # broadcast mask
    check(lambda t, m: t.clone().masked_fill_(m, 1), x, m)


def test_masked_fill_grad_and_0d():
    check(lambda t, m: t.masked_fill(m, 2.0), torch.tensor(1.0), torch.tensor(True))
    grads_match(lambda t, m: t.masked_fill(m, 0.0), X, X > 0)


def test_masked_scatter_and_select():
    m = torch.rand(4, 5) > 0.5
    src = torch.randn(20)
    check(lambda t, m, s: t.masked_scatter(m, s), X, m, src)
    check(lambda t, m, s: t.masked_scatter(m, s), NC, m[1], src.reshape(4, 5))
    check(lambda t, m, s: t.masked_scatter(m, s), torch.zeros(4, 5, dtype=torch.long), m, torch.arange(20))
    check(lambda t, m: t.masked_select(m), X, m)
    check(lambda t, m: t.masked_select(m), NC, m[0])
    check(lambda t, m: t.masked_select(m), torch.tensor(2.0), torch.tensor(True))
    grads_match(lambda s, m, t: t.masked_scatter(m, s), src, m, X)
    grads_match(lambda t, m: t.masked_select(m), X, m)


@pytest.mark.parametrize("x", [X > 0, torch.randint(0, 2, (3, 4, 2)), torch.tensor(0.0), torch.tensor(2),
                               torch.zeros(0, 3), NC], ids=["b", "i3", "0d0", "0d1", "empty", "nc"])
def test_nonzero(x):
    check(torch.nonzero, x)
    check(lambda t: torch.nonzero(t, as_tuple=True), x)
    check(torch.argwhere, x)


def test_nonzero_static():
    x = torch.tensor([0, 3, 0, 4])
    check(lambda t: torch.nonzero_static(t, size=3), x)
    check(lambda t: torch.nonzero_static(t, size=1, fill_value=-5), x)


def test_where_with_masks():
    check(lambda m, a, b: torch.where(m, a, b), X > 0, X, NC)
    check(lambda m: torch.where(m), X > 0)


# ---------------------------------------------------------------- sorting

SORT_INPUTS = {
    "float": torch.randn(4, 6),
    "nc": torch.randn(6, 4).t(),
    "ties": torch.randint(0, 3, (4, 6)).float(),
    "int": torch.randint(-5, 5, (4, 6)),
    "nan": torch.tensor([[1.0, float("nan"), -1.0, 2.0, float("nan"), 0.0]]),
    "bool": torch.rand(3, 5) > 0.5,
}


@pytest.mark.parametrize("kind", SORT_INPUTS)
def test_sort_stable(kind):
    x = SORT_INPUTS[kind]
    for descending in (False, True):
        check(lambda t: t.sort(stable=True, descending=descending), x)
        check(lambda t: t.sort(dim=0, stable=True, descending=descending), x)
        check(lambda t: t.argsort(stable=True, descending=descending), x)


def test_sort_edge_and_grad():
    check(lambda t: t.sort(), torch.tensor(3.0))
    check(lambda t: t.sort(), torch.zeros(0))
    check(lambda t: t.sort(descending=True), torch.randn(7))
    grads_match(lambda t: t.sort(1)[0], X)


def test_topk_kthvalue():
    x = torch.randn(4, 6)
    check(lambda t: t.topk(3), x)
    check(lambda t: t.topk(2, dim=0, largest=False), x)
    check(lambda t: t.topk(2), torch.randint(-99, 99, (3, 8)) * 3 + torch.arange(8))  # distinct
    check(lambda t: t.topk(1), torch.tensor(3.0))
    check(lambda t: t.kthvalue(2), x)
    check(lambda t: t.kthvalue(3, 0, True), x)
    check(lambda t: t.kthvalue(1), torch.tensor(2.0))
    grads_match(lambda t: t.topk(2)[0], x)
    with pytest.raises(RuntimeError):
        x.to("tpu").topk(7)


def test_unique():
    x = torch.tensor([3, 1, 2, 3, 1, 7])
    check(lambda t: torch.unique(t), x)
    check(lambda t: torch.unique(t, return_inverse=True, return_counts=True), x)
    check(lambda t: torch.unique(t, return_inverse=True), x.reshape(2, 3))
    check(lambda t: torch.unique(t), torch.tensor([1.5, -1.0, 1.5]))
    check(lambda t: torch.unique(t), torch.zeros(0))
    m = torch.tensor([[1, 2], [0, 0], [1, 2]])
    check(lambda t: torch.unique(t, dim=0, return_inverse=True, return_counts=True), m)
    c = torch.tensor([1, 1, 2, 2, 3, 1, 1, 2])
    check(lambda t: torch.unique_consecutive(t, return_inverse=True, return_counts=True), c)
    check(lambda t: torch.unique_consecutive(t, dim=0, return_counts=True), m[[0, 0, 1, 2]])


# ---------------------------------------------------------------- searching and counting

def test_searchsorted_bucketize():
    seq = torch.tensor([1.0, 2.0, 2.0, 5.0])
    v = torch.tensor([[0.0, 2.0, 6.0], [2.0, 1.0, 5.0]])
    check(lambda s, v: torch.searchsorted(s, v), seq, v)
    check(lambda s, v: torch.searchsorted(s, v, right=True), seq, v)
    check(lambda s, v: torch.searchsorted(s, v, side="right", out_int32=True), seq, v)
    rows = torch.sort(torch.randn(2, 5))[0]
    check(lambda s, v: torch.searchsorted(s, v), rows, torch.randn(2, 3))
    unsorted = torch.tensor([5.0, 1.0, 3.0])
    check(lambda s, v, o: torch.searchsorted(s, v, sorter=o), unsorted, v, torch.argsort(unsorted))
    check(lambda s: torch.searchsorted(s, 2.0), seq)
    check(lambda v, b: torch.bucketize(v, b), v, seq)
    check(lambda v, b: torch.bucketize(v, b, right=True, out_int32=True), v, seq)
    check(lambda v, b: torch.bucketize(v, b), torch.randint(0, 9, (5,)), torch.tensor([2, 4, 6]))


def test_bincount_histc():
    x = torch.tensor([0, 3, 1, 3, 3])
    check(torch.bincount, x)
    check(lambda t: torch.bincount(t, minlength=7), x)
    check(lambda t, w: torch.bincount(t, w), x, torch.randn(5))
    check(lambda t, w: torch.bincount(t, w), x, torch.randn(5, dtype=torch.float64))
    check(torch.bincount, torch.zeros(0, dtype=torch.long))
    with pytest.raises(RuntimeError):
        torch.bincount(torch.tensor([-1, 2], device="tpu"))
    y = torch.randn(100)
    check(torch.histc, y)
    check(lambda t: torch.histc(t, bins=7, min=-1, max=1), y)
    check(lambda t: torch.histc(t, bins=4), torch.tensor([1.0, 1.0, 1.0]))
    check(lambda t: torch.histc(t, bins=5, min=0, max=4), torch.tensor([0.0, 1.0, 4.0, 5.0, -1.0]))


@pytest.mark.parametrize("shape", [(), (7,), (4, 5), (3, 0, 2)], ids=str)
@pytest.mark.parametrize("weighted,density", [(False, False), (True, False), (False, True), (True, True)])
def test_histogram(shape, weighted, density):
    x = torch.randn(shape) * 3
    w = torch.rand(shape) if weighted else None
    check(lambda t, w: torch.histogram(t, 4, weight=w, density=density), x, w)
    check(lambda t, w: torch.histogram(t, 3, range=(-1.0, 2.0), weight=w, density=density), x, w)
    check(lambda t, b, w: torch.histogram(t, b, weight=w, density=density), x, torch.tensor([-3.0, -0.5, 0.0, 4.0]), w)


def test_histogram_edges_and_errors():
    check(lambda t: torch.histogram(t, 5), torch.tensor([2.0, 2.0, 2.0]))  # one value: edges widened by 0.5
    check(lambda t: torch.histogram(t, 4), torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0]))  # values on the edges
    check(lambda t: torch.histogram(t, 2, range=(0.0, 1.0)), torch.tensor([float("nan"), 0.5, 7.0]))
    check(lambda t: torch.histogram(t, 3), torch.randn(4, 6).t())  # non-contiguous
    for bad in (lambda: torch.histogram(torch.arange(4, device="tpu"), 2),
                lambda: torch.histogram(torch.randn(4, device="tpu"), 0),
                lambda: torch.histogram(torch.randn(4, device="tpu"), 2, range=(1.0, 0.0))):
        with pytest.raises(RuntimeError):
            bad()


@pytest.mark.parametrize("shape,bins", [((6, 2), [2, 3]), ((2, 4, 3), [3, 1, 2]), ((5, 0, 2), [2, 2])], ids=str)
@pytest.mark.parametrize("weighted,density", [(False, False), (True, True)])
def test_histogramdd(shape, bins, weighted, density):
    x = torch.randn(shape) * 3
    w = torch.rand(shape[:-1]) if weighted else None
    check(lambda t, w: torch.histogramdd(t, bins, weight=w, density=density), x, w)
    check(lambda t, w: torch.histogramdd(t, bins, range=[-1.0, 1.0] * len(bins), weight=w, density=density), x, w)
    # edges need not be sorted: the bins are PyTorch's (its CPU kernel bisects them as given)
    edges = [torch.randn(b + 1) * 3 for b in bins]
    check(lambda t, e, w: torch.histogramdd(t, e, weight=w, density=density), x, edges, w)
    check(lambda t, e, w: torch.histogramdd(t, [s.sort().values for s in e], weight=w, density=density), x, edges, w)


# ---------------------------------------------------------------- embedding_bag

@pytest.mark.parametrize("mode,padding_idx,scale", [("sum", None, True), ("sum", 2, False), ("mean", 2, True),
                                                     ("mean", None, False), ("max", None, False), ("max", 2, False)])
def test_embedding_bag_and_grad(mode, padding_idx, scale):
    import torch.nn.functional as F

    weight = torch.randn(6, 3)
    indices = torch.tensor([1, 2, 4, 5, 4, 3, 2, 0])
    offsets = torch.tensor([0, 2, 2, 5])  # the second bag is empty
    psw = torch.rand(8) if mode == "sum" else None

    def bag(w, i, o, p):
        return F.embedding_bag(i, w, o, mode=mode, padding_idx=padding_idx, scale_grad_by_freq=scale,
                               per_sample_weights=p)

    cw, cp = weight.clone().requires_grad_(), psw.clone().requires_grad_() if psw is not None else None
    out = bag(cw, indices, offsets, cp)
    g = torch.randn_like(out)
    out.backward(g)
    tw, tp = weight.to("tpu").requires_grad_(), psw.to("tpu").requires_grad_() if psw is not None else None
    tout = bag(tw, indices.to("tpu"), offsets.to("tpu"), tp)
    tout.backward(g.to("tpu"))
    assert_close(tout.detach().cpu(), out.detach())
    assert_close(tw.grad.cpu(), cw.grad)
    if psw is not None:
        assert_close(tp.grad.cpu(), cp.grad)


def test_embedding_bag_2d_and_last_offset():
    import torch.nn.functional as F

    w = torch.randn(6, 3)
    check(lambda i, w: F.embedding_bag(i, w), torch.randint(0, 6, (3, 4)), w)
    check(lambda i, w, o: F.embedding_bag(i, w, o, include_last_offset=True, mode="max"),
          torch.tensor([1, 2, 4, 5, 4, 3]), w, torch.tensor([0, 3, 6]))
