"""flex_attention's blockwise kernel: peak memory and time of forward+backward, side by side.

    python benchmarks/flex_attention.py [--lengths 1024 4096] [--repeats 3]

For each sequence length (batch 1, 8 heads, head dim 64, BlockMask blocks of 128) it prints:
- ``temp MiB``: XLA's memory analysis (temporary buffers) of one jitted forward+backward program,
  for the blockwise kernel with a causal BlockMask, the same kernel with every block listed
  (no sparsity), and a materialising softmax(QKᵀ)V with the same causal mask (jax.vjp);
- ``ms``: the median wall time of that program (after one warm-up call).
The causal row skips the blocks above the diagonal: about half the work of the full row.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from torchtpu.ops import flex_attention as flex

HEADS, DIM, BLOCK = 8, 64, 128


def _causal_blocks(n: int) -> flex.Blocks:
    """Diagonal blocks partial (mask applied), the ones below full, the ones above skipped."""
    counts = np.ones((1, 1, n), np.int32)
    indices = np.broadcast_to(np.arange(n, dtype=np.int32), (1, 1, n, n)).copy()
    full_counts = np.arange(n, dtype=np.int32).reshape(1, 1, n)
    full_indices = indices.copy()
    indices[0, 0, :, 0] = np.arange(n)
    return flex.Blocks(BLOCK, BLOCK, *map(jnp.asarray, (counts, indices, full_counts, full_indices)))


def _all_blocks(n: int) -> flex.Blocks:
    counts = np.full((1, 1, n), n, np.int32)
    indices = np.broadcast_to(np.arange(n, dtype=np.int32), (1, 1, n, n))
    return flex.Blocks(BLOCK, BLOCK, jnp.asarray(counts), jnp.asarray(indices))


def _identity(s, b, h, q, kv):
    return s


def _causal(b, h, q, kv):
    return q >= kv


def _blockwise(blocks: flex.Blocks):
    def step(q, k, v, grad):
        out, lse, _ = flex.forward(q, k, v, _identity, _causal, blocks, DIM ** -0.5)
        return flex.backward(q, k, v, out, lse, grad, None, _identity, _causal, blocks, DIM ** -0.5)[:3]

    return step


def _materialising(q, k, v, grad):
    def attend(q, k, v):
        s = jnp.einsum("bhqe,bhke->bhqk", q, k, precision="highest") * DIM ** -0.5
        n = q.shape[2]
        s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -jnp.inf)
        return jnp.einsum("bhqk,bhke->bhqe", jax.nn.softmax(s, -1), v, precision="highest")

    _, vjp = jax.vjp(attend, q, k, v)
    return vjp(grad)


def _measure(fn, args, repeats: int) -> tuple[float, float]:
    compiled = jax.jit(fn).lower(*args).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes / 2 ** 20
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return temp, statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'L':>6} {'variant':<22} {'temp MiB':>10} {'ms':>10}")
    for length in opts.lengths:
        args = [jnp.asarray(rng.standard_normal((1, HEADS, length, DIM)), jnp.float32) for _ in range(4)]
        n = length // BLOCK
        for name, fn in (("blockwise causal", _blockwise(_causal_blocks(n))),
                         ("blockwise all blocks", _blockwise(_all_blocks(n))),
                         ("materialising causal", _materialising)):
            temp, ms = _measure(fn, args, opts.repeats)
            print(f"{length:>6} {name:<22} {temp:>10.1f} {ms:>10.1f}", flush=True)


if __name__ == "__main__":
    main()
