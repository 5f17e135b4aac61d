"""From a run's findings, concrete changes with their reasons; and the check of each by re-running.

Every change has a source form (what to edit, as code) and, where one exists, a runtime form
(``apply``: an intervention ``torchtpu_agent.jobs.apply_changes`` makes before the script runs,
the same change made from outside). Changes with a runtime form are checked by re-running the
script with them; the others are advice, marked ``checked: false`` with why.
"""

from __future__ import annotations

import math
import re
from typing import Any

_DIM_CHANGED = re.compile(r"dimension (\d+) of tensor `([^`]+)` changed from (\d+) to (\d+)")


def candidates(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The changes a run's report calls for, before any check."""
    out: list[dict[str, Any]] = []
    for f in report.get("cpu_fallbacks", []):
        op = f["op"]
        qualname = "::".join(op.split(".")[:2])
        finding = f"CPU fallback: {op} ran on the host {f['count']} time(s) at {f['where']}"
        if f.get("kind") in ("python_custom_op", "library_op"):
            out.append({"finding": finding, "target": {"fallback": op},
                        "reason": f"{qualname} has a CPU kernel only, so every call copies its inputs to the host "
                                  "and its results back, and splits the program; its implementation is made of "
                                  "torch ops that run on tpu, so register it for tpu too",
                        "code": (f"@torch.library.custom_op(\"{qualname}\", mutates_args=..., "
                                 f"device_types=(\"cpu\", \"tpu\"))   # or: {qualname.split('::')[1]}"
                                 f".register_kernel(\"tpu\")(impl); for Library.impl(..., \"CPU\") add the "
                                 f"same impl for \"PrivateUse1\"; a JAX body: torchtpu.jax_op"),
                        "apply": {"kind": "register_tpu_kernel", "op": qualname}})
        else:
            out.append({"finding": finding, "target": {"fallback": op},
                        "reason": f"torchtpu has no lowering for {op}: it runs on the host, with two transfers "
                                  "per call; rewrite the line with ops that have lowerings (docs/op_coverage.md), "
                                  "or give it a JAX implementation with torchtpu.jax_op, and report the op",
                        "code": f"# at {f['where']}: replace {op}", "apply": None,
                        "unchecked_why": "needs a source edit that depends on what the line computes"})
    dims: dict[str, set] = {}
    functions = set()
    for sentence in report.get("recompile_sentences", []):
        m = _DIM_CHANGED.search(sentence)
        fn = re.search(r"recompiled `([^`]+)`", sentence)
        if m:
            dims.setdefault(f"{m.group(2)} dim {m.group(1)}", set()).update({int(m.group(3)), int(m.group(4))})
            if fn:
                functions.add(fn.group(1))
    if dims:
        sizes = sorted(set().union(*dims.values()))
        what = ", ".join(f"`{k}`" for k in dims)
        out.append({"finding": f"recompiles: {len(report.get('recompile_sentences', []))} because the size of "
                               f"{what} changed ({', '.join(map(str, sizes))})",
                    "target": {"recompiles": True},
                    "reason": "each new size fails dynamo's guards and traces the function again; compiling "
                              "with dynamic shapes traces it once for every size",
                    "code": "torch.compile(fn, dynamic=True)   # or torch._dynamo.mark_dynamic(x, dim) on the input",
                    "apply": {"kind": "compile_dynamic"}})
        bucket = 2 ** math.ceil(math.log2(max(sizes))) if max(sizes) > 0 else 1
        multiple = 8 if max(sizes) >= 8 else 1
        out.append({"finding": f"XLA builds a program for every distinct size of {what} ({len(sizes)} sizes seen)",
                    "target": None,
                    "reason": "XLA programs have static shapes: padding inputs to a few bucket sizes bounds the "
                              f"programs compiled (e.g. up to {bucket}, or to a multiple of {multiple}) and mask "
                              "or slice the padding away",
                    "code": "n = x.shape[0]; x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + "
                            f"(0, -n % {multiple}))  # then ignore the padded rows",
                    "apply": None, "unchecked_why": "padding changes what the function sees; it needs a source "
                                                    "edit that masks the padded part"})
    for b in report.get("graph_breaks", []):
        text = f"{b.get('reason', '')} {b.get('hint', '')} {b.get('explanation', '')}"
        finding = f"graph break at {b['where']}: {b['reason']}"
        if "capture_scalar_outputs" in text:
            out.append({"finding": finding, "target": {"graph_break": b["where"]},
                        "reason": "Tensor.item() stops the graph: dynamo can keep the scalar in the graph instead",
                        "code": "torch._dynamo.config.capture_scalar_outputs = True",
                        "apply": {"kind": "dynamo_config", "name": "capture_scalar_outputs", "value": True}})
        elif "reorderable_logging_functions" in text and "print" in text:
            out.append({"finding": finding, "target": {"graph_break": b["where"]},
                        "reason": "print() inside a compiled function splits the graph; dynamo can move it after "
                                  "the graph instead (or remove the print)",
                        "code": "torch._dynamo.config.reorderable_logging_functions.add(print)",
                        "apply": {"kind": "reorderable_logging", "function": "print"}})
        else:
            out.append({"finding": finding, "target": None,
                        "reason": b.get("hint") or b.get("explanation") or "rewrite the line so dynamo can trace it",
                        "code": f"# at {b['where']}: {b.get('code', '')}", "apply": None,
                        "unchecked_why": "no runtime switch for this graph break"})
    steps = report.get("steps") or {}
    if (not report.get("torch_compile_used") and steps.get("steady_step_ms") is not None
            and report.get("ops_dispatched", 0) >= 20 * max(1, steps.get("count", 1))):
        out.append({"finding": f"eager mode, {report['ops_dispatched']} ops dispatched one by one",
                    "target": {"step_time": True},
                    "reason": "DEFER_AND_FUSE records the eager ops and runs them as one XLA program per step",
                    "code": "torch.tpu.eager_mode = torch.tpu.EagerMode.DEFER_AND_FUSE",
                    "apply": {"kind": "eager_mode", "value": "defer_and_fuse"}})
    if ("XLA:CPU" not in str(report.get("device", "")) and report.get("matmul_ops", 0)
            and report.get("float32_matmul_precision") == "highest" and steps.get("steady_step_ms") is not None):
        out.append({"finding": "float32 matmuls at full precision", "target": {"step_time": True},
                    "reason": "TPUs run float32 matmuls in several bfloat16 passes at 'highest'; 'high' halves "
                              "them at a small precision cost",
                    "code": "torch.set_float32_matmul_precision('high')",
                    "apply": {"kind": "matmul_precision", "value": "high"}})
    for i, c in enumerate(out):
        c["id"] = i
    return out


def met(change: dict[str, Any], before: dict[str, Any], after: dict[str, Any]) -> tuple[bool, str]:
    """Whether a re-run with the change removed its finding, and what was measured."""
    target = change.get("target") or {}
    if not after.get("ok"):
        err = after.get("error") or {}
        return False, f"the re-run failed: {err.get('type')}: {err.get('message', '')[:300]}"
    if "fallback" in target:
        op = target["fallback"]
        n_before = sum(f["count"] for f in before.get("cpu_fallbacks", []) if f["op"] == op)
        n_after = sum(f["count"] for f in after.get("cpu_fallbacks", []) if f["op"] == op)
        return n_after == 0, f"{op} fell back {n_before} time(s) before, {n_after} after"
    if "recompiles" in target:
        b, a = len(before.get("recompile_sentences", [])), len(after.get("recompile_sentences", []))
        return a < b and a == 0, f"{b} recompile(s) before, {a} after"
    if "graph_break" in target:
        where = target["graph_break"]
        b = sum(g["count"] for g in before.get("graph_breaks", []) if g["where"] == where)
        a = sum(g["count"] for g in after.get("graph_breaks", []) if g["where"] == where)
        return a == 0, f"{b} graph break(s) at {where} before, {a} after"
    if "step_time" in target:
        b = (before.get("steps") or {}).get("steady_step_ms")
        a = (after.get("steps") or {}).get("steady_step_ms")
        if a is None or b is None:
            return False, "no steady step time to compare"
        return a < 0.95 * b, f"steady step {b} ms before, {a} ms after"
    return False, "nothing to measure"
