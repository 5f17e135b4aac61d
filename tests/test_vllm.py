"""vLLM serving on ``tpu``: the platform plugin, the slot-mapping kernel, the paged attention
backend, and ``vllm serve`` queried with the ``openai`` client.

Needs the vllm extra (``tools/vllm_env.sh`` builds a venv with it); skipped without it.
The model is a tiny random Llama built by ``tools/make_tiny_llama.py``; every greedy output is
compared with Hugging Face ``generate`` on CPU. Servers and the offline engine run in
subprocesses (own process group, free port), killed at the end whatever happens.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REASON = "the vllm extra is not installed (tools/vllm_env.sh, or pip install 'torchtpu[vllm]')"
vllm = pytest.importorskip("vllm", reason=REASON)
openai = pytest.importorskip("openai", reason=REASON)
transformers = pytest.importorskip("transformers", reason=REASON)

from torchtpu.integrations.vllm import activate, check_vllm_version  # noqa: E402
from torchtpu.integrations.vllm.platform import TpuPlatform  # noqa: E402

from serving_fixtures import MAX_NEW, free_port, hf, hf_int8, model_dir  # noqa: E402,F401,F811 (fixtures)
from serving_fixtures import hf_greedy as _hf_greedy  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# vLLM's requests here ignore the end-of-sequence token: so does the reference
hf_greedy = functools.partial(_hf_greedy, eos_token_id=None)
PROMPTS = [
    "The clockmaker said",
    "In the village of Lower Fenwick there lived",
    # longer than the server's --max-num-batched-tokens below: prefilled in chunks
    "Aldous was not a young man. His hands had grown slow, but they had not grown careless. "
    "He said that a clock was a patient thing, and that a",
]
CHUNK = 32
SERVER_START_S = 400
# No --enforce-eager: the forward is compiled (vLLM's piecewise mode, pieces on the tpu backend).
ENGINE_ARGS = ["--max-model-len", "256", "--max-num-seqs", "4",
               "--max-num-batched-tokens", str(CHUNK), "--dtype", "float32", "--block-size", "16"]


# ---------------------------------------------------------------- the pieces, without an engine

def test_version_range_is_enforced():
    assert check_vllm_version("0.33.0") == "0.33.0"
    with pytest.raises(RuntimeError, match=r"supports vllm>=0.33.0,<0.34.0, but vllm 0.34.1"):
        check_vllm_version("0.34.1")


def test_plugin_activates_on_request_only(monkeypatch):
    monkeypatch.setenv("VLLM_PLATFORM", "tpu")
    assert activate() == "torchtpu.integrations.vllm.platform.TpuPlatform"
    monkeypatch.setenv("VLLM_PLATFORM", "cuda")
    assert activate() is None


@pytest.mark.parametrize("mode", ["STOCK_TORCH_COMPILE", "DYNAMO_TRACE_ONCE"])
def test_compile_modes_without_opaque_attention_are_refused(mode):
    from vllm.config import CompilationConfig, CompilationMode

    config = CompilationConfig(mode=CompilationMode[mode])
    with pytest.raises(NotImplementedError, match=f"compilation mode {mode} is not supported"):
        TpuPlatform._configure_compilation(config)


def test_attention_is_opaque_to_dynamo():
    """Inlined, the attention's per-step metadata is frozen into vLLM's single trace."""
    assert TpuPlatform.opaque_attention_op()


# ---------------------------------------------------------------- the OpenAI-compatible server

def vllm_env() -> dict:
    return {**os.environ, "VLLM_PLATFORM": "tpu"}


@contextlib.contextmanager
def running_server(model_dir, log: Path, *options: str):
    """`vllm serve` on tpu on a free port; yields an openai client; killed at the end."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model_dir, "--port", str(port),
           "--host", "127.0.0.1", "--served-model-name", "tiny", "--enable-prompt-tokens-details",
           *ENGINE_ARGS, *options]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=vllm_env(),
                                start_new_session=True)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=60,
                           max_retries=0)
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"vllm serve did not start:\n{log.read_text()[-3000:]}")
                time.sleep(1)
        yield client
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    """The server and its log."""
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with running_server(model_dir, log) as client:
        yield client, log


@pytest.fixture(scope="module")
def server(served):
    return served[0]


def complete_ids(client, prompt: str, max_tokens: int = MAX_NEW, **kw):
    r = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=max_tokens,
                                  extra_body={"return_token_ids": True}, **kw)
    return r.choices[0].prompt_token_ids, r.choices[0].token_ids, r


def test_server_greedy_matches_hf_batched_and_chunked(server, hf):
    """Three concurrent requests (batched decode; the long one prefilled in chunks)."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: complete_ids(server, p), PROMPTS))
    assert len(results[2][0]) > CHUNK
    for prompt_ids, ids, _ in results:
        assert ids == hf_greedy(hf, prompt_ids)


def test_server_runs_the_compiled_forward(served):
    """The greedy checks in this file run on the compiled forward: vLLM traced it and compiled
    its pieces with torchtpu's compiler (the default without --enforce-eager)."""
    server, log = served
    complete_ids(server, PROMPTS[0])
    text = log.read_text()
    assert "'backend': 'torchtpu.integrations.vllm.compiler.TpuCompiler'" in text
    assert "Compiling a graph for compile range" in text or "Directly load AOT compilation" in text
    assert "load failure" not in text  # a restart reloads vLLM's AOT artifact of the traced forward


def test_server_prefix_cache_hit_matches_hf(server, hf):
    prompt = PROMPTS[2]
    complete_ids(server, prompt)
    prompt_ids, ids, r = complete_ids(server, prompt + " little")
    assert r.usage.prompt_tokens_details.cached_tokens >= 16  # at least one block reused
    assert ids == hf_greedy(hf, prompt_ids)


def test_server_chat_stream_stop_and_sampling(server, hf):
    tokenizer, _ = hf
    messages = [{"role": "user", "content": "Tell me about the clock."}]
    chat = server.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                          temperature=0, extra_body={"return_token_ids": True})
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt_ids = list(getattr(prompt_ids, "input_ids", prompt_ids))
    assert chat.choices[0].token_ids == hf_greedy(hf, prompt_ids, 6)
    assert chat.usage.completion_tokens == 6 and chat.choices[0].finish_reason == "length"

    whole = server.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    pieces = server.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8,
                                       temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in pieces) == whole.choices[0].text

    stop_at = whole.choices[0].text[3:5]
    stopped = server.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8,
                                        temperature=0, stop=[stop_at])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == whole.choices[0].text.split(stop_at)[0]

    sample = dict(model="tiny", prompt=PROMPTS[1], max_tokens=10, temperature=0.9, top_p=0.8,
                  seed=123, extra_body={"top_k": 50})
    first = server.completions.create(**sample).choices[0].text
    assert server.completions.create(**sample).choices[0].text == first


# ---------------------------------------------------------------- load and bad input

LOAD_PROMPTS = [*PROMPTS, "Once the bell", "The river ran past the mill and", "She wound the key",
                "Nobody in Lower Fenwick could remember a time when"]


def test_server_64_concurrent_requests_none_dropped_or_corrupted(server, hf):
    """64 at once against --max-num-seqs 4: they queue; each gets exactly its own greedy tokens."""
    requests = [(LOAD_PROMPTS[i % len(LOAD_PROMPTS)], 2 + (7 * i) % (MAX_NEW - 1)) for i in range(64)]
    patient = server.with_options(timeout=600)  # the last of 16 waves waits for the other 15
    with ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(lambda r: complete_ids(patient, r[0], max_tokens=r[1]), requests))
    reference = {}  # greedy is prefix-stable: one HF run per prompt serves every max_tokens
    for (prompt, n), (prompt_ids, ids, r) in zip(requests, results):
        if prompt not in reference:
            reference[prompt] = hf_greedy(hf, prompt_ids, MAX_NEW)
        assert r.choices[0].finish_reason == "length" and ids == reference[prompt][:n], (prompt, n)


def running_requests(client) -> float:
    """Requests the engine holds (running + waiting), read from the server's Prometheus metrics."""
    import re

    import httpx

    text = httpx.get(str(client.base_url).replace("/v1/", "/metrics"), timeout=30).text
    counts = re.findall(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$", text, re.M)
    assert len(counts) == 2, text[:2000]  # both gauges are there: a zero is a real zero
    return sum(float(v) for v in counts)


def test_server_rejects_bad_requests_and_keeps_serving(server, hf):
    """An over-long prompt and bad sampling parameters get HTTP 400; a stream closed after two
    chunks is aborted; the server then still serves a greedy request exactly."""
    too_long = " ".join(["clock"] * 400)  # > --max-model-len 256 tokens
    with pytest.raises(openai.BadRequestError, match="maximum"):
        server.completions.create(model="tiny", prompt=too_long, max_tokens=4)
    for bad in ({"temperature": -1}, {"top_p": 2}):
        with pytest.raises(openai.BadRequestError, match=next(iter(bad))):
            server.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=4, **bad)

    stream = server.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=200,
                                       temperature=0, stream=True)
    chunks = iter(stream)
    assert next(chunks).choices and next(chunks).choices
    stream.close()
    deadline = time.monotonic() + 60
    while running_requests(server) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert running_requests(server) == 0  # the closed stream's request was aborted, not left to run

    prompt_ids, ids, _ = complete_ids(server, PROMPTS[1])
    assert ids == hf_greedy(hf, prompt_ids)


# ---------------------------------------------------------------- offline LLM.generate

OFFLINE = """
import json, sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], max_model_len=256, max_num_seqs=4,
          max_num_batched_tokens={chunk}, dtype="float32", block_size=16, enforce_eager={eager})
outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens={n}))
print("RESULT" + json.dumps([[o.prompt_token_ids, list(o.outputs[0].token_ids)] for o in outs]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("eager", [True, False], ids=["enforce_eager", "compiled"])
def test_offline_generate_matches_hf(model_dir, hf, eager):
    import json

    script = OFFLINE.format(chunk=CHUNK, n=MAX_NEW, eager=eager)
    env = {**vllm_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "-c", script, model_dir, json.dumps(PROMPTS)],
                          capture_output=True, text=True, env=env, timeout=SERVER_START_S)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, proc.stderr[-3000:]
    for prompt_ids, ids in json.loads(line[0][len("RESULT"):]):
        assert ids == hf_greedy(hf, prompt_ids)


WARM = """
import json, sys
import jax.monitoring
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, dtype="float32",
          block_size=16)
lowered = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: lowered.append(event) if event.endswith("jaxpr_to_mlir_module_duration") else None)
result, params = {}, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
for n in json.loads(sys.argv[2]):
    before = len(lowered)
    outs = llm.generate([{"prompt_token_ids": [7 + i]} for i in range(n)], params)
    result[n] = [len(lowered) - before, [list(o.outputs[0].token_ids) for o in outs]]
print("RESULT" + json.dumps(result))
"""


def test_request_counts_are_compiled_at_start_up(model_dir, hf):
    """Steps of a request count the server has not served yet build no program: the worker's
    warm-up ran whole steps of 1 to 16 requests (vLLM's input preparation follows the count; a new
    one traced about 22 programs mid-serving), and left nothing behind (greedy = HF)."""
    import json

    counts = [1, 3, 6, 2, 8, 5]
    env = {**vllm_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "-c", WARM, model_dir, json.dumps(counts)],
                          capture_output=True, text=True, env=env, timeout=SERVER_START_S)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, proc.stderr[-3000:]
    result = json.loads(line[0][len("RESULT"):])
    assert {n: lowered for n, (lowered, _) in result.items()} == {str(n): 0 for n in counts}
    for n, (_, tokens) in result.items():
        for i, ids in enumerate(tokens):
            assert ids == hf_greedy(hf, [7 + i], 3)


INT8 = """
import json, sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], max_model_len=256, max_num_seqs=4, dtype="float32", block_size=16,
          quantization="tpu_int8")
dtypes = llm.apply_model(lambda model: sorted({{str(p.dtype) for n, p in model.named_parameters()
                                              if n.endswith("proj.weight")}}))
outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens={n}))
print("RESULT" + json.dumps([dtypes, [[o.prompt_token_ids, list(o.outputs[0].token_ids)] for o in outs]]))
"""


def test_offline_int8_weight_only_matches_dequantized_hf(model_dir, hf_int8):
    """--quantization tpu_int8 (compiled forward): the linear weights are int8, and the tokens
    are those of the float model whose weights are the int8 ones dequantized."""
    import json

    env = {**vllm_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "-c", INT8.format(n=MAX_NEW), model_dir, json.dumps(PROMPTS[:2])],
                          capture_output=True, text=True, env=env, timeout=SERVER_START_S)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, proc.stderr[-3000:]
    dtypes, results = json.loads(line[0][len("RESULT"):])
    assert dtypes == [["torch.int8"]]
    for prompt_ids, ids in results:
        assert ids == hf_greedy(hf_int8, prompt_ids)


def test_server_tensor_parallel_2_matches_hf(model_dir, hf, tmp_path):
    """``--tensor-parallel-size 2`` with the compiled forward: two worker processes, each half of
    every layer on its own device; the all-reduces and the logits' gather are traced by vLLM's
    full-graph compile and run inside the pieces' XLA programs. Concurrent greedy requests
    equal Hugging Face's."""
    log = tmp_path / "server-tp2.log"
    with running_server(model_dir, log, "--tensor-parallel-size", "2") as client:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(lambda p: complete_ids(client, p), PROMPTS))
    for prompt_ids, ids, _ in results:
        assert ids == hf_greedy(hf, prompt_ids)
    text = log.read_text()
    assert "Worker_TP1" in text and "Compiling a graph for compile range" in text
