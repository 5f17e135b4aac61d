"""XLA:CPU collectives: why large psums crawl after one small reduce-scatter, reproduced.

The symptom: on XLA:CPU with 4 processes (``jax.distributed``, one CPU device each, collectives
through gloo), after one ``lax.psum_scatter(tiled=True)`` in a ``jax.shard_map``, every later
4 MiB fp32 ``lax.psum`` takes about 3.8 s instead of about 20 ms.

Cause. jaxlib 0.10.2 runs XLA's CPU reduce-scatter with gloo's old-style
``gloo::ReduceScatterHalvingDoubling``, which sends through ``tcp::Buffer::send`` ->
``tcp::Pair::send``. That path sizes the socket's send buffer to the message:
``setsockopt(SO_SNDBUF, min(message bytes, 32 MiB))``. On Linux an explicit ``SO_SNDBUF`` also
turns the kernel's send-buffer autotuning off for that socket, for good. All-reduce, all-gather,
all-to-all and collective-permute use gloo's ``UnboundBuffer`` path, which never resizes. So a
reduce-scatter of small blocks leaves the TCP connections it used with a send buffer of twice its
largest message (4608 bytes, the kernel minimum, for a 4 KiB one), while the ring all-reduce uses
the same connections later. On loopback (MTU 64 KiB) a send buffer under about one 64 KiB segment
allows one unacknowledged segment at a time, and the receiver, which sends no data back on that
connection (a ring of >= 3), delays its ACK by the kernel's 40 ms minimum: about 64 KiB per 40 ms,
1.6 MB/s. A 4 MiB ring all-reduce on 4 processes sends 6 MiB per process: 3.8 s.
``ss -tmi`` during the stall shows the data connections with ``tb4608`` (the pinned send buffer),
``unacked:1``, ``rtt`` 37-40 ms and ``ato:40``; the one ring connection the reduce-scatter did not
use keeps an autotuned 3.9 MB buffer and a 0.2 ms rtt.

Evidence (``--matrix``; N=4 unless stated, psum of 4 MiB per process, median ms of 3; 2-core
machine; "SO_SNDBUF after": the smallest send buffer among each rank's TCP sockets, read from
``/proc/self/fd``; every result checked against numpy):

| variant (second op, bytes per process)  | psum before | psum after | CPU use after | SO_SNDBUF after |
|---|---|---|---|---|
| no second op                            | 27.2 | 16.6    | 29% | 3939840 (autotuned) |
| reduce-scatter 4 KiB                    | 23.2 | 3808.0  | 1%  | 4608    |
| reduce-scatter 64 KiB                   | 36.5 | 3755.4  | 1%  | 32864   |
| reduce-scatter 128 KiB                  | 20.8 | 3740.2  | 0%  | 65632   |
| reduce-scatter 192 KiB                  | 30.0 | 20.4    | 25% | 98400   |
| reduce-scatter 4 MiB                    | 19.6 | 15.3    | 14% | 2097248 |
| all-gather / psum / all-to-all / ppermute 4 KiB | 13.5-32.2 | 11.4-26.5 | 31-40% | 3939840 |
| reduce-scatter 4 KiB, psum 64 KiB       | 8.3  | 8.4     | 6%  | 4608    |
| reduce-scatter 4 KiB, psum 256 KiB      | 12.3 | 12.7    | 11% | 4608    |
| reduce-scatter 4 KiB, psum 1 MiB        | 8.4  | 534.6   | 1%  | 4608    |
| reduce-scatter 4 KiB, psum 16 MiB       | 51.1 | 16202.0 | 0%  | 4608    |
| reduce-scatter 4 KiB, 1 core per process (taskset) | 29.9 | 3616.0 | 1% | 4608 |
| reduce-scatter 4 KiB, 1 thread (OMP=1, no multi-thread Eigen) | 13.9 | 3887.5 | 0% | 4608 |
| reduce-scatter 4 KiB, N=2               | 40.3 | 11.6    | 6%  | 4608    |
| RS as psum + slice 4 KiB                | 25.7 | 15.5    | 33% | 3939840 |
| RS as all-to-all + sum 4 KiB            | 35.3 | 20.6    | 28% | 3939840 |

So: only the reduce-scatter (not any second distinct program); only when its largest message
leaves the send buffer at or under about 64 KiB (per-process input <= 128 KiB at N=4); only for
later messages >= about 1 MiB; time grows with bytes (1 MiB 0.5 s, 4 MiB 3.8 s, 16 MiB 16 s),
so it is throughput, not a timeout. With 2 processes the one connection carries data both ways,
ACKs ride on it, and the all-reduce slows 1.7x to 20x (varies by run) instead of 200x.

Ruled out: CPU oversubscription and spinning (1 core per process or 1 thread changes nothing; the
processes use 0-1% CPU during the stall: they sleep in TCP); XLA flags (``--xla_cpu_*`` holds
only the collective timeout and stuck-call timeouts, which do not reach gloo's transport, and the
time scales with bytes); the collectives implementation (``"gloo"`` is the only one that runs here:
``"mpi"`` needs MPItrampoline and an MPI library, ``"megascale"`` is TPU-only); a rendezvous (the
psum program is compiled before the reduce-scatter in most rows; compiling it after changes
nothing). No issue in jax-ml/jax, openxla/xla or pytorch/gloo reports this slowdown; related ones
are about the same gloo reduce-scatter path (it ignores ``--xla_cpu_collective_timeout_seconds``;
it can return wrong values with several devices per process). The values were right in every run
here. A later XLA reimplements the CPU reduce-scatter on gloo's ``UnboundBuffer`` API, which
does not resize sockets; re-run this script after a jax upgrade to see whether the pitfall remains.

Workaround (for torchtpu's collectives on multi-process XLA:CPU): do not emit XLA's reduce-scatter;
write it as ``psum`` and keep this rank's block (``lax.dynamic_slice_in_dim(lax.psum(x, ax),
lax.axis_index(ax) * n, n)``). It leaves the sockets autotuned, and at 4 MiB per process costs
23.6 ms against psum_scatter's 18.2 ms at N=4. All-to-all + a local sum also avoids the pinning
but took 43.5 ms (N=4) and 32.8 ms (N=2, psum_scatter 18.5 ms). Warming up with one large
reduce-scatter would also pin each socket, only at a larger size, and depends on what ran first.
No environment variable or XLA flag changes gloo's ``SO_SNDBUF`` call.

Re-run:

    python tools/repro_cpu_collectives_stall.py                        # one row: RS 4 MiB, N=4
    python tools/repro_cpu_collectives_stall.py --second-bytes 4096    # the stall
    python tools/repro_cpu_collectives_stall.py --second rs_psum_slice --second-bytes 4096
    python tools/repro_cpu_collectives_stall.py --matrix               # the table above (~8 min)

Each run starts N local processes (``jax.distributed`` on 127.0.0.1 and a free port, before any
other JAX call), times ``--before`` psums, runs the ``--second`` collective ``--second-count``
times, times ``--after`` psums, checks results against numpy, and prints one markdown row. All
children run in their own process groups and are killed after ``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

SECOND_OPS = ("psum_scatter", "rs_all_to_all", "rs_psum_slice", "all_gather", "psum_other",
              "all_to_all", "ppermute", "none")


def free_port() -> int:
    """A TCP port nothing listens on right now (for the JAX coordinator)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# One process of the N (run with --child).


def shard_values(rank: int, n_elems: int):
    """Process `rank`'s shard: exact in fp32 and different per rank and per element."""
    import numpy as np
    return ((rank + 1) + (np.arange(n_elems) % 997) * 0.25).astype(np.float32)


def bodies(world: int) -> dict:
    """The second collective of each variant, as a shard_map body over axis "x"."""
    from jax import lax

    def rs_all_to_all(v):  # block j of the result came from rank j: sum the blocks
        return lax.all_to_all(v, "x", 0, 0, tiled=True).reshape(world, -1).sum(0)

    def rs_psum_slice(v):  # all-reduce, keep this rank's block
        size = v.shape[0] // world
        return lax.dynamic_slice_in_dim(lax.psum(v, "x"), lax.axis_index("x") * size, size)

    return {
        "psum_scatter": lambda v: lax.psum_scatter(v, "x", tiled=True),
        "rs_all_to_all": rs_all_to_all,
        "rs_psum_slice": rs_psum_slice,
        "all_gather": lambda v: lax.all_gather(v, "x", tiled=True),
        "psum_other": lambda v: lax.psum(v * 2, "x"),
        "all_to_all": lambda v: lax.all_to_all(v, "x", 0, 0, tiled=True),
        "ppermute": lambda v: lax.ppermute(v, "x", [(i, (i + 1) % world) for i in range(world)]),
    }


def expected(op: str, rank: int, world: int, n_elems: int):
    """What `op` must leave on `rank`, computed with numpy from every rank's shard."""
    import numpy as np
    shards = [shard_values(k, n_elems) for k in range(world)]
    block = slice(rank * (n_elems // world), (rank + 1) * (n_elems // world))
    return {
        "psum_scatter": lambda: sum(x[block] for x in shards),
        "rs_all_to_all": lambda: sum(x[block] for x in shards),
        "rs_psum_slice": lambda: sum(x[block] for x in shards),
        "all_gather": lambda: np.concatenate(shards),
        "psum_other": lambda: 2 * sum(shards),
        "all_to_all": lambda: np.concatenate([x[block] for x in shards]),
        "ppermute": lambda: shards[(rank - 1) % world],
        "psum": lambda: sum(shards),
    }[op]()


def send_buffer_sizes() -> list[int]:
    """SO_SNDBUF of this process's established TCP sockets (gloo's pairs, the coordinator's)."""
    sizes = []
    for name in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        with sock:
            try:
                if sock.type != socket.SOCK_STREAM:
                    continue
                sock.getpeername()
                sizes.append(sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF))
            except OSError:
                continue
    return sorted(sizes)


def child(args: argparse.Namespace) -> None:
    """Initialise jax.distributed, time psums, the second collective, psums again; print JSON."""
    rank, world = args.rank, args.nproc
    import jax

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}",
                               num_processes=world, process_id=rank,
                               initialization_timeout=60)
    if args.impl:
        jax.config.update("jax_cpu_collectives_implementation", args.impl)
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("x",))
    sharding = NamedSharding(mesh, P("x"))

    def global_array(n_bytes: int):  # each process holds n_bytes of it (one all-reduce message)
        n_elems = max(world, n_bytes // 4 // world * world)
        shard = jax.device_put(shard_values(rank, n_elems), jax.local_devices()[0])
        return jax.make_array_from_single_device_arrays((n_elems * world,), sharding, [shard])

    def program(body):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))

    def timed(fn, arg, count: int) -> tuple[list[float], float]:
        """Wall time of each call, and the share of one core this process used meanwhile."""
        times, cpu = [], time.process_time()
        for _ in range(count):
            start = time.perf_counter()
            fn(arg).block_until_ready()
            times.append(time.perf_counter() - start)
        return times, (time.process_time() - cpu) / max(sum(times), 1e-9)

    def correct(op: str, fn, arg) -> bool:
        got = np.asarray(fn(arg).addressable_shards[0].data)
        return bool(np.array_equal(got, expected(op, rank, world, arg.shape[0] // world)))

    psum = program(lambda v: jax.lax.psum(v, "x"))
    x = global_array(args.bytes)
    timed(psum, x, args.warmup if args.before else 0)
    before, _ = timed(psum, x, args.before)
    sndbuf_before = send_buffer_sizes()
    result = {"rank": rank, "before": before, "second": [], "second_ok": True}
    if args.second != "none":
        second, y = program(bodies(world)[args.second]), global_array(args.second_bytes or args.bytes)
        result["second"], _ = timed(second, y, args.second_count)
        result["second_ok"] = correct(args.second, second, y)
    result["after"], result["after_cpu"] = timed(psum, x, args.after)
    result["psum_ok"] = correct("psum", psum, x)
    result["sndbuf_before"], result["sndbuf_after"] = sndbuf_before, send_buffer_sizes()
    print("RESULT " + json.dumps(result), flush=True)
    jax.distributed.shutdown()


# ---------------------------------------------------------------------------------------------
# The launcher.


def child_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment of one child: XLA flags and thread settings of the variant under test
    (only the flags given with --xla-flag, so that each process has one CPU device)."""
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = " ".join(args.xla_flag)
    if args.threads:
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[name] = str(args.threads)
    for item in args.env:
        key, _, value = item.partition("=")
        env[key] = value
    return env


def launch(args: argparse.Namespace) -> list[dict]:
    """Start N children (each in its own process group), wait, return their results by rank."""
    port = free_port()
    cores = os.sched_getaffinity(0)
    procs = []
    for rank in range(args.nproc):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--rank", str(rank),
               "--port", str(port), *args.passthrough]
        if args.pin:  # one core per process, round robin
            cmd = ["taskset", "-c", str(sorted(cores)[rank % len(cores)]), *cmd]
        procs.append(subprocess.Popen(cmd, env=child_env(args), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, start_new_session=True))
    deadline = time.monotonic() + args.timeout
    results, errors = [], []
    try:
        for rank, proc in enumerate(procs):
            try:
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                errors.append(f"rank {rank}: timed out after {args.timeout} s")
                continue
            lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                errors.append(f"rank {rank}: exit {proc.returncode}: {err.strip()[-800:]}")
            else:
                results.append(json.loads(lines[-1][len("RESULT "):]))
    finally:
        for proc in procs:  # never leave a child (or its children) behind
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if errors:
        raise SystemExit("\n".join(errors))
    return sorted(results, key=lambda r: r["rank"])


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.1f}" if values else "-"


def report(args: argparse.Namespace, results: list[dict]) -> str:
    """One markdown row of HEADER for this variant."""
    if args.verbose:
        for r in results:
            print(f"rank {r['rank']}: psum ms after: " + " ".join(f"{t * 1e3:.0f}" for t in r["after"])
                  + f"; SO_SNDBUF before {r['sndbuf_before']} after {r['sndbuf_after']}",
                  file=sys.stderr)
    zero = results[0]
    slowest = max(statistics.median(r["after"]) for r in results) * 1e3
    gloo_min = lambda key: min((min(r[key]) for r in results if r[key]), default=0)
    ok = all(r["second_ok"] and r["psum_ok"] for r in results)
    second = args.second if args.second == "none" else f"{args.second} {args.second_bytes or args.bytes}"
    return (f"| {args.label or second} | {args.nproc} | {args.bytes} | {ms(zero['before'])} "
            f"| {ms(zero['second'])} | {ms(zero['after'])} | {slowest:.1f} "
            f"| {zero['after_cpu']:.0%} | {gloo_min('sndbuf_before')} / {gloo_min('sndbuf_after')} "
            f"| {'yes' if ok else 'NO'} |")


HEADER = ("| variant (second op, bytes) | N | psum bytes | psum ms before | second op ms "
          "| psum ms after | after, slowest rank | CPU use after | min SO_SNDBUF before / after "
          "| correct |\n|---|---|---|---|---|---|---|---|---|---|")


# The bisection behind the write-up above: (label, arguments); `--matrix` runs them all.
MATRIX = [
    ("no second op", "--second none"),
    ("reduce-scatter 4 KiB", "--second psum_scatter --second-bytes 4096"),
    ("reduce-scatter 64 KiB", "--second psum_scatter --second-bytes 65536"),
    ("reduce-scatter 128 KiB", "--second psum_scatter --second-bytes 131072"),
    ("reduce-scatter 192 KiB", "--second psum_scatter --second-bytes 196608"),
    ("reduce-scatter 4 MiB", "--second psum_scatter"),
    ("all-gather 4 KiB", "--second all_gather --second-bytes 4096"),
    ("another psum 4 KiB", "--second psum_other --second-bytes 4096"),
    ("all-to-all 4 KiB", "--second all_to_all --second-bytes 4096"),
    ("ppermute 4 KiB", "--second ppermute --second-bytes 4096"),
    ("RS as all-to-all + sum 4 KiB", "--second rs_all_to_all --second-bytes 4096"),
    ("RS as psum + slice 4 KiB", "--second rs_psum_slice --second-bytes 4096"),
    ("reduce-scatter 4 KiB, psum 64 KiB", "--second-bytes 4096 --bytes 65536"),
    ("reduce-scatter 4 KiB, psum 256 KiB", "--second-bytes 4096 --bytes 262144"),
    ("reduce-scatter 4 KiB, psum 1 MiB", "--second-bytes 4096 --bytes 1048576"),
    ("reduce-scatter 4 KiB, psum 16 MiB", "--second-bytes 4096 --bytes 16777216 --after 2"),
    ("reduce-scatter 4 KiB, 1 core per process", "--second-bytes 4096 --pin"),
    ("reduce-scatter 4 KiB, 1 thread", "--second-bytes 4096 --threads 1 "
     "--xla-flag=--xla_cpu_multi_thread_eigen=false"),
    ("reduce-scatter 4 KiB, N=2", "--second-bytes 4096 --nproc 2"),
    ("no second op, N=2", "--second none --nproc 2"),
    ("reduce-scatter 4 MiB x5 (timed)", "--second-count 5"),
    ("RS as all-to-all + sum 4 MiB x5", "--second rs_all_to_all --second-count 5"),
    ("RS as psum + slice 4 MiB x5", "--second rs_psum_slice --second-count 5"),
    ("reduce-scatter 4 MiB x5, N=2", "--second-count 5 --nproc 2"),
    ("RS as all-to-all + sum 4 MiB x5, N=2", "--second rs_all_to_all --second-count 5 --nproc 2"),
]


def run_matrix(argv: list[str]) -> None:
    """Every MATRIX row, one after the other, as one table (`argv` is added to each row)."""
    print(HEADER, flush=True)
    for label, row in MATRIX:
        args = parse(["--before", "3", "--after", "3", *row.split(), *argv, "--label", label])
        try:
            print(report(args, launch(args)), flush=True)
        except SystemExit as err:
            print(f"| {label} | failed: {str(err).splitlines()[0][:120]} |", flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4, help="number of processes (default 4)")
    p.add_argument("--bytes", type=int, default=4 << 20,
                   help="psum message: bytes of fp32 each process all-reduces (default 4 MiB)")
    p.add_argument("--second", choices=SECOND_OPS, default="psum_scatter",
                   help="the one collective run between the two psum phases")
    p.add_argument("--second-bytes", type=int, default=0, help="its message size (default: --bytes)")
    p.add_argument("--second-count", type=int, default=1, help="how many times to call it")
    p.add_argument("--before", type=int, default=5, help="timed psums before it (0: psum is "
                   "first compiled after it)")
    p.add_argument("--after", type=int, default=5, help="timed psums after it")
    p.add_argument("--warmup", type=int, default=2, help="untimed psums before the first phase")
    p.add_argument("--impl", default="", help="jax_cpu_collectives_implementation (default: jax's)")
    p.add_argument("--xla-flag", action="append", default=[], help="an XLA flag (repeatable)")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the children")
    p.add_argument("--threads", type=int, default=0, help="OMP/MKL/OPENBLAS_NUM_THREADS")
    p.add_argument("--pin", action="store_true", help="taskset each process to one core")
    p.add_argument("--timeout", type=float, default=120, help="seconds before all are killed")
    p.add_argument("--label", default="", help="name of this row in the table")
    p.add_argument("--verbose", action="store_true", help="every psum time after, per rank")
    p.add_argument("--header", action="store_true", help="print the table header first")
    p.add_argument("--matrix", action="store_true", help="run the whole bisection (MATRIX)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    # What a child needs to know of the variant (the launcher passes it on verbatim).
    args.passthrough = ["--nproc", str(args.nproc), "--bytes", str(args.bytes), "--second",
                        args.second, "--second-bytes", str(args.second_bytes), "--second-count",
                        str(args.second_count), "--before", str(args.before), "--after",
                        str(args.after), "--warmup", str(args.warmup), "--impl", args.impl]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.child:
        child(args)
        return
    if args.matrix:
        run_matrix([a for a in (argv if argv is not None else sys.argv[1:]) if a != "--matrix"])
        return
    if args.header:
        print(HEADER)
    print(report(args, launch(args)), flush=True)


if __name__ == "__main__":
    main()
