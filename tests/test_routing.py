"""Several vLLM replicas on ``tpu`` behind a real router (``vllm-router``, from the package index).

What llm-d's router needs from the engines, and what the router does with it, checked on two
real replicas started by ``tools/serve_replicas.py`` (one engine process each, own port, own
process group) and the real router in front of them:

- greedy tokens through the router equal Hugging Face ``generate`` on CPU;
- the metrics contract under load: ``vllm:num_requests_running``/``waiting`` as the scheduler
  has them (running never above ``--max-num-seqs``, the rest waiting), ``vllm:kv_cache_usage_perc``
  a whole number of the pool's blocks, zero again when the load is gone;
- vLLM's KV-event publisher on our platform: the blocks a request stored, with its tokens, on
  the replica that served it;
- sessions: the turns of one session (an ``X-Session-ID`` header, or its growing prefix under
  ``cache_aware``) land on one replica, which then finds them in its prefix cache;
- failover: one replica SIGKILLed under load loses no non-streamed request (the router retries
  on the other; greedy replies still equal HF), a streamed request in flight ends with an error
  instead of hanging, and the dead replica leaves the rotation.

Needs the vllm extra and the ``vllm-router`` wheel (``tools/vllm_env.sh`` builds a venv with
both); skipped without them. The model is the tiny random Llama of ``tools/make_tiny_llama.py``.
"""

from __future__ import annotations

import importlib.util
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REASON = "the vllm extra is not installed (tools/vllm_env.sh, or pip install 'torchtpu[vllm]')"
pytest.importorskip("vllm", reason=REASON)
openai = pytest.importorskip("openai", reason=REASON)
pytest.importorskip("transformers", reason=REASON)
zmq = pytest.importorskip("zmq", reason=REASON)
msgspec = pytest.importorskip("msgspec", reason=REASON)
if importlib.util.find_spec("vllm_router_rs") is None:
    pytest.skip("the vllm-router wheel is not installed (tools/vllm_env.sh installs it; pip install vllm-router)",
                allow_module_level=True)

from serving_fixtures import free_port, hf, model_dir  # noqa: F401 (fixtures)
from serving_fixtures import hf_greedy as _hf_greedy

REPO = Path(__file__).resolve().parents[1]
MAX_NUM_SEQS = 2
NUM_BLOCKS = 64  # the KV pool of each replica, in blocks of 16 tokens
ENGINE_ARGS = ("--max-model-len", "256", "--max-num-seqs", str(MAX_NUM_SEQS), "--dtype", "float32",
               "--enforce-eager", "--num-gpu-blocks-override", str(NUM_BLOCKS))
WORDS = ["clock", "hand", "river", "stone", "lamp", "window", "garden", "letter", "bridge", "candle", "market", "winter", "harbor", "mill", "orchard", "lantern", "thread", "anchor", "meadow", "tower"]


def load_serve_replicas():
    spec = importlib.util.spec_from_file_location("serve_replicas", REPO / "tools" / "serve_replicas.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_replicas"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


serve_replicas = load_serve_replicas()


def hf_greedy(hf, ids, n):  # noqa: F811
    return _hf_greedy(hf, ids, n, eos_token_id=None)  # the requests below ignore end-of-sequence


def text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


@pytest.fixture(scope="module")
def fleet(model_dir, tmp_path_factory):  # noqa: F811
    with serve_replicas.Fleet(model_dir, 2, python=sys.executable, engine_args=ENGINE_ARGS, served_name="tiny",
                              kv_events=True, log_dir=tmp_path_factory.mktemp("replicas"),
                              start_timeout=600) as fleet:
        yield fleet


@pytest.fixture
def router(fleet, request):
    """A router with the policy given by ``@pytest.mark.parametrize("router", [...], indirect=True)``."""
    r = fleet.start_router(getattr(request, "param", "round_robin"))
    yield r
    fleet.stop_router(r)


def client(url: str, timeout: float = 300) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=timeout, max_retries=0)


def complete(url: str, prompt: str, n: int = 8, headers: dict | None = None):
    r = client(url).completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=n,
                                       extra_body={"return_token_ids": True, "ignore_eos": True},
                                       extra_headers=headers)
    return r.choices[0].prompt_token_ids, r.choices[0].token_ids


def served(fleet) -> list[float]:
    """Requests each replica has finished (its own counter)."""
    return [fleet.metrics(i).get("vllm:request_success_total", 0.0) for i in range(len(fleet.members))]


def served_by(fleet, fn) -> int:
    """Which replica served the one request ``fn`` sends."""
    before = served(fleet)
    fn()
    after = served(fleet)
    changed = [i for i, (a, b) in enumerate(zip(before, after)) if b > a]
    assert len(changed) == 1, (before, after)
    return changed[0]


# ---------------------------------------------------------------- through the router

@pytest.mark.parametrize("router", ["cache_aware"], indirect=True)
def test_greedy_through_the_router_matches_hf(fleet, router, hf):  # noqa: F811
    prompts = [text(i, 12 + 9 * i) for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda p: complete(router.url, p, 8), prompts))
    for prompt_ids, ids in results:
        assert ids == hf_greedy(hf, prompt_ids, 8)


# ---------------------------------------------------------------- the engines' side of the contract

def test_metrics_contract_under_load(fleet):
    """Six requests at one replica that runs at most two at a time: the scheduler's counts and
    the pool's usage as the router's scorers read them from ``/metrics``."""
    url = fleet.members[0].url
    info = fleet.metrics(0)
    raw = serve_replicas.fetch(url + "/metrics")
    assert f'num_gpu_blocks="{NUM_BLOCKS}"' in raw  # vllm:cache_config_info: the pool the engine has
    samples, done = [], threading.Event()

    def sample():
        while not done.is_set():
            m = fleet.metrics(0)
            samples.append((m["vllm:num_requests_running"], m["vllm:num_requests_waiting"], m["vllm:kv_cache_usage_perc"]))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        prompts = [f"{i} " + text(100 + i, 16) for i in range(6)]
        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda p: complete(url, p, 16), prompts))
    finally:
        done.set()
        sampler.join()
    assert all(len(ids) == 16 for _, ids in results)
    longest = max(len(p) for p, _ in results) + 16
    blocks = NUM_BLOCKS - 1  # vLLM keeps one block of the pool back (its null block)
    assert samples, "no sample"
    for running, waiting, usage in samples:
        assert 0 <= running <= MAX_NUM_SEQS and 0 <= waiting <= 6 and running + waiting <= 6
        used = usage * blocks
        assert abs(used - round(used)) < 1e-6, f"usage {usage} is not a whole number of the {blocks} blocks"
        # the running requests hold their blocks: at least one each, at most their whole lengths
        assert running <= round(used) <= MAX_NUM_SEQS * -(-longest // 16), (running, waiting, usage)
    assert max(s[0] for s in samples) == MAX_NUM_SEQS, samples  # it filled its batch ...
    assert max(s[1] for s in samples) >= 1, samples  # ... and queued the rest
    assert max(s[2] for s in samples) > 0
    end = fleet.metrics(0)
    assert (end["vllm:num_requests_running"], end["vllm:num_requests_waiting"], end["vllm:kv_cache_usage_perc"]) == (0, 0, 0)
    assert end["vllm:request_success_total"] - info["vllm:request_success_total"] == 6


def test_kv_events_name_the_blocks_a_request_stored(fleet):
    """vLLM's ZMQ publisher on our platform: the replica that prefilled a prompt announces its full
    blocks (``BlockStored``, chained by parent hash) with the prompt's own tokens; the other says nothing."""
    ctx = zmq.Context.instance()
    subs = []
    for r in fleet.members:
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.connect(r.kv_events_endpoint)
        subs.append(s)
    time.sleep(1.0)  # a SUB socket gets only what is published after it has joined
    try:
        prompt_ids, _ = complete(fleet.members[1].url, text(7, 60), 2)
        stored: list[list[dict]] = [[], []]
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            for i, s in enumerate(subs):
                while s.poll(100):
                    topic, _seq, payload = s.recv_multipart()
                    assert topic == b"kv-events"
                    _ts, events, _rank = msgspec.msgpack.decode(payload)
                    stored[i] += [e for e in events if e["type"] == "BlockStored"]
    finally:
        for s in subs:
            s.close(linger=0)
    assert stored[0] == []
    tokens = [t for e in stored[1] for t in e["token_ids"]]
    full = len(prompt_ids) // 16 * 16
    assert tokens[:full] == prompt_ids[:full]
    hashes = [h for e in stored[1] for h in e["block_hashes"]]
    assert len(hashes) == len(tokens) // 16 and len(set(hashes)) == len(hashes)
    assert stored[1][0]["parent_block_hash"] is None and all(e["block_size"] == 16 for e in stored[1])
    for prev, e in zip(stored[1], stored[1][1:]):
        assert e["parent_block_hash"] == prev["block_hashes"][-1]


# ---------------------------------------------------------------- sessions

@pytest.mark.parametrize("router", ["consistent_hash", "cache_aware"], indirect=True)
def test_turns_of_a_session_land_on_the_replica_holding_its_cache(fleet, router):
    """Three sessions, three turns each, sent one after another: under ``consistent_hash`` by the
    ``X-Session-ID`` header, under ``cache_aware`` by the conversation's prefix."""
    homes = {}
    for s in range(3):
        conversation = f"session {s}. " + text(200 + s, 40)
        headers = {"X-Session-ID": f"agent-{s}"}
        for turn in range(3):
            conversation += f" turn {turn}: " + text(300 + 10 * s + turn, 6)
            hits = [fleet.metrics(i).get("vllm:prefix_cache_hits_total", 0.0) for i in range(2)]
            where = served_by(fleet, lambda c=conversation, h=headers: complete(router.url, c, 4, h))
            if turn == 0:
                homes[s] = where
            else:
                assert where == homes[s], f"session {s} turn {turn} went to replica {where}, its cache is on {homes[s]}"
                assert fleet.metrics(where)["vllm:prefix_cache_hits_total"] > hits[where]
    if router.name.endswith("consistent_hash"):  # sessions are spread over the replicas: the ring
        # depends on the replicas' (random) ports, so three sessions may all hash to one; more
        # session ids, one short request each, until both replicas have had one (24 at most)
        seen = set(homes.values())
        for s in range(3, 27):
            if len(seen) == 2:
                break
            headers = {"X-Session-ID": f"agent-{s}"}
            seen.add(served_by(fleet, lambda h=headers, s=s: complete(router.url, f"session {s}.", 2, h)))
        assert len(seen) == 2, (homes, seen)


# ---------------------------------------------------------------- failover (last: it restarts a replica)

def test_failover_replica_killed_under_load(fleet, hf):  # noqa: F811
    """16 non-streamed requests and two long streamed ones through the router; replica 1 is
    SIGKILLed once a few have finished. None of the 16 is lost and each equals HF; every stream
    ends (finished, or with an error) instead of hanging; later requests go to replica 0 only.
    (A restarted replica rejoining: benchmarks/routing.py --failover.)"""
    router = fleet.start_router("round_robin")  # with serve_replicas.RETRY_OPTIONS: retries that outlast the health check
    try:
        prompts = [text(500 + i, 10 + i) for i in range(8)]
        refs = {}
        finished = []
        stream_results = []

        def one(i):
            ids = complete(router.url, prompts[i % 8], 6)
            finished.append(i)
            return ids

        def stream(i):
            tokens = 0
            try:
                for chunk in client(router.url, timeout=90).completions.create(
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
                f.result(timeout=120)  # a hang fails here
        assert len(stream_results) == 2
        for status, tokens in stream_results:  # a stream cut short says so: never a silent truncation
            assert status != "finished" or tokens == 60, stream_results
        for i, (prompt_ids, ids) in enumerate(results):
            key = tuple(prompt_ids)
            refs.setdefault(key, hf_greedy(hf, prompt_ids, 6))
            assert ids == refs[key], f"request {i}"
        # out of the rotation: the next requests all reach replica 0
        before = fleet.metrics(0)["vllm:request_success_total"]
        for i in range(4):
            complete(router.url, prompts[i], 2)
        assert fleet.metrics(0)["vllm:request_success_total"] - before == 4
    finally:
        fleet.stop_router(router)
