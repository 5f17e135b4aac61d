"""What the router tests share: tests/test_routing.py (vLLM replicas behind ``vllm-router``) and
tests/test_routing_sglang.py (SGLang replicas behind ``smg``) run the same session and failover
checks through their own router; ``Routing`` holds what differs. Import it into a test module after
its ``importorskip`` lines (it needs ``openai``), with the ``router`` fixture
(``from routing_checks import router``)."""

from __future__ import annotations

import importlib.util
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from serving_fixtures import hf_greedy as _hf_greedy

REPO = Path(__file__).resolve().parents[1]
WORDS = ["clock", "hand", "river", "stone", "lamp", "window", "garden", "letter", "bridge", "candle", "market",
         "winter", "harbor", "mill", "orchard", "lantern", "thread", "anchor", "meadow", "tower"]


def _load_serve_replicas():
    """``tools/serve_replicas.py`` (a script, not a module of the package), loaded once."""
    if "serve_replicas" in sys.modules:
        return sys.modules["serve_replicas"]
    spec = importlib.util.spec_from_file_location("serve_replicas", REPO / "tools" / "serve_replicas.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_replicas"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


serve_replicas = _load_serve_replicas()


@dataclass(frozen=True)
class Routing:
    """What differs between the engines and their routers."""
    served_counter: str  # each replica's counter of the requests it finished
    session_header: str  # the header the consistent-hash policy routes a session by
    hash_policy: str  # the router's name of that policy
    prefix_hits: str | None = None  # a replica's counter of prefix-cache hits; None: the reply's cached_tokens say


@pytest.fixture
def router(fleet, request):
    """A router with the policy given by ``@pytest.mark.parametrize("router", [...], indirect=True)``."""
    r = fleet.start_router(getattr(request, "param", "round_robin"))
    yield r
    fleet.stop_router(r)


def text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def hf_greedy(hf, ids, n):
    return _hf_greedy(hf, ids, n, eos_token_id=None)  # the requests here ignore end-of-sequence


def client(url: str, timeout: float = 300) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=timeout, max_retries=0)


def complete(url: str, prompt: str, n: int = 8, headers: dict | None = None):
    """(prompt token ids, completion token ids, cached prompt tokens: 0 where the engine does not
    report them) of one greedy completion."""
    r = client(url).completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=n,
                                       extra_body={"return_token_ids": True, "ignore_eos": True},
                                       extra_headers=headers)
    details = r.usage.prompt_tokens_details
    return r.choices[0].prompt_token_ids, r.choices[0].token_ids, (details.cached_tokens if details else 0) or 0


def served(fleet, routing: Routing) -> list[float]:
    """Requests each replica has finished (its own counter)."""
    return [fleet.metrics(i).get(routing.served_counter, 0.0) for i in range(len(fleet.members))]


def served_by(fleet, routing: Routing, fn):
    """Which replica served the one request ``fn`` sends, and what ``fn`` returned."""
    before = served(fleet, routing)
    out = fn()
    deadline = time.monotonic() + 10
    while True:  # an engine may bump its counter as the reply goes out: give it a moment
        after = served(fleet, routing)
        changed = [i for i, (a, b) in enumerate(zip(before, after)) if b > a]
        if changed or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(changed) == 1, (before, after)
    return changed[0], out


def check_sessions_stay_home(fleet, router, routing: Routing) -> None:
    """Three sessions, three turns each, sent one after another: under the hash policy by the
    session header, under ``cache_aware`` by the conversation's prefix. A later turn lands where
    the earlier ones are, and that replica finds the conversation so far in its prefix cache."""
    homes = {}
    salt = router.name  # each policy's sessions are new to both replicas
    for s in range(3):
        conversation = f"{salt} session {s}. " + text(200 + s, 40)
        headers = {routing.session_header: f"{salt}-agent-{s}"}
        previous = 0
        for turn in range(3):
            conversation += f" turn {turn}: " + text(300 + 10 * s + turn, 6)
            hits = [fleet.metrics(i).get(routing.prefix_hits, 0.0) for i in range(2)] if routing.prefix_hits else None
            where, (prompt_ids, _, cached) = served_by(
                fleet, routing, lambda c=conversation, h=headers: complete(router.url, c, 4, h))
            if turn == 0:
                homes[s] = where
            else:
                assert where == homes[s], f"session {s} turn {turn} went to replica {where}, its cache is on {homes[s]}"
                if hits is not None:
                    assert fleet.metrics(where)[routing.prefix_hits] > hits[where], (s, turn)
                else:  # the previous prompt (its last tokens may re-split)
                    assert cached >= previous - 4, (s, turn, cached, previous)
            previous = len(prompt_ids)
    if router.name.endswith(routing.hash_policy):  # sessions are spread over the replicas: the ring
        # follows the replicas' (random) ports, so three sessions may all hash to one; more session
        # keys, one short request each, until both replicas have had one (24 at most)
        seen = set(homes.values())
        for s in range(3, 27):
            if len(seen) == 2:
                break
            headers = {routing.session_header: f"{salt}-agent-{s}"}
            seen.add(served_by(fleet, routing, lambda h=headers, s=s: complete(router.url, f"session {s}.", 2, h))[0])
        assert len(seen) == 2, (homes, seen)


def check_failover(fleet, hf, routing: Routing) -> None:
    """16 non-streamed requests and two long streamed ones through the router (``round_robin``,
    with ``serve_replicas.RETRY_OPTIONS``: retries that outlast the health check); replica 1 is
    SIGKILLed once a few have finished. None of the 16 is lost and each equals HF; every stream
    ends (finished, or with an error) instead of hanging; later requests go to replica 0 only."""
    router = fleet.start_router("round_robin")
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
        before = fleet.metrics(0)[routing.served_counter]
        for i in range(4):
            complete(router.url, prompts[i], 2)
        deadline = time.monotonic() + 10
        while fleet.metrics(0)[routing.served_counter] - before < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert fleet.metrics(0)[routing.served_counter] - before == 4
    finally:
        fleet.stop_router(router)


def check_greedy_matches_hf(router, hf) -> None:
    """Three greedy completions at once through the router, each equal to HF's on the CPU."""
    prompts = [text(i, 12 + 9 * i) for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda p: complete(router.url, p, 8), prompts))
    for prompt_ids, ids, _ in results:
        assert ids == hf_greedy(hf, prompt_ids, 8)
