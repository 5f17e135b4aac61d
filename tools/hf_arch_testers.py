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
EOS = 1  # seq2seq inputs end with it: T5's sequence classifier pools the hidden state at the eos token
TEXT_SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)


@dataclass(frozen=True)
class ArchSpec:
    """What differs between architectures: config class, its tiny sizes, model classes, inputs."""

    config: str
    models: tuple[str, ...]
    config_kwargs: dict = field(default_factory=dict)
    inputs: str = "text"  # "text" (input_ids), "seq2seq" (and decoder_input_ids), "image" (pixel_values)
    flags: dict = field(default_factory=dict)  # ModelTesterMixin switches the per-model test class sets
    # Common tests the per-model test class replaces with its own, and why; not run here.
    overridden: dict = field(default_factory=dict)


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
        flags=dict(test_resize_embeddings=False),  # no token embeddings to resize
        overridden={"test_model_get_set_embeddings": "ViT's input embeddings are a patch Conv2d, not nn.Embedding"},
    ),
    "t5": ArchSpec(
        "T5Config",
        ("T5Model", "T5ForConditionalGeneration", "T5ForSequenceClassification", "T5ForQuestionAnswering"),
        dict(d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, eos_token_id=EOS, decoder_start_token_id=0),
        inputs="seq2seq",
        flags=dict(is_encoder_decoder=True),
    ),
    "gemma": ArchSpec(
        "GemmaConfig",
        ("GemmaModel", "GemmaForCausalLM", "GemmaForSequenceClassification", "GemmaForTokenClassification"),
        dict(TEXT_SIZES, num_key_value_heads=2, head_dim=8, max_position_embeddings=64),
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
        self.encoder_seq_length = self.decoder_seq_length = self.seq_length
        # Masked-image inputs (bool_masked_pos): half the patches masked, as transformers' ViT tester does.
        self.num_masks, self.mask_length = patches // 2, patches

    def get_config(self):
        config_class = getattr(transformers, self.spec.config)
        # pad id 0, inside any resized vocabulary (test_load_with_mismatched_shapes shrinks it)
        extra = {} if self.spec.inputs == "image" else dict(vocab_size=VOCAB, pad_token_id=0)
        return config_class(**self.spec.config_kwargs, **extra)

    def prepare_config_and_inputs_for_common(self):
        config, gen = self.get_config(), torch.Generator().manual_seed(0)
        if self.spec.inputs == "image":
            pixels = torch.randn(BATCH, config.num_channels, config.image_size, config.image_size, generator=gen)
            return config, {"pixel_values": pixels.to(torch_device)}
        inputs = self._text_inputs(gen)
        if self.spec.inputs == "seq2seq":
            inputs["input_ids"][:, -1] = EOS
            decoder = self._text_inputs(gen)
            inputs.update(decoder_input_ids=decoder["input_ids"], decoder_attention_mask=decoder["attention_mask"])
        return config, {name: t.to(torch_device) for name, t in inputs.items()}

    @staticmethod
    def _text_inputs(gen: torch.Generator) -> dict:
        ids = torch.randint(EOS + 1, VOCAB, (BATCH, SEQ), generator=gen)  # never the pad or eos id
        mask = torch.randint(0, 2, (BATCH, SEQ), generator=gen)
        mask[:, -1] = 1  # every row attends to at least its last token, as transformers' testers do
        return {"input_ids": ids, "attention_mask": mask}


def make_test_case(arch: str, mixin: type) -> type:
    """A ``unittest.TestCase`` running ``mixin``'s tests (transformers' ModelTesterMixin) for ``arch``."""
    spec = SPECS[arch]

    def setUp(self):
        self.model_tester = ArchTester(self, spec)

    attrs = {"all_model_classes": tuple(getattr(transformers, name) for name in spec.models), "setUp": setUp,
             **spec.flags}
    return type(f"{arch.capitalize()}CommonModelTest", (mixin, unittest.TestCase), attrs)
