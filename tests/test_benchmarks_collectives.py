"""benchmarks/collectives.py runs end to end under torchrun (2 processes) and prints numbers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOT_MEASURED = ("n/a (tpu backend not available)", "error", "skipped (error above)")
ROW = re.compile(r"^\| (all_reduce|all_gather|reduce_scatter) \| ([^|]+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \|")


@pytest.mark.slow
def test_quick_run_prints_numeric_raw_jax_and_gloo_columns():
    # 13-20 s on 2 cores (one torchrun launch, 9 programs compiled per process): slow, to keep CI
    # within its 15 minutes; a failing tpu c10d column adds one --group-timeout.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHTPU_")}
    env.pop("XLA_FLAGS", None)  # one device per process, as torchrun users get
    proc = subprocess.run([sys.executable, "benchmarks/collectives.py", "--quick", "--nproc", "2",
                           "--group-timeout", "20"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    out = proc.stdout
    assert "## N = 2" in out, proc.stdout + proc.stderr
    rows = [m.groups() for line in out.splitlines() if (m := ROW.match(line))]
    assert {op for op, *_ in rows} == {"all_reduce", "all_gather", "reduce_scatter"}, out
    assert len(rows) == 9, out  # 3 ops x 3 sizes
    for op, size, c10d, raw_jax, gloo in rows:
        assert float(raw_jax) > 0 and float(gloo) > 0, f"{op} {size}: raw JAX {raw_jax!r}, gloo {gloo!r}"
        c10d = c10d.strip()
        assert c10d in NOT_MEASURED or float(c10d) > 0, c10d
    assert re.search(r"^Targets at >= 4 MiB .*: N=2: \S", out, re.M), out
