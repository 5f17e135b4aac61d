"""The ``torchtpu`` command: ``info``, ``doctor``, ``demo``, ``bench`` and ``export`` (export_cli.py)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# torch first: its device autoload imports torchtpu, and importing torchtpu while torch is
# half-imported would re-enter it.
import torch  # noqa: F401  (isort: skip)


# ---------------------------------------------------------------- info

def _dir_size(path: Path) -> tuple[int, int]:
    """Total bytes and number of files under ``path``."""
    total = files = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                total += (Path(root) / name).stat().st_size
                files += 1
            except OSError:
                continue
    return total, files


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cache_line(path: str) -> str:
    p = Path(path)
    if not p.exists():
        return f"{path} (does not exist yet)"
    if not p.is_dir():
        return f"{path} (NOT a directory: run `torchtpu doctor`)"
    size, files = _dir_size(p)
    return f"{path} ({_human(size)} in {files} files)"


def info_lines() -> list[str]:
    """What ``torchtpu info`` prints, one line per fact."""
    import platform as host

    import torchtpu
    from torchtpu.config import config
    from torchtpu.runtime import platform

    lines = [f"torchtpu {torchtpu.__version__}",
             f"platform: {platform.platform()} (PJRT)",
             f"devices: {torch.tpu.device_count()}"]
    for i in platform.local_indices():
        lines.append(f"  tpu:{i}  {torch.tpu.get_device_name(i)}  [{platform.jax_device(i)}]")
    lines += distributed_lines()
    lines += [
        "versions:",
        f"  python   {host.python_version()}",
        f"  torch    {torch.__version__}",
        f"  jax      {_version('jax')}",
        f"  jaxlib   {_version('jaxlib')}",
        f"  torchtpu {torchtpu.__version__}",
        f"eager mode: {torch.tpu.eager_mode.name}",
        f"cpu fallback: {'on' if torch.tpu.is_cpu_fallback_enabled() else 'off'}",
        f"cache directory: {_cache_line(config.cache_dir)}",
        f"persistent XLA cache: {persistent_cache_line()}",
    ]
    return lines + patch_lines()


def patch_lines() -> list[str]:
    """The changes torchtpu made to PyTorch and other libraries in this process (``torchtpu.patches``)."""
    from torchtpu import patches

    names = patches.applied()
    lines = [f"patches applied in this process: {len(names)} of {len(patches.TABLE)} (torchtpu.patches.TABLE)"]
    for name in names:
        patch = patches.get(name)
        more = f" (+{len(patch.targets) - 1} more)" if len(patch.targets) > 1 else ""
        lines.append(f"  {name:<32} {patch.targets[0]}{more}  [{patch.when}]")
    return lines


def persistent_cache_line() -> str:
    """Where XLA executables are kept, how much of the bound they fill, how many were evicted."""
    from torchtpu.compile import cache

    usage = cache.persistent_cache_usage(exact=True)
    if not usage["directory"]:
        return "off (TORCHTPU_CACHE_DIR is empty)"
    bound = _human(usage["max_bytes"]) if usage["max_bytes"] else "no limit"
    return (f"{usage['directory']}: {_human(usage['bytes'])} in {usage['entries']} entries of at most {bound} "
            f"(TORCHTPU_CACHE_MAX_SIZE), {usage['evictions']} evicted so far")


def distributed_lines() -> list[str]:
    """This process's place in a multi-process launch: rank, world size, coordinator, mesh."""
    from torchtpu.runtime import multiprocess

    info = multiprocess.launch()
    if info is None:
        return ["distributed: single process (no WORLD_SIZE > 1 launch)"]
    import jax

    info = multiprocess.joined() or info  # the runtime has started (platform lines above): joined

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return [f"distributed: rank {info.rank} of {info.world_size} (local rank {info.local_rank} of "
            f"{info.local_world_size}), jax.distributed coordinator {info.coordinator}",
            f"  mesh: {len(devices)} devices in {jax.process_count()} processes: "
            + ", ".join(f"rank {d.process_index}: {d}" for d in devices[:16])
            + (" ..." if len(devices) > 16 else "")]


def cmd_info(args: argparse.Namespace) -> int:
    from torchtpu.config import env_table

    if not args.env:
        print("\n".join(info_lines()))
        print("\nenvironment variables:")
    print(env_table())
    return 0


# ---------------------------------------------------------------- doctor

@dataclass
class Check:
    """One health check: ``run`` returns a detail line or raises ``Problem``."""

    name: str
    run: Callable[[], str]


class Problem(Exception):
    """A failed check: what is wrong, and how to fix it."""

    def __init__(self, what: str, fix: str):
        super().__init__(what)
        self.fix = fix


def check_autoload() -> str:
    """``import torch`` in a fresh process loads torchtpu (the torch.backends entry point)."""
    code = "import sys, torch; print('torchtpu' in sys.modules and hasattr(torch, 'tpu'))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise Problem(f"`import torch` failed: {_exception_lines(proc.stderr)}",
                      "run `python -c 'import torch'` to see the full error; TORCH_DEVICE_BACKEND_AUTOLOAD=0 "
                      "disables the autoload while you investigate")
    if proc.stdout.strip().splitlines()[-1:] != ["True"]:
        if os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") == "0":
            raise Problem("`import torch` did not load torchtpu: TORCH_DEVICE_BACKEND_AUTOLOAD=0 is set",
                          "unset TORCH_DEVICE_BACKEND_AUTOLOAD, or `import torchtpu` explicitly")
        raise Problem("`import torch` did not load torchtpu (no torch.backends entry point found)",
                      "reinstall torchtpu (`pip install -e .` in a checkout, or `pip install torchtpu`)")
    return "`import torch` loads torchtpu and torch.tpu"


def _exception_lines(stderr: str) -> str:
    """The exception lines of a traceback, root cause first (torch wraps autoload errors)."""
    found = [line.strip() for line in stderr.splitlines() if re.match(r"^[\w.]+(Error|Exception): ", line)]
    return " -> ".join(found) if found else (stderr.strip().splitlines() or ["(no output)"])[-1]


def check_devices() -> str:
    """At least one device is visible, and what backs it."""
    n = torch.tpu.device_count()
    if n == 0:
        raise Problem("no devices", "check that JAX sees a device: python -c 'import jax; print(jax.devices())'")
    names = sorted({torch.tpu.get_device_name(i) for i in range(n)})
    return f"{n} device(s): {', '.join(names)}"


def _sample_fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (torch.relu(x @ w + 1.0) * x.exp()).sum(dim=1)


def _compare(got: torch.Tensor, want: torch.Tensor, what: str, fix: str) -> None:
    try:
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    except AssertionError as exc:
        raise Problem(f"{what} differs from CPU: {str(exc).splitlines()[0]}", fix) from None


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(8, 16, generator=gen), torch.randn(16, 16, generator=gen)


def check_eager() -> str:
    """A few eager ops run on tpu, through lowerings, and match the CPU."""
    from torchtpu import metrics

    x, w = _inputs()
    before = sum(metrics.fallbacks.values())
    got = _sample_fn(x.to("tpu"), w.to("tpu"))
    torch.tpu.synchronize()
    _compare(got, _sample_fn(x, w), "eager result", "report it with `torchtpu info` output")
    fell_back = sum(metrics.fallbacks.values()) - before
    if fell_back:
        raise Problem(f"eager ops ran, but {fell_back} of them through the CPU fallback "
                      f"({', '.join(sorted(metrics.fallbacks))})", "report it: basic ops should have lowerings")
    return "matmul, add, relu, exp, mul, sum on tpu match the CPU"


def check_compile() -> str:
    """``torch.compile(backend="tpu")`` compiles a small function that matches the CPU."""
    from torchtpu.demo import compile_backend

    compile_backend(torch.device("tpu"))
    if "tpu" not in torch.compiler.list_backends():
        raise Problem("the torch.compile backend 'tpu' is not registered",
                      "this torchtpu build has no compile backend; use eager mode")
    x, w = _inputs()
    try:
        fn = torch.compile(_sample_fn, backend="tpu", fullgraph=True)
        got = fn(x.to("tpu"), w.to("tpu"))
    except Exception as exc:
        raise Problem(f"torch.compile(backend='tpu') failed: {type(exc).__name__}: {_first_line(exc)}",
                      "report it; meanwhile run the model in eager mode") from None
    _compare(got, _sample_fn(x, w), "compiled result", "report it; meanwhile run the model in eager mode")
    return "torch.compile(backend='tpu') runs and matches the CPU"


def check_cache_dir() -> str:
    """The compilation cache directory exists (or can be made) and is writable."""
    from torchtpu.config import config

    path = Path(config.cache_dir)
    fix = "point TORCHTPU_CACHE_DIR at a writable directory (or unset it to use ~/.cache/torchtpu)"
    if path.exists() and not path.is_dir():
        raise Problem(f"cache directory {path} exists but is not a directory", fix)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".doctor-"):
            pass
    except OSError as exc:
        raise Problem(f"cache directory {path} is not writable: {exc.strerror or exc}", fix) from None
    return f"{path} is writable"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


CHECKS = [
    Check("autoload", check_autoload),
    Check("devices", check_devices),
    Check("eager op", check_eager),
    Check("compiled graph", check_compile),
    Check("cache directory", check_cache_dir),
]


def cmd_doctor(args: argparse.Namespace) -> int:
    failed = 0
    for check in CHECKS:
        try:
            detail = check.run()
        except Problem as exc:
            failed += 1
            print(f"[FAIL] {check.name}: {exc}\n       fix: {exc.fix}")
        except Exception as exc:  # an unexpected crash in a check is itself a finding
            failed += 1
            print(f"[FAIL] {check.name}: {type(exc).__name__}: {_first_line(exc)}\n"
                  f"       fix: report it with the output of `torchtpu info`")
        else:
            print(f"[ OK ] {check.name}: {detail}")
    print(f"\n{len(CHECKS) - failed} of {len(CHECKS)} checks passed"
          + ("" if not failed else f"; {failed} failed"))
    return 1 if failed else 0


# ---------------------------------------------------------------- demo

def cmd_demo(args: argparse.Namespace) -> int:
    from torchtpu import demo

    return demo.main(steps=args.steps, eager_steps=args.eager_steps, device=args.device,
                     seed=args.seed, batch_size=args.batch_size, sample_chars=args.sample_chars,
                     progress=not args.no_progress)


# ---------------------------------------------------------------- bench

def benchmarks_dir() -> Path | None:
    """``benchmarks/`` of the source checkout this torchtpu runs from, if any."""
    import torchtpu

    for base in (Path(torchtpu.__file__).resolve().parents[2], Path.cwd()):
        candidate = base / "benchmarks" / "run_all.py"
        if candidate.is_file():
            return candidate.parent
    return None


def cmd_bench(args: argparse.Namespace) -> int:
    where = benchmarks_dir()
    if where is None:
        print("the benchmarks are not part of the installed package: they live in benchmarks/ of the "
              "torchtpu source repository. Clone it, `pip install -e .`, and run `torchtpu bench` "
              "(or `python benchmarks/run_all.py`) from the checkout.")
        return 1
    cmd = [sys.executable, str(where / "run_all.py"), *args.rest]
    return subprocess.call(cmd, cwd=where.parent)


# ---------------------------------------------------------------- mcp

def cmd_mcp(args: argparse.Namespace) -> int:
    try:
        from torchtpu_agent.server import main as serve
    except ImportError as exc:
        print(f"torchtpu mcp needs the MCP SDK: pip install 'torchtpu[mcp]' ({exc})", file=sys.stderr)
        return 1
    return serve()


# ---------------------------------------------------------------- main

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchtpu", description="torchtpu: a native tpu device for PyTorch")
    sub = p.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="platform, devices, versions, settings")
    info.add_argument("--env", action="store_true", help="print only the environment-variable table (Markdown)")
    info.set_defaults(fn=cmd_info)

    doctor = sub.add_parser("doctor", help="check the installation; exit 1 if anything is broken")
    doctor.set_defaults(fn=cmd_doctor)

    demo = sub.add_parser("demo", help="train a small character-level GPT, eager then compiled")
    demo.add_argument("--steps", type=int, default=300, help="compiled-mode training steps (default 300)")
    demo.add_argument("--eager-steps", type=int, default=40, help="eager-mode training steps (default 40)")
    demo.add_argument("--device", default="tpu", help="device to train on (default tpu; cpu to compare)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--batch-size", type=int, default=16)
    demo.add_argument("--sample-chars", type=int, default=240, help="characters of text to generate")
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    demo.set_defaults(fn=cmd_demo)

    bench = sub.add_parser("bench", help="run benchmarks/run_all.py of the source checkout; other arguments "
                                         "go to it (--list, --only NAME, --timeout S)")
    bench.set_defaults(fn=cmd_bench)

    mcp = sub.add_parser("mcp", help="a Model Context Protocol server on stdio for coding agents (docs/agents.md)")
    mcp.set_defaults(fn=cmd_mcp)

    from torchtpu import export_cli  # torchtpu.export's command (it imports nothing heavy until run)

    export_cli.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args, rest = p.parse_known_args(argv)
    if rest and args.command != "bench":  # only bench passes arguments on (to run_all.py)
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
