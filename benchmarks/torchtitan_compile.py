"""TorchTitan's llama3 debug model on ``tpu``: eager against ``--compile.enable``, side by side.

Runs TorchTitan's own trainer (``torchrun -m torchtitan.train --module llama3 --config
llama3_debugmodel``, one device, the generated debug assets) in pairs, eager and compiled back to
back, the order swapped from one pair to the next so that a shared machine's drift hits both
alike, and prints for each run: steps/s (from the timestamps of TorchTitan's step lines, the
first ``--skip`` steps left out: they compile), the median tokens/s and MFU TorchTitan logs, the
peak its MFU is measured against, dynamo's recompiles and graph breaks (``TORCH_LOGS``), and the
load average before and after; then each pair's compiled/eager ratio and their median.

    python benchmarks/torchtitan_compile.py [--pairs 2] [--steps 14] [--skip 4] [--batch 2] [--seq 256]
    python benchmarks/torchtitan_compile.py --alternate [--steps 24] [--skip 4]

``--alternate`` runs one process instead: TorchTitan's trainer with ``--compile.enable``
(``--module torchtitan_compile --config llama3_alternating``, this file on ``PYTHONPATH``), whose
``train_step`` switches every step between the compiled TransformerBlocks and loss and their
eager originals (``nn.Module.compile`` keeps the original ``forward``; the block's
``_compiled_call_impl`` and the loss's compiled ``fn`` are set aside for an eager step), in the
order eager, compiled, compiled, eager, ... so that drift cancels. Each step is timed with the
device synchronized before and after; same weights, same data pipeline, same process, and the
same load for both. It prints the median step time of each and the ratio.

Needs TorchTitan (the venv of ``tools/torchtitan_env.sh``); XLA:CPU unless the host has a TPU.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from processes import kill_tree

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) - root - INFO - step:\s*(\d+)\s+loss:\s*([-\d.]+)"
                   r".*?tps:\s*([\d,]+).*?mfu:\s*([\d.]+)%")
_PEAK = re.compile(r"Peak FLOPS used for computing MFU: ([\d.e+]+)")


def _run(python: str, assets: dict, folder: str, args: argparse.Namespace, compiled: bool) -> dict:
    command = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m", "torchtitan.train",
               "--module", "llama3", "--config", "llama3_debugmodel",
               "--hf_assets_path", assets["hf_assets_path"], "--dataloader.dataset_path", assets["dataset_path"],
               "--training.steps", str(args.steps), "--training.seq_len", str(args.seq),
               "--training.local_batch_size", str(args.batch), "--debug.seed", "0", "--metrics.log_freq", "1",
               "--dump_folder", folder, *(["--compile.enable"] if compiled else [])]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "HF_DATASETS_CACHE": os.path.join(folder, "hf_datasets"), "TORCH_LOGS": "recompiles,graph_breaks"}
    env.pop("XLA_FLAGS", None)  # one device
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)  # torchrun and its worker, each in a session of its own
        out, _ = proc.communicate()
        sys.exit(f"a run did not finish within {args.timeout} s:\n{out[-4000:]}")
    wall = time.perf_counter() - started
    out = _ANSI.sub("", out)
    with open(folder + ".log", "w") as log:
        log.write(out)
    if proc.returncode != 0:
        sys.exit(f"{'compiled' if compiled else 'eager'} run failed:\n{out[-4000:]}")
    steps = {}
    for stamp, step, _loss, tps, mfu in _STEP.findall(out):
        when = dt.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        steps.setdefault(int(step), (when, float(tps.replace(",", "")), float(mfu)))
    first, last = args.skip, args.steps
    if first not in steps or last not in steps:
        sys.exit(f"steps {first} and {last} not both logged:\n{out[-4000:]}")
    timed = [steps[s] for s in range(first + 1, last + 1)]
    peak = _PEAK.search(out)
    return {
        "steps_per_s": (last - first) / (steps[last][0] - steps[first][0]),
        "tps": statistics.median(t for _, t, _ in timed),
        "mfu": statistics.median(m for _, _, m in timed),
        "peak": float(peak.group(1)) if peak else float("nan"),
        "recompiles": out.count("Recompiling function"),
        "graph_breaks": out.count("Graph break"),
        "load": (load_before, os.getloadavg()[0]),
        "wall": wall,
        "losses": [round(float(loss), 5) for _s, _st, loss, _t, _m in _STEP.findall(out)][:3],
    }


_ALTERNATING = re.compile(r"alternating step (\d+) (eager|compiled) ([\d.]+) s")
_STEP_MFU = re.compile(r"step:\s*(\d+)\s+loss:.*?mfu:\s*([\d.]+)%")
_TRAINER = None


def _alternating_trainer():
    """TorchTitan's Trainer whose steps alternate between the compiled blocks/loss and eager."""
    global _TRAINER
    if _TRAINER is not None:
        return _TRAINER
    import dataclasses

    import torch
    from torchtitan.tools.logging import logger
    from torchtitan.trainer import Trainer

    class AlternatingTrainer(Trainer):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(Trainer.Config):
            pass

        def _switches(self):
            if not hasattr(self, "_compiled_parts"):
                blocks = [b for part in self.model_parts for b in part.layers.children()]
                losses, stack = [], [self.loss_fn]
                while stack:
                    loss = stack.pop()
                    fn = getattr(loss, "fn", None)
                    if fn is not None and hasattr(fn, "_torchdynamo_orig_callable"):
                        losses.append((loss, fn, fn._torchdynamo_orig_callable))
                    inner = getattr(loss, "loss_fn", None)
                    if inner is not None:
                        stack.append(inner)
                impls = [b._compiled_call_impl for b in blocks]
                if not all(impls) or not losses:
                    raise SystemExit("llama3_alternating needs --compile.enable with the model and the loss compiled")
                self._compiled_parts = (blocks, impls, losses)
            return self._compiled_parts

        def train_step(self, data_iterator):
            blocks, impls, losses = self._switches()
            compiled = (self.step + (self.step - 1) // 2) % 2 == 0  # eager, compiled, compiled, eager, ...
            for block, impl in zip(blocks, impls):
                block._compiled_call_impl = impl if compiled else None
            for loss, compiled_fn, eager_fn in losses:
                loss.fn = compiled_fn if compiled else eager_fn
            torch.accelerator.synchronize()
            started = time.perf_counter()
            result = super().train_step(data_iterator)
            torch.accelerator.synchronize()
            logger.info("alternating step %d %s %.4f s", self.step, "compiled" if compiled else "eager",
                        time.perf_counter() - started)
            return result

    _TRAINER = AlternatingTrainer
    return _TRAINER


def llama3_alternating():
    """TorchTitan's ``llama3_debugmodel`` (with ``--compile.enable``) on the alternating trainer."""
    import dataclasses

    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    base = llama3_debugmodel()
    return _alternating_trainer().Config(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init})


def _alternate(python: str, assets: dict, root: str, args: argparse.Namespace) -> None:
    command = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m", "torchtitan.train",
               "--module", "torchtitan_compile", "--config", "llama3_alternating", "--compile.enable",
               "--hf_assets_path", assets["hf_assets_path"], "--dataloader.dataset_path", assets["dataset_path"],
               "--training.steps", str(args.steps), "--training.seq_len", str(args.seq),
               "--training.local_batch_size", str(args.batch), "--debug.seed", "0", "--metrics.log_freq", "1",
               "--dump_folder", os.path.join(root, "alternating")]
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "HF_DATASETS_CACHE": os.path.join(root, "hf_datasets"), "TORCH_LOGS": "recompiles,graph_breaks",
           "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
    env.pop("XLA_FLAGS", None)
    load_before = os.getloadavg()[0]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, _ = proc.communicate()
        sys.exit(f"the alternating run did not finish within {args.timeout} s:\n{out[-4000:]}")
    out = _ANSI.sub("", out)
    with open(os.path.join(root, "alternating.log"), "w") as log:
        log.write(out)
    if proc.returncode != 0:
        sys.exit(f"the alternating run failed:\n{out[-4000:]}")
    times = {"eager": [], "compiled": []}
    mode_of = {}
    for step, mode, seconds in _ALTERNATING.findall(out):
        mode_of[int(step)] = mode
        if int(step) > args.skip:
            times[mode].append(float(seconds))
    mfu = {"eager": [], "compiled": []}
    for step, value in _STEP_MFU.findall(out):
        if int(step) > args.skip and int(step) in mode_of:
            mfu[mode_of[int(step)]].append(float(value))
    peak = _PEAK.search(out)
    print(f"llama3 debugmodel, {args.batch} x {args.seq} tokens a step, one process, steps alternating "
          f"eager/compiled, steps {args.skip + 1}-{args.steps} timed; load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after; MFU against {float(peak.group(1)) if peak else float('nan'):.3g} FLOP/s; "
          f"recompiles {out.count('Recompiling function')}, graph breaks {out.count('Graph break')}")
    print("| mode | steps timed | median step s | steps/s (1 / median) | min / max step s | MFU (median, as logged) |")
    print("|---|---|---|---|---|---|")
    median = {}
    for mode in ("eager", "compiled"):
        median[mode] = statistics.median(times[mode])
        print(f"| {mode} | {len(times[mode])} | {median[mode]:.3f} | {1 / median[mode]:.3f} | "
              f"{min(times[mode]):.3f} / {max(times[mode]):.3f} | {statistics.median(mfu[mode]):.1f} % |")
    print(f"compiled / eager steps/s: {median['eager'] / median['compiled']:.2f} "
          f"(TorchTitan's output: {os.path.join(root, 'alternating.log')})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--skip", type=int, default=4, help="steps left out of the timing (compiles)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--alternate", action="store_true", help="one process, eager and compiled steps alternating")
    args = parser.parse_args()

    from torchtpu.integrations.torchtitan import write_debug_assets

    root = tempfile.mkdtemp(prefix="torchtitan_compile_")
    assets = write_debug_assets(os.path.join(root, "assets"))
    if args.alternate:
        _alternate(args.python, assets, root, args)
        return
    print(f"llama3 debugmodel, {args.batch} x {args.seq} tokens a step, steps {args.skip + 1}-{args.steps} "
          f"of {args.steps} timed, {args.pairs} pairs (order alternates)")
    header = ("| pair | mode | steps/s | tokens/s (median) | MFU (median, as logged) | peak (FLOP/s) | "
              "recompiles | graph breaks | load avg before/after | wall s |")
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    ratios = []
    for pair in range(args.pairs):
        order = (False, True) if pair % 2 == 0 else (True, False)
        results = {}
        for compiled in order:
            name = "compiled" if compiled else "eager"
            r = _run(args.python, assets, os.path.join(root, f"{name}{pair}"), args, compiled)
            results[compiled] = r
            print(f"| {pair + 1} | {name} | {r['steps_per_s']:.3f} | {r['tps']:.0f} | {r['mfu']:.1f} % | "
                  f"{r['peak']:.3g} | {r['recompiles']} | {r['graph_breaks']} | "
                  f"{r['load'][0]:.1f} / {r['load'][1]:.1f} | {r['wall']:.0f} |", flush=True)
        ratios.append(results[True]["steps_per_s"] / results[False]["steps_per_s"])
        eager_losses, compiled_losses = results[False]["losses"], results[True]["losses"]
        if any(abs(c - e) > 1e-4 * abs(e) for c, e in zip(compiled_losses, eager_losses)):
            print(f"  (first losses differ by more than 1e-4: eager {eager_losses}, compiled {compiled_losses})")
    print("compiled / eager steps/s, per pair: " + ", ".join(f"{r:.2f}" for r in ratios)
          + f"; median {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
