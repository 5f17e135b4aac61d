"""Fine-tune a tiny Llama with Hugging Face's Trainer on ``tpu``, then generate with the compiled
static cache. Nothing is downloaded: the tokenizer is trained on the corpus shipped with torchtpu
and the model is built from a config.

    pip install 'torchtpu[hf]'
    python examples/hf_finetune.py [--steps 60] [--out /tmp/hf_finetune]
"""

from __future__ import annotations

import argparse
import importlib.resources
import os
import time

# Accelerate (1.15) has no tpu in its list of default devices; without this, Trainer's Accelerator
# moves the model back to the CPU. Set before TrainingArguments is built (docs/transformers.md).
os.environ.setdefault("ACCELERATE_TORCH_DEVICE", "tpu")

import torch  # noqa: E402  (`import torch` loads torchtpu)

try:
    import accelerate  # noqa: F401  (Trainer needs it)
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Trainer, TrainingArguments
except ImportError as error:
    raise SystemExit(f"{error}. This example needs the hf extra: pip install 'torchtpu[hf]'") from None

CORPUS = str(importlib.resources.files("torchtpu") / "data" / "tiny_corpus.txt")


def train_tokenizer() -> PreTrainedTokenizerFast:
    """A lower-cased word-level tokenizer over the corpus's 1024 commonest words."""
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([CORPUS], trainers.WordLevelTrainer(vocab_size=1024, special_tokens=["<unk>", "<pad>", "<s>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   bos_token="<s>", eos_token="</s>")


class Chunks(torch.utils.data.Dataset):
    """The tokenized corpus cut into fixed-length blocks; labels are the inputs (causal LM)."""

    def __init__(self, ids: list[int], length: int):
        self.blocks = [torch.tensor(ids[i:i + length]) for i in range(0, len(ids) - length, length)]

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i):
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default="/tmp/hf_finetune")
    args = parser.parse_args()

    tokenizer = train_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    data = Chunks(tokenizer(open(CORPUS).read())["input_ids"], length=64)

    training = TrainingArguments(args.out, per_device_train_batch_size=8, max_steps=args.steps, learning_rate=3e-3,
                                 warmup_steps=5, logging_steps=min(10, args.steps), report_to=[], save_strategy="no",
                                 seed=0)
    print(f"training on {training.device} ({torch.tpu.get_device_name()}), {len(data)} blocks of 64 tokens")
    trainer = Trainer(model=model, args=training, train_dataset=data)
    start = time.perf_counter()
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    print(f"{args.steps} steps in {time.perf_counter() - start:.1f} s, loss {losses[0]:.2f} -> {losses[-1]:.2f}")
    assert next(model.parameters()).device.type == "tpu"

    # Save and reload straight to the device, then decode with the static cache: Transformers
    # compiles the decode step with the "tpu" torch.compile backend on its own.
    trainer.save_model(args.out)
    tokenizer.save_pretrained(args.out)
    model = LlamaForCausalLM.from_pretrained(args.out, device_map="tpu").eval()
    prompt = tokenizer(["the clockmaker kept a narrow shop"], return_tensors="pt")["input_ids"].to("tpu")
    for attempt in ("compiling", "compiled"):
        start = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=24, do_sample=False, cache_implementation="static")
        text = tokenizer.decode(out[0].cpu())
        print(f"generate ({attempt}, {time.perf_counter() - start:.1f} s): {text}")


if __name__ == "__main__":
    main()
