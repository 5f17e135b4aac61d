"""Routing by where the KV cache is: vLLM replicas on ``tpu`` behind ``vllm-router``, policies side by side.

An agent-style workload: ``--sessions`` conversations (split over ``--tenants`` tenants), each
with its own long system prompt (``--system-words`` words, private to the session) and a
conversation that grows by a user message and the model's reply each turn (``--turns``). The
sessions run at the same time, each turn sent when the previous one has answered, as agents do.
``--replicas`` vLLM replicas on ``tpu`` (``tools/serve_replicas.py``), each with a KV pool of
``--kv-blocks`` blocks of 16 tokens, by default sized to hold 60 % of the sessions' tokens
(``--pool-share``): one replica cannot hold every session, two can if each keeps its own (the
header line says how many sessions fit in one pool). The same replicas serve every policy,
their prefix caches emptied in between (vLLM's ``/reset_prefix_cache``), and each policy gets its
own router:

- ``round_robin``: the baseline, blind to the cache;
- ``cache_aware``: the router's approximate prefix tree (it tokenizes through the replicas'
  ``/v1/chat/completions/render``);
- ``kv_aware``: the router's exact index of every replica's blocks, fed by the engines' KV events
  (vLLM's ZMQ publisher).

Columns: output tokens/s over the run; time to first token p50/p99 and inter-token latency p99
over every turn (streamed chat completions); the engines' own prefix-cache hit rate (hits/queries,
``vllm:prefix_cache_*`` summed over the replicas) and how the requests split over the replicas.

``--failover`` adds the failover measurement: 64 non-streamed greedy requests through a
``round_robin`` router with retries, one replica SIGKILLed after the first few: how many were lost,
and whether every reply equals the one the healthy fleet gave; then the replica is restarted and
must get requests again. Then two routers in front of the same replicas, one SIGKILLed under load:
how many requests were lost when the client sends what router A failed to router B.
``--tenants-check`` adds tenant isolation: tenant A's TTFT p99 alone, then while tenant B floods
(``--flood`` concurrent requests), with the engines' priority scheduling (A's requests carry a
higher priority) against without; and, where the ``smg`` wheel is at hand (``--smg-python``),
through smg's per-tenant admission control in front of the same replicas (its priority
scheduler: B's requests in the ``bulk`` class get at most ``--bulk-slots`` requests in flight,
every other slot is held for A's ``interactive`` class). ``vllm-router``'s own admission
(``--max-concurrent-requests``, its queue, ``--rate-limit-tokens-per-second``) is one limit and one
FIFO queue for every tenant, so it cannot put A before B.

    python benchmarks/routing.py [--policies round_robin cache_aware kv_aware] [--replicas 2]
        [--sessions 8] [--turns 4] [--system-words 200] [--kv-blocks N | --pool-share 0.6] [--failover]
        [--tenants-check]

Run it with the interpreter of the vLLM venv (``tools/vllm_env.sh``): it needs vLLM, the
``vllm-router`` wheel and the ``openai`` client. The model is a random Llama built by
``tools/make_tiny_llama.py`` (``--hidden``/``--layers``; nothing downloaded).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORDS_FILE = REPO / "src" / "torchtpu" / "data" / "tiny_corpus.txt"


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def serve_replicas_module():
    return sys.modules.get("serve_replicas") or load_tool("serve_replicas")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def post(url: str, body: dict | None = None) -> None:
    req = urllib.request.Request(url, json.dumps(body or {}).encode(), {"Content-Type": "application/json"}, method="POST")
    urllib.request.urlopen(req, timeout=60).read()


# ---------------------------------------------------------------- the workload

def make_sessions(n: int, tenants: int, system_words: int, seed: int = 0) -> list[dict]:
    words = WORDS_FILE.read_text().split()
    rng = random.Random(seed)
    return [{"tenant": f"tenant-{s % tenants}", "id": f"session-{s}",
             "system": f"You are agent {s}. " + " ".join(rng.choice(words) for _ in range(system_words)),
             "users": [" ".join(rng.choice(words) for _ in range(12)) for _ in range(64)]}
            for s in range(n)]


async def chat_turn(client, messages, max_tokens: int, headers: dict, priority: int | None = None) -> dict:
    """One streamed chat turn: its reply text, TTFT, inter-token gaps, tokens."""
    sent = time.perf_counter()
    stamps, text = [], []
    extra = {"ignore_eos": True, "stream_options": {"include_usage": True}}
    if priority is not None:
        extra["priority"] = priority
    stream = await client.chat.completions.create(model="model", messages=messages, max_tokens=max_tokens,
                                                  temperature=0, stream=True, extra_body=extra, extra_headers=headers)
    tokens = 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
            text.append(chunk.choices[0].delta.content)
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return {"ttft": stamps[0] - sent if stamps else float("nan"),
            "itl": [b - a for a, b in itertools.pairwise(stamps)], "text": "".join(text), "tokens": tokens}


async def run_sessions(url: str, sessions: list[dict], turns: int, max_tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=600, max_retries=0)
    results: list[dict] = []

    async def session(s: dict) -> None:
        messages = [{"role": "system", "content": s["system"]}]
        headers = {"X-Session-ID": s["id"], "X-Tenant-ID": s["tenant"]}
        for t in range(turns):
            messages.append({"role": "user", "content": s["users"][t]})
            r = await chat_turn(client, messages, max_tokens, headers)
            messages.append({"role": "assistant", "content": r["text"]})
            results.append(r)

    start = time.perf_counter()
    await asyncio.gather(*(session(s) for s in sessions))
    elapsed = time.perf_counter() - start
    await client.close()
    return {"elapsed": elapsed, "results": results}


def prefix_counters(fleet) -> list[tuple[float, float, float]]:
    out = []
    for i in range(len(fleet.members)):
        m = fleet.metrics(i)
        out.append((m.get("vllm:prefix_cache_hits_total", 0.0), m.get("vllm:prefix_cache_queries_total", 0.0),
                    m.get("vllm:request_success_total", 0.0)))
    return out


def measure_policy(fleet, policy: str, sessions, turns: int, max_tokens: int) -> dict:
    for r in fleet.members:  # every policy starts from empty prefix caches
        post(r.url + "/reset_prefix_cache")
    router = fleet.start_router(policy)
    try:
        before = prefix_counters(fleet)
        run = asyncio.run(run_sessions(router.url, sessions, turns, max_tokens))
        after = prefix_counters(fleet)
        port = router.cmd[router.cmd.index("--prometheus-port") + 1]
        try:  # how the router's own prefix index fared (kv_aware: lookups that found a replica's blocks)
            lookups = {k: v for k, v in serve_replicas_module().parse_metrics(
                serve_replicas_module().fetch(f"http://127.0.0.1:{port}/metrics")).items() if "kv_placement" in k}
        except OSError:
            lookups = {}
    finally:
        fleet.stop_router(router)
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    queries = sum(a[1] - b[1] for a, b in zip(after, before))
    split = [int(a[2] - b[2]) for a, b in zip(after, before)]
    res = run["results"]
    ttft = [r["ttft"] for r in res]
    itl = [g for r in res for g in r["itl"]]
    tokens = sum(r["tokens"] for r in res)
    return {"policy": policy, "tok_s": tokens / run["elapsed"], "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "itl_p99": pct(itl, 99), "hit_rate": hits / queries if queries else float("nan"), "split": split,
            "requests": len(res), "elapsed": run["elapsed"], "router_kv_lookups": lookups}


# ---------------------------------------------------------------- failover

def failover(fleet, n: int = 64, kill_after: int = 6) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    import openai

    words = WORDS_FILE.read_text().split()
    rng = random.Random(1)
    prompts = [" ".join(rng.choice(words) for _ in range(20 + i % 7)) for i in range(n)]
    router = fleet.start_router("round_robin")  # retries that outlast the health check (serve_replicas.RETRY_OPTIONS)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", timeout=300, max_retries=0)

    def one(p):
        r = client.completions.create(model="model", prompt=p, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        return r.choices[0].text

    try:
        with ThreadPoolExecutor(8) as pool:
            reference = list(pool.map(one, prompts))  # the healthy fleet's replies
        done, lost, wrong = [], [], []

        def tracked(i):
            try:
                text = one(prompts[i])
            except Exception as e:  # noqa: BLE001  (a lost request, counted)
                lost.append((i, repr(e)))
                return
            done.append(i)
            if text != reference[i]:
                wrong.append(i)

        start = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(tracked, i) for i in range(n)]
            while len(done) + len(lost) < kill_after:
                time.sleep(0.02)
            fleet.kill_replica(len(fleet.members) - 1)
            killed_at = len(done) + len(lost)
            for f in futures:
                f.result()
        elapsed = time.perf_counter() - start
    finally:
        fleet.stop_router(router)
    print(f"\nfailover: {n} non-streamed requests, replica {len(fleet.members) - 1} SIGKILLed after {killed_at} "
          f"finished: {len(lost)} lost, {len(wrong)} replies differing from the healthy fleet's, {elapsed:.1f} s "
          f"{lost[:3]}", flush=True)
    t0 = time.perf_counter()
    replica = fleet.restart_replica(len(fleet.members) - 1)
    restart_s = time.perf_counter() - t0
    # it rejoins: the router's health check puts it back, and it serves again
    router = fleet.start_router("round_robin")
    try:
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", timeout=300, max_retries=0)
        t0 = time.perf_counter()
        while fleet.metrics(replica.index).get("vllm:request_success_total", 0.0) == 0 and time.perf_counter() - t0 < 60:
            one(prompts[0])
        rejoined = fleet.metrics(replica.index).get("vllm:request_success_total", 0.0) > 0
    finally:
        fleet.stop_router(router)
    return {"requests": n, "killed_after": killed_at, "lost": len(lost), "wrong": len(wrong), "elapsed": elapsed,
            "restart_s": restart_s, "rejoined": rejoined, "lost_detail": lost[:3]}


def two_routers(fleet, n: int = 32, kill_after: int = 6) -> dict:
    """Two routers in front of the same replicas, requests spread over both (as a load balancer in
    front of them would); router A is SIGKILLed under load and a request it failed is sent to B."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    words = WORDS_FILE.read_text().split()
    rng = random.Random(2)
    prompts = [" ".join(rng.choice(words) for _ in range(20)) for _ in range(n)]
    a, b = fleet.start_router("cache_aware"), fleet.start_router("cache_aware")
    clients = [openai.OpenAI(base_url=r.url + "/v1", api_key="none", timeout=300, max_retries=0) for r in (a, b)]
    done, failed_over, lost = [], [], []

    def one(i):
        for k in (i % 2, 1 - i % 2):  # its router, then the other one
            try:
                clients[k].completions.create(model="model", prompt=prompts[i], max_tokens=8, temperature=0)
                done.append(i)
                if k != i % 2:
                    failed_over.append(i)
                return
            except (openai.APIConnectionError, openai.InternalServerError):
                continue
        lost.append(i)

    try:
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(one, i) for i in range(n)]
            while len(done) < kill_after:
                time.sleep(0.02)
            a.kill()
            for f in futures:
                f.result()
    finally:
        for r in (a, b):
            if r in fleet.routers:
                fleet.stop_router(r)
    return {"requests": n, "lost": len(lost), "sent_to_the_other_router": len(failed_over)}


# ---------------------------------------------------------------- tenants

async def tenant_run(url: str, sessions, flood: int, a_requests: int, priority: bool, max_tokens: int,
                     classes: bool = False) -> list[float]:
    """Tenant A's TTFTs (sequential turns of one session) while tenant B keeps ``flood`` requests in flight.

    ``priority``: the engines' priority (A's requests before B's in vLLM's scheduler); ``classes``:
    smg's admission classes (``x-smg-priority``: A ``interactive``, B ``bulk``)."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=600, max_retries=0)
    stop = asyncio.Event()
    b_done, b_failed = [0], [0]

    async def flooder(k: int) -> None:
        s = sessions[1 + k % (len(sessions) - 1)]
        headers = {"X-Tenant-ID": "tenant-b", **({"x-smg-priority": "bulk"} if classes else {})}
        while not stop.is_set():
            msgs = [{"role": "system", "content": s["system"] + f" {k} {time.time()}"}, {"role": "user", "content": s["users"][0]}]
            try:
                await chat_turn(client, msgs, max_tokens, headers, priority=10 if priority else None)
            except openai.APIError:  # B's failures (a queue timeout, ...) are counted, not fatal to the run
                b_failed[0] += 1
                continue
            b_done[0] += 1

    a = sessions[0]
    flooders = [asyncio.create_task(flooder(k)) for k in range(flood)]
    if flood:
        await asyncio.sleep(2.0)
    ttfts = []
    headers = {"X-Tenant-ID": "tenant-a", **({"x-smg-priority": "interactive"} if classes else {})}
    start = time.perf_counter()
    for t in range(a_requests):
        msgs = [{"role": "system", "content": a["system"]}, {"role": "user", "content": a["users"][t]}]
        r = await chat_turn(client, msgs, max_tokens, headers, priority=0 if priority else None)
        ttfts.append(r["ttft"])
    elapsed = time.perf_counter() - start
    stop.set()
    await asyncio.gather(*flooders, return_exceptions=True)
    await client.close()
    if flood:
        print(f"    tenant B: {b_done[0]} requests done ({b_failed[0]} failed) while A sent {a_requests} "
              f"({b_done[0] / elapsed:.2f}/s)", flush=True)
    return ttfts


def smg_priority_config(path: Path, interactive_reserved: int) -> Path:
    """smg's priority-scheduler YAML (smg 1.13 field names; every field of a class is required):
    ``interactive`` holds ``interactive_reserved`` slots back from the lower classes and may preempt
    a ``bulk`` request that has not started answering; nothing else reserves."""
    classes = {"system": (0, 64, 30, 5, "true"), "interactive": (interactive_reserved, 64, 600, 600, "true"),
               "default": (0, 512, 600, 600, "false"), "bulk": (0, 1024, 600, 600, "false")}
    text = "classes:\n"
    for name, (floor, queue, timeout, starve, preempt) in classes.items():
        text += (f"  {name}:\n    reserved_floor: {floor}\n    reserved_per_slot: 0.0\n    queue_size: {queue}\n"
                 f"    queue_timeout_secs: {timeout}\n    starvation_threshold_secs: {starve}\n    can_preempt: {preempt}\n")
    path.write_text(text)
    return path


def smg_capacity(router, timeout: float = 30.0) -> int:
    """The slot capacity smg's priority scheduler admits against: what smg derives from its workers
    (it logs "backend capacity updated ... new=N"; not the --max-concurrent-requests limit)."""
    import re

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.findall(r"backend capacity updated old=\d+ new=(\d+)", re.sub(r"\x1b\[[0-9;]*m", "", router.tail(200_000)))
        if found:
            return int(found[-1])
        time.sleep(0.5)
    raise RuntimeError(f"smg did not log its backend capacity:\n{router.tail()}")


def start_smg_admission(fleet, work: Path, bulk_slots: int):
    """smg in front of the fleet with its priority scheduler on, sized so that the ``bulk`` class
    (tenant B) gets at most ``bulk_slots`` requests in flight: ``interactive`` (tenant A) holds
    back every other slot of smg's capacity. A first start learns the capacity."""
    options = ("--priority-scheduler-enabled", "--priority-scheduler-default-max-class", "interactive",
               "--queue-size", "1024", "--queue-timeout-secs", "600")
    probe = fleet.start_router("round_robin", router="smg", options=(
        *options, "--priority-scheduler-config", str(smg_priority_config(work / "smg-probe.yaml", 0))))
    try:
        capacity = smg_capacity(probe)
    finally:
        fleet.stop_router(probe)
    if capacity <= bulk_slots:
        raise ValueError(f"smg's capacity is {capacity} slots: --bulk-slots {bulk_slots} leaves none for tenant A")
    config = smg_priority_config(work / "smg-priority.yaml", capacity - bulk_slots)
    router = fleet.start_router("round_robin", router="smg", options=(*options, "--priority-scheduler-config", str(config)))
    smg_capacity(router)  # the real capacity is known before the first request
    if "falling back to legacy admission" in router.tail(200_000):
        fleet.stop_router(router)
        raise RuntimeError(f"smg's priority scheduler did not start:\n{router.tail()}")
    return router, capacity


# ---------------------------------------------------------------- main

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", nargs="+", default=["round_robin", "cache_aware", "kv_aware"])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--tenants", type=int, default=2)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=16, help="new tokens per turn")
    parser.add_argument("--kv-blocks", type=int, default=None,
                        help="each replica's KV pool, in blocks of 16 tokens (default: what holds --pool-share of the sessions)")
    parser.add_argument("--pool-share", type=float, default=0.6,
                        help="the share of all sessions' tokens one replica's pool holds (default 0.6)")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--model", default=None, help="a model directory (default: build the tiny Llama)")
    parser.add_argument("--eager", action="store_true", help="--enforce-eager (default: vLLM's compiled forward, token counts padded to buckets)")
    parser.add_argument("--failover", action="store_true")
    parser.add_argument("--tenants-check", action="store_true")
    parser.add_argument("--flood", type=int, default=16)
    parser.add_argument("--smg-python", default=None,
                        help="--tenants-check: the interpreter of a venv with the smg wheel (tools/sglang_env.sh), "
                             "for the row with smg's per-tenant admission in front of the same replicas "
                             "(default: this interpreter if it has smg, else the row is skipped)")
    parser.add_argument("--tenant-requests", type=int, default=16,
                        help="--tenants-check: tenant A's requests per measurement (one after another)")
    parser.add_argument("--bulk-slots", type=int, default=2,
                        help="--tenants-check, smg row: tenant B's (bulk) requests in flight at most; "
                             "the rest of smg's slots are held for tenant A's interactive class")
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--hash-algo", default="sha256_cbor",
                        help="vLLM's --prefix-caching-hash-algo (sha256_cbor: a hash other processes can recompute)")
    args = parser.parse_args()

    serve_replicas = load_tool("serve_replicas")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # the replicas are stopped on the way out
    work = Path(tempfile.mkdtemp(prefix="routing-bench."))
    model = args.model or str(load_tool("make_tiny_llama").make_tiny_llama(
        work / "model", hidden=args.hidden, layers=args.layers, max_positions=4096))
    sessions = make_sessions(args.sessions, args.tenants, args.system_words)

    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model)
    prefix_tokens = statistics.mean(
        len(tok(tok.apply_chat_template([{"role": "system", "content": s["system"]}], tokenize=False))["input_ids"])
        for s in sessions)
    session_tokens = prefix_tokens + args.turns * (len(tok(sessions[0]["users"][0])["input_ids"]) + 4 + args.max_tokens)
    if args.kv_blocks is None:
        args.kv_blocks = int(args.pool_share * args.sessions * session_tokens / 16) + 2
    fits = (args.kv_blocks - 1) * 16 / session_tokens
    engine_args = ["--max-model-len", str(min(2048, (args.kv_blocks - 1) * 16)), "--max-num-seqs", str(args.max_num_seqs), "--dtype", "float32",
                   "--num-gpu-blocks-override", str(args.kv_blocks), "--max-num-batched-tokens", "512",
                   "--prefix-caching-hash-algo", args.hash_algo]
    if args.eager:
        engine_args.append("--enforce-eager")
    if args.tenants_check:
        engine_args += ["--scheduling-policy", "priority"]
    print(f"# {args.replicas} vLLM replicas on tpu (torchtpu), vllm-router; {args.sessions} sessions x {args.turns} turns, "
          f"{args.tenants} tenants, system prompts of ~{prefix_tokens:.0f} tokens, {args.max_tokens} new tokens per turn; "
          f"KV pool {args.kv_blocks} blocks of 16 per replica: {fits:.1f} of the {args.sessions} sessions "
          f"(~{session_tokens:.0f} tokens each at their last turn) fit in one; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)

    with serve_replicas.Fleet(model, args.replicas, python=sys.executable, engine_args=tuple(engine_args),
                              kv_events=True, log_dir=args.log_dir or work / "logs",
                              extra_env={"VLLM_SERVER_DEV_MODE": "1"}) as fleet:
        # warm-up: every shape a turn meets, on every replica (not measured)
        measure_policy(fleet, "round_robin", make_sessions(args.replicas * 2, 1, args.system_words, seed=99), 2,
                       args.max_tokens)
        rows = []
        for policy in args.policies:
            row = measure_policy(fleet, policy, sessions, args.turns, args.max_tokens)
            rows.append(row)
            print(f"  {policy}: {json.dumps(row)}", flush=True)
        base = next((r for r in rows if r["policy"] == "round_robin"), rows[0])
        print()
        print("| policy | output tok/s | vs round_robin | TTFT p50 (ms) | TTFT p99 (ms) | ITL p99 (ms) | prefix-hit rate | requests per replica |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for r in rows:
            print(f"| {r['policy']} | {r['tok_s']:.1f} | {r['tok_s'] / base['tok_s']:.2f}x | {r['ttft_p50'] * 1e3:.0f} "
                  f"({base['ttft_p50'] / r['ttft_p50']:.2f}x lower) | {r['ttft_p99'] * 1e3:.0f} | {r['itl_p99'] * 1e3:.0f} | "
                  f"{r['hit_rate']:.3f} | {' / '.join(map(str, r['split']))} |")
        print(f"# load average after: {os.getloadavg()[0]:.1f}", flush=True)

        if args.failover:
            f = failover(fleet)
            print(f"restarted and ready in {f['restart_s']:.0f} s, {'rejoined' if f['rejoined'] else 'NOT rejoined'} "
                  f"the rotation", flush=True)
            h = two_routers(fleet)
            print(f"two routers: {h['requests']} requests over both, router A SIGKILLed under load: {h['lost']} lost, "
                  f"{h['sent_to_the_other_router']} sent again to router B", flush=True)

        if args.tenants_check:
            n = args.tenant_requests

            def show(label: str, ttfts: list[float]) -> None:
                print(f"  {label}: TTFT p50 {pct(ttfts, 50) * 1e3:.0f} ms, p99 {pct(ttfts, 99) * 1e3:.0f} ms; all (s): "
                      f"{' '.join(f'{t:.2f}' for t in sorted(ttfts))}", flush=True)

            router = fleet.start_router("round_robin")
            try:
                # A's own prefix warm on both replicas first: "alone" is A's steady state, not a cold prefill
                asyncio.run(tenant_run(router.url, sessions, 0, 2 * args.replicas, True, args.max_tokens))
                alone = asyncio.run(tenant_run(router.url, sessions, 0, n, True, args.max_tokens))
                show("A alone (vllm-router)", alone)
                plain = asyncio.run(tenant_run(router.url, sessions, args.flood, n, False, args.max_tokens))
                show("A, B flooding, vllm-router, no priorities", plain)
                prio = asyncio.run(tenant_run(router.url, sessions, args.flood, n, True, args.max_tokens))
                show("A, B flooding, vllm-router, engines' priority", prio)
            finally:
                fleet.stop_router(router)
            # vllm-router's own admission: one limit, one FIFO queue for both tenants
            router = fleet.start_router("round_robin", options=(
                "--max-concurrent-requests", str(args.bulk_slots + 1), "--queue-size", "1024", "--queue-timeout-secs", "600"))
            try:
                capped = asyncio.run(tenant_run(router.url, sessions, args.flood, n, True, args.max_tokens))
                show(f"A, B flooding, vllm-router --max-concurrent-requests {args.bulk_slots + 1}, engines' priority", capped)
            finally:
                fleet.stop_router(router)
            a = pct(alone, 99)
            print(f"\ntenant A TTFT p99: alone {a * 1e3:.0f} ms; tenant B flooding ({args.flood} in flight): "
                  f"{pct(plain, 99) * 1e3:.0f} ms ({pct(plain, 99) / a:.1f}x) without priorities, "
                  f"{pct(prio, 99) * 1e3:.0f} ms ({pct(prio, 99) / a:.1f}x) with A at a higher priority, "
                  f"{pct(capped, 99) * 1e3:.0f} ms ({pct(capped, 99) / a:.1f}x) with vllm-router's global admission limit "
                  f"of {args.bulk_slots + 1} as well", flush=True)
            smg_python = args.smg_python or (sys.executable if importlib.util.find_spec("smg") else None)
            if smg_python is None:
                print("(no smg: the row with smg's per-tenant admission is skipped; --smg-python PY)", flush=True)
            else:
                # smg's priority scheduler in front of the same replicas: tenant B's bulk class gets at
                # most --bulk-slots requests in flight, every other slot is held for A's interactive class
                fleet.smg_python = smg_python
                router, capacity = start_smg_admission(fleet, work, args.bulk_slots)
                try:
                    s_alone = asyncio.run(tenant_run(router.url, sessions, 0, n, True, args.max_tokens, classes=True))
                    show("A alone (smg)", s_alone)
                    s_adm = asyncio.run(tenant_run(router.url, sessions, args.flood, n, True, args.max_tokens, classes=True))
                    show(f"A, B flooding, smg priority scheduler (B at most {args.bulk_slots} in flight), engines' priority", s_adm)
                    port = router.cmd[router.cmd.index("--prometheus-port") + 1]
                    try:
                        sched = {k: v for k, v in serve_replicas.parse_metrics(serve_replicas.fetch(
                            f"http://127.0.0.1:{port}/metrics")).items() if k.startswith("smg_scheduler")}
                    except OSError:
                        sched = {}
                finally:
                    fleet.stop_router(router)
                print(f"tenant A TTFT p99 through smg's priority scheduler (B's bulk class at most {args.bulk_slots} in "
                      f"flight, {capacity - args.bulk_slots} of smg's {capacity} slots held for A's class, engines' "
                      f"priority on): alone {pct(s_alone, 99) * 1e3:.0f} ms; tenant B "
                      f"flooding: {pct(s_adm, 99) * 1e3:.0f} ms ({pct(s_adm, 99) / a:.1f}x the alone value above, "
                      f"{pct(s_adm, 99) / pct(s_alone, 99):.1f}x smg's own alone value); p50 {pct(s_adm, 50) * 1e3:.0f} ms",
                      flush=True)
                print(f"  smg scheduler: {json.dumps(sched)}", flush=True)


if __name__ == "__main__":
    main()
