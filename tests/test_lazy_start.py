"""Start-up as CUDA does it: ``import torch`` registers ``tpu`` without starting JAX, the runtime
starts at first use, and a fork is safe unless the child touches ``tpu`` after the parent started it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from native_required import skip_without_native


def _run(code: str, env: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def test_import_torch_starts_nothing():
    out = _run("""
        import sys, torch
        assert torch.device("tpu").type == "tpu" and hasattr(torch.Tensor, "is_tpu")
        assert "jax" not in sys.modules, "import torch imported JAX"
        assert not torch.tpu.is_initialized()
        assert torch.tpu.is_available() and torch.tpu.device_count() == 2
        assert "jax" not in sys.modules, "is_available()/device_count() started the runtime on XLA:CPU"
        torch.tpu.manual_seed(3)                     # seeding is queued state, as on CUDA
        assert not torch.tpu.is_initialized()
        x = torch.ones(3, device="tpu")              # the first op starts the runtime
        assert torch.tpu.is_initialized() and x.sum().item() == 3.0
        assert torch.tpu.device_count() == 2
        print("ok")
    """, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# Each is a first use in a fresh process (~10 s each on 2 shared cores): CI runs a move and a
# torch.tpu call; a factory is also the first use in test_import_torch_starts_nothing.
@pytest.mark.parametrize("code", [
    "torch.ones(2).to('tpu')", "torch.tpu.synchronize()",
    *(pytest.param(c, marks=pytest.mark.slow) for c in (
        "torch.zeros(2, device='tpu:0')", "torch.tpu.memory_allocated()", "torch.tpu.get_device_name()"))])
def test_first_use_through_each_entry(code):
    out = _run(f"import torch; {code}; print(torch.tpu.is_initialized())")
    assert out.returncode == 0, (code, out.stderr)
    assert out.stdout.strip() == "True", code


def test_accelerator_queries_before_first_use_start_nothing():
    """As for CUDA: torch.accelerator's synchronize and memory functions, and a new generator,
    do not start the runtime (its statistics are empty until then)."""
    out = _run("""
        import sys, torch
        from torchtpu.runtime import native
        if not native.registered():  # the C++ hooks that serve these are not built here
            print("unbuilt:", native.unavailable_reason())
            sys.exit(0)
        torch.accelerator.synchronize()
        assert dict(torch.accelerator.memory_stats()) == {} and torch.accelerator.memory_allocated() == 0
        torch.accelerator.empty_cache()
        torch.accelerator.reset_peak_memory_stats()
        torch.Generator("tpu").manual_seed(2)
        assert "jax" not in sys.modules and not torch.tpu.is_initialized()
        print("ok")
    """)
    assert out.returncode == 0, out.stderr
    if out.stdout.startswith("unbuilt:"):
        skip_without_native(out.stdout.strip())
    assert out.stdout.strip() == "ok"


def test_import_torchtpu_runtime_alone():
    out = _run("""
        import sys
        import torchtpu.runtime.state
        layers = [m for m in sys.modules if m.startswith(("torchtpu.eager", "torchtpu.ops"))]
        assert not layers, layers
        print("ok")
    """)
    assert out.returncode == 0, out.stderr


def test_fork_child_without_tpu_has_no_warning():
    # the parent started the runtime; a forked child that never touches tpu runs quietly
    out = _run("""
        import multiprocessing as mp, warnings
        warnings.simplefilter("error")
        import torch
        torch.ones(2, device="tpu").sum().item()
        def work(q):
            q.put(int(torch.arange(4).sum()))
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=work, args=(q,))
        p.start(); value = q.get(timeout=60); p.join(60)
        print(value, p.exitcode)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "6 0"
    assert "fork" not in out.stderr.lower(), out.stderr


def test_fork_child_touching_tpu_gets_clear_error():
    out = _run("""
        import multiprocessing as mp
        import torch
        x = torch.ones(2, device="tpu")
        def work(q):
            try:
                (x + 1).cpu()
                q.put("no error")
            except RuntimeError as exc:
                q.put(str(exc))
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=work, args=(q,))
        p.start(); message = q.get(timeout=60); p.join(60)
        print(message)
        print(torch._C._get_privateuse1_backend_name(), torch.tpu._is_in_bad_fork(), (x + 1).sum().item())
    """)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert "Cannot re-initialize tpu in forked subprocess" in lines[0]
    assert "spawn" in lines[0]
    assert lines[1] == "tpu False 4.0"  # the parent is unaffected


def test_fork_before_start_child_can_use_tpu():
    out = _run("""
        import multiprocessing as mp
        import torch
        def work(q):
            q.put((torch.ones(3, device="tpu") * 2).sum().item())
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=work, args=(q,))
        p.start(); value = q.get(timeout=120); p.join(60)
        print(value, torch.tpu.is_initialized())
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "6.0 False"


def test_eager_mode_set_before_first_use():
    out = _run("""
        import torch
        torch.tpu.eager_mode = torch.tpu.EagerMode.DEFER_AND_FUSE   # before the runtime starts
        with torch.tpu.set_eager_mode("defer_never_and_launch_blocking"):
            pass
        x = torch.ones(4, device="tpu") * 3
        print(torch.tpu.eager_mode.name, x.sum().item(), len(torch.tpu.debug.pending_graph()))
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "DEFER_AND_FUSE 12.0 0"


def test_the_runtime_starts_with_the_cpu_compile_flags_and_gives_xla_flags_back():
    """XLA reads ``XLA_FLAGS`` once, when the PJRT client starts: the flags are there then (and
    XLA knows them, or the process would abort), and the user's value is back after."""
    out = _run("""
        import os, torch
        from torchtpu.runtime import pjrt, state
        seen, devices = [], pjrt.devices
        pjrt.devices = lambda: seen.append(os.environ.get("XLA_FLAGS")) or devices()
        assert torch.ones(2, device="tpu").sum().item() == 2.0
        print(seen[0]); print(os.environ["XLA_FLAGS"])
    """, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "TORCHTPU_CPU_FAST_COMPILE": "1"})
    assert out.returncode == 0, out.stderr
    during, after = out.stdout.strip().splitlines()
    assert during == "--xla_force_host_platform_device_count=2 --xla_cpu_use_fusion_emitters=false"
    assert after == "--xla_force_host_platform_device_count=2"


@pytest.mark.parametrize("setting, user_flags, expected", [
    (True, None, "--xla_cpu_use_fusion_emitters=false"),
    (False, None, None),  # TORCHTPU_CPU_FAST_COMPILE=0: XLA's defaults
    (True, "--xla_cpu_use_fusion_emitters=true", "--xla_cpu_use_fusion_emitters=true"),  # the user's choice stands
])
def test_cpu_compile_flags_follow_the_setting_and_the_users_own(monkeypatch, setting, user_flags, expected):
    from torchtpu.config import config
    from torchtpu.runtime import state

    monkeypatch.setattr(config, "cpu_fast_compile", setting)
    if user_flags is None:
        monkeypatch.delenv("XLA_FLAGS", raising=False)
    else:
        monkeypatch.setenv("XLA_FLAGS", user_flags)
    with state._cpu_compile_flags():
        assert os.environ.get("XLA_FLAGS") == expected
    assert os.environ.get("XLA_FLAGS") == user_flags
