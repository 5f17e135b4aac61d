"""Small model testers that let transformers' own ``ModelTesterMixin`` run an architecture.

A transformers source checkout has a tester per model (``tests/models/<arch>``); its sdist ships
only the shared mixins. ``tools/hf_model_tests.py`` uses the testers here for an architecture whose
per-model file is absent: they build a tiny config and random inputs on the test device
(``TRANSFORMERS_TEST_DEVICE``), the same contract the per-model testers fulfil, and everything
else (the 120-odd common tests) is transformers' own code.
"""

from __future__ import annotations

import unittest
from dataclasses import dataclass, field

import torch
import transformers
from transformers.testing_utils import torch_device

BATCH, SEQ, VOCAB = 3, 7, 99
TEXT_SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)


@dataclass(frozen=True)
class ArchSpec:
    """What differs between architectures: config class, its tiny sizes, model classes, inputs."""

    config: str
    models: tuple[str, ...]
    config_kwargs: dict = field(default_factory=dict)
    inputs: str = "text"  # "text" (input_ids) or "image" (pixel_values)


SPECS: dict[str, ArchSpec] = {
    "gpt2": ArchSpec(
        "GPT2Config",
        ("GPT2Model", "GPT2LMHeadModel", "GPT2ForSequenceClassification", "GPT2ForTokenClassification",
         "GPT2ForQuestionAnswering"),
        dict(n_embd=32, n_layer=2, n_head=4, n_inner=37, n_positions=64),
    ),
    "llama": ArchSpec(
        "LlamaConfig",
        ("LlamaModel", "LlamaForCausalLM", "LlamaForSequenceClassification", "LlamaForTokenClassification",
         "LlamaForQuestionAnswering"),
        dict(TEXT_SIZES, num_key_value_heads=2, max_position_embeddings=64),
    ),
    "qwen3": ArchSpec(
        "Qwen3Config",
        ("Qwen3Model", "Qwen3ForCausalLM", "Qwen3ForSequenceClassification", "Qwen3ForTokenClassification",
         "Qwen3ForQuestionAnswering"),
        dict(TEXT_SIZES, num_key_value_heads=2, head_dim=8, max_position_embeddings=64),
    ),
    "bert": ArchSpec(
        "BertConfig",
        ("BertModel", "BertForMaskedLM", "BertForSequenceClassification", "BertForTokenClassification",
         "BertForQuestionAnswering"),
        dict(TEXT_SIZES, max_position_embeddings=64),
    ),
    "vit": ArchSpec(
        "ViTConfig",
        ("ViTModel", "ViTForImageClassification"),
        dict(TEXT_SIZES, image_size=16, patch_size=4, num_channels=3),
        inputs="image",
    ),
}


class ArchTester:
    """The attributes and two methods ``ModelTesterMixin`` reads from ``self.model_tester``."""

    def __init__(self, parent: unittest.TestCase, spec: ArchSpec):
        self.parent, self.spec = parent, spec
        self.batch_size, self.is_training, self.vocab_size = BATCH, True, VOCAB
        config = self.get_config()
        self.hidden_size = config.hidden_size
        self.num_hidden_layers = config.num_hidden_layers
        self.num_attention_heads = config.num_attention_heads
        # ViT sees one token per patch plus the [CLS] token.
        patches = (config.image_size // config.patch_size) ** 2 if spec.inputs == "image" else 0
        self.seq_length = patches + 1 if spec.inputs == "image" else SEQ

    def get_config(self):
        config_class = getattr(transformers, self.spec.config)
        extra = {} if self.spec.inputs == "image" else dict(vocab_size=VOCAB, pad_token_id=VOCAB - 1)
        return config_class(**self.spec.config_kwargs, **extra)

    def prepare_config_and_inputs_for_common(self):
        config, gen = self.get_config(), torch.Generator().manual_seed(0)
        if self.spec.inputs == "image":
            pixels = torch.randn(BATCH, config.num_channels, config.image_size, config.image_size, generator=gen)
            return config, {"pixel_values": pixels.to(torch_device)}
        ids = torch.randint(0, VOCAB - 1, (BATCH, SEQ), generator=gen)  # never the pad id
        mask = torch.randint(0, 2, (BATCH, SEQ), generator=gen)
        mask[:, -1] = 1  # every row attends to at least its last token, as transformers' testers do
        return config, {"input_ids": ids.to(torch_device), "attention_mask": mask.to(torch_device)}


def make_test_case(arch: str, mixin: type) -> type:
    """A ``unittest.TestCase`` running ``mixin``'s tests (transformers' ModelTesterMixin) for ``arch``."""
    spec = SPECS[arch]

    def setUp(self):
        self.model_tester = ArchTester(self, spec)

    attrs = {"all_model_classes": tuple(getattr(transformers, name) for name in spec.models), "setUp": setUp}
    return type(f"{arch.capitalize()}CommonModelTest", (mixin, unittest.TestCase), attrs)
