"""A/B two source trees on one benchmark, interleaved in one run: every round runs the script
once with each tree's ``src`` first on ``sys.path``, alternating, so machine load hits both alike.

    python benchmarks/ab.py --base /path/to/old/checkout eager_overhead.py -- --repeats 5

The base checkout is any other commit of this repository (``git worktree add /tmp/base HEAD~5``).
Each output line is split into a label (the text before its first number) and its numbers; the
table shows, for every numeric cell, the median of each tree's rounds and their ratio (new/base).
Lines whose label differs between rounds (timestamps) are skipped.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?")


def _cells(output: str) -> dict[tuple[str, int], float]:
    cells = {}
    for line in output.splitlines():
        match = _NUMBER.search(line)
        if not match:
            continue
        label = " ".join(line[: match.start()].split())
        if not label:
            continue
        for i, number in enumerate(_NUMBER.findall(line[match.start():])):
            cells[(label, i)] = float(number)
    return cells


def _run(tree: Path, script: str, args: list[str], timeout: float) -> str:
    env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, str(tree / "benchmarks" / script), *args], cwd=tree, env=env,
                         capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{script} failed in {tree}:\n{out.stderr[-2000:]}")
    return out.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, type=Path, help="checkout of the commit to compare against")
    parser.add_argument("--new", type=Path, default=HERE.parent, help="checkout under test (default: this one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    opts = parser.parse_args()
    args = opts.args[1:] if opts.args[:1] == ["--"] else opts.args
    runs: dict[str, list[dict]] = defaultdict(list)
    for _ in range(opts.rounds):
        for name, tree in (("base", opts.base), ("new", opts.new)):
            runs[name].append(_cells(_run(tree.resolve(), opts.script, args, opts.timeout)))
    keys = [k for k in runs["new"][0] if all(k in r for rs in runs.values() for r in rs)]
    print(f"{opts.script} {' '.join(args)}: {opts.rounds} interleaved rounds, medians; base {opts.base}")
    print(f"{'line':58s} {'col':>3s} {'base':>10s} {'new':>10s} {'new/base':>9s}")
    for label, col in keys:
        base = statistics.median(r[(label, col)] for r in runs["base"])
        new = statistics.median(r[(label, col)] for r in runs["new"])
        ratio = f"{new / base:9.3f}" if base else f"{'-':>9s}"
        print(f"{label[:58]:58s} {col:3d} {base:10.4g} {new:10.4g} {ratio}")


if __name__ == "__main__":
    main()
