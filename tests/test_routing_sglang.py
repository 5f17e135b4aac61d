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
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

os.environ.setdefault("SGLANG_PLATFORM", "tpu")
REASON = "the sglang extra is not installed (tools/sglang_env.sh, or pip install 'torchtpu[sglang]')"
pytest.importorskip("sglang", reason=REASON)
openai = pytest.importorskip("openai", reason=REASON)
pytest.importorskip("transformers", reason=REASON)
if importlib.util.find_spec("smg") is None:
    pytest.skip("the smg wheel (the SGLang gateway) is not installed (tools/sglang_env.sh installs it; pip install smg)",
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

MAX_RUNNING = 2
MAX_TOTAL_TOKENS = 2048  # each replica's KV pool, in tokens
ENGINE_ARGS = ("--dtype", "float32", "--max-total-tokens", str(MAX_TOTAL_TOKENS), "--max-running-requests",
               str(MAX_RUNNING), "--disable-cuda-graph", "--enable-cache-report")


@pytest.fixture(scope="module")
def fleet(model_dir, tmp_path_factory):  # noqa: F811
    with serve_replicas.Fleet(model_dir, 2, engine="sglang", python=sys.executable, engine_args=ENGINE_ARGS,
                              served_name="tiny", log_dir=tmp_path_factory.mktemp("replicas"),
                              start_timeout=600) as fleet:
        yield fleet


SGLANG = Routing(served_counter="sglang:num_requests_total", session_header="X-SMG-Routing-Key",
                 hash_policy="consistent_hashing")


def gauges(fleet, index: int) -> dict[str, float]:
    return fleet.metrics(index)


def loads(fleet, index: int) -> dict:
    """What smg reads from a worker: SGLang's ``/v1/loads`` (one entry per data-parallel rank)."""
    body = json.loads(serve_replicas.fetch(fleet.members[index].url + "/v1/loads"))
    (load,) = body["loads"]
    return load


# ---------------------------------------------------------------- through the router

@pytest.mark.parametrize("router", ["cache_aware"], indirect=True)
def test_greedy_through_smg_matches_hf(fleet, router, hf):  # noqa: F811
    check_greedy_matches_hf(router, hf)


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
def test_turns_of_a_session_land_on_the_replica_holding_its_cache(fleet, router):  # noqa: F811
    """``routing_checks.check_sessions_stay_home``: under ``consistent_hashing`` by the
    ``X-SMG-Routing-Key`` header; the reply's ``cached_tokens`` cover the previous turn's prompt."""
    check_sessions_stay_home(fleet, router, SGLANG)


# ---------------------------------------------------------------- failover (last: it kills a replica)

def test_failover_replica_killed_under_load(fleet, hf):  # noqa: F811
    """``routing_checks.check_failover`` through smg."""
    check_failover(fleet, hf, SGLANG)
