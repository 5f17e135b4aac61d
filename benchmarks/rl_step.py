"""Where a GRPO step's time goes on ``tpu``, and rollout tokens/s against Transformers ``generate``.

    tools/verl_env.sh            # the venvs: $VENV (VeRL, vLLM) and $VENV-trl (TRL)
    $VENV-trl/bin/python benchmarks/rl_step.py --part trl [--steps 4]     # TRL, in the TRL venv
    $VENV/bin/python benchmarks/rl_step.py --part verl [--steps 4]        # VeRL, in the VeRL venv

Both parts train the tiny random Llama of ``tools/make_tiny_llama.py`` on the toy task
(``torchtpu.integrations.verl.toy_task``), made in a temporary folder; nothing is downloaded.

* ``trl``: TRL's ``GRPOTrainer`` on ``tpu``, generation by Transformers. Its own timers (a
  subclass records the time of ``_generate`` and of every log-prob forward, outside and inside
  autograd) split each step into rollout, log-prob recomputation (forwards without grad) and
  training (the rest); TRL has no weight sync (one model). Steps after the first (which
  compiles) are averaged.
* ``verl``: VeRL's recipe (``torchtpu.integrations.verl.recipe``: FSDP2 actor and vLLM rollout on
  separate devices). VeRL's own step timers (``timing_s/gen``, ``old_log_prob``,
  ``update_actor``, ``update_weights``, ``step``) are read from its console log; the rest of a
  step (advantages, metrics, TransferQueue reads and writes) is in ``step`` but in no share.

Rollout tokens/s: the completion tokens of a step over its rollout time, against Transformers
``generate`` on ``tpu`` making the same number of completions of the same length (sampling,
EOS ignored) in this process, timed after a warm-up call.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TORCHTPU_PLATFORM", "cpu")
REPO = Path(__file__).resolve().parents[1]


def make_model(directory: Path) -> Path:
    spec = importlib.util.spec_from_file_location("make_tiny_llama", REPO / "tools" / "make_tiny_llama.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_tiny_llama(directory)


def hf_generate_tokens_per_s(model_dir: Path, sequences: int, new_tokens: int, repeats: int = 3) -> float:
    """Transformers ``generate`` on tpu: ``sequences`` sampled completions of ``new_tokens`` tokens
    for the toy task's prompts; tokens/s of the best of ``repeats`` timed calls after a warm-up."""
    import torch
    import transformers

    from torchtpu.integrations.verl import toy_task

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("tpu").eval()
    prompts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
               for r in toy_task.rows(sequences)]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to("tpu")
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, temperature=1.0,
                  top_k=0, pad_token_id=tokenizer.pad_token_id)
    best = float("inf")
    with torch.no_grad():
        model.generate(**batch, **kwargs)
        for _ in range(repeats):
            start = time.perf_counter()
            out = model.generate(**batch, **kwargs).cpu()
            best = min(best, time.perf_counter() - start)
    assert out.shape[1] - batch["input_ids"].shape[1] == new_tokens
    return sequences * new_tokens / best


# ---------------------------------------------------------------------------------------- TRL

def trl_part(model_dir: Path, work: Path, steps: int) -> dict:
    import torch
    from trl import GRPOTrainer

    from torchtpu.integrations import trl_grpo

    timings: list[dict[str, float]] = []

    class TimedGRPOTrainer(GRPOTrainer):
        """TRL's trainer with timers on its rollout and its log-prob forwards (no change of behaviour)."""

        def training_step(self, *args, **kwargs):
            timings.append({"rollout": 0.0, "logprob": 0.0, "step_start": time.perf_counter(), "tokens": 0})
            out = super().training_step(*args, **kwargs)
            torch.tpu.synchronize()
            timings[-1]["step"] = time.perf_counter() - timings[-1].pop("step_start")
            return out

        def _generate(self, prompts):
            start = time.perf_counter()
            out = super()._generate(prompts)
            timings[-1]["rollout"] += time.perf_counter() - start
            timings[-1]["tokens"] += sum(len(c) for c in out[1])  # completion_ids
            return out

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            if torch.is_grad_enabled():
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)
            start = time.perf_counter()
            out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
            out[0].sum().item()  # wait for it
            timings[-1]["logprob"] += time.perf_counter() - start
            return out

    import trl

    original, trl.GRPOTrainer = trl.GRPOTrainer, TimedGRPOTrainer
    try:
        run = trl_grpo.train(model_dir, work / "trl", steps=steps, device="tpu")
    finally:
        trl.GRPOTrainer = original
    measured = timings[1:] or timings
    step = sum(t["step"] for t in measured) / len(measured)
    rollout = sum(t["rollout"] for t in measured) / len(measured)
    logprob = sum(t["logprob"] for t in measured) / len(measured)
    tokens = sum(t["tokens"] for t in measured) / len(measured)
    args = run.trainer.args
    return {"step": step, "rollout": rollout, "logprob": logprob, "train": step - rollout - logprob, "sync": 0.0,
            "tokens_per_s": tokens / rollout, "sequences": args.per_device_train_batch_size,
            "new_tokens": args.max_completion_length, "rewards": run.rewards}


# --------------------------------------------------------------------------------------- VeRL

def verl_part(model_dir: Path, work: Path, steps: int, timeout: float = 1800) -> dict:
    from torchtpu.integrations.verl import recipe

    prompts, n, response_length = 4, 4, 8
    sequences = prompts * n
    cmd = recipe.command(model_dir, work / "verl", steps, toy=True, prompts_per_step=prompts, n=n,
                         response_length=response_length)
    out = subprocess.run(cmd, env=recipe.environment(), capture_output=True, text=True, timeout=timeout, check=False)
    (work / "verl.log").write_text(out.stdout + out.stderr)
    metrics = recipe.step_metrics(out.stdout)
    if out.returncode != 0 or not metrics:
        raise SystemExit(f"VeRL's recipe failed (exit {out.returncode}); its log: {work / 'verl.log'}\n"
                         + (out.stdout + out.stderr)[-3000:])
    measured = metrics[1:] or metrics

    def mean(key):
        values = [m[key] for m in measured if key in m]
        return sum(values) / len(values) if values else 0.0

    tokens = mean("response_length/mean") * sequences  # completion tokens of a step
    return {"step": mean("timing_s/step"), "rollout": mean("timing_s/gen"), "logprob": mean("timing_s/old_log_prob"),
            "train": mean("timing_s/update_actor"), "sync": mean("timing_s/update_weights"),
            "tokens_per_s": tokens / mean("timing_s/gen"), "sequences": sequences, "new_tokens": response_length,
            "probs_diff": mean("training/rollout_probs_diff_mean"), "log_ppl_diff": mean("rollout_corr/log_ppl_abs_diff"),
            "rewards": [m.get("critic/score/mean") for m in metrics]}


def print_table(rows: dict[str, dict], hf: dict[str, float]) -> None:
    print(f"{'':6} {'step s':>8} {'rollout':>9} {'log-prob':>9} {'train':>8} {'sync':>8} "
          f"{'rollout tok/s':>14} {'HF generate tok/s':>18} {'ratio':>6}")
    for name, r in rows.items():
        shares = [r[k] / r["step"] * 100 for k in ("rollout", "logprob", "train", "sync")]
        print(f"{name:6} {r['step']:8.2f} " + " ".join(f"{s:8.1f}%" for s in shares)
              + f" {r['tokens_per_s']:14.1f} {hf[name]:18.1f} {r['tokens_per_s'] / hf[name]:6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="trl", choices=("trl", "verl"), help="trl: in the TRL venv; verl: in the VeRL venv")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = make_model(work / "model")
        rows, hf = {}, {}
        if args.part == "trl":
            rows["TRL"] = trl_part(model_dir, work, args.steps)
            hf["TRL"] = hf_generate_tokens_per_s(model_dir, rows["TRL"]["sequences"], rows["TRL"]["new_tokens"])
        if args.part == "verl":
            rows["VeRL"] = verl_part(model_dir, work, args.steps)
            hf["VeRL"] = hf_generate_tokens_per_s(model_dir, rows["VeRL"]["sequences"], rows["VeRL"]["new_tokens"])
            print(f"VeRL: actor vs rollout mean |prob diff| {rows['VeRL']['probs_diff']:.2e}, "
                  f"mean |log-ppl diff| {rows['VeRL']['log_ppl_diff']:.2e}; mean reward per step {rows['VeRL']['rewards']}")
        print(f"GRPO step on tpu ({os.environ['TORCHTPU_PLATFORM']}), steps after the first averaged; "
              f"shares of the step:")
        print_table(rows, hf)


if __name__ == "__main__":
    main()
