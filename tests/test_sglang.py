"""SGLang serving on ``tpu``: the platform plugin, the paged attention backend, ``sglang.Engine``
and the OpenAI-compatible server queried with the ``openai`` client.

Needs the sglang extra (``tools/sglang_env.sh`` builds a venv with it); skipped without it.
The model is a tiny random Llama built by ``tools/make_tiny_llama.py``; every greedy output is
compared with Hugging Face ``generate`` on CPU. The server runs in a subprocess on a free port,
in its own process group, killed at the end whatever happens. Decode runs through the tpu
graph runner (compiled; where CUDA would replay CUDA graphs) in the engine, with mixed batches,
and in the servers, with SGLang's defaults; the server takes the load (64 concurrent requests)
and bad-input checks, and a second one serves with ``--tp 2``. Most of the time is the engines'
and the servers' start and first compiles.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

os.environ.setdefault("SGLANG_PLATFORM", "tpu")  # before sglang resolves its platform
REASON = "the sglang extra is not installed (tools/sglang_env.sh, or pip install 'torchtpu[sglang]')"
sgl = pytest.importorskip("sglang", reason=REASON)
openai = pytest.importorskip("openai", reason=REASON)
transformers = pytest.importorskip("transformers", reason=REASON)

from torchtpu.integrations.sglang import check_sglang_version  # noqa: E402

from serving_fixtures import MAX_NEW, free_port, hf, hf_greedy, hf_int8, model_dir  # noqa: E402,F401,F811 (fixtures)

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [
    "The clockmaker said",
    "In the village of Lower Fenwick there lived",
    # longer than the engine's chunked-prefill size below: prefilled in chunks
    "Aldous was not a young man. His hands had grown slow, but they had not grown careless. "
    "He said that a clock was a patient thing, and that a",
]
CHUNK = 32
SERVER_START_S = 300


# ---------------------------------------------------------------- the pieces, without a server

def test_host_free_list_allocates_like_sglangs_allocator():
    """The host free list hands out the same slots as SGLang's device one, on the device, and
    compiles nothing while doing it."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    from torchtpu import metrics
    from torchtpu.integrations.sglang.allocator import HostTokenAllocator, host_free_list

    def make(device):
        return TokenToKVPoolAllocator(64, torch.float32, device, kvcache=None, need_sort=False)

    ref, runner = make("cpu"), SimpleNamespace(token_to_kv_pool_allocator=make("tpu"))
    host_free_list(runner)
    ours = runner.token_to_kv_pool_allocator
    assert isinstance(ours, HostTokenAllocator) and ours.free_pages.device.type == "cpu"
    def programs_built():
        built = metrics.snapshot()["eager_compiles"]
        return built["compilations"] + built["persistent_hits"]

    before = programs_built()
    for n, freed in [(5, slice(1, 4)), (9, slice(0, 9)), (3, None), (40, slice(10, 30))]:
        a, b = ref.alloc(n), ours.alloc(n)
        assert b.device.type == "tpu" and b.cpu().tolist() == a.tolist()
        if freed is not None:
            ref.free(a[freed])
            ours.free(torch.tensor(a[freed].tolist(), device="tpu"))  # a device tensor, as SGLang frees
    ref.free_group_begin(), ours.free_group_begin()
    ref.free(torch.tensor([60, 61])), ours.free(torch.tensor([60, 61], device="tpu"))
    ref.free_group_end(), ours.free_group_end()
    assert ours.available_size() == ref.available_size()
    assert ours.alloc(ref.available_size() + 1) is None
    assert ours.alloc(ref.available_size()).cpu().tolist() == ref.alloc(ref.available_size()).tolist()
    assert programs_built() == before


def test_version_outside_tested_range_is_refused():
    assert check_sglang_version() == sgl.__version__
    with pytest.raises(RuntimeError, match=r"supports sglang>=0.5.23,<0.5.24, but sglang 0.6.0 is installed"):
        check_sglang_version("0.6.0")


def test_platform_is_tpu_with_real_memory_figures():
    from sglang.srt.platforms import current_platform

    from torchtpu.integrations.sglang.platform import TpuSRTPlatform

    assert isinstance(current_platform, TpuSRTPlatform)
    assert current_platform.get_default_attention_backend() == "tpu"
    free, total = current_platform.get_available_memory()
    assert 0 < free <= total == torch.tpu.mem_get_info()[1]


@pytest.mark.parametrize("option, message", [
    # SGLang honours `seed` only with --enable-deterministic-inference, whose kernels are Triton.
    ({"enable_deterministic_inference": True}, r"--enable-deterministic-inference .*`seed`.* Triton"),
    ({"pp_size": 2}, r"--pp and --dp above 1 .* not supported on tpu yet"),
])
def test_unsupported_server_options_are_refused_with_the_reason(model_dir, option, message):
    from sglang.srt.platforms import current_platform
    from sglang.srt.server_args import ServerArgs

    with pytest.raises(NotImplementedError, match=message):
        current_platform.apply_server_args_defaults(ServerArgs(model_path=model_dir, **option))


# ---------------------------------------------------------------- sglang.Engine

@pytest.fixture(scope="module")
def engine(model_dir):
    """The offline engine with decode compiled and mixed batches:
    the long prompt's second chunk is prefilled in one batch with the others' decode steps."""
    llm = sgl.Engine(model_path=model_dir, dtype="float32", max_total_tokens=4096, chunked_prefill_size=CHUNK,
                     log_level="error", enable_torch_compile=True, enable_mixed_chunk=True)
    try:
        yield llm
    finally:
        llm.shutdown()


def test_engine_greedy_matches_hf(engine, hf):
    tokenizer, _ = hf
    outs = engine.generate(PROMPTS, {"temperature": 0, "max_new_tokens": MAX_NEW})
    assert len(tokenizer(PROMPTS[-1]).input_ids) > CHUNK
    for prompt, out in zip(PROMPTS, outs):
        assert out["output_ids"] == hf_greedy(hf, tokenizer(prompt).input_ids), prompt


def test_engine_prefix_cache_reuse(engine, hf):
    """A second request sharing a long prefix reads it from the radix cache and still matches HF."""
    tokenizer, _ = hf
    prompt = PROMPTS[-1] + " clock that ran"
    out = engine.generate(prompt, {"temperature": 0, "max_new_tokens": MAX_NEW})
    assert out["meta_info"]["cached_tokens"] >= CHUNK
    assert out["output_ids"] == hf_greedy(hf, tokenizer(prompt).input_ids)


def test_engine_int8_weight_only_matches_dequantized_hf(model_dir, hf_int8):
    """--quantization tpu_int8: the linear weights are int8 in the engine, and the tokens are
    those of the float model whose weights are the int8 ones dequantized."""
    tokenizer, _ = hf_int8
    llm = sgl.Engine(model_path=model_dir, dtype="float32", max_total_tokens=2048, log_level="error",
                     quantization="tpu_int8")
    try:
        weights = llm.get_weights_by_name("model.layers.0.mlp.down_proj.weight", truncate_size=64)
        outs = llm.generate(PROMPTS[:2], {"temperature": 0, "max_new_tokens": MAX_NEW})
    finally:
        llm.shutdown()
    values = torch.tensor(weights).flatten()
    assert torch.equal(values, values.round()) and values.abs().max() <= 127  # int8 rows
    for prompt, out in zip(PROMPTS, outs):
        assert out["output_ids"] == hf_greedy(hf_int8, tokenizer(prompt).input_ids), prompt


# ---------------------------------------------------------------- the OpenAI-compatible server

def wait_healthy(proc, url: str, log: Path) -> None:
    import urllib.request

    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(2)
    pytest.fail(f"the server did not start within {SERVER_START_S} s:\n{log.read_text()[-3000:]}")


@contextlib.contextmanager
def running_server(model_dir, log: Path, *options: str):
    """``sglang.launch_server`` with ``options`` on a free port; yields (openai client, log)."""
    port = free_port()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir, "--port", str(port),
           "--served-model-name", "tiny-llama", "--dtype", "float32", "--max-total-tokens", "4096", *options]
    with open(log, "w") as out:
        # its own session: the server's children (schedulers, detokenizer) go down with it
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "SGLANG_PLATFORM": "tpu"})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, log)
        yield openai.OpenAI(base_url=url + "/v1", api_key="-", timeout=300)  # 64 requests queue on a 2-core CPU server
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with running_server(model_dir, tmp_path_factory.mktemp("server") / "server.log") as client:
        yield client


def complete(client, prompt, **kw):
    return client.completions.create(model="tiny-llama", prompt=prompt, **kw)


def test_server_completions_greedy_matches_hf(server, hf):
    tokenizer, _ = hf
    prompt = PROMPTS[1]
    result = complete(server, prompt, max_tokens=MAX_NEW, temperature=0)
    want = hf_greedy(hf, tokenizer(prompt).input_ids)
    assert result.choices[0].text == tokenizer.decode(want)
    assert result.usage.completion_tokens == MAX_NEW and result.choices[0].finish_reason == "length"


def test_server_chat_completions_use_the_chat_template(server, hf):
    tokenizer, _ = hf
    messages = [{"role": "user", "content": "hi"}]
    result = server.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=MAX_NEW, temperature=0)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    want = hf_greedy(hf, list(ids))
    if tokenizer.eos_token_id in want:  # the server stops at EOS (and does not print it)
        want = want[:want.index(tokenizer.eos_token_id)]
    assert result.choices[0].message.content == tokenizer.decode(want)
    assert result.usage.prompt_tokens == len(ids)


def test_server_streaming_equals_non_streaming(server):
    prompt = PROMPTS[0]
    whole = complete(server, prompt, max_tokens=MAX_NEW, temperature=0).choices[0].text
    chunks = [c.choices[0].text for c in complete(server, prompt, max_tokens=MAX_NEW, temperature=0, stream=True)]
    assert len(chunks) > 1 and "".join(chunks) == whole


def test_server_max_tokens_and_stop_strings(server):
    prompt = PROMPTS[0]
    short = complete(server, prompt, max_tokens=3, temperature=0)
    assert short.usage.completion_tokens == 3
    whole = complete(server, prompt, max_tokens=MAX_NEW, temperature=0).choices[0].text
    stop = whole[len(whole) // 2:][:3]  # a string that greedy decoding reaches mid-way
    stopped = complete(server, prompt, max_tokens=MAX_NEW, temperature=0, stop=[stop]).choices[0]
    assert stopped.finish_reason == "stop" and stopped.matched_stop == stop
    assert stopped.text == whole[:whole.index(stop)]


def test_server_sampling_params(server):
    prompt = PROMPTS[0]
    greedy = complete(server, prompt, max_tokens=MAX_NEW, temperature=0).choices[0].text
    # top_k=1 leaves one candidate: sampling at any temperature is greedy decoding
    top1 = complete(server, prompt, max_tokens=MAX_NEW, temperature=1.5, extra_body={"top_k": 1})
    assert top1.choices[0].text == greedy
    sampled = complete(server, prompt, max_tokens=MAX_NEW, temperature=1.0, top_p=0.9, seed=7,
                       extra_body={"top_k": 50})
    assert sampled.usage.completion_tokens == MAX_NEW
    texts = {complete(server, prompt, max_tokens=MAX_NEW, temperature=2.0).choices[0].text for _ in range(3)}
    assert len(texts) > 1  # temperature is honoured: random weights give a flat distribution


# ---------------------------------------------------------------- load and bad input

WORDS = "clock river lantern baker winter orchard copper violin harbour meadow".split()
CONCURRENT = 64


def expected_text(hf, prompt: str, max_tokens: int) -> str:
    """What greedy serving returns for ``prompt``: HF's tokens on CPU, cut at EOS, special tokens
    (which random weights do generate) not printed."""
    tokenizer, _ = hf
    want = hf_greedy(hf, tokenizer(prompt).input_ids, n=max_tokens)
    if tokenizer.eos_token_id in want:
        want = want[:want.index(tokenizer.eos_token_id)]
    return tokenizer.decode(want, skip_special_tokens=True)


def test_server_64_concurrent_greedy_requests_each_match_hf(server, hf):
    """64 requests at once (mixed prompts and lengths): none dropped, each as if served alone."""
    requests = [(f"The {WORDS[i % 10]} and the {WORDS[(i * 3 + 1) % 10]} " + "said " * (i % 7), 4 + i % 13)
                for i in range(CONCURRENT)]

    def send(request):
        prompt, max_tokens = request
        return complete(server, prompt, max_tokens=max_tokens, temperature=0).choices[0].text

    with ThreadPoolExecutor(CONCURRENT) as pool:
        served = list(pool.map(send, requests))
    assert len(served) == CONCURRENT
    for (prompt, max_tokens), text in zip(requests, served):
        assert text == expected_text(hf, prompt, max_tokens), (prompt, max_tokens)


@pytest.mark.parametrize("kwargs, message", [
    ({"prompt": "word " * 700}, r"longer than the model's context length \(512 tokens\)"),
    ({"temperature": -1}, "temperature must be a non-negative"),
    ({"top_p": 2}, r"top_p must be in \(0, 1\]"),
])
def test_server_rejects_bad_input_and_keeps_serving(server, hf, kwargs, message):
    """An over-long prompt or a bad sampling parameter is SGLang's 400; the next request is served."""
    request = {"prompt": PROMPTS[0], "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError, match=message):
        server.completions.create(model="tiny-llama", **request)
    text = complete(server, PROMPTS[0], max_tokens=MAX_NEW, temperature=0).choices[0].text
    assert text == expected_text(hf, PROMPTS[0], MAX_NEW)


def test_server_cancelled_stream_keeps_serving(server, hf):
    """A client that closes a stream after two chunks leaves a server that still serves correctly."""
    stream = complete(server, PROMPTS[1], max_tokens=400, temperature=0, stream=True,
                      extra_body={"ignore_eos": True})
    chunks = []
    for chunk in stream:
        chunks.append(chunk.choices[0].text)
        if len(chunks) == 2:
            break
    stream.close()
    assert len(chunks) == 2
    text = complete(server, PROMPTS[0], max_tokens=MAX_NEW, temperature=0).choices[0].text
    assert text == expected_text(hf, PROMPTS[0], MAX_NEW)


# ---------------------------------------------------------------- tensor parallelism

def test_server_tensor_parallel_2_matches_hf(model_dir, hf, tmp_path):
    """``--tp 2``: two scheduler processes, each half of every layer's heads and MLP on its own
    device, their all-reduces through torchtpu's tpu process group (eager in prefill, inside
    the compiled decode step). Greedy outputs, sent concurrently, equal Hugging Face's."""
    tokenizer, _ = hf
    log = tmp_path / "server-tp2.log"
    with running_server(model_dir, log, "--tp", "2") as client:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(lambda p: complete(client, p, max_tokens=MAX_NEW, temperature=0), PROMPTS))
    for prompt, result in zip(PROMPTS, results):
        assert result.choices[0].text == tokenizer.decode(hf_greedy(hf, tokenizer(prompt).input_ids)), prompt
    text = log.read_text()
    assert " TP1]" in text and "tpu decode graph: new shape" in text  # rank 1 ran; decode was compiled
