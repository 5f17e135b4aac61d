"""vLLM on ``tpu``: what one KV-cache write (``write_kv``, an eager in-place op) costs per cache size.

A decode step writes a few tokens' keys and values into each layer's cache. If the eager
in-place write rewrites the whole cache (no buffer donation), its time grows with the cache,
not with the tokens written. Prints the median time of one write of ``--tokens`` tokens into
caches of 1 to 64 MiB on ``tpu`` and on the CPU (the same torch code), and each size's
time over the 1 MiB one's, measured side by side in one run.

    python benchmarks/vllm_kv_write.py [--tokens 4] [--repeats 30]

Needs the vllm extra (``tools/vllm_env.sh``): ``write_kv`` lives in torchtpu's vLLM backend.
Wall-clock on a shared machine: compare the rows of one run, not figures across runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from torchtpu.integrations.vllm.attention import write_kv

BLOCK, KV_HEADS, HEAD = 16, 8, 64  # a [pages x 16, 8, 128] float32 layer: 64 KiB per page


def time_write(device: str, mib: int, tokens: int, repeats: int) -> float:
    """Median seconds of one write_kv of ``tokens`` tokens into a ``mib`` MiB cache."""
    pages = mib * 2**20 // (BLOCK * KV_HEADS * 2 * HEAD * 4)
    cache = torch.zeros(pages * BLOCK, KV_HEADS, 2 * HEAD, device=device)  # the runner's layout
    key = torch.randn(tokens, KV_HEADS, HEAD, device=device)
    value = torch.randn(tokens, KV_HEADS, HEAD, device=device)
    times = []
    for i in range(repeats + 2):  # two warm-up writes compile the programs
        slots = torch.randint(0, (pages - 1) * BLOCK, (tokens,), device=device)
        sync(device)
        start = time.perf_counter()
        write_kv(cache, key, value, slots)
        sync(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def sync(device: str) -> None:
    if device == "tpu":
        torch.tpu.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64], help="cache sizes, MiB")
    args = p.parse_args()
    rows = {dev: {mib: time_write(dev, mib, args.tokens, args.repeats) for mib in args.sizes}
            for dev in ("tpu", "cpu")}
    print(f"{'cache':>8}{'tpu ms':>10}{'x smallest':>12}{'cpu ms':>10}{'x smallest':>12}")
    for mib in args.sizes:
        t, c = rows["tpu"][mib], rows["cpu"][mib]
        print(f"{mib:>5}MiB{t * 1e3:10.3f}{t / rows['tpu'][args.sizes[0]]:11.1f}x"
              f"{c * 1e3:10.3f}{c / rows['cpu'][args.sizes[0]]:11.1f}x")
    print(f"(medians of {args.repeats} writes of {args.tokens} tokens; tpu: {torch.tpu.get_device_name()})")


if __name__ == "__main__":
    main()
