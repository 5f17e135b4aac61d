"""What the serving tests (SGLang, vLLM) share: the tiny Llama that ``tools/make_tiny_llama.py``
builds, its Hugging Face reference on CPU, and a free port. Import the fixtures into a test module
(``from serving_fixtures import hf, model_dir``) after its ``importorskip`` lines."""

from __future__ import annotations

import importlib.util
import socket
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
MAX_NEW = 12  # tokens each greedy comparison generates


def make_tiny_llama(directory):
    """``tools/make_tiny_llama.py``'s builder (a script, not a module of the package)."""
    spec = importlib.util.spec_from_file_location("make_tiny_llama", REPO / "tools" / "make_tiny_llama.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_tiny_llama(directory)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def hf(model_dir):
    """The checkpoint in Hugging Face on CPU, float32: the reference."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return tokenizer, model


def hf_greedy(hf, prompt_ids: list[int], n: int = MAX_NEW, **generate_kwargs) -> list[int]:
    """The ``n`` tokens Hugging Face's greedy ``generate`` adds to ``prompt_ids``."""
    _, model = hf
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, **generate_kwargs)
    return out[0, len(prompt_ids):].tolist()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def hf_int8(model_dir):
    """The reference for ``--quantization tpu_int8``: the checkpoint in Hugging Face on CPU with
    every decoder linear layer's weight replaced by its int8 rows, dequantized (the engines'
    embeddings and LM head stay float)."""
    import transformers

    from torchtpu.integrations.int8 import dequantize_rows, quantize_rows

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for module in model.model.layers.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.data = dequantize_rows(*quantize_rows(module.weight.data))
    return tokenizer, model
