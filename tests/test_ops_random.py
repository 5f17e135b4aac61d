"""Random ops on tpu: same seed gives the same numbers, and the samples have the right
distribution (statistical bounds, since the numbers need not equal the CPU generator's)."""

import math

import pytest
import torch
from torch.testing import assert_close

from torchtpu.runtime import native

from native_required import native_hooks_needed

pytestmark = pytest.mark.usefixtures("no_fallback")
N = 20000


def _draw(fn, seed=1234):
    torch.manual_seed(seed)
    return fn().cpu()


SAMPLERS = {
    "rand": lambda: torch.rand(3, 4, device="tpu"),
    "randn": lambda: torch.randn(5, device="tpu"),
    "uniform_": lambda: torch.empty(6, device="tpu").uniform_(-2, 3),
    "normal_": lambda: torch.empty(6, device="tpu").normal_(1, 2),
    "randint": lambda: torch.randint(0, 100, (7,), device="tpu"),
    "randperm": lambda: torch.randperm(9, device="tpu"),
    "bernoulli": lambda: torch.bernoulli(torch.full((8,), 0.5, device="tpu")),
    "multinomial": lambda: torch.multinomial(torch.ones(10, device="tpu"), 4),
}


@pytest.mark.parametrize("name", SAMPLERS)
def test_same_seed_same_numbers(name):
    fn = SAMPLERS[name]
    a, b = _draw(fn), _draw(fn)
    assert_close(a, b)
    assert not torch.equal(_draw(fn, 1), _draw(fn, 2))


def test_tpu_manual_seed_and_state():
    torch.tpu.manual_seed(7)
    a = torch.rand(4, device="tpu").cpu()
    state = torch.tpu.get_rng_state()
    b = torch.rand(4, device="tpu").cpu()
    torch.tpu.set_rng_state(state)
    assert_close(torch.rand(4, device="tpu").cpu(), b)
    torch.tpu.manual_seed(7)
    assert_close(torch.rand(4, device="tpu").cpu(), a)
    assert not torch.equal(a, b)


def _stats(x):
    x = x.double()
    return x.mean().item(), x.std().item()


def _close(value, expected, tol):
    assert abs(value - expected) < tol, (value, expected)


def test_uniform_and_rand():
    x = torch.rand(N, device="tpu").cpu()
    assert x.dtype == torch.float32 and 0 <= x.min() and x.max() < 1
    m, s = _stats(x)
    _close(m, 0.5, 0.01)
    _close(s, math.sqrt(1 / 12), 0.01)
    y = torch.empty(N, dtype=torch.float64, device="tpu").uniform_(-2, 4).cpu()
    assert y.dtype == torch.float64 and -2 <= y.min() and y.max() < 4
    _close(_stats(y)[0], 1.0, 0.05)
    assert torch.rand(2, 3, dtype=torch.bfloat16, device="tpu").dtype == torch.bfloat16
    assert torch.rand(0, device="tpu").shape == (0,)
    assert torch.rand((), device="tpu").shape == ()


def test_normal_variants():
    m, s = _stats(torch.randn(N, device="tpu").cpu())
    _close(m, 0.0, 0.03)
    _close(s, 1.0, 0.03)
    m, s = _stats(torch.empty(N, device="tpu").normal_(3, 0.5).cpu())
    _close(m, 3.0, 0.02)
    _close(s, 0.5, 0.02)
    mean = torch.full((N,), -1.0, device="tpu")
    m, s = _stats(torch.normal(mean, 2.0).cpu())
    _close(m, -1.0, 0.06)
    _close(s, 2.0, 0.06)
    m, s = _stats(torch.normal(5.0, torch.full((N,), 0.1, device="tpu")).cpu())
    _close(m, 5.0, 0.01)
    _close(s, 0.1, 0.01)
    m, s = _stats(torch.normal(mean, torch.full((N,), 3.0, device="tpu")).cpu())
    _close(s, 3.0, 0.1)
    out = torch.normal(2.0, 1.0, (N,), device="tpu")
    assert out.device.type == "tpu"
    _close(_stats(out.cpu())[0], 2.0, 0.03)
    assert torch.randn(3, dtype=torch.float64, device="tpu").dtype == torch.float64


def test_bernoulli_variants():
    p = torch.linspace(0, 1, N, device="tpu")
    x = torch.bernoulli(p).cpu()
    assert set(x.unique().tolist()) <= {0.0, 1.0}
    _close(x.mean().item(), 0.5, 0.02)
    assert x[:100].sum() == 0 or x[:100].mean() < 0.05  # low p: nearly all zeros
    y = torch.empty(N, device="tpu").bernoulli_(0.2).cpu()
    _close(y.mean().item(), 0.2, 0.015)
    z = torch.zeros(N, device="tpu").bernoulli_(torch.full((N,), 0.7, device="tpu")).cpu()
    _close(z.mean().item(), 0.7, 0.015)
    w = torch.ops.aten.bernoulli.p(torch.zeros(N, device="tpu"), 0.9).cpu()
    _close(w.mean().item(), 0.9, 0.015)
    b = torch.bernoulli(torch.full((N,), 0.5, dtype=torch.float64, device="tpu"))
    assert b.dtype == torch.float64


def test_dropout_uses_device_rng():
    x = torch.ones(N, device="tpu")
    y = torch.nn.functional.dropout(x, 0.25).cpu()
    _close((y == 0).double().mean().item(), 0.25, 0.015)
    assert_close(y[y != 0], torch.full_like(y[y != 0], 1 / 0.75))


def test_random_variants():
    x = torch.empty(N, dtype=torch.int64, device="tpu").random_(3, 10).cpu()
    assert x.min() == 3 and x.max() == 9
    y = torch.empty(N, device="tpu").random_(5).cpu()
    assert y.min() == 0 and y.max() == 4 and y.dtype == torch.float32
    z = torch.empty(N, dtype=torch.uint8, device="tpu").random_().cpu()
    assert z.min() >= 0 and z.max() <= 255 and z.float().mean() > 100
    f = torch.empty(N, device="tpu").random_().cpu()
    assert f.min() >= 0 and f.max() <= 2 ** 24 and f.max() > 2 ** 23
    b = torch.empty(N, dtype=torch.bool, device="tpu").random_().cpu()
    _close(b.double().mean().item(), 0.5, 0.02)
    with pytest.raises(RuntimeError):
        torch.empty(3, device="tpu").random_(5, 5)


def test_randint_randperm():
    r = torch.randint(-3, 4, (N,), device="tpu").cpu()
    assert r.dtype == torch.int64 and r.min() == -3 and r.max() == 3
    _close(r.double().mean().item(), 0.0, 0.1)
    r = torch.randint(5, (2, 3), dtype=torch.int32, device="tpu")
    assert r.dtype == torch.int32 and r.shape == (2, 3)
    like = torch.randint_like(torch.zeros(N, device="tpu"), 2, 6).cpu()
    assert like.dtype == torch.float32 and like.min() == 2 and like.max() == 5
    p = torch.randperm(50, device="tpu").cpu()
    assert p.dtype == torch.int64 and torch.equal(p.sort()[0], torch.arange(50))
    assert not torch.equal(p, torch.arange(50))
    assert torch.randperm(0, device="tpu").shape == (0,)


def test_exponential_geometric_lognormal_cauchy():
    e = torch.empty(N, device="tpu").exponential_(2.0).cpu()
    assert e.min() >= 0
    m, s = _stats(e)
    _close(m, 0.5, 0.02)
    _close(s, 0.5, 0.03)
    g = torch.empty(N, device="tpu").geometric_(0.25).cpu()
    assert g.min() >= 1 and torch.equal(g, g.round())
    m, s = _stats(g)
    _close(m, 4.0, 0.15)  # mean 1/p
    _close(s, math.sqrt(0.75) / 0.25, 0.2)
    ln = torch.empty(N, device="tpu").log_normal_(0.0, 0.5).cpu()
    assert ln.min() > 0
    m, s = _stats(ln.log())
    _close(m, 0.0, 0.02)
    _close(s, 0.5, 0.02)
    c = torch.empty(N, device="tpu").cauchy_(1.0, 2.0).cpu()
    _close(c.median().item(), 1.0, 0.1)  # the median, not the mean: Cauchy has none
    q = c.quantile(torch.tensor([0.25, 0.75], dtype=c.dtype))
    _close((q[1] - q[0]).item() / 2, 2.0, 0.15)  # half the interquartile range is the scale


def test_rand_like_randn_like():
    base = torch.zeros(N, dtype=torch.float64, device="tpu")
    u, n = torch.rand_like(base), torch.randn_like(base)
    assert u.dtype == n.dtype == torch.float64 and u.device.type == "tpu"
    _close(_stats(u.cpu())[0], 0.5, 0.01)
    _close(_stats(n.cpu())[1], 1.0, 0.03)


def test_multinomial():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3], device="tpu")
    draws = torch.multinomial(probs, N, replacement=True).cpu()
    assert draws.dtype == torch.int64 and draws.shape == (N,)
    freq = torch.bincount(draws, minlength=4).double() / N
    assert_close(freq, torch.tensor([0.1, 0.0, 0.6, 0.3], dtype=torch.float64), atol=0.02, rtol=0)
    rows = torch.tensor([[1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 5.0, 5.0]], device="tpu")
    picks = torch.multinomial(rows, 2).cpu()
    assert picks.shape == (2, 2)
    assert set(picks[1].tolist()) == {2, 3}
    assert 2 not in picks[0].tolist() and picks[0, 0] != picks[0, 1]
    with pytest.raises(RuntimeError):
        torch.multinomial(probs, 5)


# ---------------------------------------------------------------- torch.Generator("tpu")

needs_hooks = native_hooks_needed()

# Every way a generator reaches a random op: factories, in-place samplers, torch.nn.init, a
# positional generator (rrelu's schema takes it positionally).
GENERATOR_SAMPLERS = {
    "randn": lambda g: torch.randn(5, device="tpu", generator=g),
    "rand": lambda g: torch.rand(3, 4, device="tpu", generator=g),
    "randint": lambda g: torch.randint(0, 100, (7,), device="tpu", generator=g),
    "randperm": lambda g: torch.randperm(9, device="tpu", generator=g),
    "normal_": lambda g: torch.empty(6, device="tpu").normal_(1, 2, generator=g),
    "normal(Tensor)": lambda g: torch.normal(torch.zeros(6, device="tpu"), 1.0, generator=g),
    "uniform_": lambda g: torch.empty(6, device="tpu").uniform_(-2, 3, generator=g),
    "init.normal_": lambda g: torch.nn.init.normal_(torch.empty(6, device="tpu"), generator=g),
    "init.uniform_": lambda g: torch.nn.init.uniform_(torch.empty(6, device="tpu"), generator=g),
    "bernoulli": lambda g: torch.bernoulli(torch.full((8,), 0.5, device="tpu"), generator=g),
    "bernoulli_": lambda g: torch.empty(8, device="tpu").bernoulli_(0.5, generator=g),
    "multinomial": lambda g: torch.multinomial(torch.ones(10, device="tpu"), 4, generator=g),
    "random_": lambda g: torch.empty(6, device="tpu").random_(0, 1000, generator=g),
    "exponential_": lambda g: torch.empty(6, device="tpu").exponential_(generator=g),
    "rrelu": lambda g: torch.ops.aten.rrelu_with_noise(torch.full((6,), -1.0, device="tpu"),
                                                       torch.zeros(6, device="tpu"), 0.1, 0.3, True, g),
}


def _tpu_generator(seed: int) -> torch.Generator:
    return torch.Generator("tpu").manual_seed(seed)


@needs_hooks
@pytest.mark.usefixtures("each_eager_mode")
@pytest.mark.parametrize("name", GENERATOR_SAMPLERS)
def test_generator_draws_from_its_own_state(name):
    fn = GENERATOR_SAMPLERS[name]
    device_state = torch.tpu.get_rng_state()
    g1, g2 = _tpu_generator(11), _tpu_generator(11)
    first = fn(g1).cpu()
    torch.rand(3, device="tpu", generator=_tpu_generator(99))  # another generator in between
    assert_close(fn(g2).cpu(), first)  # same seed, same numbers; generators are independent
    assert not torch.equal(fn(g1).cpu(), first)  # g1 moved on
    assert not torch.equal(fn(_tpu_generator(12)).cpu(), first)
    assert torch.equal(torch.tpu.get_rng_state(), device_state)  # the device's state is untouched


@needs_hooks
def test_generator_seed_matches_device_seed():
    """A generator seeded with s draws what the device draws after torch.tpu.manual_seed(s)."""
    torch.tpu.manual_seed(5)
    from_device = torch.randn(8, device="tpu").cpu()
    assert_close(torch.randn(8, device="tpu", generator=_tpu_generator(5)).cpu(), from_device)


@needs_hooks
def test_dropout_draws_from_the_device_state_only():
    x = torch.ones(64, device="tpu")
    torch.manual_seed(3)
    a = torch.nn.functional.dropout(x, 0.5).cpu()
    torch.manual_seed(3)
    torch.randn(4, device="tpu", generator=_tpu_generator(0))
    assert_close(torch.nn.functional.dropout(x, 0.5).cpu(), a)


@needs_hooks
@pytest.mark.parametrize("device", ["cpu", "tpu"])
def test_generator_api_as_on_cpu(device):
    """The torch.Generator API behaves on a tpu generator as it does on a CPU one."""
    g = torch.Generator(device)
    assert g.device.type == device
    assert g.initial_seed() == torch.Generator("cpu").initial_seed()  # PyTorch's default seed
    assert g.manual_seed(9) is g and g.initial_seed() == 9
    state = g.get_state()
    assert state.dtype == torch.uint8 and state.device.type == "cpu"
    first = torch.rand(5, device=device, generator=g).cpu()
    second = torch.rand(5, device=device, generator=g).cpu()
    g.set_state(state)
    assert_close(torch.rand(5, device=device, generator=g).cpu(), first)
    assert_close(torch.rand(5, device=device, generator=g).cpu(), second)
    seed = g.seed()
    assert g.initial_seed() == seed
    clone = g.clone_state()
    assert clone is not g and clone.device == g.device
    assert_close(torch.rand(5, device=device, generator=clone).cpu(), torch.rand(5, device=device, generator=g).cpu())
    with pytest.raises(TypeError, match="ByteTensor"):
        g.set_state(torch.zeros(3))


@needs_hooks
def test_tpu_generator_state_is_the_device_state_format():
    torch.tpu.manual_seed(21)
    torch.rand(3, device="tpu")
    g = torch.Generator("tpu")
    g.set_state(torch.tpu.get_rng_state())
    assert g.initial_seed() == 21 and g.get_offset() == 1
    torch.tpu.manual_seed(21)
    torch.rand(3, device="tpu")
    assert_close(torch.rand(4, device="tpu", generator=g).cpu(), torch.rand(4, device="tpu").cpu())
    with pytest.raises(RuntimeError, match="16 bytes"):
        g.set_state(torch.zeros(3, dtype=torch.uint8))


@needs_hooks
def test_default_generator_is_the_device_state():
    """torch.accelerator's random functions read torch.tpu's state (the default generator)."""
    import torch.accelerator.random as accelerator_random

    torch.tpu.manual_seed(21)
    torch.rand(2, device="tpu")
    assert accelerator_random.initial_seed() == 21
    assert torch.equal(accelerator_random.get_rng_state(), torch.tpu.get_rng_state())
    default = torch._C._accelerator_getDefaultGenerator(0)
    default.manual_seed(33)
    assert torch.tpu.initial_seed() == 33 and default.initial_seed() == 33
    expected = torch.rand(4, device="tpu").cpu()
    default.manual_seed(33)
    assert_close(torch.rand(4, device="tpu", generator=default).cpu(), expected)
    assert torch.equal(default.get_state(), torch.tpu.get_rng_state())  # the draw advanced it


def test_cpu_generator_on_tpu_is_refused_as_on_cuda():
    with pytest.raises(RuntimeError, match="Expected a 'tpu' device type for generator but found 'cpu'"):
        torch.rand(3, device="tpu", generator=torch.Generator())


def test_cpu_sampling_with_cpu_generators_is_unaffected():
    """DataLoader shuffling and RandomSampler with a CPU generator: CPU numbers, tpu state untouched."""
    from torch.utils.data import DataLoader, RandomSampler

    device_state = torch.tpu.get_rng_state()
    expected = torch.randperm(10, generator=torch.Generator().manual_seed(0)).tolist()
    assert list(RandomSampler(range(10), generator=torch.Generator().manual_seed(0))) == expected
    orders = [next(iter(DataLoader(list(range(10)), batch_size=10, shuffle=True,
                                   generator=torch.Generator().manual_seed(0)))).tolist() for _ in range(2)]
    assert orders[0] == orders[1] and sorted(orders[0]) == list(range(10))
    assert torch.equal(torch.tpu.get_rng_state(), device_state)
