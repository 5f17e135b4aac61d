"""Hugging Face Transformers + Accelerate on ``tpu``: loading, generation, pipelines, Trainer.

Every model is a tiny random Llama built from a config and saved as safetensors into a temporary
folder; the tokenizer is trained here on the corpus shipped with torchtpu. Nothing is downloaded.
Outputs are compared with the same checkpoint run by PyTorch on CPU.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from packaging.version import Version

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed (pip install 'torchtpu[hf]')")
accelerate = pytest.importorskip("accelerate", reason="the hf extra is not installed (pip install 'torchtpu[hf]')")
pytest.importorskip("tokenizers", reason="the hf extra is not installed (pip install 'torchtpu[hf]')")

# Accelerate 1.16 finds the device through torch.accelerator (get_torch_accelerator_backend) and
# special-cases "tpu": get_max_memory reads its free memory and PartialState.default_device is
# tpu, so device_map="auto" alone and Trainer without ACCELERATE_TORCH_DEVICE work. 1.15 lists
# CUDA, NPU, MLU, SDAA, MUSA, XPU, HPU (and MPS, Neuron) only; its users need the workarounds
# (max_memory={0: ...}, ACCELERATE_TORCH_DEVICE=tpu), which 1.16 still honours. The hf extra allows
# both; each test below asserts what the installed release does. (.release: 1.16.0.dev0 counts.)
ACCELERATE_KNOWS_TPU = Version(accelerate.__version__).release[:2] >= (1, 16)

SPECIALS = ["<unk>", "<pad>", "<s>", "</s>"]
PROMPTS = ["the clockmaker kept a narrow shop", "the moon went on rising and"]


def corpus_path() -> str:
    return str(importlib.resources.files("torchtpu") / "data" / "tiny_corpus.txt")


def build_tokenizer():
    """A word-level tokenizer trained on torchtpu's tiny corpus (its 1024 commonest words)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([corpus_path()], trainers.WordLevelTrainer(vocab_size=1024, special_tokens=SPECIALS))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def tiny_config(tokenizer, **overrides):
    sizes = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    sizes.update(overrides)
    return transformers.LlamaConfig(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                                    eos_token_id=tokenizer.eos_token_id, **sizes)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer):
    """A random tiny Llama saved with save_pretrained (safetensors) and its tokenizer."""
    path = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny_config(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    assert (path / "model.safetensors").exists()
    return path


@pytest.fixture(scope="module")
def cpu_model(checkpoint):
    return transformers.LlamaForCausalLM.from_pretrained(checkpoint).eval()


@pytest.fixture(scope="module")
def tpu_model(checkpoint):
    return transformers.LlamaForCausalLM.from_pretrained(checkpoint, device_map="tpu").eval()


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    ids = tokenizer(PROMPTS, return_tensors="pt")["input_ids"]
    assert ids.shape == (2, 6) and (ids != tokenizer.unk_token_id).all()
    return ids


def devices_of(model) -> set[str]:
    return {str(p.device) for p in model.parameters()}


def assert_logits_match(model, cpu_model, ids):
    with torch.no_grad():
        got = model(ids.to("tpu")).logits.cpu()
        want = cpu_model(ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- loading


def test_from_pretrained_device_map_tpu(tpu_model, cpu_model, prompt_ids):
    assert devices_of(tpu_model) == {"tpu:0"}
    assert_logits_match(tpu_model, cpu_model, prompt_ids)


def test_device_map_auto_with_a_tpu_budget(checkpoint, cpu_model, prompt_ids):
    """'auto' fills ``tpu:0`` once max_memory names it: integer keys are accelerator indices,
    and ``torch.device(0)`` is ``tpu:0`` when tpu is the accelerator."""
    free, _ = torch.tpu.mem_get_info(0)
    model = transformers.LlamaForCausalLM.from_pretrained(checkpoint, device_map="auto", max_memory={0: free})
    assert devices_of(model) == {"tpu:0"}
    assert_logits_match(model, cpu_model, prompt_ids)


def test_device_map_auto_alone(checkpoint, cpu_model, prompt_ids):
    """'auto' with no max_memory: Accelerate >= 1.16 budgets tpu:0 by its free memory and places
    every module there; 1.15 sees no tpu memory and places every module on CPU (the workaround,
    max_memory={0: ...}, is test_device_map_auto_with_a_tpu_budget, run on both)."""
    from accelerate.utils import get_max_memory

    budget = get_max_memory()
    model = transformers.LlamaForCausalLM.from_pretrained(checkpoint, device_map="auto")
    if ACCELERATE_KNOWS_TPU:
        free, total = torch.tpu.mem_get_info(0)
        assert set(budget) == {0, "cpu"}  # one index: the process's tpu
        assert abs(budget[0] - free) <= 0.01 * total  # read from the device, not a guess
        assert devices_of(model) == {"tpu:0"}
        assert_logits_match(model, cpu_model, prompt_ids)
    else:
        assert set(budget) == {"cpu"}
        assert devices_of(model) == {"cpu"}


RSS_CHILD = textwrap.dedent("""
    import json, os, resource, sys
    import torch, transformers
    def rss(field):  # bytes, from /proc/self/status
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    path, warm = sys.argv[1], sys.argv[2]
    transformers.LlamaForCausalLM.from_pretrained(warm, device_map="tpu")  # imports and programs, once
    torch.tpu.synchronize()
    open("/proc/self/clear_refs", "w").write("5")  # resets the peak (VmHWM) to the current RSS
    base, device_before = rss("VmRSS"), torch.tpu.memory_allocated()
    model = transformers.LlamaForCausalLM.from_pretrained(path, device_map="tpu")
    torch.tpu.synchronize()
    print(json.dumps({"base": base, "peak": rss("VmHWM"),
                      "device": torch.tpu.memory_allocated() - device_before,
                      "on_tpu": all(p.device.type == "tpu" for p in model.parameters())}))
""")


@pytest.mark.slow
def test_load_peak_host_memory(tmp_path, tokenizer, checkpoint):
    """Peak RSS while loading a 67 MB checkpoint to tpu stays within 1.3x its size on top of the
    device's own buffers (on XLA:CPU those live in host memory too, so they are allowed for)."""
    path = tmp_path / "big"
    torch.manual_seed(0)
    config = tiny_config(tokenizer, vocab_size=32000, hidden_size=256, intermediate_size=512,
                         tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    size = (path / "model.safetensors").stat().st_size
    assert size > 50 * 2**20
    env = dict(os.environ, TORCHTPU_PLATFORM="cpu")
    out = subprocess.run([sys.executable, "-c", RSS_CHILD, str(path), str(checkpoint)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["on_tpu"]
    assert got["device"] >= 0.95 * size  # the parameters really went to the device
    host = got["peak"] - got["base"] - got["device"]
    assert host <= 1.3 * size, f"peak host memory {host / size:.2f}x the checkpoint"


# ---------------------------------------------------------------- generate

GEN = dict(max_new_tokens=6, pad_token_id=1)


def test_generate_greedy_matches_cpu(tpu_model, cpu_model, prompt_ids):
    got = tpu_model.generate(prompt_ids.to("tpu"), do_sample=False, **GEN)
    assert got.device.type == "tpu"
    assert torch.equal(got.cpu(), cpu_model.generate(prompt_ids, do_sample=False, **GEN))


def test_generate_sampling_is_seeded(tpu_model, cpu_model, prompt_ids):
    """Sampling draws from the tpu generator: the same seed (or a restored generator state) gives
    the same tokens. Its stream differs from CPU's, so only top_k=1 is compared with CPU."""
    ids = prompt_ids.to("tpu")

    def sample(seed=None, **kw):
        if seed is not None:
            torch.manual_seed(seed)
        return tpu_model.generate(ids, do_sample=True, **GEN, **kw).cpu()

    first = sample(7)
    assert torch.equal(sample(7), first)
    assert not torch.equal(sample(8), first)
    state = torch.tpu.get_rng_state()
    again = sample()
    torch.tpu.set_rng_state(state)
    assert torch.equal(sample(), again)
    assert torch.equal(sample(7, top_k=1), cpu_model.generate(prompt_ids, do_sample=False, **GEN))


@pytest.mark.slow
def test_generate_beam_search_matches_cpu(tpu_model, cpu_model, prompt_ids):
    kw = dict(num_beams=2, do_sample=False, **GEN)
    got = tpu_model.generate(prompt_ids.to("tpu"), **kw)
    assert torch.equal(got.cpu(), cpu_model.generate(prompt_ids, **kw))


@pytest.mark.slow
def test_generate_static_cache_compiled_matches_cpu(checkpoint, cpu_model, prompt_ids):
    """A static cache makes transformers compile the decode step, through the "tpu" backend."""
    model = transformers.LlamaForCausalLM.from_pretrained(checkpoint, device_map="tpu").eval()
    got = model.generate(prompt_ids.to("tpu"), do_sample=False, cache_implementation="static", **GEN)
    assert model._last_compile_config.backend == "tpu"  # the decode step ran compiled
    assert torch.equal(got.cpu(), cpu_model.generate(prompt_ids, do_sample=False, **GEN))


def test_pipeline_text_generation(tpu_model, cpu_model, tokenizer):
    kw = dict(max_new_tokens=6, do_sample=False, batch_size=2)  # the shapes the other tests compiled
    tpu_pipe = transformers.pipeline("text-generation", model=tpu_model, tokenizer=tokenizer, device="tpu")
    assert tpu_pipe.device.type == "tpu"
    cpu_pipe = transformers.pipeline("text-generation", model=cpu_model, tokenizer=tokenizer, device="cpu")
    got = [out[0]["generated_text"] for out in tpu_pipe(PROMPTS, **kw)]
    assert got == [out[0]["generated_text"] for out in cpu_pipe(PROMPTS, **kw)]
    assert all(len(text.split()) > len(prompt.split()) for text, prompt in zip(got, PROMPTS))


# ---------------------------------------------------------------- Trainer


class CorpusChunks(torch.utils.data.Dataset):
    """Fixed-length chunks of the tokenized corpus, labels = inputs (causal LM)."""

    def __init__(self, tokenizer, length=16, count=32):
        ids = tokenizer(open(corpus_path()).read())["input_ids"]
        self.chunks = [torch.tensor(ids[i * length:(i + 1) * length]) for i in range(count)]

    def __len__(self):
        return len(self.chunks)

    def __getitem__(self, i):
        return {"input_ids": self.chunks[i], "labels": self.chunks[i]}


def run_trainer(checkpoint, tokenizer, tmp_path, steps=4, **args):
    """``steps`` Trainer steps from the saved checkpoint; returns (trainer, losses)."""
    model = transformers.LlamaForCausalLM.from_pretrained(checkpoint)
    args = transformers.TrainingArguments(
        str(tmp_path), per_device_train_batch_size=4, max_steps=steps, learning_rate=1e-2, logging_steps=1,
        report_to=[], save_strategy="no", seed=0, data_seed=0, dataloader_num_workers=0, **args)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=CorpusChunks(tokenizer))
    threads = torch.get_num_threads()
    if args.use_cpu:  # one thread: for a model this small more only contend (13 s vs 0.6 s for 24
        torch.set_num_threads(1)  # steps on 2 busy cores)
    try:
        trainer.train()
    finally:
        torch.set_num_threads(threads)
    return trainer, [log["loss"] for log in trainer.state.log_history if "loss" in log]


def train(checkpoint, tokenizer, tmp_path, **args):
    """Four Trainer steps from the saved checkpoint; returns (model, losses)."""
    trainer, losses = run_trainer(checkpoint, tokenizer, tmp_path, **args)
    return trainer.model, losses


LONG_STEPS = 24  # three epochs of CorpusChunks at batch 4


@pytest.fixture(scope="module")
def cpu_losses(checkpoint, tokenizer, tmp_path_factory):
    model, losses = train(checkpoint, tokenizer, tmp_path_factory.mktemp("cpu_run"), use_cpu=True)
    assert devices_of(model) == {"cpu"}
    return losses


@pytest.fixture
def accelerate_on_tpu(monkeypatch):
    """What a user of the installed Accelerate does for Trainer on tpu: nothing on >= 1.16,
    ACCELERATE_TORCH_DEVICE=tpu on 1.15."""
    if ACCELERATE_KNOWS_TPU:
        monkeypatch.delenv("ACCELERATE_TORCH_DEVICE", raising=False)
    else:
        monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "tpu")


def test_trainer_on_tpu_matches_cpu(checkpoint, tokenizer, tmp_path, cpu_losses, monkeypatch):
    """With ACCELERATE_TORCH_DEVICE=tpu (Accelerate's setting for a device it does not know; the
    workaround on 1.15, still honoured by 1.16), Trainer trains on tpu, and its losses follow the
    CPU run's."""
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "tpu")
    model, losses = train(checkpoint, tokenizer, tmp_path)
    assert devices_of(model) == {"tpu:0"}
    assert len(losses) == 4 and losses[-1] < losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(cpu_losses), atol=2e-3, rtol=2e-3)


def test_trainer_on_tpu_without_setting(checkpoint, tokenizer, tmp_path, monkeypatch):
    """No ACCELERATE_TORCH_DEVICE. Accelerate >= 1.16: Trainer's Accelerator picks tpu, and
    LONG_STEPS (24) steps train the model on tpu:0 as on CPU (losses, and the trained weights). 1.15:
    its default device is cpu, so the Accelerator moves the model back to cpu while
    TrainingArguments sends the batches to tpu:0, and the first step fails."""
    monkeypatch.delenv("ACCELERATE_TORCH_DEVICE", raising=False)
    if not ACCELERATE_KNOWS_TPU:
        with pytest.raises(RuntimeError, match="tpu:0 and cpu|cpu and tpu:0"):
            train(checkpoint, tokenizer, tmp_path)
        return
    trainer, losses = run_trainer(checkpoint, tokenizer, tmp_path / "tpu", steps=LONG_STEPS)
    model = trainer.model
    assert trainer.accelerator.device.type == "tpu"
    assert devices_of(model) == {"tpu:0"}
    # the optimizer steps the model's own tpu parameters, not copies left behind on cpu
    stepped = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert stepped == {id(p) for p in model.parameters()}
    assert len(losses) == LONG_STEPS
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 1.0  # measured: 6.87 -> 4.75
    cpu_model, cpu_losses = train(checkpoint, tokenizer, tmp_path / "cpu", steps=LONG_STEPS, use_cpu=True)
    assert devices_of(cpu_model) == {"cpu"}
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(cpu_losses), atol=5e-3, rtol=2e-3)
    initial = transformers.LlamaForCausalLM.from_pretrained(checkpoint).state_dict()
    trained, want = model.state_dict(), cpu_model.state_dict()
    assert max((trained[k].cpu() - initial[k]).abs().max() for k in initial) > 0.05  # it moved
    for name in want:  # measured: within 2e-5
        torch.testing.assert_close(trained[name].cpu(), want[name], atol=1e-3, rtol=1e-3, msg=name)


@pytest.mark.slow
def test_trainer_bf16_autocast(checkpoint, tokenizer, tmp_path, cpu_losses, accelerate_on_tpu):
    """bf16=True trains under torch.autocast("tpu", bfloat16): losses near the fp32 CPU run's."""
    model, losses = train(checkpoint, tokenizer, tmp_path, bf16=True)
    assert devices_of(model) == {"tpu:0"}
    assert losses[-1] < losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(cpu_losses), atol=5e-2, rtol=2e-2)
