#!/usr/bin/env python3
"""Run PyTorch's own device-generic test files on the ``tpu`` device and on CPU.

PyTorch's device-generic tests (``instantiate_device_type_tests``) instantiate a
copy of every test class for each available device type.  torchtpu registers the
PrivateUse1 backend under the name ``tpu`` (loaded automatically through the
``torch.backends`` entry point, so no ``import torchtpu`` is needed), which makes
PyTorch generate ``Test<Name>PRIVATEUSE1`` classes whose tests end in ``_tpu``
(for example ``TestIndexingPRIVATEUSE1::test_index_put_src_datatype_tpu_float32``)
next to the ``Test<Name>CPU`` classes (``..._cpu_float32``).

WHERE THE FILES COME FROM.  The test files are PyTorch's, not this project's:
they are not copied into this repository.  Pass the ``test/`` folder of a
PyTorch source checkout that matches the installed torch (``torch.__version__``
and ``torch.version.git_version``), e.g. ``git clone
https://github.com/pytorch/pytorch && git -C pytorch checkout <git_version>``,
then ``python tools/pytorch_device_tests.py pytorch/test``.  The files import
``torch.testing._internal`` from the installed wheel.

What it does, one file at a time (never in parallel with another file):

1. the ``tpu`` variants: ``PYTORCH_TESTING_DEVICE_ONLY_FOR=privateuse1`` (only
   the PrivateUse1 classes are generated), pytest with ``--junitxml``;
2. the CPU variants: ``PYTORCH_TESTING_DEVICE_ONLY_FOR=cpu`` and
   ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (plain PyTorch, torchtpu not loaded);
3. pairs every tpu test with its CPU twin (class suffix PRIVATEUSE1 -> CPU, the
   ``_tpu`` name token -> ``_cpu``).  A tpu test whose CPU twin fails or errors is
   *excluded*: it tests something PyTorch's CPU build does not do either.  A tpu
   test without a CPU twin (device-specific test) or whose twin is skipped is
   kept.
4. prints per file: tpu passed / failed / skipped, the excluded tests, and the
   pass rate = passed / (passed + failed) over the kept tpu tests, plus the same
   figures over all files.  ``--failures`` also lists each kept tpu failure with
   the first line of its error.

Each test gets a per-test timeout (``--timeout``, default 900 s) when the
pytest-timeout plugin is installed; without it there is none.  A timed-out test
counts as failed.  Tests that allocate more than 2**31 elements
(``--skip-huge``, on by default) are deselected on both devices to keep the
machine usable; ``--no-skip-huge`` runs them too.

``--rerun-failed`` re-runs only the tpu tests that failed in ``--out-dir``'s results
(and, with ``--recheck-passed N``, a fixed sample of N that passed, to catch a
regression among them), writes ``<file>.tpu.rerun.xml`` and counts those outcomes
over the earlier ones; the report says which tests were re-run and when.

Examples::

    python tools/pytorch_device_tests.py ~/src/pytorch/test
    python tools/pytorch_device_tests.py ~/src/pytorch/test --files test_indexing.py -n 2
    python tools/pytorch_device_tests.py ~/src/pytorch/test --report-only --failures
    python tools/pytorch_device_tests.py ~/src/pytorch/test --json summary.json
    python tools/pytorch_device_tests.py ~/src/pytorch/test --rerun-failed --recheck-passed 40 -n 2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

DEFAULT_FILES = [
    "test_view_ops.py",
    "test_type_promotion.py",
    "test_indexing.py",
    "test_shape_ops.py",
    "test_tensor_creation_ops.py",
]

# Tests that allocate > 2**31 elements (several GiB of host memory on XLA:CPU).
HUGE_TESTS = [
    "test_index_put_accumulate_large_tensor",
    "test_cat_large_tensor",
    "test_flip_large_tensor",
    "test_randperm_large",
    "test_range_factories_64bit_indexing",
]

DEVICE_CLASS_SUFFIXES = ("PRIVATEUSE1", "TPU")
_TPU_TOKEN = re.compile(r"_tpu(?=_|$)")


# --- pytest plugin (loaded into the pytest runs with ``-p pytorch_device_tests``) ---
# Appends every test's outcome to $PYTORCH_DEVICE_TESTS_RESULTS as it completes, so a
# run that is interrupted (time limit, killed) still leaves the results it reached.
def pytest_runtest_logreport(report):
    path = os.environ.get("PYTORCH_DEVICE_TESTS_RESULTS")
    if not path or (report.when != "call" and not (report.failed or report.skipped)):
        return
    cls, _, name = report.nodeid.rpartition("::")
    if report.skipped:
        outcome = "skipped"
        msg = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else ""
    elif report.failed:
        outcome = "failed"
        crash = getattr(report.longrepr, "reprcrash", None)
        msg = crash.message if crash is not None else str(report.longrepr)
    else:
        outcome = "passed"
        msg = ""
    with open(path, "a") as f:
        f.write(json.dumps({"class": cls.rpartition("::")[2], "name": name, "when": report.when,
                            "outcome": outcome, "message": msg.strip().splitlines()[0][:300] if msg.strip() else ""})
                + "\n")


def torchtpu_state() -> str:
    """Where torchtpu is imported from and, for a git checkout, its commit (+ dirty flag)."""
    spec = importlib.util.find_spec("torchtpu")
    if spec is None or not spec.origin:
        return "torchtpu not installed"
    where = Path(spec.origin).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=where,
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "."],
                               cwd=where, capture_output=True, text=True).stdout.strip()
        return f"torchtpu {where} at git {head}" + (" with uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return f"torchtpu {where}"


def _have_timeout_plugin() -> bool:
    return importlib.util.find_spec("pytest_timeout") is not None


def run_pytest(test_dir: Path, fname: str, device: str, xml_path: Path, args,
               node_ids: list[str] | None = None) -> float:
    """Runs one file's variants for one device (only ``node_ids`` if given); returns the wall
    time in seconds."""
    env = dict(os.environ)
    if device == "tpu":
        env["PYTORCH_TESTING_DEVICE_ONLY_FOR"] = "privateuse1"
    else:
        env["PYTORCH_TESTING_DEVICE_ONLY_FOR"] = "cpu"
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    jsonl = xml_path.with_suffix(".jsonl")
    jsonl.unlink(missing_ok=True)
    env["PYTORCH_DEVICE_TESTS_RESULTS"] = str(jsonl)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent), env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable, "-m", "pytest", *(node_ids or [fname]),
        "-p", "no:cacheprovider", "-p", "pytorch_device_tests",
        "-q", "-rN", "--tb=line",
        f"--junitxml={xml_path}",
        "-o", "junit_logging=no",
    ]
    if args.workers:
        cmd += ["-n", str(args.workers)]
    if _have_timeout_plugin() and args.timeout:
        cmd += [f"--timeout={args.timeout}"]
    skip = (HUGE_TESTS if args.skip_huge else []) + args.skip
    if skip and not node_ids:
        cmd += ["-k", " and ".join(f"not {t}" for t in skip)]
    cmd += args.pytest_args
    log_path = xml_path.with_suffix(".log")
    t0 = time.time()
    with open(log_path, "w") as log:
        log.write(time.strftime("%Y-%m-%d %H:%M:%S ") + torchtpu_state() + "\n")
        log.write(" ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=test_dir, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=args.file_time_limit or None)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # pytest stops and still writes what it has
            log.write(f"\n*** interrupted: --file-time-limit {args.file_time_limit} s reached\n")
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return time.time() - t0


def parse_junit(xml_path: Path) -> dict[tuple[str, str], tuple[str, str]]:
    """(class, test name) -> (outcome, first message line); outcome in passed/failed/skipped."""
    results: dict[tuple[str, str], tuple[str, str]] = {}
    jsonl = xml_path.with_suffix(".jsonl")
    if not xml_path.exists() or (jsonl.exists() and jsonl.stat().st_mtime > xml_path.stat().st_mtime + 5):
        # interrupted run: the junit file is missing or stale, the per-test log is not
        if jsonl.exists():
            for line in jsonl.read_text().splitlines():
                r = json.loads(line)
                key = (r["class"], r["name"])
                if r["outcome"] != "passed" or key not in results:
                    results[key] = (r["outcome"], r["message"])
        return results
    root = ET.parse(xml_path).getroot()
    for tc in root.iter("testcase"):
        cls = tc.get("classname", "").rsplit(".", 1)[-1]
        name = tc.get("name", "")
        outcome, msg = "passed", ""
        for child in tc:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                msg = (child.get("message") or child.text or "").strip()
                break
            if child.tag == "skipped":
                outcome = "skipped"
                msg = (child.get("message") or "").strip()
        msg = msg.splitlines()[0] if msg else ""
        results[(cls, name)] = (outcome, msg[:300])
    return results


def rerun_ids(fname: str, tpu: dict, recheck: int) -> list[str]:
    """pytest node ids of the tpu tests that failed in ``tpu`` (class, name) -> outcome, and of
    ``recheck`` of those that passed (a sample fixed by the file name)."""
    import random  # noqa: PLC0415

    failed = sorted(k for k, (outcome, _) in tpu.items() if outcome == "failed")
    passed = sorted(k for k, (outcome, _) in tpu.items() if outcome == "passed")
    sample = random.Random(fname).sample(passed, min(recheck, len(passed)))
    return [f"{fname}::{cls}::{name}" for cls, name in failed + sorted(sample)]


def cpu_twin(cls: str, name: str) -> tuple[str, str]:
    for suffix in DEVICE_CLASS_SUFFIXES:
        if cls.endswith(suffix):
            cls = cls[: -len(suffix)] + "CPU"
            break
    return cls, _TPU_TOKEN.sub("_cpu", name, count=1)


def summarize(fname: str, tpu: dict, cpu: dict) -> dict:
    s = {"file": fname, "passed": 0, "failed": 0, "skipped": 0,
         "excluded": [], "failures": [], "tpu_total": len(tpu), "cpu_total": len(cpu)}
    for key, (outcome, msg) in sorted(tpu.items()):
        twin = cpu.get(cpu_twin(*key))
        if twin is not None and twin[0] == "failed":
            s["excluded"].append({"test": "::".join(key), "tpu": outcome, "cpu_error": twin[1]})
            continue
        s[outcome] += 1
        if outcome == "failed":
            s["failures"].append({"test": "::".join(key), "error": msg})
    ran = s["passed"] + s["failed"]
    s["rate"] = s["passed"] / ran if ran else float("nan")
    return s


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("test_dir", type=Path,
                   help="the test/ folder of a PyTorch source checkout matching the installed torch")
    p.add_argument("--files", nargs="+", default=DEFAULT_FILES)
    p.add_argument("--out-dir", type=Path, default=Path("pytorch_device_tests_out"),
                   help="where the junit xml files and pytest logs go")
    p.add_argument("--timeout", type=int, default=900,
                   help="per-test timeout in seconds (needs pytest-timeout; 0 = none)")
    p.add_argument("-n", "--workers", type=int, default=0,
                   help="pytest-xdist workers per file (0 = in process)")
    p.add_argument("--file-time-limit", type=int, default=0, metavar="SECONDS",
                   help="interrupt a file's run after this long and report the tests it reached (0 = none)")
    p.add_argument("--device", choices=["both", "tpu", "cpu"], default="both",
                   help="which runs to (re)do; the other device's xml is reused if present")
    p.add_argument("--report-only", action="store_true", help="only parse the existing xml files")
    p.add_argument("--failures", action="store_true", help="list each counted tpu failure")
    p.add_argument("--no-skip-huge", dest="skip_huge", action="store_false",
                   help=f"also run the tests that allocate > 2**31 elements ({', '.join(HUGE_TESTS)})")
    p.add_argument("--skip", action="append", default=[], metavar="NAME",
                   help="deselect tests whose id contains NAME on both devices (repeatable)")
    p.add_argument("--rerun-failed", action="store_true",
                   help="re-run only the tpu tests that failed in --out-dir's results (plus --recheck-passed "
                        "of those that passed), and count the new outcomes over the old ones")
    p.add_argument("--recheck-passed", type=int, default=0, metavar="N",
                   help="with --rerun-failed: also re-run N of the previously passing tpu tests per file "
                        "(a fixed random sample), so a regression among them shows")
    p.add_argument("--json", type=Path, help="write the summary as JSON")
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = p.parse_args()

    test_dir = args.test_dir.resolve()
    missing = [f for f in args.files if not (test_dir / f).exists()]
    if missing:
        print(f"not found in {test_dir}: {', '.join(missing)}\n"
              "Pass the test/ folder of a PyTorch source checkout matching the installed torch.",
              file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)

    import torch  # noqa: PLC0415  (after argument errors, it takes a few seconds)

    print(f"torch {torch.__version__} ({torch.version.git_version}); test files from {test_dir}")
    print(torchtpu_state())
    if not _have_timeout_plugin():
        print("pytest-timeout not installed: no per-test timeout")

    summaries = []
    for fname in args.files:
        stem = Path(fname).stem
        xml = {d: (args.out_dir / f"{stem}.{d}.xml").resolve() for d in ("tpu", "cpu")}
        rerun = (args.out_dir / f"{stem}.tpu.rerun.xml").resolve()
        if args.rerun_failed and not args.report_only:
            ids = rerun_ids(fname, parse_junit(xml["tpu"]), args.recheck_passed)
            rerun.with_suffix(".jsonl").unlink(missing_ok=True)
            rerun.unlink(missing_ok=True)
            if ids:
                secs = run_pytest(test_dir, fname, "tpu", rerun, args, ids)
                print(f"  re-ran {len(ids)} tests of {fname} [tpu] in {secs:.0f} s", flush=True)
        elif not args.report_only:
            rerun.unlink(missing_ok=True)
            rerun.with_suffix(".jsonl").unlink(missing_ok=True)
            for dev in ("tpu", "cpu"):
                if args.device in ("both", dev):
                    secs = run_pytest(test_dir, fname, dev, xml[dev], args)
                    print(f"  ran {fname} [{dev}] in {secs:.0f} s", flush=True)
        tpu = parse_junit(xml["tpu"])
        rerun_results = parse_junit(rerun) if rerun.exists() or rerun.with_suffix(".jsonl").exists() else {}
        tpu.update(rerun_results)
        s = summarize(fname, tpu, parse_junit(xml["cpu"]))
        log = xml["tpu"].with_suffix(".log")
        text = log.read_text() if log.exists() else ""
        s["tpu_run"] = text.splitlines()[0] if text else ""
        if rerun_results:
            first = rerun.with_suffix(".log").read_text().splitlines()[0]
            s["tpu_run"] += (f"; re-run of {len(rerun_results)} tests ({sum(o == 'passed' for o, _ in rerun_results.values())}"
                             f" passed): {first}")
        if "*** interrupted" in text:
            s["tpu_run"] += " (interrupted by --file-time-limit: only the tests it reached are counted)"
        summaries.append(s)

    print()
    hdr = f"{'file':<28} {'tpu tests':>9} {'passed':>7} {'failed':>7} {'skipped':>8} {'excluded':>9} {'pass rate':>10}"
    print(hdr)
    print("-" * len(hdr))
    tot = {"tpu_total": 0, "passed": 0, "failed": 0, "skipped": 0, "excluded": 0}
    for s in summaries:
        print(f"{s['file']:<28} {s['tpu_total']:>9} {s['passed']:>7} {s['failed']:>7} "
              f"{s['skipped']:>8} {len(s['excluded']):>9} {100 * s['rate']:>9.1f}%")
        for k in ("tpu_total", "passed", "failed", "skipped"):
            tot[k] += s[k]
        tot["excluded"] += len(s["excluded"])
    ran = tot["passed"] + tot["failed"]
    overall = tot["passed"] / ran if ran else float("nan")
    print("-" * len(hdr))
    print(f"{'all files':<28} {tot['tpu_total']:>9} {tot['passed']:>7} {tot['failed']:>7} "
          f"{tot['skipped']:>8} {tot['excluded']:>9} {100 * overall:>9.1f}%")
    print("\npass rate = passed / (passed + failed) over tpu tests whose CPU twin does not fail")

    print("\ntpu runs:")
    for s in summaries:
        print(f"  {s['file']}: {s['tpu_run']}")
    for s in summaries:
        if s["excluded"]:
            print(f"\n{s['file']}: excluded (the CPU twin fails too):")
            for e in s["excluded"]:
                print(f"  {e['test']}  [tpu {e['tpu']}; cpu: {e['cpu_error'][:120]}]")
    if args.failures:
        for s in summaries:
            if s["failures"]:
                print(f"\n{s['file']}: tpu failures counted:")
                for f in s["failures"]:
                    print(f"  {f['test']}: {f['error'][:200]}")
    if args.json:
        args.json.write_text(json.dumps({"torch": torch.__version__, "test_dir": str(test_dir),
                                         "overall": {**tot, "rate": overall},
                                         "files": summaries}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
