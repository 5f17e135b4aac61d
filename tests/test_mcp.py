"""``torchtpu mcp`` (src/torchtpu_agent) driven by the MCP SDK's own client over stdio.

One server for the module; every tool runs on tests/data/agent_problems.py, which has a deliberate
CPU fallback (a custom op with a CPU kernel only), a recompile (a new batch size per call under
torch.compile) and a graph break (print in the compiled function). The answers must name them, and
``suggest``'s changes must remove the fallback and the recompile in a re-run (issue 34's acceptance).
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from pathlib import Path

import pytest

mcp = pytest.importorskip("mcp", reason="the MCP SDK is not installed: pip install -e '.[mcp]'")
from mcp import ClientSession  # noqa: E402
from mcp.client.stdio import StdioServerParameters, stdio_client  # noqa: E402

DATA = Path(__file__).parent / "data"
PROBLEMS = str(DATA / "agent_problems.py")
TOOLS = {"doctor", "info", "run", "explain", "compare_with_cpu", "hlo", "cost_analysis", "profile", "bench", "suggest"}


class Client:
    """An MCP client session on a thread of its own, so that sync tests can share one server."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.stop: asyncio.Event | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._main(),), daemon=True)
        self.thread.start()
        assert self.ready.wait(120), "the MCP server did not initialise"
        if self.error:
            raise self.error

    async def _main(self):
        src = str(Path(__file__).parents[1] / "src")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
        params = StdioServerParameters(command=sys.executable, args=["-m", "torchtpu_agent"], env=env)
        self.stop = asyncio.Event()
        try:
            async with stdio_client(params) as (read, write):
                async with ClientSession(read, write) as session:
                    self.init = await session.initialize()
                    self.session = session
                    self.ready.set()
                    await self.stop.wait()
        except BaseException as exc:
            self.error = exc
            self.ready.set()

    def __call__(self, coro_fn, timeout=300):
        return asyncio.run_coroutine_threadsafe(coro_fn(self.session), self.loop).result(timeout)

    def tool(self, name, timeout=300, **arguments):
        return self(lambda s: s.call_tool(name, arguments), timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)


@pytest.fixture(scope="module")
def client():
    c = Client()
    yield c
    c.close()


@pytest.fixture(scope="module")
def report(client):
    result = client.tool("run", path=PROBLEMS, args=["3"])
    assert not result.is_error, result.content[0].text
    return result.structured_content


def _text(result) -> str:
    return "\n".join(getattr(c, "text", "") for c in result.content)


def test_initialise_and_list(client):
    assert client.init.server_info.name == "torchtpu"
    tools = client(lambda s: s.list_tools())
    assert TOOLS <= {t.name for t in tools.tools}
    resources = client(lambda s: s.list_resources())
    uris = {str(r.uri) for r in resources.resources}
    assert {"torchtpu://environment", "torchtpu://op-coverage", "torchtpu://known-limits"} <= uris
    env = client(lambda s: s.read_resource("torchtpu://environment"))
    assert "TORCHTPU_CPU_FALLBACK" in env.contents[0].text
    limits = client(lambda s: s.read_resource("torchtpu://known-limits"))
    assert "Known limits" in limits.contents[0].text


def test_run_names_the_problems(report):
    assert report["ok"]
    fallback = report["cpu_fallbacks"][0]
    assert fallback["op"] == "demo_agent.scale.default" and fallback["count"] == 3
    assert "agent_problems.py" in fallback["where"] and "scale(x)" in fallback["where"]
    assert any("dimension 0 of tensor `x` changed from 8 to 9" in s for s in report["recompile_sentences"])
    assert any(b["where"].endswith("agent_problems.py:19") and "print" in b["explanation"]
               for b in report["graph_breaks"])
    assert report["host_transfers"]["to_host"] >= 3
    compiled = report["compile"]  # compiled now, or loaded from the persistent cache a previous run filled
    assert compiled["graph_programs_compiled"] + compiled["loaded_from_persistent_cache"] >= 2
    assert report["peak_device_memory_bytes"] is not None
    assert any("CPU fallback" in line for line in report["summary"])


def test_function_tools(client, tmp_path):
    out = client.tool("explain", path=PROBLEMS).structured_content
    assert out["graph_count"] == 2 and "print" in out["graph_breaks"][0] and "agent_problems.py:19" in out["text"]
    out = client.tool("compare_with_cpu", path=PROBLEMS).structured_content
    assert out["match"] is True
    out = client.tool("hlo", path=PROBLEMS).structured_content
    assert out["programs"] == 2 and "stablehlo" in out["text"]
    out = client.tool("cost_analysis", path=PROBLEMS).structured_content
    assert len(out["programs"]) == 2 and "flops" in out["programs"][0]
    out = client.tool("profile", path=PROBLEMS, steps=2, logdir=str(tmp_path / "trace")).structured_content
    assert out["trace_files"] and out["top_ops"]
    assert any("dispatch aten" in op["name"] for op in out["top_ops"])


def test_bench(client):
    out = client.tool("bench", path=PROBLEMS, steps=2, warmup=1).structured_content
    modes = {m["mode"]: m for m in out["modes"]}
    assert set(modes) == {"eager", "fused", "torch.compile", "compile_step"}
    assert all("steady_step_ms" in m for m in modes.values()), out
    assert out["recommendation"].startswith("use ")


def test_doctor_and_info(client):
    out = client.tool("info").structured_content
    assert any(line.startswith("devices:") for line in out["lines"]) and "TORCHTPU_" in out["environment_table"]
    out = client.tool("doctor").structured_content
    assert {c["check"] for c in out["checks"]} >= {"devices", "eager op", "compiled graph"}
    assert out["ok"], out


def test_errors_keep_the_server_serving(client, tmp_path):
    bad = client.tool("run", path=str(tmp_path / "missing.py"))
    assert bad.is_error and "no such script" in _text(bad)
    raised = client.tool("run", path=str(DATA / "agent_raises.py"))
    assert raised.is_error and "ValueError: deliberate failure" in _text(raised) and "agent_raises.py:4" in _text(raised)
    missing_fn = client.tool("explain", path=PROBLEMS, function="nope")
    assert missing_fn.is_error and "no function 'nope'" in _text(missing_fn)
    slow = client.tool("run", path=str(DATA / "agent_sleeps.py"), timeout_s=3)
    assert slow.is_error and "time bound of 3 s" in _text(slow)
    assert TOOLS <= {t.name for t in client(lambda s: s.list_tools()).tools}  # still serving


def test_suggest_removes_the_fallback_and_the_recompile(client, report):
    out = client.tool("suggest", path=PROBLEMS, args=["3"], report=report).structured_content
    kinds = {s["apply"]["kind"]: s for s in out["suggestions"] if s["apply"]}
    assert kinds["register_tpu_kernel"]["verified"] and kinds["compile_dynamic"]["verified"], out
    assert kinds["reorderable_logging"]["verified"], out
    assert any("pad" in s["reason"] for s in out["suggestions"])
    rerun = client.tool("run", path=PROBLEMS, args=["3"], changes=out["changes"]).structured_content
    assert rerun["cpu_fallbacks"] == [] and rerun["recompile_sentences"] == [] and rerun["graph_breaks"] == []
    assert rerun["ok"]
