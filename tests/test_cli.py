"""The ``torchtpu`` command, run as users run it: in a subprocess."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHTPU_")}
    full_env.pop("XLA_FLAGS", None)  # one device, as a user gets
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "torchtpu.cli", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=ROOT)


@pytest.fixture
def cache_dir(monkeypatch, tmp_path):
    """Point torchtpu's cache directory setting at a fresh path for one test."""
    from torchtpu.config import config

    path = tmp_path / "cache"
    monkeypatch.setattr(config, "cache_dir", str(path))
    return path


def test_info_reports_device_versions_and_settings(cache_dir, capsys):
    import jax
    import torch

    from torchtpu import cli as tt

    cache_dir.mkdir()
    (cache_dir / "entry.bin").write_bytes(b"x" * 2048)
    assert tt.main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"devices: {torch.tpu.device_count()}" in out
    assert "tpu:0  XLA:CPU  [" in out
    assert f"torch    {torch.__version__}" in out
    assert f"jax      {jax.__version__}" in out
    assert f"eager mode: {torch.tpu.eager_mode.name}" in out
    assert f"cache directory: {cache_dir} (2.0 KiB in 1 files)" in out
    assert "| `TORCHTPU_CACHE_DIR` |" in out


def test_info_env_prints_only_the_markdown_table(capsys):
    from torchtpu import cli as tt
    from torchtpu.config import env_table

    assert tt.main(["info", "--env"]) == 0
    assert capsys.readouterr().out.strip() == env_table().strip()


def test_doctor_healthy_exits_0(cache_dir, capsys):
    from torchtpu import cli as tt

    assert tt.main(["doctor"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert out.count("[ OK ]") == len(tt.CHECKS) == 5
    assert "[FAIL]" not in out
    assert cache_dir.is_dir()  # doctor created it


def test_doctor_cache_check_unwritable_parent(monkeypatch, tmp_path):
    from torchtpu import cli as tt
    from torchtpu.config import config

    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a directory should be")
    monkeypatch.setattr(config, "cache_dir", str(blocker / "cache"))
    with pytest.raises(tt.Problem, match="is not writable") as info:
        tt.check_cache_dir()
    assert str(blocker / "cache") in str(info.value)
    assert "TORCHTPU_CACHE_DIR" in info.value.fix


def test_doctor_broken_cache_dir_env_exits_1_with_fix(tmp_path):
    """End to end: the installed command, TORCHTPU_CACHE_DIR pointing at a file."""
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("not a directory")
    proc = cli("doctor", env={"TORCHTPU_CACHE_DIR": str(not_a_dir)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"[FAIL] cache directory: cache directory {not_a_dir} exists but is not a directory" in proc.stdout
    assert "fix: point TORCHTPU_CACHE_DIR at a writable directory" in proc.stdout
    assert proc.stdout.count("[ OK ]") == 4, proc.stdout


def test_doctor_reports_disabled_autoload(monkeypatch):
    from torchtpu import cli as tt

    monkeypatch.setenv("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    with pytest.raises(tt.Problem, match="TORCH_DEVICE_BACKEND_AUTOLOAD=0 is set") as info:
        tt.check_autoload()
    assert "unset TORCH_DEVICE_BACKEND_AUTOLOAD" in info.value.fix


def test_demo_tiny_trains_and_reports():
    proc = cli("demo", "--steps", "4", "--eager-steps", "3", "--sample-chars", "8", "--no-progress",
               timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    first, last = map(float, re.search(r"loss: first ([\d.]+) -> last ([\d.]+)", out).groups())
    assert math.isfinite(first) and math.isfinite(last)
    assert abs(first - math.log(59)) < 0.3  # an untrained model over 59 characters
    assert last < first
    # the ratio's value is the benchmark's business; here it must be measured and printed
    assert math.isfinite(float(re.search(r"speed ratio compiled/eager: ([\d.]+)x", out).group(1)))
    assert "compiled mode FAILED" not in out
    assert "ops dispatched:" in out  # torchtpu.metrics.report()
    assert "[3/3] sample" in out


def test_demo_first_loss_matches_cpu():
    """Same seed, same initial model and batch on either device: the same first loss."""
    from torchtpu import demo

    quiet = dict(steps=0, eager_steps=1, sample_chars=1, progress=False, out=lambda *a: None)
    tpu = demo.run(device="tpu", **quiet)
    cpu = demo.run(device="cpu", **quiet)
    assert tpu.first_loss == pytest.approx(cpu.first_loss, abs=1e-4)
    assert len(tpu.sample) == len(cpu.sample) == 1


def test_bench_lists_benchmarks_from_checkout(capfd):
    from torchtpu import cli as tt

    assert tt.main(["bench", "--list"]) == 0
    names = capfd.readouterr().out.split()
    assert "eager_overhead" in names
    assert "models" not in names and "run_all" not in names


def test_eager_overhead_benchmark_prints_table(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("eager_overhead", ROOT / "benchmarks" / "eager_overhead.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    assert bench.main(["--repeats", "1", "--iters", "5", "--only", "add"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith("| add")]
    budget = [line for line in out if line.startswith("| `add")]  # where a native call's time goes
    from torchtpu.eager import native_kernels
    if native_kernels.enabled():
        assert [r.split("|")[1].strip() for r in budget] == ["`add`", "`add_ (in place)`"]
        for row in budget:
            total, outside, *stages, jax_us = (float(c) for c in row.split("|")[2:-1])
            assert len(stages) == 5 and all(t >= 0 for t in stages) and stages[2] > 0  # (the JAX call)
            # each of the 7 printed values is rounded to 0.1 us: their sum may differ by 7 x 0.05
            assert outside + sum(stages) == pytest.approx(total, abs=0.05 * (len(stages) + 2) + 1e-9)
    else:
        assert not budget
    assert [r.split("|")[1].strip() for r in rows] == ["add", "add_ (in place)"]
    for row in rows:
        cpu_us, tpu_us, python_us, jax_us, ratio, python_ratio, overhead, fused_us = (
            float(c.strip().rstrip("x")) for c in row.split("|")[3:11])
        assert cpu_us > 0 and tpu_us > 0 and python_us > 0 and jax_us > 0 and fused_us > 0
        assert ratio == pytest.approx(tpu_us / cpu_us, rel=0.05, abs=0.01)
        assert python_ratio == pytest.approx(python_us / tpu_us, rel=0.05, abs=0.01)
        assert overhead == pytest.approx(tpu_us - jax_us, abs=0.15 + 1e-9)  # (three values rounded to 0.1)


def test_attention_benchmark_decode_table(capsys):
    """benchmarks/attention.py's decode-step table (no-backward SDPA, the fused op, the CPU) runs,
    checks the paths agree, and its ratio columns follow from its times."""
    spec = importlib.util.spec_from_file_location("attention_bench", ROOT / "benchmarks" / "attention.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--decode-only", "--decode-keys", "8", "--repeats", "1"])
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 8 |")]
    output_us, fused_us, cpu_us, fused_ratio, cpu_ratio = (float(c.strip().rstrip("x")) for c in row.split("|")[2:7])
    assert min(output_us, fused_us, cpu_us) > 0
    assert fused_ratio == pytest.approx(fused_us / output_us, rel=0.05, abs=0.01)
    assert cpu_ratio == pytest.approx(output_us / cpu_us, rel=0.05, abs=0.01)


def test_dispatch_floor_benchmark_prints_table(capsys):
    """benchmarks/dispatch_floor.py reaches jaxlib's executables (internals): it still runs."""
    spec = importlib.util.spec_from_file_location("dispatch_floor", ROOT / "benchmarks" / "dispatch_floor.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--calls", "3", "--loops", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| add 8x8")]
    (row,) = rows
    jit_us, sharded_us, execute_us, ratio = (float(c) for c in row.split("|")[2:6])
    assert min(jit_us, sharded_us, execute_us) > 0
    assert ratio == pytest.approx(sharded_us / jit_us, rel=0.05, abs=0.01)


def test_bench_outside_a_checkout_says_where_benchmarks_are(monkeypatch, capsys):
    from torchtpu import cli as tt

    monkeypatch.setattr(tt, "benchmarks_dir", lambda: None)
    assert tt.main(["bench"]) == 1
    assert "they live in benchmarks/ of the torchtpu source repository" in capsys.readouterr().out


def test_unknown_arguments_are_rejected_except_for_bench():
    from torchtpu import cli as tt

    with pytest.raises(SystemExit) as exc:
        tt.main(["info", "--bogus"])
    assert exc.value.code == 2
