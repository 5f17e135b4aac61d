"""What torchtpu adds to ``import torch``: wall time of a fresh ``python -c "import torch"`` with
the device autoloaded and with ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``, interleaved, and of the
process's first ``tpu`` op (when the runtime starts).

    python benchmarks/import_time.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

_FIRST_OP = "import torch, time; t = time.perf_counter(); torch.ones(1, device='tpu').sum().item(); " \
            "print(time.perf_counter() - t)"


def _seconds(code: str, autoload: str) -> float:
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": autoload}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    _seconds("import torch", "1")  # warm the file cache and build the C++ hooks if needed
    on, off, first = [], [], []
    for _ in range(args.repeats):
        off.append(_seconds("import torch", "0"))
        on.append(_seconds("import torch", "1"))
        out = subprocess.run([sys.executable, "-c", _FIRST_OP], check=True, capture_output=True, text=True,
                             timeout=300)
        first.append(float(out.stdout.strip().splitlines()[-1]))
    m_on, m_off = statistics.median(on), statistics.median(off)
    print(f"{'import torch':40s} {'median s':>9s}   runs")
    print(f"{'  TORCH_DEVICE_BACKEND_AUTOLOAD=0':40s} {m_off:9.3f}   {' '.join(f'{x:.2f}' for x in off)}")
    print(f"{'  with torchtpu (autoload)':40s} {m_on:9.3f}   {' '.join(f'{x:.2f}' for x in on)}")
    print(f"{'  added by torchtpu':40s} {m_on - m_off:9.3f}   (target <= 0.300)")
    print(f"{'first tpu op (starts the runtime)':40s} {statistics.median(first):9.3f}")


if __name__ == "__main__":
    main()
