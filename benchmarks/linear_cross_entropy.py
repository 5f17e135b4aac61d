"""Fused linear cross-entropy on tpu: peak memory and time of loss+gradients, chunked vs unfused.

    python benchmarks/linear_cross_entropy.py [--tokens 4096] [--hidden 512] [--vocabs 8192 32768]
                                              [--time-tokens 1024] [--repeats 3]

float32, class-index targets, reduction "mean". For each vocabulary size:

- ``temp MiB``: XLA's memory analysis (temporary buffers of the compiled program, not run) of one
  jitted loss-and-gradients program: the unfused loss (``logits = x @ W.T``, log-softmax, NLL and
  its ``jax.vjp``: what a compiled ``F.cross_entropy(F.linear(x, W), t)`` computes) and the
  chunked lowering that ``F.linear_cross_entropy(..., options=LinearCrossEntropyOptions())`` runs
  on tpu (``ops/losses.py``, chunk size from PyTorch's own default options, raised to
  ``losses.MIN_CHUNK_ROWS``). Inputs and outputs
  (x, W and their gradients) are not counted; one (tokens x vocab) float32 logits matrix is shown
  for scale.
- ``ms``: median wall time of the loss + ``backward()`` as users run it (eager, DEFER_NEVER, ended
  with a read of the gradients) at ``--time-tokens`` tokens: unfused and fused on tpu, fused on
  torch CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F
from torch.nn import LinearCrossEntropyOptions

from torchtpu.ops import losses

MIB = 1 << 20


def chunk_size(tokens: int, hidden: int, vocab: int) -> int:
    """The chunk the tpu lowering uses with PyTorch's default options for these sizes."""
    options = LinearCrossEntropyOptions()._adjust(num_batches=tokens, in_features=hidden, num_classes=vocab,
                                                  dtype=torch.float32, device=torch.device("tpu"))
    return losses.rows_per_chunk(tokens, options.batch_chunk_size)


def _unfused(x, w, target):
    def loss(x, w):
        logp = jax.nn.log_softmax(x @ w.T, axis=1)
        return -jnp.take_along_axis(logp, target[:, None], axis=1).mean()

    value, pullback = jax.vjp(loss, x, w)
    return (value, *pullback(jnp.ones((), value.dtype)))


def _fused(chunk: int):
    def run(x, w, target):
        return losses.chunked_loss_and_grads(x, w, target, None, None, "mean", -100, chunk, torch.float32,
                                             (True, True, False))[:3]
    return run


def temp_mib(fn, tokens: int, hidden: int, vocab: int) -> float:
    """XLA's temporary-buffer size of ``fn``'s compiled loss-and-gradients program, not run."""
    x, w = jax.ShapeDtypeStruct((tokens, hidden), jnp.float32), jax.ShapeDtypeStruct((vocab, hidden), jnp.float32)
    target = jax.ShapeDtypeStruct((tokens,), jnp.int32)
    return jax.jit(fn).lower(x, w, target).compile().memory_analysis().temp_size_in_bytes / MIB


def time_ms(device: str, fused: bool, tokens: int, hidden: int, vocab: int, repeats: int) -> float:
    """Median ms of the loss + backward on ``device``, as users call it."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(tokens, hidden, generator=gen) / hidden ** 0.5).to(device).requires_grad_()
    w = torch.randn(vocab, hidden, generator=gen).to(device).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    times = []
    for _ in range(repeats + 1):  # the first compiles
        start = time.perf_counter()
        if fused:
            loss = F.linear_cross_entropy(x, w, target, options=LinearCrossEntropyOptions())
        else:
            loss = F.cross_entropy(F.linear(x, w), target)
        loss.backward()
        x.grad.sum().item(), w.grad.sum().item()
        times.append((time.perf_counter() - start) * 1e3)
        x.grad = w.grad = None
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocabs", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--time-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    n, d = args.tokens, args.hidden
    print(f"tokens {n}, hidden {d}, float32, mean; temp MiB = XLA memory analysis of loss+grads")
    print(f"{'vocab':>6} {'chunk':>6} {'logits MiB':>11} {'unfused MiB':>12} {'fused MiB':>10} {'ratio':>7}")
    for v in args.vocabs:
        chunk = chunk_size(n, d, v)
        unfused, fused = temp_mib(_unfused, n, d, v), temp_mib(_fused(chunk), n, d, v)
        print(f"{v:>6} {chunk:>6} {n * v * 4 / MIB:>11.0f} {unfused:>12.1f} {fused:>10.1f} {unfused / fused:>6.1f}x")
    t = args.time_tokens
    print(f"\ntokens {t}, hidden {d}: median ms of loss + backward (eager)")
    print(f"{'vocab':>6} {'tpu unfused':>12} {'tpu fused':>10} {'cpu fused':>10}")
    for v in args.vocabs:
        row = [time_ms("tpu", False, t, d, v, args.repeats), time_ms("tpu", True, t, d, v, args.repeats),
               time_ms("cpu", True, t, d, v, args.repeats)]
        print(f"{v:>6} " + " ".join(f"{ms:>{w}.0f}" for ms, w in zip(row, (12, 10, 10))))


if __name__ == "__main__":
    main()
