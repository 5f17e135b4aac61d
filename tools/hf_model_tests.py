"""Run transformers' own model tests on ``tpu`` and write their pass rates to docs/transformers_tests.md.

    /tmp/hfenv/bin/python tools/hf_model_tests.py SOURCE [--arch gpt2 llama bert ...]

SOURCE is a transformers source tree: a git checkout or the unpacked sdist of the installed
version (``pip download --no-binary :all: --no-deps transformers==X``). For an architecture whose
``tests/models/<arch>/test_modeling_<arch>.py`` is in SOURCE, that file runs as it is. The sdist
ships only the shared test files; there, transformers' ``ModelTesterMixin`` (its common model
tests) runs with a small tester from ``tools/hf_arch_testers.py``, and the two shared modules the
sdist lacks (the generation and export mixins) are replaced by empty mixins, so those tests do not
run; the report says which mode each architecture ran in.

Each architecture runs in its own pytest process (``TRANSFORMERS_TEST_DEVICE=tpu``), in its own
process group, killed with its children at the timeout. This module is also the pytest plugin
(``-p hf_model_tests``) that records every test's outcome as a JSON line as it finishes, so a run
cut by the timeout still counts what it ran.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
RESULTS_ENV = "HF_MODEL_TESTS_RESULTS"
OUTCOMES = ("passed", "failed", "errors", "skipped")

# Shared test modules the sdist does not ship, and the empty mixin that stands in for each.
MISSING_MIXINS = {
    "generation/test_utils.py": "GenerationTesterMixin",
    "exporters/test_export.py": "ExportTesterMixin",
}
# Tests that check how a tester is wired up (it must inherit the generation mixin), not the model.
COMMON_DESELECT = ("test_generation_tester_mixin_inheritance",)

# Known causes, matched against a failure's first line: (pattern, cause, whose). Read when grouping.
KNOWN_CAUSES: list[tuple[str, str, str]] = [
    # skip reasons
    (r"requires FlexAttention", "transformers' is_torch_flex_attn_available() answers False whenever the "
     "accelerator is a `tpu` (written for other TPU stacks); torchtpu itself runs flex_attention", "transformers"),
    (r"requires Flash Attention|requires the kernels library|requires MPS|requires deepspeed",
     "CUDA/MPS-only kernels or packages", "not the device"),
    (r"test is slow", "transformers runs these with RUN_SLOW=1", "not run here"),
    (r"same number of <eos> tokens",
     "the common SDPA test pads rows unevenly; T5ForSequenceClassification needs one eos per row",
     "test input, not the device"),
]


# ---- the pytest plugin half: runs inside the pytest process --------------------------------------

def pytest_runtest_logreport(report) -> None:
    """Append one JSON line per finished test phase that decides its outcome."""
    outcome = _outcome(report)
    if outcome is None:
        return
    # A failing subtest (pytest's built-in subtests) fails its test, whose own report may still pass.
    subtest = type(report).__name__ == "SubtestReport"
    if subtest and outcome != "failed":
        return
    line = {"test": report.nodeid, "outcome": outcome, "reason": _reason(report)}
    with open(os.environ[RESULTS_ENV], "a") as f:
        f.write(json.dumps(line) + "\n")


def _outcome(report) -> str | None:
    if report.skipped:
        return "skipped"
    if report.failed:
        return "failed" if report.when == "call" else "errors"
    return "passed" if report.when == "call" else None


def _reason(report) -> str:
    if report.passed:
        return ""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    crash = getattr(report.longrepr, "reprcrash", None)
    return crash.message if crash is not None else str(report.longrepr)[-400:]


# ---- the driver half --------------------------------------------------------------------------------

@dataclass
class ArchResult:
    """Outcome of one architecture's run."""

    arch: str
    mode: str
    tests: list[dict] = field(default_factory=list)
    timed_out: bool = False
    seconds: float = 0.0
    overridden: dict = field(default_factory=dict)  # test -> why it is not run in common mode

    def count(self, outcome: str) -> int:
        return sum(t["outcome"] == outcome for t in self.tests)

    def cpu_failures(self) -> int:
        return sum(t.get("cpu") in ("failed", "errors") for t in self.tests)


def model_test_file(source: Path, arch: str) -> Path:
    return source / "tests" / "models" / arch / f"test_modeling_{arch}.py"


def build_common_tree(source: Path, work: Path, arch: str) -> Path:
    """Copy SOURCE's shared tests into WORK, fill the missing mixins, write ARCH's test module."""
    tests = work / "tests"
    if not tests.exists():
        shutil.copytree(source / "tests", tests, ignore=shutil.ignore_patterns("models", "__pycache__"))
        for rel, mixin in MISSING_MIXINS.items():
            target = tests / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            (target.parent / "__init__.py").touch()
            if not target.exists():
                target.write_text(f'"""Not in the transformers sdist: its tests do not run here."""\n\n'
                                  f"class {mixin}:\n    pass\n")
        (tests / "__init__.py").touch()
    arch_dir = tests / "models" / arch
    arch_dir.mkdir(parents=True, exist_ok=True)
    for pkg in (tests / "models", arch_dir):
        (pkg / "__init__.py").touch()
    module = arch_dir / f"test_common_{arch}.py"
    module.write_text(
        f'"""transformers\' ModelTesterMixin for {arch}, with the tester from tools/hf_arch_testers.py."""\n\n'
        "from hf_arch_testers import make_test_case\n\n"
        "from ...test_modeling_common import ModelTesterMixin\n\n"
        f'{arch.capitalize()}CommonModelTest = make_test_case("{arch}", ModelTesterMixin)\n'
    )
    return module


def common_overridden(python: str, arch: str) -> dict[str, str]:
    """The common tests ARCH's own test file replaces (tools/hf_arch_testers.py), read in PYTHON."""
    code = f"import json, hf_arch_testers as t; print(json.dumps(t.SPECS[{arch!r}].overridden))"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=str(TOOLS), TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_arch(source: Path, work: Path, arch: str, python: str, timeout: float,
             extra_args: tuple[str, ...] = ()) -> ArchResult:
    """Run one architecture's tests on tpu, then its failures again on CPU (are they tpu's?)."""
    own_file = model_test_file(source, arch)
    if own_file.exists():
        mode, root, target, overridden, deselect = "model file", source, own_file, {}, ()
    else:
        mode, root, target = "common mixin", work, build_common_tree(source, work, arch)
        overridden = common_overridden(python, arch)
        deselect = (*COMMON_DESELECT, *overridden)
    rel = str(target.relative_to(root))
    args = [rel, *extra_args]
    for name in deselect:
        args += ["--deselect", f"{rel}::{arch.capitalize()}CommonModelTest::{name}"]
    started = datetime.datetime.now()
    tests, timed_out = _pytest(python, root, args, "tpu", work / arch, timeout)
    result = ArchResult(arch, mode, tests=tests, timed_out=timed_out, overridden=overridden)
    result.seconds = (datetime.datetime.now() - started).total_seconds()
    failing = [t for t in tests if t["outcome"] in ("failed", "errors")]
    if failing:
        on_cpu, _ = _pytest(python, root, [t["test"] for t in failing], "cpu", work / f"{arch}-cpu", timeout)
        cpu_outcome = {t["test"]: t["outcome"] for t in on_cpu}
        for t in failing:
            t["cpu"] = cpu_outcome.get(t["test"], "not run")
    return result


def _pytest(python: str, root: Path, args: list[str], device: str, stem: Path,
            timeout: float) -> tuple[list[dict], bool]:
    """One pytest process group on DEVICE; killed with its children at the timeout. (tests, timed out)"""
    results = stem.with_suffix(".jsonl")
    results.write_text("")
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "hf_model_tests", f"--rootdir={root}", *args]
    env = dict(os.environ, TRANSFORMERS_TEST_DEVICE=device, HF_HUB_OFFLINE="1", PYTHONPATH=str(TOOLS),
               **{RESULTS_ENV: str(results)})
    timed_out = False
    with open(stem.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_group(proc)
    lines = (json.loads(line) for line in results.read_text().splitlines() if line.strip())
    return merge_phases(lines), timed_out


SEVERITY = {"passed": 0, "skipped": 1, "failed": 2, "errors": 3}


def merge_phases(lines) -> list[dict]:
    """One entry per test: the worst of its setup, call, subtest and teardown outcomes."""
    merged: dict[str, dict] = {}
    for line in lines:
        seen = merged.get(line["test"])
        if seen is None or SEVERITY[line["outcome"]] > SEVERITY[seen["outcome"]]:
            merged[line["test"]] = line
    return list(merged.values())


def _kill_group(proc: subprocess.Popen) -> None:
    """End the pytest process and anything it started (compile workers, subprocess tests)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def reason_key(reason: str) -> str:
    """One line that groups equal causes: first line, numbers and addresses folded, shortened."""
    first = reason.strip().splitlines()[0] if reason.strip() else "(no message)"
    first = re.sub(r"0x[0-9a-f]+", "ADDR", first)
    first = re.sub(r"(?<![\w.])\d+(\.\d+)?(e[-+]?\d+)?", "N", first)  # numbers, not T5 or fp32
    return first[:160]


def known_cause(key: str) -> tuple[str, str]:
    for pattern, cause, whose in KNOWN_CAUSES:
        if re.search(pattern, key):
            return cause, whose
    return "", ""


def write_doc(results: list[ArchResult], out: Path, source: Path, version: str, argv: list[str]) -> None:
    lines = [
        "# Transformers' own model tests on `tpu`",
        "",
        "Generated by `tools/hf_model_tests.py`; do not edit by hand. Tests run on XLA:CPU.",
        "",
        f"- transformers {version}; tests from `{source}` ({_source_revision(source)})",
        f"- sources: the sdist is `pip download --no-binary :all: --no-deps transformers=={version}`, unpacked;",
        f"  with a transformers git checkout at tag `v{version}` as SOURCE, each architecture's own test file runs",
        f"- date: {datetime.date.today().isoformat()}; machine: 2 shared CPU cores, loaded (times are rough)",
        f"- command: `{' '.join(argv)}`",
        "",
        "| architecture | mode | tests run | passed | failed | errors | skipped | pass rate | failing on CPU too | time |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        ran = r.count("passed") + r.count("failed") + r.count("errors")
        rate = f"{100 * r.count('passed') / ran:.1f}%" if ran else "-"
        note = " (timed out)" if r.timed_out else ""
        lines.append(f"| {r.arch} | {r.mode} | {ran} | " + " | ".join(str(r.count(o)) for o in OUTCOMES)
                     + f" | {rate} | {r.cpu_failures()} | {r.seconds / 60:.1f} min{note} |")
    lines += ["", "Pass rate = passed / (passed + failed + errors); skipped tests are not run. *Failing on CPU too*:",
              "the failures that also fail with `TRANSFORMERS_TEST_DEVICE=cpu` (the test's or its tester's, not tpu's).",
              ""]
    lines += _modes_section()
    lines += [f"- {r.arch}: `{test}` not run: the per-model test file replaces it ({why})."
              for r in results for test, why in r.overridden.items()]
    lines += [""] if any(r.overridden for r in results) else []
    lines += _failure_section(results)
    lines += _skip_section(results)
    out.write_text("\n".join(lines) + "\n")


def _modes_section() -> list[str]:
    return [
        "**Modes.** *model file*: the architecture's own `tests/models/<arch>/test_modeling_<arch>.py`.",
        "*common mixin*: the source has no per-model file (the sdist ships only the shared tests), so",
        "transformers' `ModelTesterMixin` (`tests/test_modeling_common.py`) runs with a small tester from",
        "`tools/hf_arch_testers.py`; the generation and export mixins, absent from the sdist, are empty,",
        f"so `generate` and `torch.export` tests do not run, and {', '.join(COMMON_DESELECT)} (it checks",
        "that a tester inherits the generation mixin) is deselected.",
        "",
    ]


def _failure_section(results: list[ArchResult]) -> list[str]:
    groups: dict[str, list[dict]] = collections.defaultdict(list)
    for r in results:
        for t in r.tests:
            if t["outcome"] in ("failed", "errors"):
                groups[reason_key(t["reason"])].append(dict(t, arch=r.arch))
    if not groups:
        return ["## Failures", "", "None.", ""]
    lines = ["## Failures, grouped by their first line", "",
             "*On CPU*: the same tests run again with `TRANSFORMERS_TEST_DEVICE=cpu`; a failure there too is",
             "not the device's.", "",
             "| count | reason | on CPU | cause | tests |", "| --- | --- | --- | --- | --- |"]
    for key, tests in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        cause, whose = known_cause(key)
        cpu = collections.Counter(t.get("cpu", "not run") for t in tests)
        if not cause and set(cpu) <= {"failed", "errors"}:
            cause, whose = "fails on CPU too", "the test or its tester, not the device"
        cause_cell = f"{cause} ({whose})" if cause else "not yet analysed"
        cpu_cell = ", ".join(f"{n} {outcome}" for outcome, n in cpu.most_common())
        names = [f"{t['arch']}: {t['test'].rsplit('::', 1)[-1]}" for t in tests]
        shown = ", ".join(names[:6]) + (f", … ({len(names) - 6} more)" if len(names) > 6 else "")
        lines.append(f"| {len(tests)} | `{_cell(key)}` | {cpu_cell} | {_cell(cause_cell)} | {_cell(shown)} |")
    return lines + [""]


def _skip_section(results: list[ArchResult]) -> list[str]:
    reasons = collections.Counter(reason_key(t["reason"]) for r in results for t in r.tests
                                  if t["outcome"] == "skipped")
    lines = ["## Skips, grouped by reason (top 15)", "", "| count | reason | note |", "| --- | --- | --- |"]
    for key, n in reasons.most_common(15):
        cause, whose = known_cause(key)
        lines.append(f"| {n} | `{_cell(key)}` | {_cell(f'{cause} ({whose})' if cause else '')} |")
    return lines + [""]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("`", "'")


def _source_revision(source: Path) -> str:
    if (source / ".git").exists():
        rev = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True)
        return f"commit {rev.stdout.strip()}"
    return "sdist, no git commit"


def transformers_version(python: str) -> str:
    out = subprocess.run([python, "-c", "import transformers; print(transformers.__version__)"],
                         capture_output=True, text=True, env=dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    return out.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="transformers source tree or unpacked sdist")
    parser.add_argument("--arch", nargs="+", default=["gpt2", "llama", "bert"])
    parser.add_argument("--timeout", type=float, default=900, help="seconds per architecture")
    parser.add_argument("--python", default=sys.executable, help="interpreter with transformers and torchtpu")
    parser.add_argument("--work", type=Path, default=Path("/tmp/hf_model_tests"))
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "transformers_tests.md")
    parser.add_argument("--jobs", type=int, default=1, help="architectures run side by side")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression, to rerun a subset")
    parser.add_argument("--report-only", action="store_true", help="rewrite the report from WORK/results.json")
    args = parser.parse_args(argv)
    source = args.source.resolve()
    if args.report_only:
        saved = json.loads((args.work / "results.json").read_text())
        write_doc([ArchResult(**r) for r in saved["results"]], args.out, source, saved["version"], saved["argv"])
        return 0
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    extra = ("-k", args.keyword) if args.keyword else ()
    # Build the shared tree once before runs start side by side.
    if not all(model_test_file(source, a).exists() for a in args.arch):
        build_common_tree(source, args.work, args.arch[0])
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda a: run_arch(source, args.work, a, args.python, args.timeout, extra), args.arch))
    for result in results:
        arch = result.arch
        print(f"{arch}: {len(result.tests)} tests, {result.count('passed')} passed, {result.count('failed')} failed, "
              f"{result.count('errors')} errors, {result.count('skipped')} skipped"
              f"{' (timed out)' if result.timed_out else ''}", flush=True)
    shown_argv = ["python", "tools/hf_model_tests.py", *(sys.argv[1:] if argv is None else argv)]
    version = transformers_version(args.python)
    saved = {"results": [dataclasses.asdict(r) for r in results], "version": version, "argv": shown_argv}
    (args.work / "results.json").write_text(json.dumps(saved))
    write_doc(results, args.out, source, version, shown_argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
