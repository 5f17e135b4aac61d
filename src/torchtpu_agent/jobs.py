"""What a job does inside its own process: run a user's script, or one of the diagnostics on a
function of it, with torchtpu's reporting on, and write the result as JSON.

This module runs in the job's process (forked from the warm zygote, or spawned as
``python -m torchtpu_agent.jobs JOB.json``), never in the MCP server: user code can crash, hang or
leave state behind, and the server kills the process group when the time bound passes.

A job is a dict: ``kind`` (run, info, doctor, explain, compare_with_cpu, hlo, cost_analysis,
profile, bench), ``path`` and ``args`` of the script, ``function`` (the name of a function in the
script that builds ``(fn, args)`` or ``(fn, args, kwargs)``), ``changes`` (interventions from
``suggest`` applied before the script runs, see ``apply_changes``) and ``options``.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import re
import runpy
import statistics
import sys
import time
import traceback
from typing import Any, Callable

import torch  # noqa: F401  (first: its autoload imports torchtpu)

import torchtpu  # noqa: F401
from torchtpu import metrics

_MAX_TEXT = 40_000


class UserError(Exception):
    """A problem with what the caller asked for (bad path, no such function): reported as a tool error."""


# ---------------------------------------------------------------- recording

class Recorder:
    """Collects what ``torchtpu.metrics`` does not: where each CPU fallback happened, graph breaks
    with their place, step boundaries (optimizer steps and ``metrics.end_step()``)."""

    def __init__(self, script: str | None):
        self.script = os.path.realpath(script) if script else None
        self.fallback_where: dict[str, str] = {}
        self.graph_breaks: list[dict[str, str]] = []
        self.step_times: list[float] = []
        self.step_source: str | None = None
        self._handles: list = []

    def install(self) -> None:
        self._install_fallback_hook()
        self._install_graph_break_log()
        self._install_step_hooks()

    # the user's frame nearest the op, as file:line (the script's own frames first)
    def _user_where(self) -> str:
        frames = traceback.extract_stack()[:-3]
        mine = os.path.dirname(os.path.abspath(__file__))
        candidates = [f for f in frames if not f.filename.startswith(mine) and "site-packages" not in f.filename
                      and "/torchtpu/" not in f.filename and not f.filename.startswith("<")]
        if self.script:
            own = [f for f in candidates if os.path.realpath(f.filename) == self.script]
            candidates = own or candidates
        if not candidates:
            return "unknown"
        f = candidates[-1]
        return f"{f.filename}:{f.lineno} in {f.name}" + (f" (`{f.line.strip()}`)" if f.line else "")

    def _install_fallback_hook(self) -> None:
        from torchtpu.eager import fallback

        original = fallback._cpu_fallback
        recorder = self

        def recording(op, *args, **kwargs):
            name = str(op)
            if name not in recorder.fallback_where:
                recorder.fallback_where[name] = recorder._user_where()
            return original(op, *args, **kwargs)

        fallback._cpu_fallback = recording

    def _install_graph_break_log(self) -> None:
        torch._logging.set_logs(graph_breaks=True)
        logger = logging.getLogger("torch._dynamo.symbolic_convert.__graph_breaks")
        recorder = self

        class Handler(logging.Handler):
            def emit(self, record):
                try:
                    recorder.graph_breaks.append(_parse_graph_break(record.getMessage()))
                except Exception:  # a log we cannot read is not worth failing the run
                    pass

        logger.handlers[:] = [Handler()]
        logger.propagate = False  # not on the script's stderr

    def _install_step_hooks(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        def boundary(source: str) -> None:
            if self.step_source not in (None, source):
                return  # the script marks steps both ways: keep the first kind seen
            self.step_source = source
            try:
                torch.tpu.synchronize()  # the step's device work is done: the time is the step's
            except Exception:
                pass
            self.step_times.append(time.perf_counter())

        self._handles.append(register_optimizer_step_post_hook(lambda opt, args, kwargs: boundary("optimizer.step")))
        end_step = metrics.end_step

        def counted_end_step():
            boundary("torchtpu.metrics.end_step")
            return end_step()

        metrics.end_step = counted_end_step

    def steps(self) -> dict[str, Any]:
        times = self.step_times
        durations = [b - a for a, b in zip(times, times[1:])]
        out: dict[str, Any] = {"count": len(times), "marked_by": self.step_source}
        if len(durations) >= 2:
            steady = durations[len(durations) // 2:]  # the later half: past compilation and warm-up
            out["first_step_s"] = round(durations[0], 4)
            out["steady_step_ms"] = round(1000 * statistics.median(steady), 3)
        else:
            out["steady_step_ms"] = None
            out["note"] = ("fewer than 3 step boundaries: steps are marked by optimizer.step() or "
                           "torchtpu.metrics.end_step() calls")
        return out


_BREAK_AT = re.compile(r"Graph break in user code at (?P<where>\S+)")


def _parse_graph_break(text: str) -> dict[str, str]:
    lines = [line.rstrip() for line in text.splitlines()]
    where = next((m.group("where") for m in map(_BREAK_AT.search, lines) if m), "unknown")
    reason, explanation, hints = "", "", []
    for i, line in enumerate(lines):
        s = line.strip()
        if s.startswith("Graph Break Reason:"):
            rest = s[len("Graph Break Reason:"):].strip()
            nxt = next((x.strip() for x in lines[i + 1:] if x.strip()), "")
            reason = nxt if rest.startswith("Encountered graph break when attempting") and nxt else rest
        elif s.startswith("Explanation:") and not explanation:
            explanation = s[len("Explanation:"):].strip()
        elif s.startswith("Hint:"):
            hints.append(s[len("Hint:"):].strip())
    code = ""
    m = re.search(r'File "([^"]+)", line (\d+), in \S+\n\s+(.+)', text)
    if m and f"{m.group(1)}:{m.group(2)}" == where:
        code = m.group(3).strip()
    return {"where": where, "code": code, "reason": reason or explanation or "unknown",
            "explanation": explanation, "hint": " ".join(hints)}


# ---------------------------------------------------------------- changes (from suggest)

def apply_changes(changes: list[dict[str, Any]]) -> list[str]:
    """Apply ``suggest``'s interventions, each the runtime form of a source change; returns what was done."""
    done = []
    for change in changes or []:
        kind = change.get("kind")
        if kind == "register_tpu_kernel":
            _tpu_kernel_for(change["op"])
            done.append(f"{change['op']}: its CPU implementation also registered for tpu")
        elif kind == "compile_dynamic":
            _compile_default(dynamic=True)
            done.append("torch.compile(..., dynamic=True) where dynamic was not given")
        elif kind == "dynamo_config":
            setattr(torch._dynamo.config, change["name"], change["value"])
            done.append(f"torch._dynamo.config.{change['name']} = {change['value']!r}")
        elif kind == "reorderable_logging":
            fn = getattr(builtins, change.get("function", "print"))
            torch._dynamo.config.reorderable_logging_functions.add(fn)
            done.append(f"torch._dynamo.config.reorderable_logging_functions.add({change.get('function', 'print')})")
        elif kind == "eager_mode":
            torch.tpu.eager_mode = getattr(torch.tpu.EagerMode, change["value"].upper())
            done.append(f"torch.tpu.eager_mode = EagerMode.{change['value'].upper()}")
        elif kind == "matmul_precision":
            torch.set_float32_matmul_precision(change["value"])
            done.append(f"torch.set_float32_matmul_precision({change['value']!r})")
        else:
            raise UserError(f"unknown change kind {kind!r}")
    return done


def _tpu_kernel_for(qualname: str) -> None:
    """A custom op defined later by the script (``torch.library.custom_op(..., device_types="cpu")``
    or ``Library.impl(name, fn, "CPU")``) gets its implementation registered for tpu as well: the
    source change "add 'tpu' to device_types" / "impl it for PrivateUse1"."""
    from torch._library import custom_ops

    original = custom_ops.custom_op

    def custom_op(name, fn=None, /, *, mutates_args, device_types=None, schema=None, **kwargs):
        if name == qualname and device_types is not None:
            types = [device_types] if isinstance(device_types, str) else list(device_types)
            device_types = types + ["tpu"] if "tpu" not in types else types
        return original(name, fn, mutates_args=mutates_args, device_types=device_types, schema=schema, **kwargs)

    custom_ops.custom_op = custom_op
    torch.library.custom_op = custom_op
    impl = torch.library.Library.impl

    def library_impl(self, op_name, fn, dispatch_key="", *args, **kwargs):
        result = impl(self, op_name, fn, dispatch_key, *args, **kwargs)
        name = op_name if isinstance(op_name, str) else str(op_name)
        if f"{self.ns}::{name.split('.')[0]}" == qualname and dispatch_key == "CPU":
            impl(self, op_name, fn, "PrivateUse1", *args, **kwargs)
        return result

    torch.library.Library.impl = library_impl


def _compile_default(**defaults: Any) -> None:
    compile_ = torch.compile

    def compile(model=None, **kwargs):
        for k, v in defaults.items():
            kwargs.setdefault(k, v)
        if model is None:
            return lambda m: compile_(m, **kwargs)
        return compile_(model, **kwargs)

    torch.compile = compile


# ---------------------------------------------------------------- the report of a run

def _fallback_kind(name: str) -> str:
    ns = name.split(".")[0]
    if ns in ("aten", "prims"):
        return "aten"
    from torch._library import custom_ops

    qualname = "::".join(name.split(".")[:2])
    if qualname in custom_ops.OPDEFS:
        return "python_custom_op"
    return "library_op"


def collect(recorder: Recorder) -> dict[str, Any]:
    from torchtpu.compile.introspect import recompile_sentences

    snap = metrics.snapshot()
    fallbacks = [{"op": op, "count": n, "where": recorder.fallback_where.get(op, "unknown"),
                  "kind": _fallback_kind(op)}
                 for op, n in sorted(snap["cpu_fallbacks"].items(), key=lambda kv: -kv[1])]
    breaks: dict[tuple, dict] = {}
    known = {b["explanation"] or b["reason"] for b in recorder.graph_breaks if b["where"] != "unknown"}
    for b in recorder.graph_breaks:
        if b["where"] == "unknown" and (b["explanation"] or b["reason"]) in known:
            continue  # the same break, logged again without its place (a resumed frame)
        entry = breaks.setdefault((b["where"], b["reason"]), {**b, "count": 0})
        entry["count"] += 1
    graph = snap["graph_compiles"]
    eager = snap["eager_compiles"]
    ops = snap["ops"]
    try:
        peak = int(torch.tpu.max_memory_allocated())
    except Exception:
        peak = None
    return {
        "cpu_fallbacks": fallbacks,
        "recompiles": sorted(snap["recompiles"], key=lambda e: -e["count"]),
        "recompile_sentences": recompile_sentences(),
        "graph_breaks": list(breaks.values()),
        "host_transfers": snap["transfers"],
        "compile": {
            "graph_programs_compiled": graph["compilations"],
            "graph_compile_s": round(graph["compile_seconds"], 3),
            "eager_programs_compiled": eager["compilations"],
            "eager_compile_s": round(eager["compile_seconds"], 3),
            "loaded_from_persistent_cache": graph["persistent_hits"] + eager["persistent_hits"],
            "compiled_functions": {k: v["compilations"] for k, v in snap["compiles"].items()},
        },
        "steps": recorder.steps(),
        "peak_device_memory_bytes": peak,
        "ops_dispatched": sum(ops.values()),
        "top_ops": [{"op": k, "count": v} for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:10]],
        "matmul_ops": sum(v for k, v in ops.items() if any(m in k for m in ("mm", "matmul", "linear", "bmm"))),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "torch_compile_used": bool(snap["compiles"]) or graph["compilations"] > 0,
    }


def summary(report: dict[str, Any]) -> list[str]:
    """The findings in plain sentences."""
    lines = []
    for f in report.get("cpu_fallbacks", []):
        lines.append(f"CPU fallback: {f['op']} ran on the host {f['count']} time(s), at {f['where']}")
    lines += [f"recompile: {s}" for s in report.get("recompile_sentences", [])]
    for b in report.get("graph_breaks", []):
        why = f"{b['reason']}: {b['explanation']}" if b.get("explanation") else b["reason"]
        lines.append(f"graph break at {b['where']}: {why}")
    t = report.get("host_transfers") or {}
    if t:
        lines.append(f"host transfers: {t.get('to_device', 0)} to device ({t.get('to_device_bytes', 0)} B), "
                     f"{t.get('to_host', 0)} to host ({t.get('to_host_bytes', 0)} B)")
    c = report.get("compile") or {}
    if c:
        lines.append(f"compile: {c['graph_programs_compiled']} torch.compile programs ({c['graph_compile_s']} s), "
                     f"{c['eager_programs_compiled']} eager programs ({c['eager_compile_s']} s)")
    s = report.get("steps") or {}
    if s.get("steady_step_ms") is not None:
        lines.append(f"steady step time: {s['steady_step_ms']} ms over {s['count']} steps ({s['marked_by']})")
    if report.get("peak_device_memory_bytes") is not None:
        lines.append(f"peak device memory: {report['peak_device_memory_bytes']} B")
    return lines


# ---------------------------------------------------------------- running user code

def _check_path(path: str | None) -> str:
    if not path:
        raise UserError("no script path given")
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise UserError(f"no such script: {full}")
    return full


def _error(exc: BaseException, script: str | None) -> dict[str, Any]:
    frames = traceback.extract_tb(exc.__traceback__)
    here = os.path.abspath(__file__)
    frames = [f for f in frames if f.filename != here and "runpy" not in f.filename]
    where = ""
    if script:
        own = [f for f in frames if os.path.realpath(f.filename) == os.path.realpath(script)]
        if own:
            where = f"{own[-1].filename}:{own[-1].lineno} in {own[-1].name}"
    text = "".join(traceback.format_list(frames[-8:]))
    return {"type": type(exc).__name__, "message": str(exc)[:4000], "where": where,
            "traceback": text[-6000:]}


def run_script(job: dict[str, Any]) -> dict[str, Any]:
    path = _check_path(job.get("path"))
    recorder = Recorder(path)
    recorder.install()
    applied = apply_changes(job.get("changes") or [])
    metrics.reset()
    sys.argv = [path, *map(str, job.get("args") or [])]
    sys.path.insert(0, os.path.dirname(path))
    start = time.perf_counter()
    error = None
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            error = {"type": "SystemExit", "message": f"the script exited with status {exc.code}", "where": "",
                     "traceback": ""}
    except BaseException as exc:  # the script's own failure: reported, with what ran before it
        error = _error(exc, path)
    try:
        torch.tpu.synchronize()
    except BaseException as exc:
        error = error or _error(exc, path)
    wall = time.perf_counter() - start
    report = {"script": path, "args": job.get("args") or [], "ok": error is None, "error": error,
              "wall_s": round(wall, 3), "device": torch.tpu.get_device_name(), "changes_applied": applied,
              **collect(recorder)}
    report["summary"] = summary(report)
    return report


def load_function(job: dict[str, Any]) -> tuple[Callable, tuple, dict, str]:
    """The ``function`` of the script at ``path``, called: ``(fn, args)`` or ``(fn, args, kwargs)``."""
    path = _check_path(job.get("path"))
    name = job.get("function") or "example"
    sys.argv = [path, *map(str, job.get("args") or [])]
    sys.path.insert(0, os.path.dirname(path))
    namespace = runpy.run_path(path, run_name="__torchtpu_agent__")  # the script's `if __name__ == "__main__"` stays off
    builder = namespace.get(name)
    if not callable(builder):
        available = sorted(k for k, v in namespace.items() if callable(v) and not k.startswith("_")
                           and getattr(v, "__module__", None) in (None, "__torchtpu_agent__"))
        raise UserError(f"{path} defines no function {name!r} (functions there: {', '.join(available) or 'none'}); "
                        f"it must return (fn, args) or (fn, args, kwargs)")
    built = builder()
    if not isinstance(built, (tuple, list)) or len(built) not in (2, 3) or not callable(built[0]):
        raise UserError(f"{name}() must return (fn, args) or (fn, args, kwargs), got {type(built).__name__}")
    fn, args = built[0], tuple(built[1])
    kwargs = dict(built[2]) if len(built) == 3 else {}
    return fn, args, kwargs, path


def _bind(fn: Callable, kwargs: dict) -> Callable:
    if not kwargs:
        return fn

    def call(*args):
        return fn(*args, **kwargs)

    call.__qualname__ = getattr(fn, "__qualname__", "fn")
    return call


def do_explain(job):
    fn, args, kwargs, _ = load_function(job)
    e = torch.tpu.compiler.explain(_bind(fn, kwargs), *args)
    return {"function": e.function, "graph_count": e.graph_count, "graph_breaks": e.graph_breaks,
            "recompilations": e.recompilations, "programs": e.programs, "text": str(e)}


def do_compare(job):
    from torchtpu import debug

    fn, args, kwargs, _ = load_function(job)
    opts = job.get("options") or {}
    m = debug.compare_with_cpu(fn, *args, rtol=opts.get("rtol"), atol=opts.get("atol"), **kwargs)
    if m is None:
        return {"match": True, "text": "every op matched the CPU"}
    return {"match": False, "op": m.op, "module_path": m.module_path, "reason": m.reason,
            "output_index": m.output_index, "max_abs_diff": m.max_abs_diff,
            "first_index": list(m.first_index) if m.first_index else None, "ops_matched_before": m.ops_checked,
            "text": str(m)}


def do_hlo(job):
    fn, args, kwargs, _ = load_function(job)
    opts = job.get("options") or {}
    text = torch.tpu.compiler.hlo(_bind(fn, kwargs), *args, stage=opts.get("stage", "stablehlo"))
    limit = int(opts.get("max_chars", _MAX_TEXT))
    return {"stage": opts.get("stage", "stablehlo"), "programs": text.count("// ===== graph "),
            "chars": len(text), "truncated": len(text) > limit, "text": text[:limit]}


def do_cost(job):
    fn, args, kwargs, _ = load_function(job)
    costs = torch.tpu.compiler.cost_analysis(_bind(fn, kwargs), *args)
    keep = ("graph", "kind", "inputs", "flops", "bytes accessed", "transcendentals", "optimal_seconds")
    return {"programs": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in c.items() if k in keep}
                         for c in costs]}


def do_profile(job):
    import tempfile

    from torchtpu import profiler

    fn, args, kwargs, _ = load_function(job)
    opts = job.get("options") or {}
    steps = int(opts.get("steps", 3))
    logdir = opts.get("logdir") or tempfile.mkdtemp(prefix="torchtpu_profile_")
    fn(*args, **kwargs)  # warm-up: compilation stays out of the trace
    torch.tpu.synchronize()
    with profiler.trace(logdir):
        for _ in range(steps):
            fn(*args, **kwargs)
    events = profiler.trace_events(logdir)
    totals: dict[str, list] = {}
    for e in events:
        t = totals.setdefault(e["name"], [0.0, 0])
        t[0] += e.get("dur", 0)
        t[1] += 1
    skip = re.compile(r"^(\$|PjitFunction|ThunkExecutor|TfrtCpu|pjit|jit_|TraceAnnotation)")
    ranked = sorted(((n, d, c) for n, (d, c) in totals.items() if not skip.search(n)), key=lambda x: -x[1])
    top = int(opts.get("top", 15))
    return {"logdir": logdir, "trace_files": profiler.trace_files(logdir), "steps": steps,
            "top_ops": [{"name": n, "total_ms": round(d / 1000, 3), "calls": c} for n, d, c in ranked[:top]],
            "view": f"tensorboard --logdir {logdir} (Profile tab), or open the .trace.json.gz in ui.perfetto.dev"}


_MODES = ("eager", "fused", "torch.compile", "compile_step")


def do_bench(job):
    opts = job.get("options") or {}
    steps, warmup = int(opts.get("steps", 5)), int(opts.get("warmup", 2))
    job = {**job, "function": job.get("function") or "train_step"}
    modes = opts.get("modes") or list(_MODES)
    results = []
    for mode in modes:
        step, args, kwargs, _ = load_function(job)  # a fresh model and optimizer per mode
        entry: dict[str, Any] = {"mode": mode}
        try:
            entry.update(_time_mode(mode, step, args, kwargs, steps, warmup))
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500]
        results.append(entry)
    ok = [r for r in results if "steady_step_ms" in r]
    recommendation = None
    if ok:
        best = min(ok, key=lambda r: r["steady_step_ms"])
        eager = next((r for r in ok if r["mode"] == "eager"), None)
        recommendation = f"use {best['mode']}: {best['steady_step_ms']} ms per step"
        if eager and best is not eager:
            recommendation += f" ({eager['steady_step_ms'] / best['steady_step_ms']:.2f}x eager)"
            extra = best["first_steps_s"] - eager["first_steps_s"]
            saved = (eager["steady_step_ms"] - best["steady_step_ms"]) / 1000
            if extra > 0 and saved > 0:
                recommendation += f"; its extra warm-up ({extra:.2f} s) pays off after {int(extra / saved) + 1} steps"
    return {"modes": results, "steps": steps, "warmup": warmup, "recommendation": recommendation,
            "how": {"eager": "as written (EagerMode.DEFER_NEVER)",
                    "fused": "torch.tpu.eager_mode = torch.tpu.EagerMode.DEFER_AND_FUSE",
                    "torch.compile": "step = torch.compile(step)",
                    "compile_step": "step = torch.tpu.compile_step(step)"}}


def _time_mode(mode: str, step: Callable, args, kwargs, steps: int, warmup: int) -> dict[str, Any]:
    import contextlib

    context = contextlib.nullcontext
    if mode == "fused":
        context = lambda: torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE)  # noqa: E731
    elif mode == "torch.compile":
        step = torch.compile(step)
    elif mode == "compile_step":
        step = torch.tpu.compile_step(step)
        warmup = max(warmup, 2)  # the first call runs eagerly, the second captures
    elif mode != "eager":
        raise UserError(f"unknown mode {mode!r}; modes: {', '.join(_MODES)}")

    def one():
        with context():
            out = step(*args, **kwargs)
        torch.tpu.synchronize()
        return out

    start = time.perf_counter()
    for _ in range(warmup):
        one()
    first = time.perf_counter() - start
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        out = one()
        times.append(time.perf_counter() - t)
    loss = float(out.detach().float().mean().cpu()) if isinstance(out, torch.Tensor) else None
    return {"steady_step_ms": round(1000 * statistics.median(times), 3), "first_steps_s": round(first, 3),
            "warmup_steps": warmup, "last_loss": loss}


def do_info(job):
    from torchtpu import cli
    from torchtpu.config import env_table

    return {"lines": cli.info_lines(), "environment_table": env_table()}


def do_doctor(job):
    from torchtpu import cli

    checks = []
    for check in cli.CHECKS:
        try:
            checks.append({"check": check.name, "ok": True, "detail": check.run()})
        except cli.Problem as exc:
            checks.append({"check": check.name, "ok": False, "detail": str(exc), "fix": exc.fix})
        except Exception as exc:
            checks.append({"check": check.name, "ok": False, "detail": f"{type(exc).__name__}: {exc}",
                           "fix": "report it with the output of `torchtpu info`"})
    return {"ok": all(c["ok"] for c in checks), "checks": checks}


KINDS = {"run": run_script, "explain": do_explain, "compare_with_cpu": do_compare, "hlo": do_hlo,
         "cost_analysis": do_cost, "profile": do_profile, "bench": do_bench, "info": do_info, "doctor": do_doctor}


def execute(job: dict[str, Any], result_path: str) -> int:
    """Run ``job`` and write ``{"ok": ..., "result" | "error": ...}`` to ``result_path``; the exit status."""
    if job.get("cwd"):
        os.chdir(job["cwd"])
    try:
        kind = KINDS[job["kind"]]
        if job["kind"] not in ("run",):
            apply_changes(job.get("changes") or [])
        out = {"ok": True, "result": kind(job)}
    except UserError as exc:
        out = {"ok": False, "error": {"type": "UserError", "message": str(exc), "where": "", "traceback": ""}}
    except BaseException as exc:
        out = {"ok": False, "error": _error(exc, job.get("path"))}
    tmp = result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, default=str)
    os.replace(tmp, result_path)
    return 0


if __name__ == "__main__":  # python -m torchtpu_agent.jobs JOB.json RESULT.json (the spawn path)
    with open(sys.argv[1]) as f:
        job_ = json.load(f)
    code = execute(job_, sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
