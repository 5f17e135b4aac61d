"""LLM serving throughput and latency on ``tpu``: SGLang and vLLM against a naive baseline.

A random Llama (``tools/make_tiny_llama.py --hidden 256 --layers 4``, nothing downloaded)
serves a fixed set of requests, ``--requests`` (64) of them, prompts of 64-192 tokens (128 on
average) and 32-96 new tokens (64 on average), drawn once from a seeded generator and sent as
token ids, greedy, ignoring end-of-sequence so that every request makes exactly its tokens. A
client keeps ``concurrency`` requests in flight (1, 16, 32) and streams every reply. Rows,
measured in one run:

- ``sglang tpu``: ``python -m sglang.launch_server`` on ``tpu`` (torchtpu's SGLang platform),
  decode compiled (``--enable-torch-compile``), queried over HTTP with the ``openai`` client;
- ``vllm tpu``: ``vllm serve`` on ``tpu`` (torchtpu's vLLM platform; its forward compiled, as
  vLLM does by default), the same client;
- ``hf tpu (naive)``: Hugging Face ``generate`` on ``tpu`` in this process, serving one request
  at a time in arrival order (no batching: what a server written around ``generate`` does);
- ``hf cpu (naive)``: the same on the CPU.

Columns: output tokens/s over the run (first request sent to last token received), time to
first token and inter-token latency (gaps between streamed chunks), medians (p50) and p99,
and the throughput ratio to ``hf tpu (naive)`` at the same concurrency. Every row first serves
``--warmup`` passes (2, untimed) of requests with the same lengths, so XLA compiles the shapes
before the clock runs: how requests share a step depends on their arrival, so one pass does not
meet every batch a server compiles for, while the compiled programs stay cached for the server's
life. Each pass has its own token ids, so no pass finds another's prompts in a prefix cache. Servers run in their own process group and are stopped at the end, whatever happens.

``--prefix 512`` adds a second table: every prompt starts with the same 512-token system prompt,
served by each engine with its prefix cache on and off (``--disable-radix-cache``,
``--no-enable-prefix-caching``), to show the cache's effect on time to first token.

    python benchmarks/serving.py [--engines sglang vllm hf-tpu hf-cpu] [--concurrency 1 16 32]
        [--requests 64] [--warmup 2] [--prefix 512 [--prefix-only]] [--sglang-python PY] [--vllm-python PY]

SGLang and vLLM usually live in their own venvs (``tools/sglang_env.sh``, ``tools/vllm_env.sh``):
``--sglang-python`` and ``--vllm-python`` name their interpreters; an engine that is not
importable by its interpreter is left out with the reason. The script itself needs
``transformers`` and ``openai`` (either venv has both).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
BASELINE = "hf tpu (naive)"
SERVER_START_S = 900


@dataclass
class Request:
    prompt: list[int]
    new_tokens: int


@dataclass
class Trace:
    """When one request was sent and when each streamed chunk of its reply arrived."""

    sent: float
    chunks: list[float] = field(default_factory=list)
    tokens: int = 0


# ---------------------------------------------------------------- workload

def make_model(directory: Path, max_positions: int) -> Path:
    spec = importlib.util.spec_from_file_location("make_tiny_llama", REPO / "tools" / "make_tiny_llama.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_tiny_llama(directory, hidden=256, layers=4, max_positions=max_positions)


@dataclass
class Workload:
    """Requests of random token ids (from ``first_id`` on: no special tokens), the same lengths
    every pass, with other ids in each pass so that no pass finds another's prompts cached."""

    requests: list[Request]
    first_id: int
    vocab: int
    passes: int = 0

    @classmethod
    def draw(cls, n: int, vocab: int, first_id: int, prefix_len: int, seed: int = 0) -> Workload:
        rng = np.random.default_rng(seed)
        prefix = rng.integers(first_id, vocab, prefix_len).tolist()
        return cls([Request(prefix + rng.integers(first_id, vocab, int(rng.integers(64, 193))).tolist(),
                            int(rng.integers(32, 97))) for _ in range(n)], first_id, vocab)

    def next_pass(self) -> list[Request]:
        """The requests with every id shifted by the pass number (shared prefixes stay shared)."""
        self.passes += 1
        span = self.vocab - self.first_id
        return [Request([(t - self.first_id + self.passes) % span + self.first_id for t in r.prompt], r.new_tokens)
                for r in self.requests]


# ---------------------------------------------------------------- clients

async def run_http(url: str, model: str, requests: list[Request], concurrency: int) -> list[Trace]:
    """Stream every request through the OpenAI completions API, ``concurrency`` at a time."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="-", timeout=3600, max_retries=0)
    gate = asyncio.Semaphore(concurrency)

    async def one(req: Request) -> Trace:
        async with gate:
            trace = Trace(time.perf_counter())
            stream = await client.completions.create(
                model=model, prompt=req.prompt, max_tokens=req.new_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    trace.chunks.append(time.perf_counter())
                if chunk.usage is not None:
                    trace.tokens = chunk.usage.completion_tokens
            if trace.tokens != req.new_tokens:
                raise RuntimeError(f"asked for {req.new_tokens} tokens, the server made {trace.tokens}")
            return trace

    try:
        return await asyncio.gather(*(one(r) for r in requests))
    finally:
        await client.close()


class NaiveServer:
    """Hugging Face ``generate`` serving one request at a time, in arrival order."""

    def __init__(self, model_dir: Path, device: str):
        import torch
        import transformers

        self.torch, self.device = torch, device
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model.to(device)
        self.worker = ThreadPoolExecutor(max_workers=1)  # one request at a time

    def generate(self, req: Request, trace: Trace) -> None:
        from transformers.generation.streamers import BaseStreamer

        class Clock(BaseStreamer):
            first = True

            def put(self, value):  # the prompt first, then each new token
                if not self.first:
                    trace.chunks.append(time.perf_counter())
                self.first = False

            def end(self):
                pass

        torch = self.torch
        ids = torch.tensor([req.prompt], device=self.device)
        with torch.no_grad():
            out = self.model.generate(ids, max_new_tokens=req.new_tokens, min_new_tokens=req.new_tokens,
                                      do_sample=False, streamer=Clock(), pad_token_id=0)
        trace.tokens = out.shape[1] - len(req.prompt)

    async def run(self, requests: list[Request], concurrency: int) -> list[Trace]:
        gate, loop = asyncio.Semaphore(concurrency), asyncio.get_running_loop()

        async def one(req: Request) -> Trace:
            async with gate:
                trace = Trace(time.perf_counter())
                await loop.run_in_executor(self.worker, self.generate, req, trace)
                return trace

        return await asyncio.gather(*(one(r) for r in requests))


# ---------------------------------------------------------------- servers

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """An engine's OpenAI-compatible server in its own process group; stopped on exit."""

    def __init__(self, cmd: list[str], port: int, log: Path):
        self.url, self.log = f"http://127.0.0.1:{port}", log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "SGLANG_PLATFORM": "tpu", "VLLM_PLATFORM": "tpu"})

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return
            except OSError:
                time.sleep(2)
        raise RuntimeError(f"the server did not start within {SERVER_START_S} s:\n{self.log.read_text()[-3000:]}")

    def __enter__(self):
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass


def engine_command(engine: str, python: str, model_dir: Path, port: int, max_len: int, concurrency: int,
                   prefix_cache: bool) -> list[str]:
    """The command that serves ``model_dir`` with ``engine`` on tpu, batching ``concurrency`` requests."""
    if engine == "sglang":
        cmd = [python, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--port", str(port),
               "--served-model-name", "m", "--dtype", "float32", "--context-length", str(max_len),
               "--max-running-requests", str(concurrency), "--max-total-tokens", str(concurrency * max_len),
               "--enable-torch-compile", "--torch-compile-max-bs", str(concurrency), "--log-level", "error"]
        return cmd + ([] if prefix_cache else ["--disable-radix-cache"])
    cmd = [python, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir), "--port", str(port),
           "--served-model-name", "m", "--dtype", "float32", "--max-model-len", str(max_len),
           "--max-num-seqs", str(concurrency), "--block-size", "16"]
    return cmd + (["--enable-prefix-caching"] if prefix_cache else ["--no-enable-prefix-caching"])


def importable(python: str, module: str) -> str | None:
    """None when ``python`` imports ``module``, else why not."""
    out = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True)
    return None if out.returncode == 0 else f"{python} cannot import {module}: {out.stderr.strip().splitlines()[-1]}"


# ---------------------------------------------------------------- figures

def summarize(traces: list[Trace], wall: float) -> dict[str, float]:
    ttft = [t.chunks[0] - t.sent for t in traces]
    itl = [b - a for t in traces for a, b in zip(t.chunks, t.chunks[1:])]
    pct = lambda xs, q: float(np.percentile(xs, q)) * 1e3 if xs else float("nan")  # noqa: E731
    return {"tok/s": sum(t.tokens for t in traces) / wall, "ttft p50": pct(ttft, 50), "ttft p99": pct(ttft, 99),
            "itl p50": pct(itl, 50), "itl p99": pct(itl, 99)}


def timed(serve, work: Workload, concurrency: int, warmup: int) -> dict[str, float]:
    for _ in range(warmup):  # the same lengths, untimed
        asyncio.run(serve(work.next_pass(), concurrency))
    requests = work.next_pass()
    start = time.perf_counter()
    traces = asyncio.run(serve(requests, concurrency))
    return summarize(traces, time.perf_counter() - start)


def print_table(title: str, rows: dict[tuple[str, int], dict[str, float]], baseline: str | None) -> None:
    cols = ["tok/s", "ttft p50", "ttft p99", "itl p50", "itl p99"]
    print(f"\n{title}\n{'row':<26}{'conc':>5}" + "".join(f"{c:>11}" for c in cols)
          + (f"{'x naive':>9}" if baseline else ""))
    for (name, conc), fig in rows.items():
        line = f"{name:<26}{conc:>5}" + "".join(f"{fig[c]:>11.1f}" for c in cols)
        if baseline and (baseline, conc) in rows:
            line += f"{fig['tok/s'] / rows[baseline, conc]['tok/s']:>9.2f}"
        print(line, flush=True)
    print("tok/s: output tokens per second; ttft, itl: milliseconds")


# ---------------------------------------------------------------- main

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", nargs="+", default=["sglang", "vllm", "hf-tpu", "hf-cpu"],
                   choices=["sglang", "vllm", "hf-tpu", "hf-cpu"])
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 32])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2, help="untimed passes before each timed one")
    p.add_argument("--prefix", type=int, default=0, help="also run with a shared system prompt of this many tokens")
    p.add_argument("--prefix-only", action="store_true", help="with --prefix: only the prefix-cache table")
    p.add_argument("--sglang-python", default=sys.executable)
    p.add_argument("--vllm-python", default=sys.executable)
    args = p.parse_args()
    for module in ("transformers", "openai"):
        if importlib.util.find_spec(module) is None:
            print(f"serving benchmark skipped: {module} is not installed (tools/sglang_env.sh builds a venv with it)")
            return 0

    max_len = 1024 if args.prefix else 320
    scratch = Path(tempfile.mkdtemp(prefix="serving-bench-"))
    model_dir = make_model(scratch / "model", max_positions=max_len)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    first_id = max(tokenizer.all_special_ids) + 1
    work = Workload.draw(args.requests, len(tokenizer), first_id, 0)
    print(f"{args.requests} requests, prompts {statistics.mean(len(r.prompt) for r in work.requests):.0f} tokens "
          f"on average, {sum(r.new_tokens for r in work.requests)} output tokens; model: Llama 4 layers, d 256, "
          f"vocab {len(tokenizer)}, float32", flush=True)

    rows: dict[tuple[str, int], dict[str, float]] = {}
    top = max(args.concurrency)
    for engine in args.engines if not (args.prefix and args.prefix_only) else []:
        if engine.startswith("hf-"):
            device = engine.split("-")[1]
            if device == "tpu":
                import torchtpu  # noqa: F401  (registers the device)
            server = NaiveServer(model_dir, device)
            for conc in args.concurrency:
                rows[f"hf {device} (naive)", conc] = timed(server.run, work, conc, args.warmup)
                print(f"  hf {device} (naive) at {conc}: {rows[f'hf {device} (naive)', conc]['tok/s']:.1f} tok/s",
                      flush=True)
            continue
        python = getattr(args, f"{engine}_python")
        if (why := importable(python, engine)) is not None:
            print(f"  {engine} tpu: left out ({why})", flush=True)
            continue
        port = free_port()
        cmd = engine_command(engine, python, model_dir, port, max_len, top, prefix_cache=True)
        with Server(cmd, port, scratch / f"{engine}.log") as server:
            serve = lambda reqs, conc: run_http(server.url, "m", reqs, conc)  # noqa: E731
            for conc in args.concurrency:
                rows[f"{engine} tpu", conc] = timed(serve, work, conc, args.warmup)
                print(f"  {engine} tpu at {conc}: {rows[f'{engine} tpu', conc]['tok/s']:.1f} tok/s", flush=True)
    if rows:
        print_table("Serving, greedy, output tokens/s and latency", rows, BASELINE)

    if args.prefix:
        prefixed = Workload.draw(args.requests, len(tokenizer), first_id, args.prefix)
        prefix_rows: dict[tuple[str, int], dict[str, float]] = {}
        for engine in [e for e in args.engines if e in ("sglang", "vllm")]:
            python = getattr(args, f"{engine}_python")
            if importable(python, engine) is not None:
                continue
            for cache in (True, False):
                port = free_port()
                cmd = engine_command(engine, python, model_dir, port, max_len, top, prefix_cache=cache)
                with Server(cmd, port, scratch / f"{engine}-prefix.log") as server:
                    serve = lambda reqs, conc: run_http(server.url, "m", reqs, conc)  # noqa: E731
                    row = f"{engine} cache {'on' if cache else 'off'}"
                    prefix_rows[row, top] = timed(serve, prefixed, top, args.warmup)
        print_table(f"Shared {args.prefix}-token system prompt, prefix cache on and off", prefix_rows, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
