"""``torchtpu mcp``: a Model Context Protocol server (stdio) for coding agents working on ``tpu``.

Tools: ``doctor``, ``info``, ``run``, ``explain``, ``compare_with_cpu``, ``hlo``, ``cost_analysis``,
``profile``, ``bench``, ``suggest``. Each runs in its own process (``torchtpu_agent.executor``)
with a time bound, so a crashing or hanging script cannot take the server down.

Function convention (explain, compare_with_cpu, hlo, cost_analysis, profile, bench): ``path`` is a
Python file and ``function`` the name of a function in it, called with no arguments, that returns
``(fn, args)`` or ``(fn, args, kwargs)``: the thing to diagnose and the inputs to call it with
(on ``tpu``). The file is run as a module named ``__torchtpu_agent__``, so its
``if __name__ == "__main__":`` block does not run. For ``bench``, ``fn(*args)`` is one training
step (forward, backward, optimizer step) and the function is called once per mode, so each mode
starts from a fresh model.

Resources: ``torchtpu://environment`` (the environment-variable table), ``torchtpu://op-coverage``
(docs/op_coverage.md), ``torchtpu://known-limits`` (the README's Known limits).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio

try:
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
except ImportError:  # mcp 1.x
    from mcp.server.fastmcp import FastMCP as MCPServer
    from mcp.server.fastmcp.exceptions import ToolError

from torchtpu_agent import suggest as suggesting
from torchtpu_agent.executor import Executor, Outcome

INSTRUCTIONS = """\
torchtpu runs PyTorch on `tpu` (TPUs, or any XLA device). Start with `doctor` when the install is in
doubt, `run` a user's script to see CPU fallbacks, recompiles, graph breaks, host transfers, compile
time, step time and peak memory, then `suggest` for checked fixes. Function tools take `path` and
`function`: a function in the file that returns (fn, args) or (fn, args, kwargs)."""

_DEFAULT_TIMEOUT = 600.0
_executor: Executor | None = None


def executor() -> Executor:
    global _executor
    if _executor is None:
        _executor = Executor()
    return _executor


def _repo_file(*parts: str) -> Path | None:
    """A file of the source checkout torchtpu runs from (the wheel ships no docs)."""
    here = Path(__file__).resolve().parents[2]
    for base in (here, Path.cwd()):
        candidate = base.joinpath(*parts)
        if candidate.is_file():
            return candidate
    return None


def _fail(outcome: Outcome, what: str, timeout_s: float) -> ToolError:
    if outcome.timed_out:
        return ToolError(f"{what} ran past its time bound of {timeout_s:g} s and was stopped (its process group "
                         f"was killed). Last output:\n{(outcome.stdout + outcome.stderr)[-1500:]}")
    err = outcome.error or {}
    if err:
        where = f" at {err['where']}" if err.get("where") else ""
        text = f"{what} failed: {err.get('type')}: {err.get('message')}{where}"
        if err.get("traceback"):
            text += f"\n{err['traceback'][-3000:]}"
        return ToolError(text)
    return ToolError(f"{what}: its process ended with status {outcome.rc} and left no result. stderr:\n"
                     f"{outcome.stderr[-3000:]}")


async def _job(job: dict[str, Any], timeout_s: float, what: str) -> Outcome:
    if timeout_s <= 0:
        raise ToolError("timeout_s must be positive")
    return await anyio.to_thread.run_sync(lambda: executor().run(job, timeout_s), abandon_on_cancel=True)


async def _result(job: dict[str, Any], timeout_s: float, what: str) -> dict[str, Any]:
    outcome = await _job(job, timeout_s, what)
    if not outcome.ok:
        raise _fail(outcome, what, timeout_s)
    return outcome.result


async def _run(path: str, args: list[str], timeout_s: float, changes: list[dict] | None) -> tuple[Outcome, dict]:
    job = {"kind": "run", "path": os.path.abspath(path), "args": list(args or []), "changes": changes or []}
    outcome = await _job(job, timeout_s, f"run {path}")
    if not outcome.ok:
        raise _fail(outcome, f"run {path}", timeout_s)
    report = outcome.result
    report["stdout_tail"] = outcome.stdout[-2000:]
    report["stderr_tail"] = outcome.stderr[-2000:]
    return outcome, report


def build() -> MCPServer:
    server = MCPServer("torchtpu", instructions=INSTRUCTIONS)

    @server.tool()
    async def doctor(timeout_s: float = 300) -> dict[str, Any]:
        """Check the torchtpu install: autoload, devices, an eager op and a compiled graph against the
        CPU, the cache directory. Each check has ok, detail and (when failing) fix."""
        return await _result({"kind": "doctor"}, timeout_s, "doctor")

    @server.tool()
    async def info(timeout_s: float = 300) -> dict[str, Any]:
        """The install: platform, devices, versions, eager mode, CPU fallback, caches, and the
        environment-variable table (Markdown)."""
        return await _result({"kind": "info"}, timeout_s, "info")

    @server.tool()
    async def run(path: str, args: list[str] | None = None, timeout_s: float = _DEFAULT_TIMEOUT,
                  changes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """Run a Python script on tpu in its own process (as `python path *args`) and report what to look
        for: cpu_fallbacks (op, count, where), recompiles with reasons, graph_breaks (where, reason, hint),
        host_transfers, compile time, steps (steady step time, from optimizer.step() or
        torchtpu.metrics.end_step()), peak_device_memory_bytes, and `summary` in sentences. A script
        that raises is a tool error naming the exception and line; one past timeout_s is killed.
        `changes`: the `changes` list `suggest` returns, applied before the script runs."""
        _, report = await _run(path, args or [], timeout_s, changes)
        if not report["ok"]:
            err = report["error"]
            where = f" at {err['where']}" if err.get("where") else ""
            raise ToolError(f"the script raised {err['type']}: {err['message']}{where}\n{err['traceback'][-3000:]}"
                            f"\nfindings before it raised: {'; '.join(report['summary']) or 'none'}")
        return report

    def _fn_job(kind: str, path: str, function: str, args: list[str] | None, options: dict | None = None):
        return {"kind": kind, "path": os.path.abspath(path), "function": function, "args": list(args or []),
                "options": options or {}}

    @server.tool()
    async def explain(path: str, function: str = "example", args: list[str] | None = None,
                      timeout_s: float = 300) -> dict[str, Any]:
        """torch.compile a fresh copy of a function and say in plain words where its graph breaks and
        why it recompiled (graph_breaks, recompilations, programs, text). `function` in `path` returns
        (fn, args) or (fn, args, kwargs)."""
        return await _result(_fn_job("explain", path, function, args), timeout_s, f"explain {function}")

    @server.tool()
    async def compare_with_cpu(path: str, function: str = "example", args: list[str] | None = None,
                               rtol: float | None = None, atol: float | None = None,
                               timeout_s: float = 300) -> dict[str, Any]:
        """Run the function on tpu checking every aten op against the CPU: the first op whose output
        differs (op, module_path, max_abs_diff, both values in `text`), or match: true."""
        return await _result(_fn_job("compare_with_cpu", path, function, args, {"rtol": rtol, "atol": atol}),
                             timeout_s, f"compare_with_cpu {function}")

    @server.tool()
    async def hlo(path: str, function: str = "example", args: list[str] | None = None, stage: str = "stablehlo",
                  max_chars: int = 40000, timeout_s: float = 300) -> dict[str, Any]:
        """The XLA programs the function compiles to: StableHLO, or stage='optimized' for XLA's optimised
        HLO (text truncated to max_chars)."""
        return await _result(_fn_job("hlo", path, function, args, {"stage": stage, "max_chars": max_chars}),
                             timeout_s, f"hlo {function}")

    @server.tool()
    async def cost_analysis(path: str, function: str = "example", args: list[str] | None = None,
                            timeout_s: float = 300) -> dict[str, Any]:
        """XLA's cost analysis of each program the function compiles to: flops, bytes accessed,
        transcendentals, and the input shapes."""
        return await _result(_fn_job("cost_analysis", path, function, args), timeout_s, f"cost_analysis {function}")

    @server.tool()
    async def profile(path: str, function: str = "example", args: list[str] | None = None, steps: int = 3,
                      logdir: str | None = None, top: int = 15, timeout_s: float = 300) -> dict[str, Any]:
        """Call the function once (warm-up), then `steps` times under a device and host trace written to
        `logdir` (a new temporary directory by default); the top spans by total time (torchtpu's
        `dispatch aten.*` and `cpu_fallback *` spans, XLA's programs and ops)."""
        return await _result(_fn_job("profile", path, function, args,
                                     {"steps": steps, "logdir": logdir and os.path.abspath(logdir), "top": top}),
                             timeout_s, f"profile {function}")

    @server.tool()
    async def bench(path: str, function: str = "train_step", args: list[str] | None = None, steps: int = 5,
                    warmup: int = 2, modes: list[str] | None = None, timeout_s: float = 600) -> dict[str, Any]:
        """Time a training step in each execution mode side by side: eager, fused (DEFER_AND_FUSE),
        torch.compile, compile_step; steady ms per step, warm-up seconds, and which to use. `function`
        returns (step, args) where step(*args) runs forward, backward and the optimizer step; it is
        called once per mode (a fresh model each time)."""
        return await _result(_fn_job("bench", path, function, args,
                                     {"steps": steps, "warmup": warmup, "modes": modes}),
                             timeout_s, f"bench {function}")

    @server.tool()
    async def suggest(path: str, args: list[str] | None = None, timeout_s: float = _DEFAULT_TIMEOUT,
                      report: dict[str, Any] | None = None) -> dict[str, Any]:
        """From a run's findings (`report`: what `run` returned; or the script is run now), concrete changes,
        each with its reason, the source edit (`code`), and whether a re-run with it removed the finding
        (`checked`, `verified`, `measured`). `changes` is the list of verified runtime changes: pass it to
        `run(..., changes=...)` to see the script as it would be with the edits."""
        if report is None:
            _, report = await _run(path, args or [], timeout_s, None)
            if not report["ok"]:
                err = report["error"]
                raise ToolError(f"the script raised {err['type']}: {err['message']}: fix that first")
        proposals = suggesting.candidates(report)
        checkable = [p for p in proposals if p["apply"] is not None]
        together = [p for p in checkable if "step_time" not in (p["target"] or {})]
        alone = [p for p in checkable if "step_time" in (p["target"] or {})]
        runs = 0
        if together:
            _, after = await _run(path, args or [], timeout_s, [p["apply"] for p in together])
            runs += 1
            results = {p["id"]: suggesting.met(p, report, after) for p in together}
            if not after["ok"] or not all(ok for ok, _ in results.values()):
                alone = together + alone  # isolate: which change did not do it, or broke the script
            else:
                for p in together:
                    p["verified"], p["measured"] = results[p["id"]]
                    p["checked"] = True
        for p in alone:
            _, after = await _run(path, args or [], timeout_s, [p["apply"]])
            runs += 1
            p["verified"], p["measured"] = suggesting.met(p, report, after)
            p["checked"] = True
        for p in proposals:
            p.setdefault("checked", False)
            p.setdefault("verified", False)
        verified = [p["apply"] for p in proposals if p["verified"]]
        return {"script": os.path.abspath(path), "findings": report.get("summary", []), "suggestions": proposals,
                "changes": verified, "re_runs": runs,
                "next": "run(path, changes=changes) shows the script with these changes; make the `code` edits "
                        "in the source to keep them"}

    @server.resource("torchtpu://environment", name="environment", mime_type="text/markdown",
                     description="torchtpu's environment variables: name, default, meaning")
    def environment() -> str:
        section = _find_section("## Environment variables")
        if section:
            return section
        return "Run `torchtpu info --env` (or the `info` tool) for the environment-variable table."

    @server.resource("torchtpu://op-coverage", name="op-coverage", mime_type="text/markdown",
                     description="OpInfo/ModuleInfo conformance of tpu: pass rates, missing lowerings, failures")
    def op_coverage() -> str:
        path = _repo_file("docs", "op_coverage.md")
        return path.read_text() if path else "docs/op_coverage.md is in the torchtpu source repository."

    @server.resource("torchtpu://known-limits", name="known-limits", mime_type="text/markdown",
                     description="What torchtpu does differently from CUDA or does not support")
    def known_limits() -> str:
        section = _find_section("## Known limits")
        return section or "See the Known limits section of torchtpu's README."

    return server


def _find_section(heading: str) -> str | None:
    """A ``## `` section of the README, or of a page of docs/ (sections move there as the README shrinks)."""
    readme = _repo_file("README.md")
    if readme is None:
        return None
    for page in [readme, *sorted((readme.parent / "docs").glob("*.md"))]:
        section = _section(page.read_text(), heading)
        if section:
            return section
    return None


def _section(text: str, heading: str) -> str | None:
    start = text.find(heading + "\n")
    if start < 0:
        return None
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end > 0 else len(text)].strip() + "\n"


def main() -> int:
    server = build()
    executor()  # start the warm zygote while the client initialises
    try:
        server.run("stdio")
    finally:
        if _executor is not None:
            _executor.close()
    return 0
