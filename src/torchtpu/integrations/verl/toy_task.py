"""A small RL task in VeRL's GSM8K schema, made locally: what the RL tests and benchmark train on.

Rows are what VeRL's ``examples/data_preprocess/gsm8k.py`` writes for GSM8K (``data_source``,
``prompt`` as chat messages, ``ability``, ``reward_model.{style,ground_truth}``, ``extra_info``),
with one-digit sums as questions, so VeRL's RL data set reads them as it reads GSM8K.

Two rewards:

* ``data_source = "openai/gsm8k"``: VeRL's own GSM8K rule (``#### <answer>``), the recipe's
  reward. A random-init model never earns it; it is there to run the recipe as shipped.
* ``data_source = TOY_SOURCE``: ``answers_with_a_number`` — 1 when the response contains a
  digit, else 0. A tiny random model does that about one time in ten (measured: 1-2 % chance of
  a digit per token, over 8 tokens), so GRPO has a signal from the first step and can learn it
  in tens of steps: the "GRPO learns" check. ``compute_score`` is VeRL's custom-reward
  signature; ``trl_reward`` is TRL's.

Nothing here imports VeRL or TRL.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

GSM8K_SOURCE = "openai/gsm8k"
TOY_SOURCE = "torchtpu/answer-with-a-number"
# VeRL's GSM8K preprocessing appends this to every question
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_DIGIT = re.compile(r"[0-9]")


def rows(n: int, split: str = "train", seed: int = 0, data_source: str = TOY_SOURCE) -> list[dict[str, Any]]:
    """``n`` questions "What is a + b?" (one-digit a, b) as VeRL's GSM8K rows."""
    rng = random.Random(f"{seed}-{split}")
    out = []
    for index in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        question = f"What is {a} + {b}?"
        out.append({
            "data_source": data_source,
            "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": split, "index": index, "answer": f"{a} + {b} = {a + b}\n#### {a + b}",
                           "question": question},
        })
    return out


def write_parquet(path: str | Path, n: int, split: str = "train", seed: int = 0,
                  data_source: str = TOY_SOURCE) -> Path:
    """Write ``rows(...)`` as a parquet file (what VeRL's ``data.train_files`` reads); return its path."""
    import pandas as pd

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows(n, split, seed, data_source)).to_parquet(path)
    return path


def read_parquet(path: str | Path) -> list[dict[str, Any]]:
    """The rows ``write_parquet`` wrote (chat messages as plain lists of dicts)."""
    import pandas as pd

    out = []
    for row in pd.read_parquet(path).to_dict("records"):
        row["prompt"] = [dict(m) for m in row["prompt"]]
        out.append(row)
    return out


def answers_with_a_number(response: str) -> float:
    """1.0 when the response contains a digit, else 0.0."""
    return 1.0 if _DIGIT.search(response) else 0.0


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None,
                  **kwargs) -> float:
    """VeRL's custom reward (``reward.custom_reward_function.path`` = this file, ``name`` =
    ``compute_score``): the toy rule for ``TOY_SOURCE`` rows, VeRL's GSM8K rule for GSM8K rows."""
    if data_source == TOY_SOURCE:
        return answers_with_a_number(solution_str)
    if data_source == GSM8K_SOURCE:
        from verl.utils.reward_score import gsm8k

        return gsm8k.compute_score(solution_str, ground_truth)
    raise ValueError(f"no reward for data_source {data_source!r}: rows of {TOY_SOURCE!r} or {GSM8K_SOURCE!r}")


def trl_reward(completions: list, **kwargs) -> list[float]:
    """TRL's reward-function signature: one score per completion (text, or chat messages)."""
    texts = [c if isinstance(c, str) else "".join(m["content"] for m in c) for c in completions]
    return [answers_with_a_number(text) for text in texts]
