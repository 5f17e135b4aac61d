"""Several SGLang replicas on ``tpu`` behind a real router (``smg``, the SGLang gateway, from the package index).

The SGLang side of what tests/test_routing.py checks for vLLM, on two real replicas started by
``tools/serve_replicas.py --engine sglang`` (one ``sglang.launch_server`` process each, own port,
own process group) and the real ``smg`` in front of them:

- greedy tokens through the router equal Hugging Face ``generate`` on CPU;
- the figures smg's load-aware policies and overload protection read (``/v1/loads``:
  ``num_running_reqs``, ``num_waiting_reqs``, ``num_used_tokens``, ``token_usage``) are the
  engine's own Prometheus gauges (``sglang:num_running_reqs``, ``sglang:num_queue_reqs``,
  ``sglang:num_used_tokens``, ``sglang:token_usage``), within the scheduler's limits under load
  and back to zero when the load is gone;
- sessions: the turns of one session (an ``X-SMG-Routing-Key`` header under
  ``consistent_hashing``, or its growing prefix under ``cache_aware``) land on one replica, which
  finds the conversation so far in its radix cache (the reply's ``cached_tokens``);
- failover: one replica SIGKILLed under load loses no non-streamed request (smg retries on the
  other; replies still equal HF), a streamed request in flight ends instead of hanging, and the
  dead replica leaves the rotation.

Needs the sglang extra and the ``smg`` wheel (``tools/sglang_env.sh`` builds a venv with both);
skipped without them. The model is the tiny random Llama of ``tools/make_tiny_llama.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

os.environ.setdefault("SGLANG_PLATFORM", "tpu")
REASON = "the sglang extra is not installed (tools/sglang_env.sh, or pip install 'torchtpu[sglang]')"
pytest.importorskip("sglang", reason=REASON)
openai = pytest.importorskip("openai", reason=REASON)
pytest.importorskip("transformers", reason=REASON)
if importlib.util.find_spec("smg") is None:
    pytest.skip("the smg wheel (the SGLang gateway) is not installed (tools/sglang_env.sh installs it; pip install smg)",
                allow_module_level=True)

from serving_fixtures import hf, model_dir  # noqa: F401 (fixtures)
from serving_fixtures import hf_greedy as _hf_greedy

REPO = Path(__file__).resolve().parents[1]
MAX_RUNNING = 2
MAX_TOTAL_TOKENS = 2048  # each replica's KV pool, in tokens
ENGINE_ARGS = ("--dtype", "float32", "--max-total-tokens", str(MAX_TOTAL_TOKENS), "--max-running-requests",
               str(MAX_RUNNING), "--disable-cuda-graph", "--enable-cache-report")
WORDS = ["clock", "hand", "river", "stone", "lamp", "window", "garden", "letter", "bridge", "candle", "market", "winter", "harbor", "mill", "orchard", "lantern", "thread", "anchor", "meadow", "tower"]


def load_serve_replicas():
    spec = importlib.util.spec_from_file_location("serve_replicas", REPO / "tools" / "serve_replicas.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_replicas"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


serve_replicas = sys.modules.get("serve_replicas") or load_serve_replicas()


def hf_greedy(hf, ids, n):  # noqa: F811
    return _hf_greedy(hf, ids, n, eos_token_id=None)  # the requests below ignore end-of-sequence


def text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


@pytest.fixture(scope="module")
def fleet(model_dir, tmp_path_factory):  # noqa: F811
    with serve_replicas.Fleet(model_dir, 2, engine="sglang", python=sys.executable, engine_args=ENGINE_ARGS,
                              served_name="tiny", log_dir=tmp_path_factory.mktemp("replicas"),
                              start_timeout=600) as fleet:
        yield fleet


@pytest.fixture
def router(fleet, request):
    """An smg router with the policy given by ``@pytest.mark.parametrize("router", [...], indirect=True)``."""
    r = fleet.start_router(getattr(request, "param", "round_robin"))
    yield r
    fleet.stop_router(r)


def client(url: str, timeout: float = 300) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=timeout, max_retries=0)


def complete(url: str, prompt: str, n: int = 8, headers: dict | None = None):
    """(prompt token ids, completion token ids, cached prompt tokens) of one greedy completion."""
    r = client(url).completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=n,
                                       extra_body={"return_token_ids": True, "ignore_eos": True},
                                       extra_headers=headers)
    details = r.usage.prompt_tokens_details
    return r.choices[0].prompt_token_ids, r.choices[0].token_ids, (details.cached_tokens if details else 0) or 0


def gauges(fleet, index: int) -> dict[str, float]:
    return fleet.metrics(index)


def loads(fleet, index: int) -> dict:
    """What smg reads from a worker: SGLang's ``/v1/loads`` (one entry per data-parallel rank)."""
    body = json.loads(serve_replicas.fetch(fleet.members[index].url + "/v1/loads"))
    (load,) = body["loads"]
    return load


def served(fleet) -> list[float]:
    """Requests each replica has finished (its own counter)."""
    return [fleet.metrics(i).get("sglang:num_requests_total", 0.0) for i in range(len(fleet.members))]


def served_by(fleet, fn):
    """Which replica served the one request ``fn`` sends, and what ``fn`` returned."""
    before = served(fleet)
    out = fn()
    deadline = time.monotonic() + 10
    while True:  # the counter is bumped as the reply goes out: give it a moment
        after = served(fleet)
        changed = [i for i, (a, b) in enumerate(zip(before, after)) if b > a]
        if changed or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(changed) == 1, (before, after)
    return changed[0], out


# ---------------------------------------------------------------- through the router

@pytest.mark.parametrize("router", ["cache_aware"], indirect=True)
def test_greedy_through_smg_matches_hf(fleet, router, hf):  # noqa: F811
    prompts = [text(i, 12 + 9 * i) for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda p: complete(router.url, p, 8), prompts))
    for prompt_ids, ids, _ in results:
        assert ids == hf_greedy(hf, prompt_ids, 8)


# ---------------------------------------------------------------- the engines' side of the contract

def test_load_figures_smg_reads_under_load(fleet):
    """Six requests at one replica that runs at most two at a time. SGLang refreshes its gauges
    when it logs a batch, so they are sampled, not exact at every instant: every sample must be
    within the scheduler's limits and say the same in ``/v1/loads`` (smg) as in ``/metrics``
    (Prometheus scrapers, llm-d's SGLang scorers); under load they must show the batch and the
    pool in use, and with the load gone, nothing."""
    import threading

    samples, done = [], threading.Event()

    def sample():
        while not done.is_set():
            g, load = gauges(fleet, 0), loads(fleet, 0)
            samples.append((g, load))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        prompts = [f"{i} " + text(100 + i, 16) for i in range(6)]
        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda p: complete(fleet.members[0].url, p, 16), prompts))
    finally:
        done.set()
        sampler.join()
    assert all(len(ids) == 16 for _, ids, _ in results)
    longest = max(len(p) for p, _, _ in results) + 16
    assert samples, "no sample"
    for g, load in samples:
        running, waiting = g["sglang:num_running_reqs"], g["sglang:num_queue_reqs"]
        used, usage = g["sglang:num_used_tokens"], g["sglang:token_usage"]
        assert 0 <= running <= MAX_RUNNING and 0 <= waiting <= 6, (g, load)
        assert g["sglang:max_total_num_tokens"] == load["max_total_num_tokens"] == MAX_TOTAL_TOKENS
        # the running requests hold their tokens: at most their whole lengths
        assert 0 <= used <= MAX_RUNNING * longest, (g, load)
        assert abs(usage - used / MAX_TOTAL_TOKENS) <= 0.005 + 1e-9, (g, load)  # the gauge is rounded to 2 places
        assert 0 <= load["num_running_reqs"] <= MAX_RUNNING and 0 <= load["num_used_tokens"] <= MAX_RUNNING * longest
        assert abs(load["token_usage"] - load["num_used_tokens"] / MAX_TOTAL_TOKENS) < 1e-3, load
    assert max(g["sglang:num_running_reqs"] for g, _ in samples) >= 1, samples
    assert max(g["sglang:num_used_tokens"] for g, _ in samples) > 0, samples
    assert max(load["num_running_reqs"] for _, load in samples) >= 1, samples
    deadline = time.monotonic() + 30
    while True:
        g, load = gauges(fleet, 0), loads(fleet, 0)
        idle = (g["sglang:num_running_reqs"], g["sglang:num_queue_reqs"], g["sglang:num_used_tokens"],
                load["num_running_reqs"], load["num_waiting_reqs"], load["num_used_tokens"])
        if idle == (0, 0, 0, 0, 0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert idle == (0, 0, 0, 0, 0, 0), (g, load)


# ---------------------------------------------------------------- sessions

@pytest.mark.parametrize("router", ["consistent_hashing", "cache_aware"], indirect=True)
def test_turns_of_a_session_land_on_the_replica_holding_its_cache(fleet, router):
    """Three sessions, three turns each, sent one after another: under ``consistent_hashing`` by
    the ``X-SMG-Routing-Key`` header, under ``cache_aware`` by the conversation's prefix. A later
    turn lands where the earlier ones are, and that replica's radix cache holds the conversation
    so far (the reply's ``cached_tokens`` cover the previous turn's prompt)."""
    homes = {}
    salt = router.name  # each policy's sessions are new to both replicas
    for s in range(3):
        conversation = f"{salt} session {s}. " + text(200 + s, 40)
        headers = {"X-SMG-Routing-Key": f"{salt}-agent-{s}"}
        previous = 0
        for turn in range(3):
            conversation += f" turn {turn}: " + text(300 + 10 * s + turn, 6)
            where, (prompt_ids, _, cached) = served_by(
                fleet, lambda c=conversation, h=headers: complete(router.url, c, 4, h))
            if turn == 0:
                homes[s] = where
            else:
                assert where == homes[s], f"session {s} turn {turn} went to replica {where}, its cache is on {homes[s]}"
                assert cached >= previous - 4, (s, turn, cached, previous)  # the previous prompt (its last tokens may re-split)
            previous = len(prompt_ids)
    if router.name.endswith("consistent_hashing"):  # sessions are spread over the replicas: the
        # ring follows the replicas' (random) ports, so three sessions may all hash to one; more
        # routing keys, one short request each, until both replicas have had one (24 at most)
        seen = set(homes.values())
        for s in range(3, 27):
            if len(seen) == 2:
                break
            headers = {"X-SMG-Routing-Key": f"{salt}-agent-{s}"}
            seen.add(served_by(fleet, lambda h=headers, s=s: complete(router.url, f"session {s}.", 2, h))[0])
        assert len(seen) == 2, (homes, seen)


# ---------------------------------------------------------------- failover (last: it kills a replica)

def test_failover_replica_killed_under_load(fleet, hf):  # noqa: F811
    """16 non-streamed requests and two long streamed ones through smg; replica 1 is SIGKILLed
    once a few have finished. None of the 16 is lost and each equals HF; every stream ends
    (finished, or with an error) instead of hanging; later requests go to replica 0 only."""
    router = fleet.start_router("round_robin")  # with serve_replicas.RETRY_OPTIONS
    try:
        prompts = [text(500 + i, 10 + i) for i in range(8)]
        refs = {}
        finished = []
        stream_results = []

        def one(i):
            out = complete(router.url, prompts[i % 8], 6)
            finished.append(i)
            return out

        def stream(i):
            tokens = 0
            try:
                for chunk in client(router.url, timeout=120).completions.create(
                        model="tiny", prompt=text(900 + i, 20), max_tokens=60, temperature=0, stream=True,
                        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
                    if chunk.usage:
                        tokens = chunk.usage.completion_tokens
                stream_results.append(("finished", tokens))
            except Exception as e:  # noqa: BLE001  (the dead replica's stream ends with an error)
                stream_results.append((type(e).__name__, tokens))

        with ThreadPoolExecutor(8) as pool:
            streams = [pool.submit(stream, i) for i in range(2)]
            futures = [pool.submit(one, i) for i in range(16)]
            while len(finished) < 3:
                time.sleep(0.2)
            fleet.kill_replica(1)
            results = [f.result(timeout=300) for f in futures]
            for f in streams:
                f.result(timeout=150)  # a hang fails here
        assert len(stream_results) == 2
        for status, tokens in stream_results:  # a stream cut short says so: never a silent truncation
            assert status != "finished" or tokens == 60, stream_results
        for i, (prompt_ids, ids, _) in enumerate(results):
            key = tuple(prompt_ids)
            refs.setdefault(key, hf_greedy(hf, prompt_ids, 6))
            assert ids == refs[key], f"request {i}"
        # out of the rotation: the next requests all reach replica 0
        before = fleet.metrics(0)["sglang:num_requests_total"]
        for i in range(4):
            complete(router.url, prompts[i], 2)
        deadline = time.monotonic() + 10
        while fleet.metrics(0)["sglang:num_requests_total"] - before < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert fleet.metrics(0)["sglang:num_requests_total"] - before == 4
    finally:
        fleet.stop_router(router)
