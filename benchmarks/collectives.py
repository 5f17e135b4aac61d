"""Collectives on tpu tensors through torch.distributed, against raw JAX and gloo, on 2 and 4 processes.

For each process count N (``--nproc``, default ``2,4``) the script runs itself under torchrun
(``python -m torch.distributed.run --standalone --nproc-per-node N``, with ``--worker``). Each
worker measures, for ``all_reduce`` (sum), ``all_gather_into_tensor`` and ``reduce_scatter_tensor``
on fp32 buffers of 4 KiB, 16 KiB, ... 64 MiB, the median time of ``--iters`` calls after
``--warmup`` calls, three ways in the same processes, the three taking turns call by call:

* **tpu c10d**: ``torch.distributed`` with ``init_process_group("cpu:gloo,tpu:tpu")`` on tpu
  tensors, each call followed by ``torch.tpu.synchronize()``. When torchtpu registers no ``"tpu"``
  backend, the column reads ``n/a (tpu backend not available)``;
* **raw JAX**: the same collective as one jitted ``jax.shard_map`` (``lax.psum``,
  ``lax.all_gather(tiled=True)``, ``lax.psum_scatter(tiled=True)``) over a mesh of every process's
  device, on a global array built with ``jax.make_array_from_single_device_arrays``, timed with
  ``block_until_ready``. torchtpu joins ``jax.distributed`` itself at its first tpu use under
  torchrun; without the tpu backend the worker joins it (coordinator 127.0.0.1, port
  ``MASTER_PORT + 1``) before any other JAX call;
* **gloo**: ``torch.distributed``'s gloo on CPU tensors.

"bytes" is the size of the whole buffer, as nccl-tests counts it: the all-reduced tensor, the
all-gather's output, the reduce-scatter's input. Every column's first call is checked against
numpy. Rank 0 prints one markdown table per N; the script ends with one line saying whether the
targets hold at >= 4 MiB: tpu c10d within 1.2x of raw JAX and no slower than gloo.

Raw JAX's reduce-scatters run after everything else: on XLA:CPU one gloo reduce-scatter pins the
send buffers of the TCP connections it uses, which makes later large all-reduces slow (the tpu
backend's own reduce-scatter avoids it there; docs/design.md, "XLA:CPU collectives: the
reduce-scatter stall").

    python benchmarks/collectives.py                    # N = 2 and 4, 4 KiB ... 64 MiB
    python benchmarks/collectives.py --quick --nproc 2  # smoke run: 3 sizes, 3 calls each
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from datetime import timedelta

OPS = ("all_reduce", "all_gather", "reduce_scatter")  # reduce-scatter last (see the docstring)
SIZES = [4096 * 4**i for i in range(8)]  # 4 KiB ... 64 MiB
QUICK_SIZES = [4096, 256 * 1024, 4 << 20]
TARGET_BYTES = 4 << 20
TARGET_VS_JAX = 1.2
NA = "n/a (tpu backend not available)"
RUN_ID_ENV = "TORCHTPU_BENCH_COLLECTIVES_RUN"


def human(nbytes: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes // size} {unit}"
    return f"{nbytes} B"


# ---------------------------------------------------------------------------------------------
# Worker: one process of the torchrun launch.


def shard_values(rank: int, n_elems: int):
    """This rank's input: exact in fp32, different per rank and per element."""
    import numpy as np

    return ((rank + 1) + (np.arange(n_elems) % 997) * 0.25).astype(np.float32)


def input_elems(op: str, nbytes: int, world: int) -> int:
    """Elements of each rank's input for a `nbytes` buffer (see "bytes" in the docstring)."""
    total = max(world, nbytes // 4 // world * world)
    return total // world if op == "all_gather" else total


def expected(op: str, rank: int, world: int, n_in: int):
    """What `op` leaves on `rank`, from every rank's input."""
    import numpy as np

    shards = [shard_values(k, n_in) for k in range(world)]
    if op == "all_reduce":
        return sum(shards)
    if op == "all_gather":
        return np.concatenate(shards)
    block = n_in // world
    return sum(x[rank * block:(rank + 1) * block] for x in shards)


def c10d_call(op: str, x, world: int, device: str):
    """One torch.distributed collective on `device` tensors: (call, read the result)."""
    import torch
    import torch.distributed as dist

    inp = torch.from_numpy(x.copy()).to(device)
    if op == "all_reduce":
        out, run = inp, lambda: dist.all_reduce(inp)
    elif op == "all_gather":
        out = torch.empty(inp.numel() * world, device=device)
        run = lambda: dist.all_gather_into_tensor(out, inp)
    else:
        out = torch.empty(inp.numel() // world, device=device)
        run = lambda: dist.reduce_scatter_tensor(out, inp)
    wait = (lambda: torch.tpu.synchronize(device)) if device.startswith("tpu") else (lambda: None)

    def call():
        run()
        wait()

    return call, lambda: out.cpu().numpy()


def jax_call(op: str, x, world: int):
    """The same collective as one jitted shard_map over every process's device."""
    import jax
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("x",))
    body = {"all_reduce": lambda v: lax.psum(v, "x"),
            "all_gather": lambda v: lax.all_gather(v, "x", tiled=True),
            "reduce_scatter": lambda v: lax.psum_scatter(v, "x", tiled=True)}[op]
    program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    local = jax.device_put(x, jax.local_devices()[0])
    arr = jax.make_array_from_single_device_arrays((x.size * world,), NamedSharding(mesh, P("x")),
                                                   [local])
    last = {}

    def call():
        last["out"] = program(arr)
        last["out"].block_until_ready()

    return call, lambda: np.asarray(last["out"].addressable_shards[0].data)


class Worker:
    """This rank's process group, the columns it can run, and its measurements."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.notes: list[str] = []
        self.device = f"tpu:{os.environ.get('LOCAL_RANK', '0')}"  # this process's own device
        self.tpu = self._start()

    def _start(self) -> bool:
        """init_process_group, and jax.distributed joined before any other JAX call."""
        import torch.distributed as dist

        try:
            import torchtpu  # noqa: F401  (registers the "tpu" backend when torchtpu has it)
        except Exception as exc:  # a broken torchtpu must not stop the other two columns
            self.notes.append(f"import torchtpu failed: {exc!r}")
        tpu = "tpu" in dist.Backend.backend_list
        timeout = timedelta(seconds=self.args.group_timeout)
        if not tpu:
            self._join_jax()
            dist.init_process_group("gloo", timeout=timeout)
            self._sync_group()
            return False
        dist.init_process_group("cpu:gloo,tpu:tpu", timeout=timeout)
        self._sync_group()
        try:
            import torch

            if hasattr(torch.tpu, "set_device"):  # as a CUDA script calls torch.cuda.set_device
                torch.tpu.set_device(self.device)
            torch.empty(1, device=self.device).cpu()  # torchtpu starts, joining jax.distributed
        except Exception as exc:
            self.notes.append(f"tpu c10d: first tpu tensor failed: {exc!r}")
            tpu = False
        self._join_jax()
        return tpu

    def _sync_group(self) -> None:
        """A gloo group for agreeing between cells, whose timeout outlasts a failing tpu call."""
        import torch.distributed as dist

        self.sync = dist.new_group(backend="gloo",
                                   timeout=timedelta(seconds=3 * self.args.group_timeout + 30))

    def _join_jax(self) -> None:
        import jax

        if jax.distributed.is_initialized():
            return
        port = int(os.environ["MASTER_PORT"]) + 1
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                                   num_processes=self.world, process_id=self.rank,
                                   initialization_timeout=int(self.args.group_timeout))

    def _everyone_ok(self, ok: bool) -> bool:
        """Whether `ok` holds on every rank (a 4-byte gloo all-reduce; also aligns the ranks)."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([0 if ok else 1], dtype=torch.int32)
        dist.all_reduce(flag, group=self.sync)
        return int(flag) == 0

    def _prepare(self, make, op: str, nbytes: int):
        """One column's call for (op, nbytes), checked against numpy: the call, or why there is none."""
        import numpy as np

        n_in = input_elems(op, nbytes, self.world)
        error = None
        try:
            call, read = make(op, shard_values(self.rank, n_in), self.world)
            call()
            if not np.array_equal(read(), expected(op, self.rank, self.world, n_in)):
                error = "wrong result"
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        if not self._everyone_ok(error is None):
            return error or "failed on another rank"
        return call

    def _measure(self, calls: dict) -> dict:
        """Median ms per column. The columns take turns call by call, so a slow spell on this
        shared machine lands on all of them alike and the ratios stay meaningful."""
        for call in calls.values():
            for _ in range(self.args.warmup - 1):
                call()
        times = {name: [] for name in calls}
        for _ in range(self.args.iters):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
        return {name: statistics.median(t) * 1e3 for name, t in times.items()}

    def run(self) -> list[dict]:
        """Every (op, size): the three columns, in the order the docstring gives."""
        columns = {"jax": jax_call,
                   "gloo": lambda op, x, world: c10d_call(op, x, world, "cpu")}
        if self.tpu:
            columns = {"c10d": lambda op, x, world: c10d_call(op, x, world, self.device), **columns}
        sizes = QUICK_SIZES if self.args.quick else SIZES
        rows = [{"op": op, "bytes": nbytes, "c10d": NA} for op in OPS for nbytes in sizes]
        for row in rows:
            # raw JAX's reduce-scatter stalls the collectives after it: it runs after all others
            now = {k: v for k, v in columns.items() if not (k == "jax" and row["op"] == "reduce_scatter")}
            self._fill(row, now, columns)
        for row in rows:
            if row["op"] == "reduce_scatter":
                self._fill(row, {"jax": jax_call}, columns)
        return rows

    def _fill(self, row: dict, columns: dict, all_columns: dict) -> None:
        """Measure ``columns`` for one row; a failing c10d column is dropped for the rest."""
        if self.tpu and "c10d" not in all_columns and row["c10d"] == NA:
            row["c10d"] = "skipped (error above)"
        calls = {}
        for name, make in columns.items():
            prepared = self._prepare(make, row["op"], row["bytes"])
            if not isinstance(prepared, str):
                calls[name] = prepared
                continue
            row[name] = prepared
            if name == "c10d":
                self.notes.append(f"rank {self.rank}: tpu c10d {row['op']} {human(row['bytes'])}: {prepared}")
                all_columns.pop("c10d", None)  # one failure is enough: the rest would only hang
                row[name] = "error"
        row.update(self._measure(calls))

    def all_notes(self) -> list[str]:
        """Every rank's notes (rank 0 prints them)."""
        import torch.distributed as dist

        gathered = [None] * self.world
        dist.all_gather_object(gathered, self.notes, group=self.sync)
        return [note for notes in gathered for note in notes]

    def close(self) -> None:
        import torch.distributed as dist

        self._everyone_ok(True)
        dist.destroy_process_group()  # every group, the sync group too


def cell(value: float | str) -> str:
    return f"{value:.2f}" if isinstance(value, float) else value


def ratio(a: float | str, b: float | str) -> str:
    return f"{a / b:.2f}x" if isinstance(a, float) and isinstance(b, float) else "n/a"


def verdict(rows: list[dict]) -> str:
    """Whether the targets hold at >= 4 MiB, and which rows miss them."""
    big = [r for r in rows if r["bytes"] >= TARGET_BYTES]
    if any(not isinstance(r["c10d"], float) for r in big):
        return NA if all(r["c10d"] == NA for r in big) else "n/a (tpu c10d failed)"
    misses = [f"{r['op']} {human(r['bytes'])} ({ratio(r['c10d'], r['jax'])} of JAX, "
              f"{ratio(r['c10d'], r['gloo'])} of gloo)" for r in big
              if not isinstance(r["jax"], float) or not isinstance(r["gloo"], float)
              or r["c10d"] > TARGET_VS_JAX * r["jax"] or r["c10d"] > r["gloo"]]
    return "hold" if not misses else "do not hold: " + "; ".join(misses)


def table(rows: list[dict], world: int, args: argparse.Namespace) -> str:
    import jax
    import torch

    lines = [f"## N = {world} (torch {torch.__version__}, jax {jax.__version__}, "
             f"{jax.devices()[0].platform}; median of {args.iters} calls after {args.warmup})", "",
             "| op | bytes | tpu c10d ms | raw JAX ms | gloo ms | c10d/JAX | c10d/gloo |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['op']} | {human(r['bytes'])} | {cell(r['c10d'])} | {cell(r['jax'])} "
                     f"| {cell(r['gloo'])} | {ratio(r['c10d'], r['jax'])} "
                     f"| {ratio(r['c10d'], r['gloo'])} |")
    return "\n".join(lines)


def die_with_parent() -> None:
    """Ask Linux to kill this worker if torchrun dies, so no worker outlives a killed run."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def worker(args: argparse.Namespace) -> None:
    die_with_parent()
    bench = Worker(args)
    rows = bench.run()
    notes = bench.all_notes()
    if bench.rank == 0:
        print(table(rows, bench.world, args))
        for note in notes:
            print(f"\nnote: {note}")
        print("\nVERDICT " + json.dumps({"world": bench.world, "verdict": verdict(rows)}), flush=True)
    bench.close()


# ---------------------------------------------------------------------------------------------
# Driver: one torchrun per N.


def kill_leftovers(run_id: str) -> None:
    """SIGKILL any process of this run still alive (found by the run id in its environment)."""
    marker = f"{RUN_ID_ENV}={run_id}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    os.kill(int(pid), signal.SIGKILL)
        except OSError:
            continue


def launch(world: int, args: argparse.Namespace, passthrough: list[str]) -> str | None:
    """Run the workers for N = `world` under torchrun; print rank 0's table; return its verdict."""
    run_id = uuid.uuid4().hex
    env = {**os.environ, RUN_ID_ENV: run_id}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(world), "--max-restarts", "0", os.path.abspath(__file__), "--worker", *passthrough]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # torchrun stops its workers on SIGTERM
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        err = f"timed out after {args.timeout:.0f} s\n{err}"
    finally:
        kill_leftovers(run_id)
    found = None
    for line in out.splitlines():
        if line.startswith("VERDICT "):
            found = json.loads(line[len("VERDICT "):])["verdict"]
        elif not line.startswith("[Gloo] "):  # gloo's connection messages
            print(line)
    if proc.returncode != 0 or found is None:
        print(f"\nN = {world}: torchrun exited with {proc.returncode}:\n{err.strip()[-3000:]}")
    print(flush=True)
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", default="2,4", help="process counts, comma-separated (default 2,4)")
    p.add_argument("--quick", action="store_true", help="3 sizes (4 KiB, 256 KiB, 4 MiB), 3 calls each")
    p.add_argument("--iters", type=int, default=None, help="timed calls per cell (default 10; quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 2; quick 1)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per N before everything is killed (default 1200; quick 100)")
    p.add_argument("--group-timeout", type=float, default=60,
                   help="seconds to wait for the other ranks to join (default 60)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.iters = args.iters or (3 if args.quick else 10)
    args.warmup = max(1, args.warmup or (1 if args.quick else 2))
    args.timeout = args.timeout or (100 if args.quick else 1200)
    if args.worker:
        worker(args)
        return 0
    passthrough = ["--iters", str(args.iters), "--warmup", str(args.warmup),
                   "--group-timeout", str(args.group_timeout)] + (["--quick"] if args.quick else [])
    verdicts = {n: launch(n, args, passthrough) for n in map(int, args.nproc.split(","))}
    summary = "; ".join(f"N={n}: {v or 'no result'}" for n, v in verdicts.items())
    print(f"Targets at >= {human(TARGET_BYTES)} (tpu c10d <= {TARGET_VS_JAX}x raw JAX and no slower "
          f"than gloo): {summary}")
    return 0 if all(verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
