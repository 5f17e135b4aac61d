"""Run every benchmark script in benchmarks/ and print their tables (what ``torchtpu bench`` runs).

    python benchmarks/run_all.py [--only NAME] [--list] [--timeout SECONDS]

A benchmark script is a ``*.py`` file here with a ``__main__`` block (``models.py`` and other
helpers have none). Each runs in its own process, so one failing does not stop the others.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def scripts() -> list[Path]:
    """Benchmark scripts in this directory, in name order."""
    found = []
    for path in sorted(HERE.glob("*.py")):
        if path.name == Path(__file__).name or path.name.startswith("_"):
            continue
        if '__name__ == "__main__"' in path.read_text(encoding="utf-8"):
            found.append(path)
    return found


def run_one(path: Path, timeout: float) -> tuple[int, float]:
    """Run one script with its output streamed through; its exit code (124 on timeout) and seconds."""
    start = time.perf_counter()
    try:
        code = subprocess.call([sys.executable, str(path)], cwd=HERE.parent, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"\n{path.name}: timed out after {timeout:.0f} s", flush=True)
        code = 124
    return code, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", action="append", default=[], help="run scripts whose name contains this (repeatable)")
    p.add_argument("--list", action="store_true", help="list the benchmark scripts and exit")
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed per script (default 1800)")
    args = p.parse_args(argv)

    chosen = [s for s in scripts() if not args.only or any(o in s.stem for o in args.only)]
    if args.list:
        print("\n".join(s.stem for s in chosen))
        return 0
    if not chosen:
        print(f"no benchmark script matches {args.only}; available: {', '.join(s.stem for s in scripts())}")
        return 1
    results = []
    for path in chosen:
        print(f"\n===== {path.stem} =====", flush=True)
        results.append((path.stem, *run_one(path, args.timeout)))
    print("\n===== summary =====")
    print("| benchmark | result | seconds |\n| --- | --- | ---: |")
    for name, code, seconds in results:
        print(f"| {name} | {'ok' if code == 0 else f'FAILED (exit {code})'} | {seconds:.0f} |")
    return 0 if all(code == 0 for _, code, _ in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
