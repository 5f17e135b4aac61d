"""The floor under any eager op built on JAX: one compiled XLA program launched per op.

For a few small ops, the cost per call of launching the same compiled program three ways, in
one run, calls chained (each call's output is the next call's input), the device synchronised at
the end of each loop:

- ``jax.jit``: the jitted function's call (JAX's C++ fast path: argument signature check, then
  PJRT's execute), what the native eager kernel (``csrc/eager.cpp``) calls through vectorcall;
- ``execute_sharded``: the compiled program's PJRT ``LoadedExecutable.execute_sharded``, no
  signature check, outputs taken apart into arrays (JAX's own path under ``jax.jit``);
- ``execute``: the older single-device ``LoadedExecutable.execute``.

The issue that asked for the native kernel allowed either "the jitted callable through CPython's
vectorcall, or PJRT's execute directly, whichever measures faster": this is that measurement.
``execute_sharded``/``execute`` are jaxlib internals (reached through ``Compiled._executable``),
used here only to measure.

    python benchmarks/dispatch_floor.py [--calls 2000] [--loops 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp

OPS = {
    "add 8x8": (lambda a, b: a + b, (8, 8)),
    "mul 8x8": (lambda a, b: a * b, (8, 8)),
    "matmul 8x8": (lambda a, b: a @ b * 0.5, (8, 8)),
    "add 256x256": (lambda a, b: a + b, (256, 256)),
}


def loops_for(fn, shape):
    x, y = jnp.ones(shape), jnp.ones(shape)
    jitted = jax.jit(fn)
    jitted(x, y).block_until_ready()
    exe = jitted.lower(x, y).compile()._executable.xla_executable

    def via_jit(n):
        a = x
        for _ in range(n):
            a = jitted(a, y)
        a.block_until_ready()

    def via_execute_sharded(n):
        a = x
        for _ in range(n):
            a = exe.execute_sharded([a, y]).disassemble_into_single_device_arrays()[0][0]
        a.block_until_ready()

    def via_execute(n):
        a = x
        for _ in range(n):
            a = exe.execute([a, y])[0]
        a.block_until_ready()

    for loop in (via_jit, via_execute_sharded, via_execute):  # the three give the same result
        loop(3)
    return {"jax.jit": via_jit, "execute_sharded": via_execute_sharded, "execute": via_execute}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--loops", type=int, default=7)
    args = parser.parse_args(argv)
    load = os.getloadavg()
    print(f"{jax.devices()[0].platform} via jax {jax.__version__}; median of {args.loops} loops x {args.calls} "
          f"chained calls, loops of the three ways alternating; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}\n")
    print("| op | jax.jit (us) | execute_sharded (us) | execute (us) | execute_sharded / jax.jit |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, (fn, shape) in OPS.items():
        loops = loops_for(fn, shape)
        times = {k: [] for k in loops}
        for _ in range(args.loops):
            for k, loop in loops.items():
                start = time.perf_counter()
                loop(args.calls)
                times[k].append((time.perf_counter() - start) / args.calls * 1e6)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"| {name} | {med['jax.jit']:.2f} | {med['execute_sharded']:.2f} | {med['execute']:.2f} | "
              f"{med['execute_sharded'] / med['jax.jit']:.2f} |")


if __name__ == "__main__":
    main()
