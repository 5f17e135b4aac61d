"""OpInfo / ModuleInfo coverage sweep: runs the conformance harness over PyTorch's op and module
databases and writes ``docs/op_coverage.md`` and ``tests/conformance/known_failures.json``.

    nice -n 10 python tools/op_coverage.py                      # every mode (see --help)
    python tools/op_coverage.py --modes eager_float32 --ops 'add|mul'
    python tools/op_coverage.py --report-only                   # rewrite the report from results

Results accumulate in ``tests/conformance/results.json`` (mode -> entry -> result), so a run of
a few modes or ops updates only those rows. Entries run in worker processes that write one JSON
line per result; a worker that crashes or hangs past the hard limit is replaced and its entry is
recorded as a failure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFORMANCE = ROOT / "tests" / "conformance"
RESULTS = CONFORMANCE / "results.json"
KNOWN_FAILURES = CONFORMANCE / "known_failures.json"
REPORT = ROOT / "docs" / "op_coverage.md"
FULL_COMMAND = "nice -n 10 python tools/op_coverage.py --jobs 2"
TASKS_PER_WORKER = 300  # a fresh process now and then keeps jit caches and memory bounded
FAILING = ("fail", "cpu-fallback")

sys.path.insert(0, str(CONFORMANCE))


def _harness():
    os.environ.setdefault("TORCHTPU_PLATFORM", "cpu")
    import harness

    return harness


# ---------------------------------------------------------------- worker side

def _fast_worker_settings() -> None:
    """One torch thread (the sweep runs several processes on few cores) and JAX's persistent
    compilation cache, so a second sweep reuses the first one's executables."""
    import jax
    import torch

    torch.set_num_threads(1)
    if not jax.config.jax_compilation_cache_dir:
        from torchtpu.config import config

        jax.config.update("jax_compilation_cache_dir", str(Path(config.cache_dir) / "op_coverage_xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def worker(tasks_file: str, out_file: str, timeout: int) -> None:
    """Run the (mode, entry) tasks in ``tasks_file``; one JSON line per event in ``out_file``."""
    import warnings

    warnings.filterwarnings("ignore")
    _fast_worker_settings()
    harness = _harness()
    tasks = json.loads(Path(tasks_file).read_text())
    with open(out_file, "a", buffering=1) as out:
        for mode, entry in tasks:
            out.write(json.dumps({"start": [mode, entry]}) + "\n")
            result = harness.run_entry(entry, mode, timeout=timeout)
            out.write(json.dumps({"result": result.as_dict()}) + "\n")


# ---------------------------------------------------------------- parent side

class Worker:
    """One worker process and the tasks it still owes."""

    def __init__(self, tasks: list, timeout: int, tmp: Path, serial: int):
        self.tasks = tasks[:TASKS_PER_WORKER]
        self.rest = tasks[TASKS_PER_WORKER:]
        self.timeout = timeout
        self.tasks_file = tmp / f"tasks{serial}.json"
        self.out_file = tmp / f"out{serial}.jsonl"
        self.tasks_file.write_text(json.dumps(self.tasks))
        self.out_file.write_text("")
        self.err_file = tmp / f"err{serial}.log"
        with open(self.err_file, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, "--worker", str(self.tasks_file), str(self.out_file),
                 "--timeout", str(timeout)],
                stdout=subprocess.DEVNULL, stderr=err)
        self.read = 0
        self.current = None
        self.last_progress = time.monotonic()

    def poll(self) -> list[dict]:
        """New results since the last poll."""
        lines = self.out_file.read_text().splitlines()
        fresh = [json.loads(ln) for ln in lines[self.read:] if ln.endswith("}")]
        self.read += len(fresh)
        results = []
        for event in fresh:
            self.last_progress = time.monotonic()
            if "start" in event:
                self.current = tuple(event["start"])
            else:
                results.append(event["result"])
                self.current = None
        return results

    def last_error(self) -> str:
        lines = [ln.strip() for ln in self.err_file.read_text(errors="replace").splitlines() if ln.strip()]
        return lines[-1][:200] if lines else "no message"

    def hung(self) -> bool:
        return time.monotonic() - self.last_progress > 3 * self.timeout + 60

    def remaining(self, done: set) -> list:
        return [t for t in self.tasks if tuple(t) not in done and tuple(t) != self.current] + self.rest


def _lost(task, why: str) -> dict:
    mode, entry = task
    return {"entry": entry, "mode": mode, "status": "fail", "error": why, "samples": 0,
            "seconds": 0.0, "note": "", "missing": []}


def sweep(tasks: list, jobs: int, timeout: int, progress: bool = True) -> list[dict]:
    """Run every task in up to ``jobs`` worker processes; returns their results."""
    tmp = Path(tempfile.mkdtemp(prefix="op_coverage_"))
    queues = [tasks[i::jobs] for i in range(jobs)]
    workers = [Worker(q, timeout, tmp, i) for i, q in enumerate(queues) if q]
    serial = len(workers)
    results: list[dict] = []
    done: set = set()
    start = time.monotonic()
    shown = -1
    while workers:
        time.sleep(0.5)
        for w in list(workers):
            for r in w.poll():
                results.append(r)
                done.add((r["mode"], r["entry"]))
            exited = w.proc.poll() is not None
            if not exited and not w.hung():
                continue
            if not exited:
                w.proc.kill()  # a worker this sweep started, stuck in native code
                w.proc.wait()
                for r in w.poll():
                    results.append(r)
                    done.add((r["mode"], r["entry"]))
            if exited and w.read == 0:
                raise RuntimeError(f"a worker exited (code {w.proc.returncode}: {w.last_error()}) before running anything; "
                                   f"run one entry by hand to see why: python tools/op_coverage.py "
                                   f"--modes {w.tasks[0][0]} --ops '{re.escape(w.tasks[0][1])}' --jobs 1")
            if w.current is not None and tuple(w.current) not in done:
                why = (f"hung past the hard limit of {3 * timeout + 60} s" if not exited
                       else f"worker process died (exit code {w.proc.returncode}): {w.last_error()}")
                results.append(_lost(w.current, why))
                done.add(tuple(w.current))
            workers.remove(w)
            rest = w.remaining(done)
            if rest:
                workers.append(Worker(rest, timeout, tmp, serial))
                serial += 1
        if progress and len(done) != shown:
            shown = len(done)
            end = "" if sys.stdout.isatty() else "\n"
            print(f"\r{shown}/{len(tasks)} entries, {time.monotonic() - start:.0f} s", end=end, flush=True)
    if progress and sys.stdout.isatty():
        print()
    return results


# ---------------------------------------------------------------- results, report, known failures

def load_results() -> dict:
    return json.loads(RESULTS.read_text()) if RESULTS.exists() else {}


def merge(results: dict, fresh: list[dict]) -> dict:
    for r in fresh:
        results.setdefault(r["mode"], {})[r["entry"]] = r
    return {mode: dict(sorted(rows.items())) for mode, rows in sorted(results.items())}


def write_known_failures(results: dict) -> None:
    known = {mode: sorted(e for e, r in rows.items() if r["status"] in FAILING)
             for mode, rows in results.items()}
    KNOWN_FAILURES.write_text(json.dumps(known, indent=1, sort_keys=True) + "\n")


def _counts(rows: dict) -> Counter:
    return Counter(r["status"] for r in rows.values())


def _pct(n: int, d: int) -> str:
    return f"{100.0 * n / d:.1f}%" if d else "-"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:240]


def render(results: dict, meta: dict) -> str:
    """The markdown report."""
    harness = _harness()
    lines = [
        "# Op coverage: OpInfo / ModuleInfo conformance on `tpu`",
        "",
        "Generated by `tools/op_coverage.py`; do not edit by hand. Full sweep (every mode; "
        + (f"{meta['minutes']} min on this machine" if "minutes" in meta else "not yet timed in one run")
        + "):",
        "",
        f"    {FULL_COMMAND}",
        "",
        f"Last run: {meta.get('date', '?')}, torch {meta.get('torch', '?')}, jax {meta.get('jax', '?')}, "
        f"platform {meta.get('platform', '?')}; command of the last run: `{meta.get('command', '?')}`.",
        "",
        "Each entry runs PyTorch's OpInfo sample inputs (made on the CPU, seeded) on the CPU and on "
        "`tpu` with the CPU fallback off, and compares the results with `torch.testing.assert_close` "
        "at the dtype's default tolerance (for a floating result of an integer or bool sample, the "
        "result dtype's, as `assert_close` chooses), raised to the OpInfo's own `toleranceOverride` "
        "where it has one. An entry passes when all its samples pass; `cpu-fallback` means an op ran on the "
        "CPU anyway. Random ops, and entries whose OpInfo skips `test_compare_cpu` as "
        "non-deterministic or undefined, are compared on shape and dtype only. A float result "
        "outside tolerance still passes when it is as close to a float64 CPU run as the float32 "
        "CPU result is (inductor's fp64-reference rule). The denominator of a mode is the entries that have samples of its "
        "dtype (`n/a`: the others, not counted). To bound the sweep's time a mode checks the first "
        f"samples of each entry only: {_caps(harness)}; an entry gets {meta.get('timeout', '?')} s.",
        "",
        "| mode | entries | pass | fail | cpu-fallback | skipped | pass % | n/a | last run |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    runs = meta.get("mode_runs", {})
    for mode in harness.MODES:
        rows = results.get(mode)
        if not rows:
            lines.append(f"| {mode} | not run | | | | | | | |")
            continue
        c = _counts(rows)
        total = c["pass"] + c["fail"] + c["cpu-fallback"] + c["skipped"]
        lines.append(f"| {mode} | {total} | {c['pass']} | {c['fail']} | {c['cpu-fallback']} | "
                     f"{c['skipped']} | {_pct(c['pass'], total)} | {c['n/a']} | {runs.get(mode, '?')} |")
    lines += [""] + [f"- {line}" for line in summary(results, harness)]
    lines += _notes_table(results, harness)
    lines += _missing_table(results)
    for mode in harness.MODES:
        lines += _mode_section(mode, results.get(mode) or {})
    return "\n".join(lines) + "\n"


def summary(results: dict, harness) -> list[str]:
    """The headline figures (also written into the README): combined rows the acceptance uses."""
    lines = []
    eager = [m for m in harness.MODES if m.startswith("eager_")]
    ran = [m for m in eager if results.get(m)]
    if ran:
        counts = sum((_counts(results[m]) for m in ran), Counter())
        total = counts["pass"] + counts["fail"] + counts["cpu-fallback"] + counts["skipped"]
        lines.append(f"Eager forward, {len(ran)} of {len(eager)} dtypes together: "
                     f"{_pct(counts['pass'], total)} of {total} (op, dtype) pairs pass.")
    fwd, bwd = results.get("module_forward") or {}, results.get("module_backward") or {}
    both = [e for e in fwd if fwd[e]["status"] != "n/a" and e in bwd]
    if both:
        ok = sum(fwd[e]["status"] == "pass" and bwd[e]["status"] == "pass" for e in both)
        lines.append(f"Modules passing forward and backward: {_pct(ok, len(both))} ({ok} of {len(both)}).")
    for mode in ("eager_float32", "backward_float32", "compiled_float32"):
        rows = results.get(mode)
        if rows:
            c = _counts(rows)
            total = c["pass"] + c["fail"] + c["cpu-fallback"] + c["skipped"]
            lines.append(f"{mode}: {_pct(c['pass'], total)} ({c['pass']} of {total} entries).")
    return lines


README = ROOT / "README.md"
_README_MARKERS = ("<!-- coverage:begin -->", "<!-- coverage:end -->")


def write_readme(results: dict, harness) -> None:
    """Replace the README's generated coverage lines (between its markers) with ``summary``."""
    text = README.read_text()
    begin, end = _README_MARKERS
    if begin not in text or end not in text:
        return
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    body = "\n".join(f"- {line}" for line in summary(results, harness))
    README.write_text(f"{head}{begin}\n{body}\n{end}{tail}")


def _caps(harness) -> str:
    caps = {}
    for mode, cap in harness.SAMPLE_CAPS.items():
        caps.setdefault("all" if cap is None else str(cap), []).append(mode)
    return "; ".join(f"{cap} for {', '.join(modes)}" for cap, modes in caps.items())


_NOTE_KINDS = {"compared shape/dtype only": "shape/dtype only (random or not comparable)",
               "float64": "via the float64-accuracy rule", "graph breaks": "with graph breaks"}


def _notes_table(results: dict, harness) -> list[str]:
    """How many passes needed a caveat, per mode."""
    rows = []
    for mode in harness.MODES:
        counts = Counter(kind for r in (results.get(mode) or {}).values() if r["status"] == "pass"
                         for key, kind in _NOTE_KINDS.items() if key in r.get("note", ""))
        if counts:
            rows.append(f"| {mode} | " + " | ".join(str(counts[k]) for k in _NOTE_KINDS.values()) + " |")
    if not rows:
        return []
    return ["", "Passes with a caveat (counted as passes above):", "",
            "| mode | " + " | ".join(_NOTE_KINDS.values()) + " |", "|---|" + "---:|" * len(_NOTE_KINDS), *rows]


def _missing_table(results: dict) -> list[str]:
    missing = Counter()
    for rows in results.values():
        for r in rows.values():
            for op in r.get("missing", []):
                missing[op] += 1
    if not missing:
        return []
    lines = ["", "## Missing lowerings", "",
             "aten ops that failed an entry because they have no lowering (entries x modes blocked).", "",
             "| aten op | entries |", "|---|---:|"]
    lines += [f"| `{op}` | {n} |" for op, n in missing.most_common()]
    return lines


def _mode_section(mode: str, rows: dict) -> list[str]:
    failing = {e: r for e, r in rows.items() if r["status"] in FAILING}
    skipped = Counter(r["error"] for r in rows.values() if r["status"] == "skipped")
    if not failing and not skipped:
        return []
    lines = ["", f"## {mode}: failures", ""]
    for reason, n in skipped.items():
        lines.append(f"Skipped {n} entries: {reason}")
        lines.append("")
    if failing:
        lines += ["| entry | status | first error |", "|---|---|---|"]
        lines += [f"| `{e}` | {r['status']} | {_cell(r['error'])} |" for e, r in failing.items()]
    return lines


def _meta(command: str, minutes: float | None, previous: dict) -> dict:
    import jax
    import torch

    meta = dict(previous)
    meta.update(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                torch=torch.__version__, jax=jax.__version__,
                platform=os.environ.get("TORCHTPU_PLATFORM", "cpu"), command=command)
    if minutes is not None:
        meta["minutes"] = f"{minutes:.0f}"
    return meta


META = CONFORMANCE / "results_meta.json"


# ---------------------------------------------------------------- command line

def _tasks(modes: list[str], ops: str | None) -> list:
    harness = _harness()
    pattern = re.compile(ops) if ops else None
    tasks = []
    for mode in modes:
        for entry in harness.entries_for(mode):
            if pattern is None or pattern.fullmatch(entry):
                tasks.append([mode, entry])
    return tasks


def _command_line(argv: list[str], n_tasks: int) -> str:
    """The command as run, with a long --ops pattern shortened."""
    shown = []
    for i, arg in enumerate(argv):
        long_ops = len(arg) > 60 and i > 0 and argv[i - 1] == "--ops"
        shown.append(f"'<pattern matching {n_tasks} tasks>'" if long_ops else arg)
    return "python tools/op_coverage.py " + " ".join(shown)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="all", help="comma-separated modes, or 'all'")
    parser.add_argument("--ops", help="regular expression an entry name must match in full")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes")
    parser.add_argument("--timeout", type=int, default=30, help="seconds per entry")
    parser.add_argument("--report-only", action="store_true", help="rewrite the report from results.json")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker, timeout=args.timeout)
        return
    if args.report_only:
        os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # the report needs no device
    harness = _harness()
    modes = list(harness.MODES) if args.modes == "all" else args.modes.split(",")
    unknown = [m for m in modes if m not in harness.MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {list(harness.MODES)}")
    results = load_results()
    previous = json.loads(META.read_text()) if META.exists() else {}
    minutes = None
    command = previous.get("command", "")
    if not args.report_only:
        tasks = _tasks(modes, args.ops)
        start = time.monotonic()
        results = merge(results, sweep(tasks, args.jobs, args.timeout))
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
        command = _command_line(argv if argv is not None else sys.argv[1:], len(tasks))
        if args.modes == "all" and not args.ops:
            minutes = (time.monotonic() - start) / 60
    meta = _meta(command, minutes, previous)
    if not args.report_only:
        meta["timeout"] = args.timeout
        runs = meta.setdefault("mode_runs", {})
        for mode in modes:
            runs[mode] = meta["date"] + (" (some entries)" if args.ops else "")
    META.write_text(json.dumps(meta, indent=1) + "\n")
    write_known_failures(results)
    REPORT.write_text(render(results, meta))
    write_readme(results, harness)
    for mode in modes:
        rows = results.get(mode) or {}
        c = _counts(rows)
        total = c["pass"] + c["fail"] + c["cpu-fallback"] + c["skipped"]
        print(f"{mode}: {c['pass']}/{total} pass ({_pct(c['pass'], total)}), fail {c['fail']}, "
              f"cpu-fallback {c['cpu-fallback']}, skipped {c['skipped']}, n/a {c['n/a']}")


if __name__ == "__main__":
    main()
