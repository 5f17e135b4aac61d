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
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

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

from routing_checks import (
    Routing,
    check_failover,
    check_greedy_matches_hf,
    check_sessions_stay_home,
    complete,
    router,  # noqa: F401 (router: a fixture)
    serve_replicas,
    text,
)
from serving_fixtures import hf, model_dir  # noqa: F401 (fixtures)

MAX_NUM_SEQS = 2
NUM_BLOCKS = 64  # the KV pool of each replica, in blocks of 16 tokens
ENGINE_ARGS = ("--max-model-len", "256", "--max-num-seqs", str(MAX_NUM_SEQS), "--dtype", "float32",
               "--enforce-eager", "--num-gpu-blocks-override", str(NUM_BLOCKS))


@pytest.fixture(scope="module")
def fleet(model_dir, tmp_path_factory):  # noqa: F811
    with serve_replicas.Fleet(model_dir, 2, python=sys.executable, engine_args=ENGINE_ARGS, served_name="tiny",
                              kv_events=True, log_dir=tmp_path_factory.mktemp("replicas"),
                              start_timeout=600) as fleet:
        yield fleet


VLLM = Routing(served_counter="vllm:request_success_total", session_header="X-Session-ID",
               hash_policy="consistent_hash", prefix_hits="vllm:prefix_cache_hits_total")


# ---------------------------------------------------------------- through the router

@pytest.mark.parametrize("router", ["cache_aware"], indirect=True)
def test_greedy_through_the_router_matches_hf(fleet, router, hf):  # noqa: F811
    check_greedy_matches_hf(router, hf)


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
    assert all(len(ids) == 16 for _, ids, _ in results)
    longest = max(len(p) for p, _, _ in results) + 16
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
        prompt_ids, _, _ = complete(fleet.members[1].url, text(7, 60), 2)
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
def test_turns_of_a_session_land_on_the_replica_holding_its_cache(fleet, router):  # noqa: F811
    """``routing_checks.check_sessions_stay_home``: under ``consistent_hash`` by the ``X-Session-ID``
    header; the replica's ``vllm:prefix_cache_hits_total`` grows on each later turn."""
    check_sessions_stay_home(fleet, router, VLLM)


# ---------------------------------------------------------------- failover (last: it restarts a replica)

def test_failover_replica_killed_under_load(fleet, hf):  # noqa: F811
    """``routing_checks.check_failover`` through vllm-router. (A restarted replica rejoining:
    benchmarks/routing.py --failover.)"""
    check_failover(fleet, hf, VLLM)
