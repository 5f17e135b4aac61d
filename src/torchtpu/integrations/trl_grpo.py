"""TRL's ``GRPOTrainer`` on ``tpu``: generation by Transformers, training by the Trainer, both on
``tpu``; nothing in TRL is patched.

``train(model_dir, device=...)`` runs TRL's trainer on the toy task of
``torchtpu.integrations.verl.toy_task`` (answer with a number) and returns the mean reward of
each step. What makes it run on ``tpu`` is only Accelerate's device choice: Accelerate >= 1.16
picks ``tpu`` when it is the accelerator; ``ACCELERATE_TORCH_DEVICE=tpu`` says it for older
releases (set here where the caller asks for ``tpu``). ``use_cpu=True`` is the CPU reference.

    python -m torchtpu.integrations.trl_grpo MODEL_DIR [--steps 30] [--device tpu|cpu]
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchtpu.integrations.verl import toy_task


@dataclass
class Run:
    """What one ``train`` call measured."""

    rewards: list[float] = field(default_factory=list)  # mean reward of each step's completions
    losses: list[float] = field(default_factory=list)
    device: str = ""
    trainer: Any = None


def config(output_dir: str | Path, steps: int, device: str, *, num_generations: int = 8, prompts_per_step: int = 4,
           max_completion_length: int = 8, learning_rate: float = 2e-3, seed: int = 0, **overrides):
    """A ``GRPOConfig`` for the toy task: tiny batches, short completions, no logging backends."""
    from trl import GRPOConfig

    values = dict(
        output_dir=str(output_dir), max_steps=steps, learning_rate=learning_rate, lr_scheduler_type="constant",
        per_device_train_batch_size=num_generations * prompts_per_step, num_generations=num_generations,
        max_completion_length=max_completion_length, temperature=1.0, beta=0.0, logging_steps=1,
        report_to=[], save_strategy="no", seed=seed, data_seed=seed, use_cpu=device == "cpu",
        dataloader_num_workers=0, bf16=False, fp16=False, disable_tqdm=True,
    )
    values.update(overrides)
    return GRPOConfig(**values)


def train(model_dir: str | Path, output_dir: str | Path, steps: int = 30, device: str = "tpu", *,
          reward_funcs=toy_task.trl_reward, n_prompts: int = 256, **config_overrides) -> Run:
    """TRL's ``GRPOTrainer`` on the toy task for ``steps`` steps on ``device`` ("tpu" or "cpu")."""
    import datasets
    import transformers
    from trl import GRPOTrainer

    if device == "tpu":
        os.environ.setdefault("ACCELERATE_TORCH_DEVICE", "tpu")
    rows = toy_task.rows(n_prompts)
    dataset = datasets.Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]}
                                          for r in rows])
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    args = config(output_dir, steps, device, **config_overrides)
    trainer = GRPOTrainer(model=model, reward_funcs=reward_funcs, args=args, train_dataset=dataset,
                          processing_class=tokenizer)
    trainer.train()
    run = Run(device=str(next(trainer.model.parameters()).device), trainer=trainer)
    for entry in trainer.state.log_history:
        if "reward" in entry:
            run.rewards.append(float(entry["reward"]))
            run.losses.append(float(entry.get("loss", float("nan"))))
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", default="tpu", choices=("tpu", "cpu"))
    parser.add_argument("--output-dir", default=None)
    args = parser.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        run = train(args.model_dir, args.output_dir or tmp, args.steps, args.device)
    print(f"device {run.device}")
    for step, (reward, loss) in enumerate(zip(run.rewards, run.losses), 1):
        print(f"step {step:3d}  mean reward {reward:.3f}  loss {loss:+.4f}")


if __name__ == "__main__":
    main()
