"""Prefill/decode disaggregation with vLLM on ``tpu``: a prefill server and a decode server, the KV
moved between them by torchtpu's ``TpuTcpConnector`` (:mod:`torchtpu.integrations.vllm.kv_connector`),
driven directly (the two requests a P/D router makes) and through ``vllm-router``'s P/D mode.

Needs the vllm extra (``tools/vllm_env.sh``); the router cases also need the ``vllm-router``
wheel next to the interpreter or on ``PATH``. Skipped with the reason otherwise. Greedy tokens
through P/D are compared with Hugging Face on CPU and with the decode server serving the same
prompt by itself (colocated). The decode server only computes a prompt's last token: if the KV
did not arrive, its tokens are wrong.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REASON = "the vllm extra is not installed (tools/vllm_env.sh, or pip install 'torchtpu[vllm]')"
vllm = pytest.importorskip("vllm", reason=REASON)
openai = pytest.importorskip("openai", reason=REASON)
transformers = pytest.importorskip("transformers", reason=REASON)

import torch  # noqa: E402

from torchtpu.integrations.vllm.kv_connector import _StagedKV, fetch_blocks  # noqa: E402

from serving_fixtures import MAX_NEW, free_port, hf, model_dir  # noqa: E402,F401,F811 (fixtures)
from serving_fixtures import hf_greedy as _hf_greedy  # noqa: E402

hf_greedy = functools.partial(_hf_greedy, eos_token_id=None)  # the requests ignore EOS too
CHUNK = 32
BLOCK = 16
# Eager: the servers start sooner (the compiled forward is tests/test_vllm.py's and
# benchmarks/pd.py's); the connector is the same either way.
ENGINE_ARGS = ["--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens",
               str(CHUNK), "--dtype", "float32", "--block-size", str(BLOCK), "--enforce-eager"]
SERVER_START_S = 400
PROMPTS = [
    "The clockmaker said",
    # longer than --max-num-batched-tokens: prefilled in chunks, several blocks moved
    "Aldous was not a young man. His hands had grown slow, but they had not grown careless. "
    "He said that a clock was a patient thing, and that a",
    # three blocks: the transfer pads block counts to a power of two (scratch block on the decode side)
    "Nobody in Lower Fenwick could remember a time when the clock on the church tower had stopped",
]
LOADED = re.compile(r"tpu KV transfer: loaded (\d+) blocks \(\d+ KiB\) of (\S+) from")


def router_binary() -> str | None:
    here = Path(sys.executable).parent / "vllm-router"
    return str(here) if here.exists() else shutil.which("vllm-router")


def kv_transfer_config(role: str, kv_port: int) -> str:
    return json.dumps({"kv_connector": "TpuTcpConnector", "kv_role": role, "kv_port": kv_port,
                       "kv_connector_module_path": "torchtpu.integrations.vllm.kv_connector"})


# ---------------------------------------------------------------- the transfer, without an engine

def test_staged_blocks_are_served_once_by_range():
    port = free_port()
    layers = {"layers.0": torch.randn(3 * BLOCK, 2, 8), "layers.1": torch.randn(3 * BLOCK, 2, 8).bfloat16()}
    staged = _StagedKV("127.0.0.1", port, BLOCK, ttl_s=60)
    try:
        staged.put("r1", layers)
        got = fetch_blocks("127.0.0.1", port, "r1", 1, 2)
        for name, t in layers.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t[BLOCK:])
        with pytest.raises(RuntimeError, match="no staged KV for this request id"):
            fetch_blocks("127.0.0.1", port, "r1", 0, 1)  # fetched already: dropped
        staged.put("r2", layers)
        with pytest.raises(RuntimeError, match=r"asked for slots \[32, 64\) of 48 staged"):
            fetch_blocks("127.0.0.1", port, "r2", 2, 2)
    finally:
        staged.close()


# ---------------------------------------------------------------- two servers (and the router)

@contextlib.contextmanager
def started(cmd: list[str], log: Path, env: dict | None = None):
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def wait_ready(client, proc, log: Path, limit: float = SERVER_START_S) -> None:
    deadline = time.monotonic() + limit
    while True:
        try:
            client.models.list()
            return
        except (openai.APIConnectionError, openai.APIStatusError):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"{proc.args[:4]} did not start:\n{log.read_text()[-3000:]}")
            time.sleep(1)


def vllm_server(model_dir, log: Path, role: str):
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model_dir, "--port", str(port),
           "--host", "127.0.0.1", "--served-model-name", "tiny", *ENGINE_ARGS,
           "--kv-transfer-config", kv_transfer_config(role, free_port())]
    return port, started(cmd, log, {**os.environ, "VLLM_PLATFORM": "tpu"})


def client_for(port: int):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120,
                         max_retries=0)


@pytest.fixture(scope="module")
def pd(model_dir, tmp_path_factory):
    """A prefill server and a decode server (separate processes, each its own tpu device), both
    started at once; yields (prefill client, decode client, decode log, prefill port, decode port)."""
    logs = tmp_path_factory.mktemp("pd")
    p_port, p_ctx = vllm_server(model_dir, logs / "prefill.log", "kv_producer")
    d_port, d_ctx = vllm_server(model_dir, logs / "decode.log", "kv_consumer")
    with p_ctx as p_proc, d_ctx as d_proc:
        prefill, decode = client_for(p_port), client_for(d_port)
        wait_ready(prefill, p_proc, logs / "prefill.log")
        wait_ready(decode, d_proc, logs / "decode.log")
        yield prefill, decode, logs / "decode.log", p_port, d_port


def complete(client, prompt: str, max_tokens: int = MAX_NEW, **extra):
    r = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=max_tokens,
                                  extra_body={"return_token_ids": True, "ignore_eos": True, **extra})
    return r.choices[0].prompt_token_ids, r.choices[0].token_ids, r


def loads(log: Path) -> dict[str, int]:
    """The decode server's KV loads: blocks by the prefill server's request id."""
    return {rid: int(n) for n, rid in LOADED.findall(log.read_text())}


def test_pd_greedy_equals_hf_and_colocated(pd, hf):
    """Prefill on one server (max_tokens=1, do_remote_decode), decode on the other with the
    parameters the prefill returned: the tokens are Hugging Face's and the decode server's own."""
    prefill, decode, log, _, _ = pd
    counts = []
    for prompt in PROMPTS:
        _, _, first = complete(prefill, prompt, 1, kv_transfer_params={"do_remote_decode": True})
        params = first.model_extra["kv_transfer_params"]
        assert params["do_remote_prefill"] and params["remote_request_id"]
        prompt_ids, ids, _ = complete(decode, prompt, kv_transfer_params=params)
        assert ids == hf_greedy(hf, prompt_ids)
        blocks = -(-len(prompt_ids) // BLOCK)
        assert loads(log).get(params["remote_request_id"]) == blocks  # every block moved
        counts.append(blocks)
        _, colocated, _ = complete(decode, prompt)  # the same server without P/D
        assert colocated == ids
    assert any(n & (n - 1) for n in counts)  # a block count that is not a power of two was padded


def test_pd_unknown_prefill_fails_the_request(pd):
    """Parameters naming KV the prefill server never staged: the request ends with an error
    (vLLM's kv_load_failure_policy 'fail'), it does not hang or decode from an empty cache."""
    _, decode, _, p_port, _ = pd
    _, _, first = complete(pd[0], "Once the bell", 1, kv_transfer_params={"do_remote_decode": True})
    bogus = {**first.model_extra["kv_transfer_params"], "remote_request_id": "never-prefilled"}
    try:
        _, _, r = complete(decode, "Once the bell", kv_transfer_params=bogus)
    except openai.APIError:
        return
    assert r.choices[0].finish_reason not in ("length", "stop"), r


def test_pd_through_vllm_router(pd, hf, tmp_path):
    """vllm-router --vllm-pd-disaggregation in front: completions and a streamed chat."""
    binary = router_binary()
    if binary is None:
        pytest.skip("the vllm-router wheel is not installed (tools/vllm_env.sh, or pip install vllm-router)")
    prefill, decode, log, p_port, d_port = pd
    port = free_port()
    cmd = [binary, "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
           "--prefill", f"http://127.0.0.1:{p_port}", "--decode", f"http://127.0.0.1:{d_port}",
           "--policy", "round_robin"]
    with started(cmd, tmp_path / "router.log") as proc:
        router = client_for(port)
        wait_ready(router, proc, tmp_path / "router.log", 60)
        before = len(loads(log))
        prompt = PROMPTS[1] + " The river ran past the mill and"
        r = router.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=MAX_NEW,
                                      extra_body={"ignore_eos": True})
        prompt_ids = hf[0](prompt)["input_ids"]
        assert hf[0].decode(hf_greedy(hf, prompt_ids)) == r.choices[0].text
        messages = [{"role": "user", "content": "Tell me about the clock."}]
        stream = router.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                                temperature=0, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        direct = decode.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                                temperature=0)
        assert streamed == direct.choices[0].message.content
        assert len(loads(log)) == before + 2  # both went through the prefill server
