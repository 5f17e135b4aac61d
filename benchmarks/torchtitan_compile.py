"""TorchTitan's llama3 debug model on ``tpu``: eager against ``--compile.enable``, side by side.

Runs TorchTitan's own trainer (``torchrun -m torchtitan.train --module llama3 --config
llama3_debugmodel``, one device, the generated debug assets) in pairs, eager and compiled back to
back, the order swapped from one pair to the next so that a shared machine's drift hits both
alike, and prints for each run: steps/s (from the timestamps of TorchTitan's step lines, the
first ``--skip`` steps left out: they compile), the median tokens/s and MFU TorchTitan logs, the
peak its MFU is measured against, dynamo's recompiles and graph breaks (``TORCH_LOGS``), and the
load average before and after; then each pair's compiled/eager ratio and their median.

    python benchmarks/torchtitan_compile.py [--pairs 2] [--steps 14] [--skip 4] [--batch 2] [--seq 256]

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--skip", type=int, default=4, help="steps left out of the timing (compiles)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args()

    from torchtpu.integrations.torchtitan import write_debug_assets

    root = tempfile.mkdtemp(prefix="torchtitan_compile_")
    assets = write_debug_assets(os.path.join(root, "assets"))
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
