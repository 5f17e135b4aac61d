"""Ray on ``tpu``: a CPU task feeds a task that asks for a ``TPU``, then Ray Train runs DDP on
``tpu`` with ``ScalingConfig(use_tpu=True)`` and the ``tpu_dist`` backend.

    pip install 'torchtpu[ray]'
    python examples/ray_workflow.py [--part workflow|train|both] [--workers 2]

On a machine without TPU chips, ``TORCHTPU_PLATFORM=cpu`` runs the ``tpu`` device on XLA:CPU;
the script then declares the ``TPU`` resources itself (``ray.init(resources=...)``), one per
worker. Each result is checked against the same computation on the CPU.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

try:
    import ray
except ImportError as error:
    raise SystemExit(f"{error}. This example needs the ray extra: pip install 'torchtpu[ray]'") from None

# Ray Train's use_tpu=True with more than one worker wants a slice: an accelerator type and a
# topology that Ray knows. A single-host one ("2x2": 4 chips, one host) needs no GCE metadata and
# no node labels; Ray has no 2-chip topology, so two workers take 2 of its 4 TPU resources each.
ACCELERATOR_TYPE = "TPU-V6E"
TOPOLOGY = "2x2"
SLICE_TPUS = 4


def make_data(n: int = 64, d: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear-regression problem: inputs and noisy targets, on the CPU."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(d, 1, generator=g)
    return x, x @ w + 0.01 * torch.randn(n, 1, generator=g)


def fit(x: torch.Tensor, y: torch.Tensor, device: str, steps: int = 5, lr: float = 0.1
        ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """A few full-batch SGD steps of a fixed-init linear model on ``device``: the loss per step and
    the trained weights (on the CPU)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(x.shape[1], 1).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = x.to(device), y.to(device)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {name: value.cpu() for name, value in model.state_dict().items()}


@ray.remote(num_cpus=1)
def produce(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU stage: builds the data set."""
    return make_data(seed=seed)


@ray.remote(num_cpus=1, resources={"TPU": 1})
def train_on_tpu(data: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """The TPU stage: trains on ``tpu`` in the worker that holds the ``TPU`` resource."""
    import torch_tpu._loader

    torch_tpu._loader.load()  # the device and the c10d backends, as Ray Train's TPU support loads them

    x, y = data
    losses, weights = fit(x, y, "tpu")
    return {"device": str(torch.ones(1, device="tpu").device), "losses": losses, "weights": weights}


def run_workflow(seed: int = 0) -> dict:
    """CPU task -> TPU task; returns the TPU task's result and the CPU reference."""
    result = ray.get(train_on_tpu.remote(produce.remote(seed)), timeout=300)
    cpu_losses, cpu_weights = fit(*make_data(seed=seed), "cpu")
    return {**result, "cpu_losses": cpu_losses, "cpu_weights": cpu_weights}


def train_loop_per_worker(config: dict) -> None:
    """One Ray Train worker: DDP on ``tpu`` over this rank's shard of the batch."""
    import torch.distributed as dist
    import ray.train
    import ray.train.torch

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(torch.nn.Linear(config["d"], 1))
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"])
    x, y = make_data(d=config["d"], seed=config["seed"])
    x, y = x[rank::world].to(device), y[rank::world].to(device)
    losses = []
    for _ in range(config["steps"]):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()  # DDP averages the gradients over the ranks through tpu_dist
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    metrics = {"losses": losses, "backend": dist.get_backend(), "device": str(device), "world_size": world}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = None
        if rank == 0:  # Ray keeps the metrics that come with a checkpoint
            torch.save({k: v.cpu() for k, v in model.module.state_dict().items()}, os.path.join(tmp, "model.pt"))
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report(metrics, checkpoint=checkpoint)


def run_train(workers: int = 2, steps: int = 5, storage: str | None = None) -> dict:
    """Ray Train with ``use_tpu=True`` (backend ``tpu_dist``); returns rank 0's report and the
    single-process CPU reference (equal shards, so the DDP mean gradient is the full-batch one)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    config = {"d": 8, "lr": 0.1, "seed": 0, "steps": steps}
    trainer = TorchTrainer(
        train_loop_per_worker, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=workers, use_tpu=True,
                                     resources_per_worker={"CPU": 1, "TPU": SLICE_TPUS // workers},
                                     topology=TOPOLOGY, accelerator_type=ACCELERATOR_TYPE),
        run_config=RunConfig(storage_path=storage or tempfile.mkdtemp(prefix="ray_workflow_"), name="tpu_ddp"))
    result = trainer.fit()
    with result.checkpoint.as_directory() as path:
        weights = torch.load(os.path.join(path, "model.pt"))
    cpu_losses, cpu_weights = fit(*make_data(d=config["d"], seed=config["seed"]), "cpu", steps=steps,
                                  lr=config["lr"])
    return {**result.metrics, "weights": weights, "cpu_losses": cpu_losses, "cpu_weights": cpu_weights}


def start_ray(num_cpus: int = 3) -> None:
    """A local Ray. On a TPU VM Ray finds the chips itself; with ``TORCHTPU_PLATFORM=cpu`` this
    declares one slice's ``TPU`` resources and its accelerator type, and gives the workers the
    platform (one XLA:CPU device per process: no forced host device count)."""
    if os.environ.get("TORCHTPU_PLATFORM") != "cpu":
        ray.init(include_dashboard=False)
        return
    ray.init(num_cpus=num_cpus, resources={"TPU": SLICE_TPUS, f"accelerator_type:{ACCELERATOR_TYPE}": 1},
             runtime_env={"env_vars": {"TORCHTPU_PLATFORM": "cpu", "XLA_FLAGS": ""}}, include_dashboard=False)


def check(out: dict) -> None:
    """The ``tpu`` run's losses and weights match the CPU's within 1e-4 relative."""
    torch.testing.assert_close(out["losses"], out["cpu_losses"], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out["weights"], out["cpu_weights"], rtol=1e-4, atol=1e-6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["workflow", "train", "both"], default="both")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--storage", help="Ray Train's storage path (default: a new temporary folder)")
    args = parser.parse_args()
    start_ray(args.workers + 1)
    try:
        if args.part in ("workflow", "both"):
            out = run_workflow()
            print(f"workflow on {out['device']}: losses {out['losses']}, cpu {out['cpu_losses']}")
            check(out)
        if args.part in ("train", "both"):
            out = run_train(args.workers, storage=args.storage)
            print(f"Ray Train, {out['world_size']} workers, {out['backend']} on {out['device']}: "
                  f"losses {out['losses']}, cpu {out['cpu_losses']}")
            check(out)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
