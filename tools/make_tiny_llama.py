"""Build a tiny random-init Llama checkpoint with a locally trained tokenizer; nothing is downloaded.

    python tools/make_tiny_llama.py ./tiny-llama [--vocab 512] [--seed 0]

The directory it writes is an ordinary Hugging Face model directory (config, safetensors
weights, `tokenizer.json` with a chat template), so serving stacks (SGLang, vLLM) and
`transformers.AutoModelForCausalLM` load it as they would a downloaded model. The tokenizer
is a byte-level BPE trained on the corpus shipped with torchtpu (`torchtpu/data/tiny_corpus.txt`);
the weights are random, so outputs are deterministic nonsense: good for checking that a
serving stack reproduces Hugging Face's greedy tokens, useless as a language model.
Needs `transformers` and `tokenizers` (the `hf` or `sglang` extra).
"""

from __future__ import annotations

import argparse
from pathlib import Path

CORPUS = Path(__file__).resolve().parents[1] / "src" / "torchtpu" / "data" / "tiny_corpus.txt"
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"]
# One turn per message, then the assistant header when a reply is wanted (the usual HF shape).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eos|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on the shipped corpus, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte stays encodable
    )
    tok.train([str(CORPUS)], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        chat_template=CHAT_TEMPLATE,
    )


def build_model(tokenizer, seed: int, hidden: int = 64, layers: int = 2, max_positions: int = 512):
    """A Llama with random weights (seeded), sized to the tokenizer; 2 layers of width 64 by default."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention, as in the Llamas people serve
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    # A wider init than the default 0.02 so greedy decoding does not collapse to one token.
    config.initializer_range = 0.2
    return LlamaForCausalLM(config).eval()


def make_tiny_llama(out_dir: str | Path, vocab_size: int = 512, seed: int = 0, *, hidden: int = 64,
                    layers: int = 2, max_positions: int = 512) -> Path:
    """Write the tiny model and its tokenizer to `out_dir`; return the directory."""
    out = Path(out_dir)
    tokenizer = train_tokenizer(vocab_size)
    model = build_model(tokenizer, seed, hidden, layers, max_positions)
    model.generation_config.do_sample = False
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=64, help="model width (the MLP is twice as wide)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--max-positions", type=int, default=512, help="the longest context the model takes")
    args = parser.parse_args()
    print(make_tiny_llama(args.out_dir, args.vocab, args.seed, hidden=args.hidden, layers=args.layers,
                          max_positions=args.max_positions))


if __name__ == "__main__":
    main()
