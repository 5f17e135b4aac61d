"""Fused SDPA on tpu: time and peak memory of forward+backward, materialising vs blockwise vs torch CPU.

    python benchmarks/attention.py [--seqs 1024 4096 8192 16384] [--repeats 3] [--time-materialising-up-to 4096]
                                   [--decode-keys 40 1024] [--decode-only]

Causal self-attention, batch 1, 8 heads, head dim 64, float32. For each sequence length:

- ``ms``: median wall time of ``F.scaled_dot_product_attention(...)`` + ``backward()`` as users run
  it (eager, DEFER_NEVER, ended with a read of the gradients), for the tpu math path
  (``sdpa_kernel([SDPBackend.MATH])``: what tpu ran before the fused op, the L×L decomposition),
  the tpu fused path (the default: the blockwise lowering) and torch's CPU SDPA (its flash kernel);
- ``temp MiB``: XLA's memory analysis (temporary buffers of the compiled program, not run) of one
  jitted forward+backward program: the materialising lowering (``reference_attention`` and its
  ``jax.vjp``: the attention lowering before the blockwise one) and the blockwise forward and
  backward lowerings. Inputs and outputs (4 MiB each at 16k) are not counted.

Then a decode step's attention as generation runs it (``--decode-keys``; ``--decode-only`` skips the
table above): under ``torch.no_grad``, one query of 8 heads (a transposed ``[B, T, H, D]`` view, as
Transformers makes it) over 4 KV heads of head dim 32, microseconds per call (loops of 200 calls,
each read at the end, taken in turns): SDPA on tpu (no backward: the fused lowering's output alone),
the fused op that SDPA on tpu dispatches where a backward may follow, and torch's CPU SDPA.

The materialising path is timed only up to ``--time-materialising-up-to`` (its L×L buffers are
2 GiB per score-sized array at 8k on 8 heads); its memory is analysed at every length.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from torchtpu.ops import attention

HEADS, DIM = 8, 64
MIB = 1 << 20


def _materialising(q, k, v, g):
    out, vjp = jax.vjp(lambda a, b, c: attention.reference_attention(a, b, c, causal=True)[0], q, k, v)
    return (out, *vjp(g))


def _blockwise(q, k, v, g):
    out, lse, *_ = attention.fused_attention(None, q, k, v, None, 0.0, True)
    return (out, *attention.fused_attention_backward(g, q, k, v, None, [True, True, True, False], out, lse, None,
                                                     None, 0, 0, 0.0, True, None, None)[:3])


def temp_mib(fn, length: int) -> float:
    """XLA's temporary-buffer size of ``fn``'s compiled forward+backward program, not run."""
    spec = jax.ShapeDtypeStruct((1, HEADS, length, DIM), jnp.float32)
    analysis = jax.jit(fn).lower(spec, spec, spec, spec).compile().memory_analysis()
    return analysis.temp_size_in_bytes / MIB


def time_ms(device: str, length: int, repeats: int, backend: SDPBackend | None) -> float:
    """Median ms of SDPA forward+backward on ``device`` (backend None: the default choice)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, length, DIM, generator=gen).to(device).requires_grad_() for _ in range(3))
    g = torch.randn(1, HEADS, length, DIM, generator=gen).to(device)

    def step():
        with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)
        q.grad.sum().item()  # waits for the device
        q.grad = k.grad = v.grad = None

    step()  # compiles
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run(seqs: list[int], repeats: int, time_materialising_up_to: int) -> list[dict]:
    rows = []
    for length in seqs:
        row = {"L": length, "mat_mib": temp_mib(_materialising, length), "blk_mib": temp_mib(_blockwise, length)}
        row["mat_ms"] = (time_ms("tpu", length, repeats, SDPBackend.MATH)
                         if length <= time_materialising_up_to else None)
        row["blk_ms"] = time_ms("tpu", length, repeats, None)
        row["cpu_ms"] = time_ms("cpu", length, repeats, None)
        rows.append(row)
        print(_line(row), flush=True)
    return rows


HEADER = ("| L | materialising ms | blockwise ms | torch CPU ms | blockwise / materialising speed | "
          "blockwise / torch CPU speed | materialising temp MiB | blockwise temp MiB | memory ratio |\n"
          "|---|---|---|---|---|---|---|---|---|")


def _fmt(value, spec: str, unit: str = "") -> str:
    return "—" if value is None else format(value, spec) + unit


def _line(row: dict) -> str:
    speed = None if row["mat_ms"] is None else row["mat_ms"] / row["blk_ms"]
    return (f"| {row['L']} | {_fmt(row['mat_ms'], '.0f')} | {row['blk_ms']:.0f} | {row['cpu_ms']:.0f} | "
            f"{_fmt(speed, '.2f', 'x')} | {row['cpu_ms'] / row['blk_ms']:.2f}x | {row['mat_mib']:.0f} | "
            f"{row['blk_mib']:.1f} | {row['blk_mib'] / row['mat_mib']:.4f} |")


DECODE_HEADS, DECODE_KV_HEADS, DECODE_DIM, DECODE_CALLS = 8, 4, 32, 200


def decode(keys: list[int], repeats: int) -> list[dict]:
    """The decode-step rows: {keys, us per call of each path}."""
    fused_op = torch.ops.aten._scaled_dot_product_fused_attention_overrideable.default
    rows = []
    for s in keys:
        gen = torch.Generator().manual_seed(s)
        q = torch.randn(1, 1, DECODE_HEADS, DECODE_DIM, generator=gen).transpose(1, 2)
        k, v = (torch.randn(1, DECODE_KV_HEADS, s, DECODE_DIM, generator=gen) for _ in range(2))
        dq, dk, dv = (t.to("tpu") for t in (q, k, v))
        paths = {
            "output": lambda: F.scaled_dot_product_attention(dq, dk, dv, enable_gqa=True),
            "fused op": lambda: fused_op(dq, dk, dv, None, 0.0, False, False)[0],
            "cpu": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        }
        times = {name: [] for name in paths}
        with torch.no_grad():
            for name, fn in paths.items():  # compiled, and the same answer
                torch.testing.assert_close(fn().cpu(), paths["cpu"](), atol=1e-5, rtol=1e-4)
            for _ in range(repeats):
                for name, fn in paths.items():
                    start = time.perf_counter()
                    for _ in range(DECODE_CALLS):
                        out = fn()
                    out.cpu()
                    times[name].append((time.perf_counter() - start) / DECODE_CALLS * 1e6)
        rows.append({"keys": s, **{name: statistics.median(t) for name, t in times.items()}})
    return rows


DECODE_HEADER = ("| keys | tpu SDPA, no backward (us) | tpu fused op (us) | torch CPU SDPA (us) | fused op / no backward "
                 "| no backward / CPU |\n| ---: | ---: | ---: | ---: | ---: | ---: |")


def _decode_line(row: dict) -> str:
    return (f"| {row['keys']} | {row['output']:.1f} | {row['fused op']:.1f} | {row['cpu']:.1f} | "
            f"{row['fused op'] / row['output']:.2f}x | {row['output'] / row['cpu']:.2f}x |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096, 8192, 16384])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--time-materialising-up-to", type=int, default=4096)
    p.add_argument("--decode-keys", type=int, nargs="+", default=[40, 1024])
    p.add_argument("--decode-only", action="store_true", help="only the decode-step table")
    args = p.parse_args(argv)
    torch.zeros(1, device="tpu")  # starts the runtime (and JAX's x64 mode) before the analyses
    if not args.decode_only:
        print(f"causal SDPA forward+backward, batch 1, {HEADS} heads, head dim {DIM}, float32; "
              f"median of {args.repeats}; blocks: one up to {attention.SINGLE_BLOCK}, else "
              f"{attention.BLOCK_Q}x{attention.BLOCK_K}")
        print(HEADER)
        run(args.seqs, args.repeats, args.time_materialising_up_to)
        print("targets: 8k blockwise temp <= 1/4 of materialising; 1k blockwise speed >= 0.9x materialising")
    print(f"\ndecode step under no_grad: 1 query, {DECODE_HEADS} heads over {DECODE_KV_HEADS} KV heads, head dim "
          f"{DECODE_DIM}, float32; median of {args.repeats} loops of {DECODE_CALLS} calls, in turns")
    print(DECODE_HEADER)
    for row in decode(args.decode_keys, args.repeats):
        print(_decode_line(row))


if __name__ == "__main__":
    main()
