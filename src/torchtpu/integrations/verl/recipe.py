"""VeRL's GSM8K GRPO recipe on ``tpu``, shrunk in sizes and steps only.

    python -m torchtpu.integrations.verl.recipe MODEL_DIR WORK_DIR [--steps 3] [--toy] [override ...]

runs ``python -m verl.trainer.main_ppo`` with the recipe's settings (``algorithm.adv_estimator=grpo``,
``rollout.n > 1``, the GSM8K rule-based reward; ``--toy`` uses the toy task's reward instead) and
the placement of VeRL's TPU deployment: the trainer and the rollout on separate devices
(``actor_rollout_ref.hybrid_engine=False``, VeRL's v1 ``separate_async`` trainer with the weights
synced after every step, ``parameter_sync_step=1``), the actor trained with FSDP2 on ``tpu_dist``
(``strategy=fsdp2``), the rollout served by VeRL's vLLM server mode on vLLM's ``tpu`` platform,
the weights moved by ``checkpoint_engine.py`` (backend ``tpu``). Ray is VeRL's controller, started
with the ``TPU`` resources declared (one per device: ``--actor-devices`` + ``--rollout-devices``).
The data set is written in WORK_DIR in VeRL's GSM8K schema (``toy_task.py``); nothing is
downloaded. Extra ``key=value`` arguments are Hydra overrides passed on to VeRL.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from torchtpu.integrations.verl import names, toy_task

CHECKPOINT_ENGINE_MODULE = "torchtpu.integrations.verl.checkpoint_engine"


def overrides(model_dir: str | Path, work_dir: str | Path, steps: int = 3, *, toy: bool = False,
              actor_devices: int = 1, rollout_devices: int = 1, prompts_per_step: int = 4, n: int = 4,
              response_length: int = 8, lr: float = 1e-6) -> list[str]:
    """The recipe's Hydra overrides for ``verl.trainer.main_ppo`` (data files written into ``work_dir``)."""
    work_dir = Path(work_dir)
    source = toy_task.TOY_SOURCE if toy else toy_task.GSM8K_SOURCE
    train = toy_task.write_parquet(work_dir / "data" / "train.parquet", 256, "train", data_source=source)
    test = toy_task.write_parquet(work_dir / "data" / "test.parquet", 16, "test", data_source=source)
    a, r = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    return [
        # VeRL's GSM8K GRPO recipe (examples/grpo_trainer), sizes shrunk
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
        f"data.train_files={train}", f"data.val_files={test}", f"data.train_batch_size={prompts_per_step}",
        "data.max_prompt_length=64", f"data.max_response_length={response_length}",
        "data.filter_overlong_prompts=True", "data.truncation=error", "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.model.use_remove_padding=False",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",  # VeRL's default: flash_attention_2
        f"{a}.optim.lr={lr}", f"{a}.ppo_mini_batch_size={prompts_per_step}",
        f"{a}.ppo_micro_batch_size_per_gpu={prompts_per_step * n}", f"{a}.use_kl_loss=False", f"{a}.entropy_coeff=0",
        # FSDP2 on tpu_dist, float32 (the log-prob check compares float32 with float32)
        f"{a}.strategy=fsdp2", f"{a}.fsdp_config.strategy=fsdp2", f"{a}.fsdp_config.model_dtype=fp32",
        f"{a}.fsdp_config.dtype=float32", f"{a}.use_torch_compile=False", f"{a}.fsdp_config.use_torch_compile=False",
        # VeRL's FSDP engine otherwise computes in bfloat16 (its MixedPrecision default, and autocast to it)
        f"+{a}.fsdp_config.mixed_precision={{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}}",
        # the rollout: VeRL's vLLM server mode, on its own device
        f"{r}.name=vllm", f"{r}.mode=async", f"{r}.n={n}", f"{r}.tensor_model_parallel_size=1",
        f"{r}.dtype=float32", f"{r}.gpu_memory_utilization=0.2", f"{r}.max_model_len=128",
        f"{r}.max_num_seqs={prompts_per_step * n}", f"{r}.max_num_batched_tokens=512", f"{r}.enforce_eager=True",
        f"{r}.load_format=auto", f"{r}.calculate_log_probs=True", f"{r}.agent.num_workers=1",
        # vLLM's sleep mode is CUDA's memory pool (a colocated engine's); the rollout keeps its device
        f"+{r}.enable_sleep_mode=False", f"{r}.free_cache_engine=False",
        f"{r}.log_prob_micro_batch_size_per_gpu={prompts_per_step * n}",
        f"{r}.nnodes=1", f"{r}.n_gpus_per_node={rollout_devices}",
        f"{r}.checkpoint_engine.backend=tpu", f"{r}.checkpoint_engine.custom_backend_module={CHECKPOINT_ENGINE_MODULE}",
        f"{r}.checkpoint_engine.update_weights_bucket_megabytes=16",
        # separate devices: no hybrid engine; weights synced after every step
        "actor_rollout_ref.hybrid_engine=False", "trainer.use_v1=True", "trainer.v1.trainer_mode=separate_async",
        "trainer.v1.separate_async.parameter_sync_step=1",
        # no prompts generated ahead (VeRL's default prefetches one batch, sampled with the weights of
        # the step before): each step's rollout uses the weights synced at the end of the previous
        # step, the ones the actor recomputes the log-probs with
        "trainer.v1.separate_async.num_warmup_batches=0",
        f"trainer.device={names.DEVICE}", "trainer.nnodes=1", f"trainer.n_gpus_per_node={actor_devices}",
        f"trainer.total_training_steps={steps}", "trainer.total_epochs=1000", "trainer.logger=[console]",
        "trainer.val_before_train=False", "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.critic_warmup=0",
        f"trainer.default_local_dir={work_dir / 'checkpoints'}",
        f"reward.custom_reward_function.path={Path(toy_task.__file__)}", "reward.custom_reward_function.name=compute_score",
        "reward.num_workers=1",
        # VeRL's v1 trainers pass batches through TransferQueue: one storage actor (the default 8 is sized for a cluster)
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        # Ray: the TPU resources declared, as on a machine whose chips Ray does not detect
        "ray_kwargs.ray_init.num_cpus=16", "+ray_kwargs.ray_init.include_dashboard=False",
        # VeRL 0.9.1's ResourcePoolManager._check_resource_available counts only Ray's "GPU" or "NPU"
        # resources (not the platform's ray_resource_name(), which its placement groups do use): the
        # same count under "NPU" lets that check see the chips; nothing asks for NPU.
        (f"+ray_kwargs.ray_init.resources={{{names.RAY_RESOURCE}:{actor_devices + rollout_devices},"
         f"NPU:{actor_devices + rollout_devices}}}"),
    ]


def compiles_shape_asserts() -> bool:
    """Whether torchtpu's ``torch.compile`` backend lowers ``aten._assert_scalar`` (the shape
    assertions of a graph with symbolic sizes)."""
    import torch

    from torchtpu.compile.graph import has_lowering

    return has_lowering(torch.ops.aten._assert_scalar.default)


def environment() -> dict[str, str]:
    """The driver's environment (Ray's local workers inherit it): VeRL's platform, the rollout's
    vLLM platform, and one XLA:CPU device per process when the device is XLA:CPU."""
    env = {**os.environ, "VERL_PLATFORM": names.PLATFORM_NAME, "VLLM_PLATFORM": names.DEVICE,
           "TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "0",
           # VeRL registers its FSDP/FSDP2 engines for the devices "cuda" and "npu" only;
           # VERL_ENGINE_DEVICE is VeRL's switch to take another device's engine. The engine's
           # device work goes through the platform (tpu), whatever name selected it.
           "VERL_ENGINE_DEVICE": "cuda",
           # VeRL 0.9.1's separate_async trainer, with hybrid_engine=False, logs at INFO with
           # logger.info(..., flush=True), a TypeError; at WARN level that line is not formatted
           "VERL_LOGGING_LEVEL": os.environ.get("VERL_LOGGING_LEVEL", "WARN")}
    if not compiles_shape_asserts():
        # the rollout's log-probs (vLLM's sampler: a torch.compile'd rank count over sizes marked
        # unbacked) need torch.compile graphs with aten._assert_scalar, which this torchtpu's
        # compiler does not lower yet: those small functions then run eagerly on tpu
        env.setdefault("TORCHDYNAMO_DISABLE", "1")
    if env.get("TORCHTPU_PLATFORM") == "cpu":  # each worker process drives one device
        env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                    if not f.startswith("--xla_force_host_platform_device_count"))
    return env


def command(model_dir, work_dir, steps: int = 3, extra: list[str] = (), **kwargs) -> list[str]:
    """VeRL's trainer with the recipe's overrides; Hydra's run folder (its log) goes in ``work_dir``,
    not in the current directory (Hydra's default: ``outputs/<date>/<time>``)."""
    return [sys.executable, "-m", "verl.trainer.main_ppo", *overrides(model_dir, work_dir, steps, **kwargs),
            f"hydra.run.dir={Path(work_dir) / 'hydra'}", *extra]


_METRIC = re.compile(r"([\w/@.\-]+):(?:np\.\w+\()?([-+0-9.eE]+|nan)")  # a value, or numpy's repr of one


def step_metrics(console_log: str) -> list[dict[str, float]]:
    """VeRL's console-logger lines (``step:N - key:value - ...``), one dict per training step."""
    return [{k: float(v) for k, v in _METRIC.findall(line)} for line in console_log.splitlines()
            if "step:" in line and "timing_s/" in line]


def greedy_check_overrides(work_dir: str | Path, step: int) -> list[str]:
    """Overrides for the greedy-tokens check at ``step``: after that step's weight sync VeRL
    validates (its ``val_kwargs``: greedy, one sample a prompt) with the rollout and dumps the
    generations (``trainer.validation_data_dir``), and the actor saves the weights it just synced
    as a Hugging Face checkpoint (``checkpoint.save_contents=[hf_model]``, saved before the sync)."""
    work_dir = Path(work_dir)
    return [f"trainer.test_freq={step}", f"trainer.validation_data_dir={work_dir / 'validation'}",
            f"trainer.save_freq={step}", "actor_rollout_ref.actor.checkpoint.save_contents=[hf_model]"]


def actor_checkpoint(work_dir: str | Path, step: int) -> Path:
    """The Hugging Face checkpoint the actor saved at ``step`` (``greedy_check_overrides``)."""
    return Path(work_dir) / "checkpoints" / f"global_step_{step}" / "actor" / "huggingface"


def rollout_greedy(work_dir: str | Path, step: int) -> dict[str, str]:
    """The rollout's greedy response to each validation prompt VeRL dumped at ``step``
    (``greedy_check_overrides``), both as VeRL decodes them (special tokens skipped)."""
    import json

    lines = (Path(work_dir) / "validation" / f"{step}.jsonl").read_text().splitlines()
    return {sample["input"]: sample["output"] for sample in map(json.loads, lines)}


def hf_greedy(model_dir: str | Path, work_dir: str | Path, max_new_tokens: int = 8) -> dict[str, str]:
    """Hugging Face ``generate`` (greedy, CPU, float32) with the checkpoint in ``model_dir`` on
    each prompt of the recipe's validation set, tokenized as VeRL's agent loop does (the chat
    template, generation prompt added) and decoded as VeRL decodes: ``{prompt: response}``, the
    keys ``rollout_greedy`` has."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        for row in toy_task.read_parquet(Path(work_dir) / "data" / "test.parquet"):
            ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
            prompt = torch.tensor([ids])
            tokens = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                                    do_sample=False, pad_token_id=tokenizer.pad_token_id)[0, len(ids):]
            out[tokenizer.decode(ids, skip_special_tokens=True)] = tokenizer.decode(tokens, skip_special_tokens=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("work_dir")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--toy", action="store_true", help="the toy task's reward (answer with a number)")
    parser.add_argument("--lr", type=float, default=1e-6, help="the actor's learning rate")
    parser.add_argument("--greedy-check", action="store_true",
                        help="after the last step: validate greedily and save the actor's weights (greedy_check_overrides)")
    parser.add_argument("extra", nargs="*", help="Hydra overrides passed on to VeRL")
    args = parser.parse_intermixed_args()  # overrides may follow --steps / --toy
    extra = [*(greedy_check_overrides(args.work_dir, args.steps) if args.greedy_check else ()), *args.extra]
    cmd = command(args.model_dir, args.work_dir, args.steps, extra, toy=args.toy, lr=args.lr)
    raise SystemExit(subprocess.call(cmd, env=environment()))


if __name__ == "__main__":
    main()
