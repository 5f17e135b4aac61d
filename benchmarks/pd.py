"""Prefill/decode disaggregation with vLLM on ``tpu``: decode latency while long prompts arrive.

Two rows, measured in one run, on the same random Llama (``tools/make_tiny_llama.py --hidden 256
--layers 4``, nothing downloaded), served greedy with ``ignore_eos``:

- ``colocated``: one ``vllm serve`` on tpu; every request prefills and decodes there.
- ``P/D``: a prefill server and a decode server (separate processes, each its own tpu device),
  torchtpu's ``TpuTcpConnector`` moving each prompt's KV from the first to the second, and
  ``vllm-router --vllm-pd-disaggregation`` in front; every request goes through the router.

The workload: ``--decodes`` (4) streams with short prompts and ``--decode-tokens`` (160) new
tokens each start first; once every one of them is decoding, ``--burst`` (4) requests with
``--long`` (768)-token prompts and 4 new tokens arrive at once. Columns: the running decodes'
inter-token latency (gaps between streamed chunks) p50 and p99 *during the burst* (gaps that
end between the burst's first send and its last reply) and outside it, the long prompts' time
to first token p50, and whether every request's tokens equal the colocated row's. The last
table gives the ratios P/D / colocated. Each row first runs the workload once untimed (XLA
compiles the shapes), then measures a pass with other token ids (no prefix cache hits).

With ``--pin`` (the default where the machine has at least 2 cores) the decode side runs on
core 1 in both rows (the colocated server, the P/D decode server), alone, and everything else on
core 0: the prefill server, the router and this benchmark's own client threads. So the decode
device is the same in both rows, with prefills moved off it in the P/D row, as separate devices
and a host with cores to spare would have it (on 2 shared cores an unpinned router and client
otherwise land beside the decode server, and its gaps measure them). ``--no-pin`` lets the OS
place them all.

    python benchmarks/pd.py [--decodes 4] [--decode-tokens 160] [--burst 4] [--long 768]
        [--chunk 256] [--pin | --no-pin] [--router PATH] [--logs DIR]

Run it with the vLLM venv's interpreter (``tools/vllm_env.sh``): it needs vLLM, ``openai`` and the
``vllm-router`` wheel (its binary next to the interpreter, on ``PATH``, or ``--router``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SERVER_START_S = 900
CONNECTOR = "torchtpu.integrations.vllm.kv_connector"


def make_model(directory: Path, max_positions: int) -> Path:
    spec = importlib.util.spec_from_file_location("make_tiny_llama", REPO / "tools" / "make_tiny_llama.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_tiny_llama(directory, hidden=256, layers=4, max_positions=max_positions)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A server in its own process group, optionally pinned to CPU cores; killed on exit."""

    def __init__(self, cmd: list[str], log: Path, cores: list[int] | None = None, health: str | None = None):
        self.log, self.health = log, health
        env = {**os.environ, "VLLM_PLATFORM": "tpu"}
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True,
                                         preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)

    def wait(self) -> None:
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args[:3]} exited:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.health, timeout=2):
                    return
            except OSError:
                time.sleep(1)
        raise RuntimeError(f"{self.proc.args[:3]} did not start:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        except ProcessLookupError:
            pass


def vllm_cmd(model_dir: Path, port: int, args, role: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir), "--port", str(port),
           "--host", "127.0.0.1", "--served-model-name", "m", "--dtype", "float32",
           "--max-model-len", str(args.long + 256), "--max-num-seqs", str(args.decodes + args.burst),
           "--max-num-batched-tokens", str(args.chunk), "--block-size", "16", "--no-enable-prefix-caching"]
    if role:
        cmd += ["--kv-transfer-config", json.dumps({
            "kv_connector": "TpuTcpConnector", "kv_connector_module_path": CONNECTOR,
            "kv_role": role, "kv_port": free_port()})]
    return cmd


# ---------------------------------------------------------------- workload and client

@dataclass
class Trace:
    sent: float
    chunks: list[float] = field(default_factory=list)
    text: str = ""


def stream(url: str, prompt: list[int], max_tokens: int, trace: Trace) -> None:
    """One streamed completion; every chunk's arrival time and the text."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="-", timeout=1800, max_retries=0)
    trace.sent = time.perf_counter()
    for chunk in client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].text:
            trace.chunks.append(time.perf_counter())
            trace.text += chunk.choices[0].text


def run_pass(url: str, decodes: list[list[int]], longs: list[list[int]], args) -> dict:
    """Start the decodes, wait until each streams, then send the burst of long prompts."""
    dec = [Trace(0.0) for _ in decodes]
    threads = [threading.Thread(target=stream, args=(url, p, args.decode_tokens, t)) for p, t in zip(decodes, dec)]
    for t in threads:
        t.start()
    while not all(len(t.chunks) >= 4 for t in dec):
        if not any(t.is_alive() for t in threads):
            raise RuntimeError("the decodes ended before the burst")
        time.sleep(0.01)
    burst = [Trace(0.0) for _ in longs]
    bthreads = [threading.Thread(target=stream, args=(url, p, 4, t)) for p, t in zip(longs, burst)]
    for t in bthreads:
        t.start()
    for t in bthreads:
        t.join()
    start, end = min(t.sent for t in burst), max(t.chunks[-1] for t in burst)
    for t in threads:
        t.join()
    if any(len(t.chunks) < args.decode_tokens // 2 for t in dec):
        raise RuntimeError("a decode stream came back short")
    inside, outside = [], []
    for t in dec:
        for a, b in zip(t.chunks, t.chunks[1:]):
            (inside if start < b <= end else outside).append(b - a)
    return {"itl_burst": inside, "itl_other": outside, "ttft_long": [t.chunks[0] - t.sent for t in burst],
            "burst_s": end - start, "texts": [t.text for t in dec + burst]}


def workload(args, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = np.random.default_rng(seed)
    ids = lambda n: rng.integers(10, 500, n).tolist()  # noqa: E731  (no special tokens)
    return [ids(16) for _ in range(args.decodes)], [ids(args.long) for _ in range(args.burst)]


# ---------------------------------------------------------------- rows

def run_row(name: str, model_dir: Path, logs: Path, args) -> dict:
    procs = []
    try:
        if name == "colocated":
            port = free_port()
            procs.append(Proc(vllm_cmd(model_dir, port, args), logs / "colocated.log", args.decode_cores,
                              f"http://127.0.0.1:{port}/v1/models"))
            url = f"http://127.0.0.1:{port}"
        else:
            pp, dp, rp = free_port(), free_port(), free_port()
            procs.append(Proc(vllm_cmd(model_dir, pp, args, "kv_producer"), logs / "prefill.log",
                              args.prefill_cores, f"http://127.0.0.1:{pp}/v1/models"))
            procs.append(Proc(vllm_cmd(model_dir, dp, args, "kv_consumer"), logs / "decode.log",
                              args.decode_cores, f"http://127.0.0.1:{dp}/v1/models"))
            for p in procs:
                p.wait()
            procs.append(Proc([args.router, "--host", "127.0.0.1", "--port", str(rp), "--vllm-pd-disaggregation",
                               "--prefill", f"http://127.0.0.1:{pp}", "--decode", f"http://127.0.0.1:{dp}",
                               "--policy", "round_robin"], logs / "router.log", args.prefill_cores,
                              f"http://127.0.0.1:{rp}/v1/models"))
            url = f"http://127.0.0.1:{rp}"
        for p in procs:
            p.wait()
        run_pass(url, *workload(args, 1), args)  # untimed: XLA compiles the shapes
        return run_pass(url, *workload(args, 2), args)
    finally:
        for p in reversed(procs):
            p.stop()


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) * 1e3 if xs else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decodes", type=int, default=4)
    parser.add_argument("--decode-tokens", type=int, default=160)
    parser.add_argument("--burst", type=int, default=4)
    parser.add_argument("--long", type=int, default=768)
    parser.add_argument("--chunk", type=int, default=256, help="--max-num-batched-tokens of every server")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--router", default=None)
    parser.add_argument("--logs", type=Path, default=None, help="keep the servers' and router's logs here")
    args = parser.parse_args()
    args.router = args.router or (str(Path(sys.executable).parent / "vllm-router")
                                  if (Path(sys.executable).parent / "vllm-router").exists()
                                  else shutil.which("vllm-router"))
    if not args.router:
        sys.exit("vllm-router is not installed (pip install vllm-router, or tools/vllm_env.sh)")
    cores = sorted(os.sched_getaffinity(0))
    pin = args.pin if args.pin is not None else len(cores) >= 2
    args.prefill_cores, args.decode_cores = ([cores[0]], [cores[1]]) if pin else (None, None)
    if pin:  # this process's client threads (and the model build) off the decode core
        os.sched_setaffinity(0, args.prefill_cores)
    with tempfile.TemporaryDirectory(prefix="pd-bench-") as tmp:
        tmp = Path(tmp)
        model_dir = make_model(tmp / "model", args.long + 256)
        results = {}
        for name in ("colocated", "P/D"):
            logs = (args.logs or tmp) / name.replace("/", "")
            logs.mkdir(parents=True, exist_ok=True)
            results[name] = run_row(name, model_dir, logs, args)
    load = os.getloadavg()
    print(f"\n{args.decodes} decodes x {args.decode_tokens} tokens, burst of {args.burst} x {args.long}-token "
          f"prompts; --max-num-batched-tokens {args.chunk}; pinned: {pin} (prefill server, router and client on "
          f"core {args.prefill_cores}, decode side alone on core {args.decode_cores}); load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}\n")
    print("| row | decode ITL p50 in burst (ms) | decode ITL p99 in burst (ms) | ITL p50 outside (ms) "
          "| ITL p99 outside (ms) | long-prompt TTFT p50 (ms) | burst (s) | tokens = colocated |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    base = results["colocated"]
    for name, r in results.items():
        print(f"| {name} | {pct(r['itl_burst'], 50):.1f} | {pct(r['itl_burst'], 99):.1f} | "
              f"{pct(r['itl_other'], 50):.1f} | {pct(r['itl_other'], 99):.1f} | {pct(r['ttft_long'], 50):.0f} | "
              f"{r['burst_s']:.2f} | {'yes' if r['texts'] == base['texts'] else 'NO'} |")
    pd = results["P/D"]
    print("\n| P/D / colocated | decode ITL p99 in burst | decode ITL p50 in burst | long-prompt TTFT p50 |")
    print("| --- | --- | --- | --- |")
    print(f"| ratio | {pct(pd['itl_burst'], 99) / pct(base['itl_burst'], 99):.2f} | "
          f"{pct(pd['itl_burst'], 50) / pct(base['itl_burst'], 50):.2f} | "
          f"{pct(pd['ttft_long'], 50) / pct(base['ttft_long'], 50):.2f} |")


if __name__ == "__main__":
    main()
