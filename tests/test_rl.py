"""Reinforcement learning on ``tpu``: VeRL's platform plugin and TRL's ``GRPOTrainer``.

Needs the venvs ``tools/verl_env.sh`` builds: the VeRL tests run in its VeRL venv (VeRL 0.9.1,
vLLM 0.33), the TRL tests in its TRL venv (TRL 1.16; VeRL 0.9.1 cannot share a venv with TRL 1.x);
each test is skipped, with the reason, where its library is missing. The model is the tiny random Llama of ``tools/make_tiny_llama.py``; the data set is
``torchtpu.integrations.verl.toy_task`` (VeRL's GSM8K schema, made locally). Nothing is
downloaded.

- The platform: registered by torchtpu's ``verl.plugins`` entry point when ``verl`` is
  imported, chosen by ``VERL_PLATFORM=tpu`` and by VeRL's auto-detection, and what VeRL's
  device helpers then answer (checked in a fresh process: VeRL resolves its platform once).
- TRL: on the same prompts and completions, TRL's GRPO loss and its gradients on ``tpu`` equal
  CPU's; and (``slow``) 30 steps on ``tpu`` raise the toy task's mean reward to >= 0.8.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from serving_fixtures import model_dir  # noqa: F401  (fixture)

from torchtpu.integrations.verl import names, toy_task


def _installed(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


needs_verl = pytest.mark.skipif(not _installed("verl", "vllm"), reason=(
    "VeRL and vLLM are not installed: run this file in the VeRL venv of tools/verl_env.sh"))
needs_trl = pytest.mark.skipif(not _installed("trl"), reason=(
    "TRL is not installed: run this file in the TRL venv of tools/verl_env.sh (<venv>-trl)"))


def _fresh_verl(code: str, **env) -> dict:
    """Run ``code`` (which prints one JSON line last) in a fresh interpreter after ``import verl``."""
    full_env = {**os.environ, **env}
    for key, value in env.items():
        if value is None:
            full_env.pop(key)
    out = subprocess.run([sys.executable, "-c", "import verl\n" + textwrap.dedent(code)], env=full_env, check=False,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


PLATFORM_REPORT = """
    import json, torch
    from verl.plugin.platform import PlatformRegistry, get_platform
    from verl.utils import device
    from torchtpu.integrations.verl.platform import PlatformTPU
    p = get_platform()
    x = torch.ones(3, device=device.get_device_name()) * 2
    print(json.dumps({
        "registered": PlatformRegistry.get("tpu") is PlatformTPU, "class": type(p).__name__,
        "device": device.get_device_name(), "module": device.get_torch_device().memory_allocated is torch.tpu.memory_allocated,
        "peak_reserved": device.get_torch_device().max_memory_reserved() >= 0,
        "backend": device.get_nccl_backend(), "resource": device.get_resource_name(),
        "visible": device.get_visible_devices_keyword(), "options": [p.ray_resource_options(2), p.ray_resource_options(1 / 3)],
        "ipc": device.is_support_ipc(), "tensor": [str(x.device), x.sum().item()],
        "backend_known": torch.distributed.Backend(device.get_nccl_backend()) == "tpu_dist",
    }))
"""


@needs_verl
@pytest.mark.parametrize("selected_by", ["VERL_PLATFORM", "auto-detection"])
def test_platform_from_the_entry_point(selected_by):
    """``import verl`` loads torchtpu's entry point, which registers ``tpu``; VeRL then answers
    with tpu's device, backend and Ray resource, and its device name makes ``tpu`` tensors."""
    env = {"VERL_PLATFORM": "tpu"} if selected_by == "VERL_PLATFORM" else {"VERL_PLATFORM": None}
    report = _fresh_verl(PLATFORM_REPORT, **env)
    assert report == {
        "registered": True, "class": "PlatformTPU", "device": "tpu", "module": True,
        "backend": names.COMMUNICATION_BACKEND, "resource": "TPU", "visible": "TPU_VISIBLE_CHIPS",
        "options": [{"resources": {"TPU": 2}}, {"resources": {"TPU": 1}}], "ipc": False, "tensor": ["tpu:0", 6.0], "backend_known": True,
        "peak_reserved": True,
    }


@needs_verl
def test_plugins_off_leaves_verl_without_tpu():
    """``VERL_USE_EXTERNAL_PLUGINS=none`` (VeRL's switch) skips the entry point: ``tpu`` is then
    unknown to VeRL, which shows the platform comes from the entry point and nowhere else."""
    report = _fresh_verl("""
        import json
        from verl.plugin.platform import PlatformRegistry
        print(json.dumps({"names": sorted(PlatformRegistry.registered_names())}))
    """, VERL_USE_EXTERNAL_PLUGINS="none")
    assert "tpu" not in report["names"] and "nvidia" in report["names"]


VLLM_ROLLOUT_REPORT = """
    import asyncio, json
    from verl.workers.rollout.replica import get_rollout_replica_class
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica
    from vllm.v1.engine.async_llm import AsyncLLM
    from torchtpu.integrations.verl import vllm_rollout

    cls = get_rollout_replica_class("vllm")
    calls = []

    class Engine:  # what VeRL's server holds: records what reaches vLLM
        output_processor = "the engine's own"

        async def pause_generation(self, *, mode="abort", clear_cache=True):
            calls.append([mode, clear_cache])

    engine = vllm_rollout.PauseModeEngine(Engine())
    asyncio.run(engine.pause_generation(wait_for_inflight_requests=False, clear_cache=True))  # VeRL's call
    asyncio.run(engine.pause_generation(wait_for_inflight_requests=True, clear_cache=False))
    asyncio.run(engine.pause_generation(mode="keep"))
    print(json.dumps({
        "tpu_class": cls is vllm_rollout.TpuvLLMReplica, "subclass": issubclass(cls, vLLMReplica),
        "server_subclass": issubclass(vllm_rollout.TpuvLLMHttpServer, vLLMHttpServer),
        "vllm_takes_flag": vllm_rollout.takes_wait_flag(AsyncLLM.pause_generation),
        "calls": calls, "attribute": engine.output_processor,
    }))
"""


@needs_verl
def test_vllm_rollout_through_verls_registry():
    """On ``tpu``, VeRL's ``RolloutReplicaRegistry`` answers ``rollout.name=vllm`` with torchtpu's
    subclass of VeRL's vLLM replica, whose server passes VeRL's ``pause_generation(
    wait_for_inflight_requests=...)`` on as vLLM's ``mode`` (the installed vLLM takes no such flag,
    which is why the adapter exists); on another platform VeRL's own replica is used."""
    report = _fresh_verl(VLLM_ROLLOUT_REPORT, VERL_PLATFORM="tpu")
    assert report == {"tpu_class": True, "subclass": True, "server_subclass": True, "vllm_takes_flag": False,
                      "calls": [["abort", True], ["wait", False], ["keep", True]],
                      "attribute": "the engine's own"}
    other = _fresh_verl("""
        import json
        from verl.workers.rollout.replica import get_rollout_replica_class
        from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMReplica
        print(json.dumps({"verls": get_rollout_replica_class("vllm") is vLLMReplica}))
    """, VERL_PLATFORM="nvidia")
    assert other == {"verls": True}


@needs_verl
def test_toy_rows_read_by_verl_and_scored(tmp_path, model_dir):  # noqa: F811
    """The parquet file in GSM8K's schema goes through VeRL's own RL data set (chat
    messages) and its reward: the toy rule scores a digit, VeRL's GSM8K rule its ``####`` form."""
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    path = toy_task.write_parquet(tmp_path / "train.parquet", 8)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": 64, "truncation": "error",
                               "filter_overlong_prompts": False, "return_raw_chat": False})
    dataset = RLHFDataset(data_files=str(path), tokenizer=tokenizer, config=config, processor=None)
    assert len(dataset) == 8
    row, want = dataset[0], toy_task.rows(8)[0]
    assert [dict(m) for m in row["raw_prompt"]] == want["prompt"]
    assert row["data_source"] == toy_task.TOY_SOURCE
    assert row["reward_model"]["ground_truth"] == want["reward_model"]["ground_truth"]
    prompt = tokenizer.apply_chat_template(row["raw_prompt"], add_generation_prompt=True, tokenize=False)
    assert want["extra_info"]["question"] in prompt and prompt.endswith("<|assistant|>")
    assert toy_task.compute_score(toy_task.TOY_SOURCE, " 12 apples", "7") == 1.0
    assert toy_task.compute_score(toy_task.TOY_SOURCE, "no digits here", "7") == 0.0
    assert toy_task.compute_score(toy_task.GSM8K_SOURCE, "so #### 7", "7") == 1.0
    assert toy_task.compute_score(toy_task.GSM8K_SOURCE, "so 7", "7") == 0.0
    assert toy_task.trl_reward([[{"role": "assistant", "content": "a 3"}], "none"]) == [1.0, 0.0]


@needs_verl
def test_checkpoint_engine_moves_tpu_weights_to_every_receiver():
    """torchtpu's checkpoint engine driven as VeRL's ``CheckpointEngineManager`` drives it (prepare,
    build_topology, init_process_group, send/receive, finalize; the registry by backend name):
    a model's ``tpu`` weights reach two receivers bit for bit, in buckets smaller than a weight
    (a tensor larger than the bucket travels alone), and again at a second sync."""
    import asyncio

    from verl.checkpoint_engine import CheckpointEngineRegistry

    from torchtpu.integrations.verl import checkpoint_engine  # noqa: F401  (registers "tpu")

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 48), torch.nn.LayerNorm(48))
    model = model.to("tpu")
    bucket = 4096  # bytes: the embedding (8 KiB) is larger, the biases many to a bucket
    sender = CheckpointEngineRegistry.new("tpu", bucket_size=bucket, is_master=True)
    receivers = [CheckpointEngineRegistry.new("tpu", bucket_size=bucket) for _ in range(2)]
    engine_cls = type(sender)

    async def sync():
        metadata = [sender.prepare()] + [r.prepare() for r in receivers]
        actor_kwargs, rollout_kwargs = engine_cls.build_topology(1, len(receivers), metadata)
        sender.init_process_group(**{k: v[0] for k, v in actor_kwargs.items()})
        for i, r in enumerate(receivers):
            r.init_process_group(**{k: v[i] for k, v in rollout_kwargs.items()})

        async def receive(r):
            return [(name, tensor.clone()) async for name, tensor in r.receive_weights()]

        results = await asyncio.gather(sender.send_weights(iter(model.state_dict().items())),
                                       *[receive(r) for r in receivers])
        for engine in (sender, *receivers):
            engine.finalize()
        return results

    for _ in range(2):
        metrics, *received = asyncio.run(sync())
        want = [(name, value.cpu()) for name, value in model.state_dict().items()]
        assert metrics["perf/weight_sync_mb"] > 0
        for got in received:
            assert [name for name, _ in got] == [name for name, _ in want]
            for (name, value), (_, expected) in zip(got, want):
                assert value.device.type == "cpu" and value.dtype == expected.dtype
                assert torch.equal(value, expected), name
        with torch.no_grad():
            model[1].weight.add_(1.0)  # a training step's change: the next sync carries it


@needs_verl
def test_recipe_config_is_verls_grpo_with_separate_devices(tmp_path, model_dir):  # noqa: F811
    """The recipe's overrides compose with VeRL's own ``ppo_trainer`` config and pass VeRL's
    validation, and say what the recipe promises: GRPO with n > 1, FSDP2 on tpu, a vLLM server
    rollout on its own device, no hybrid engine, a weight sync after every step through the
    ``tpu`` checkpoint engine, which VeRL's import of ``custom_backend_module`` registers."""
    from hydra import compose, initialize_config_module
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.import_utils import import_external_libs

    from torchtpu.integrations.verl import recipe

    lines = recipe.step_metrics("step:2 - timing_s/gen:1.5 - critic/score/mean:0.25 - x/nan:nan - s/max:np.int64(3)")
    assert lines[0]["timing_s/gen"] == 1.5 and lines[0]["step"] == 2 and lines[0]["critic/score/mean"] == 0.25
    assert lines[0]["s/max"] == 3
    with initialize_config_module("verl.trainer.config", version_base=None):
        config = compose("ppo_trainer", overrides=recipe.overrides(model_dir, tmp_path, steps=3))
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    aro = config.actor_rollout_ref
    assert config.algorithm.adv_estimator == "grpo" and aro.rollout.n > 1
    assert aro.hybrid_engine is False and config.trainer.v1.trainer_mode == "separate_async"
    assert config.trainer.v1.separate_async.parameter_sync_step == 1
    assert config.trainer.v1.separate_async.num_warmup_batches == 0  # on-policy: no batch sampled ahead
    assert config.data.train_batch_size == aro.actor.ppo_mini_batch_size  # so: one sync per step
    assert aro.actor.strategy == "fsdp2" and config.trainer.device == "tpu"
    assert dict(aro.actor.fsdp_config.mixed_precision) == {  # float32 compute, not VeRL's bfloat16 default
        "param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    assert aro.rollout.name == "vllm" and aro.rollout.mode == "async" and aro.rollout.n_gpus_per_node == 1
    assert dict(config.ray_kwargs.ray_init.resources)["TPU"] == 2
    engine = aro.rollout.checkpoint_engine
    import_external_libs(engine.custom_backend_module)
    assert CheckpointEngineRegistry.get(engine.backend).__module__ == recipe.CHECKPOINT_ENGINE_MODULE
    assert Path(config.data.train_files).exists()


@needs_trl
def test_trl_grpo_loss_and_gradients_match_cpu(tmp_path, model_dir):  # noqa: F811
    """TRL's trainer on ``tpu`` generates and scores a batch (Transformers ``generate`` on tpu);
    TRL's GRPO loss of that batch and its gradients equal the same computation on CPU."""
    from torchtpu.integrations import trl_grpo

    run = trl_grpo.train(model_dir, tmp_path, steps=1, device="tpu")
    trainer = run.trainer
    assert run.device == "tpu:0" and len(run.rewards) == 1
    batch = [trainer.train_dataset[i] for i in range(trainer.args.per_device_train_batch_size)]
    trainer.model.train()
    inputs = trainer._generate_and_score_completions(batch)
    assert inputs["completion_ids"].device.type == "tpu"
    assert inputs["advantages"].abs().sum() > 0, "the batch's rewards all tie: nothing to compare"

    def loss_and_grads(model, inputs):
        model.zero_grad()
        loss = trainer._compute_loss(model, inputs)
        loss.backward()
        return loss.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}

    tpu_loss, tpu_grads = loss_and_grads(trainer.model, inputs)
    cpu_model = type(trainer.model)(trainer.model.config)
    cpu_model.load_state_dict({k: v.cpu() for k, v in trainer.model.state_dict().items()})
    # what the trainer did to its model: the fused LM head that returns log-probs and entropies
    from trl.trainer.grpo_trainer import add_fused_lm_head

    add_fused_lm_head(cpu_model, temperature=trainer.temperature, cast_lm_head_to_fp32=trainer.args.cast_lm_head_to_fp32,
                      outputs=("log_probs", "entropy"))
    cpu_model.train()
    cpu_inputs = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    cpu_loss, cpu_grads = loss_and_grads(cpu_model, cpu_inputs)
    assert tpu_grads.keys() == cpu_grads.keys() and len(cpu_grads) > 0
    torch.testing.assert_close(tpu_loss, cpu_loss, atol=1e-5, rtol=1e-4)
    for name, grad in cpu_grads.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(tpu_grads[name], grad, atol=1e-5, rtol=1e-3, msg=name)


@needs_trl
@pytest.mark.slow
def test_trl_grpo_learns_the_toy_task(tmp_path, model_dir):  # noqa: F811
    """30 GRPO steps of TRL's trainer on ``tpu``: the mean reward rises from the untrained model's
    (about 0.1) to >= 0.8."""
    from torchtpu.integrations import trl_grpo

    run = trl_grpo.train(model_dir, tmp_path, steps=30, device="tpu")
    assert run.device == "tpu:0" and len(run.rewards) == 30
    print("mean reward per step:", [round(r, 3) for r in run.rewards])
    assert sum(run.rewards[:3]) / 3 < 0.4
    assert max(run.rewards[-5:]) >= 0.8 and sum(run.rewards[-5:]) / 5 >= 0.7


@needs_verl
def test_verl_recipe_three_steps_split_placement(tmp_path, model_dir):  # noqa: F811
    """VeRL's recipe for 3 steps, the FSDP2 actor and the vLLM rollout on separate ``tpu``
    devices under Ray, a weight sync after each step. Every step is logged and on-policy (the
    rollout sampled with the weights the actor had: staleness 0); the actor's recomputed
    probabilities of the rollout's tokens match the rollout engine's (VeRL's
    ``training/rollout_probs_diff_mean``, float32 on both sides); and after the third step's sync
    the rollout's greedy responses (VeRL's validation, dumped) equal Hugging Face ``generate``
    with the actor's weights of that step (saved by VeRL as a Hugging Face checkpoint), which
    differ from the initial model's on some prompt (the toy task's reward, which the untrained
    model earns on a few samples, so advantages are not all zero, and a learning rate of 0.05: 3
    steps change the greedy tokens, and a rollout left on the old weights would fail this; with
    GSM8K's reward a random model earns nothing, no step moves the weights, and the check could
    not tell a synced rollout from a stale one)."""
    from torchtpu.integrations.verl import recipe

    cmd = recipe.command(model_dir, tmp_path, 3, recipe.greedy_check_overrides(tmp_path, 3), lr=0.05, toy=True)
    out = subprocess.run(cmd, env=recipe.environment(), capture_output=True, text=True, timeout=2400, check=False)
    assert out.returncode == 0, (out.stdout + out.stderr)[-5000:]
    steps = recipe.step_metrics(out.stdout)
    print("probs diff mean/max, log-ppl abs diff per step:", [(m["training/rollout_probs_diff_mean"],
          m["training/rollout_probs_diff_max"], m["rollout_corr/log_ppl_abs_diff"]) for m in steps])
    print("mean reward per step:", [m.get("critic/score/mean") for m in steps])
    assert [int(m["step"]) for m in steps] == [1, 2, 3]
    for m in steps:
        assert m["training/rollout_probs_diff_valid"] == 1
        assert m["training/rollout_probs_diff_mean"] <= 1e-3, m
        assert m["rollout_corr/log_ppl_abs_diff"] <= 1e-3, m  # per sequence, |mean log-prob difference|
        assert m["training/off_policy/trajectory_staleness/max"] == 0, m
        assert m["timing_s/update_weights"] > 0
    rollout = recipe.rollout_greedy(tmp_path, 3)
    actor = recipe.hf_greedy(recipe.actor_checkpoint(tmp_path, 3), tmp_path)
    initial = recipe.hf_greedy(model_dir, tmp_path)
    assert rollout.keys() == actor.keys() and len(rollout) >= 8
    assert rollout == actor
    assert any(actor[p] != initial[p] for p in actor), "3 steps left every greedy response as it was"
