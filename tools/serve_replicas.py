"""Serve N replicas of one model on ``tpu`` behind a real router, from one command.

    python tools/serve_replicas.py MODEL [--replicas 2] [--engine vllm|sglang]
        [--policy cache_aware] [--port 30000] [--routers 1] [--kv-events]
        [--engine-python PY] [--log-dir DIR] [-- ENGINE ARGS...]

One engine process per replica (``vllm serve`` or ``python -m sglang.launch_server``, on
torchtpu's platform), each on its own port of 127.0.0.1 and, on a TPU host, on its own chip
(libtpu's chip-visibility variables: replica i sees chip i); then the router: vLLM's
``vllm-router`` in front of vLLM replicas, the SGLang gateway's ``smg`` in front of SGLang ones
(both Rust wheels from the package index; ``tools/vllm_env.sh`` and ``tools/sglang_env.sh`` put
them in the engines' venvs). The router is started only once every replica answers
``/health``; the router's own health checks then take a replica that stops answering out of
the rotation and put it back when it answers again. ``--routers 2`` starts a second router on
the next port in front of the same replicas (highly available routing: either one serves). The
script prints the router URLs and serves until Ctrl-C or SIGTERM, then stops everything it
started.

What the routers need from vLLM replicas, which this script passes:

- ``--enable-scale-out``: vLLM's ``/v1/completions/render`` and ``/v1/chat/completions/render``,
  which the router calls to tokenize a request with the engine's own tokenizer before it matches
  the tokens against its prefix tree. Without it vLLM answers 403 and ``vllm-router`` routes
  without the request's tokens (issue 30: "cache_aware does not take effect").
- ``--kv-events``: vLLM's KV-event publisher (``--kv-events-config``, ZMQ PUB bound on
  ``tcp://*:PORT``; vLLM binds only wildcard or ipc endpoints and the router only connects to
  ``tcp://HOST:PORT``), and the router's ``--kv-event-source`` for each replica: the
  ``kv_aware`` policy then knows which blocks each engine holds, from the engines themselves.
- ``--policy`` is the router's: ``round_robin``, ``cache_aware`` (an approximate prefix tree in
  the router), ``kv_aware`` (vllm-router: exact, from the KV events; implies ``--kv-events``),
  ``power_of_two``, ``consistent_hash`` (session affinity by the ``X-Session-ID`` header), ...

Across hosts: start ``vllm serve`` (with the flags above) on each host, then ``vllm-router
--worker-urls http://HOST:PORT ...`` anywhere; docs/routing.md has the commands. The same
module is what tests/test_routing.py and benchmarks/routing.py start their fleets with
(``Fleet``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ENGINES = ("vllm", "sglang")
ROUTER_OF = {"vllm": "vllm-router", "sglang": "smg"}
BLOCK_SIZE = 16  # the KV block size the replicas are started with (the router hashes blocks of it)
HEALTH_CHECK_INTERVAL_S = 2
# Both routers retry a request that failed on a replica (a refused connection or a body cut short
# answers 500, a retryable status) by picking a replica again, after an exponential backoff.
# Their defaults (5 attempts, 50 ms growing 1.5x) all fall within ~0.5 s, before the health check
# (every HEALTH_CHECK_INTERVAL_S) has taken a dead replica out of the rotation, so under
# round_robin a request can meet the dead replica on every attempt and come back as 500. These
# attempts (at 0, 0.5, 1.5, 3.5 and 7.5 s) outlast the health check.
RETRY_OPTIONS = ("--retry-max-retries", "5", "--retry-initial-backoff-ms", "500", "--retry-backoff-multiplier", "2")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_ok(url: str, timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def chip_env(index: int) -> dict[str, str]:
    """libtpu's variables that give replica ``index`` chip ``index`` alone (a TPU host only)."""
    return {
        "TPU_VISIBLE_CHIPS": str(index),
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        "TPU_PROCESS_BOUNDS": "1,1,1",
        "TPU_PROCESS_PORT": str(8476 + index),
    }


def on_tpu_host() -> bool:
    return any(Path("/dev").glob("accel*")) or Path("/dev/vfio/0").exists()


@dataclass
class Process:
    """One process the fleet started: its command, environment, log and handle."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    log: Path
    url: str
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "a") as out:
            out.write(f"\n# {shlex.join(self.cmd)}\n")
            out.flush()
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the process group (an engine's API server and its engine-core child)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


@dataclass
class Replica(Process):
    index: int = 0
    port: int = 0
    kv_events_port: int | None = None

    @property
    def kv_events_endpoint(self) -> str | None:
        return None if self.kv_events_port is None else f"tcp://127.0.0.1:{self.kv_events_port}"


@dataclass
class Fleet:
    """N engine replicas of ``model`` and the routers in front of them.

    ``with Fleet(model, 2) as fleet: router = fleet.start_router("cache_aware")`` starts the
    replicas (waiting until each is ready) and a router (``router.url``); everything is killed
    when the block ends. ``kill_replica``/``restart_replica`` are for failover."""

    model: str
    replicas: int = 2
    engine: str = "vllm"
    python: str = sys.executable
    engine_args: tuple[str, ...] = ()
    served_name: str = "model"
    kv_events: bool = False
    log_dir: Path | None = None
    start_timeout: float = 900.0
    one_chip_each: bool | None = None  # None: when this is a TPU host
    extra_env: dict[str, str] = field(default_factory=dict)
    smg_python: str | None = None  # the interpreter whose `smg` to run (default: python); see router_command
    members: list[Replica] = field(default_factory=list, init=False)
    routers: list[Process] = field(default_factory=list, init=False)

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, not {self.engine!r}")
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="torchtpu-replicas."))
        self.log_dir = Path(self.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.one_chip_each is None:
            self.one_chip_each = on_tpu_host()

    # ------------------------------------------------------------ replicas
    def _replica(self, index: int, port: int, kv_port: int | None) -> Replica:
        env = {**os.environ, **self.extra_env}
        if self.one_chip_each:
            env.update(chip_env(index))
        if self.engine == "vllm":
            env["VLLM_PLATFORM"] = "tpu"
            cmd = [self.python, "-m", "vllm.entrypoints.cli.main", "serve", self.model,
                   "--host", "127.0.0.1", "--port", str(port), "--served-model-name", self.served_name,
                   "--block-size", str(BLOCK_SIZE), "--enable-scale-out"]
            if kv_port is not None:
                cmd += ["--kv-events-config", json.dumps({
                    "enable_kv_cache_events": True, "publisher": "zmq",
                    "endpoint": f"tcp://*:{kv_port}", "topic": "kv-events"})]
        else:
            env["SGLANG_PLATFORM"] = "tpu"
            # --enable-metrics: the Prometheus figures (sglang:num_running_reqs, num_queue_reqs,
            # token_usage, ...); smg itself reads the same figures from /v1/loads
            cmd = [self.python, "-m", "sglang.launch_server", "--model-path", self.model,
                   "--host", "127.0.0.1", "--port", str(port), "--served-model-name", self.served_name,
                   "--enable-metrics"]
        cmd += list(self.engine_args)
        return Replica(name=f"replica{index}", cmd=cmd, env=env, log=self.log_dir / f"replica{index}.log",
                       url=f"http://127.0.0.1:{port}", index=index, port=port, kv_events_port=kv_port)

    def start(self) -> Fleet:
        for i in range(self.replicas):
            replica = self._replica(i, free_port(), free_port() if self.kv_events else None)
            replica.start()
            self.members.append(replica)
        for replica in self.members:
            self.wait_ready(replica)
        return self

    def wait_ready(self, replica: Replica) -> None:
        """Until the replica serves: ``/health`` and ``/v1/models`` answer 200."""
        deadline = time.monotonic() + self.start_timeout
        while not (http_ok(replica.url + "/health") and http_ok(replica.url + "/v1/models")):
            if not replica.alive():
                raise RuntimeError(f"{replica.name} ({shlex.join(replica.cmd)}) exited:\n{replica.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{replica.name} did not answer in {self.start_timeout:.0f} s:\n{replica.tail()}")
            time.sleep(1)

    def kill_replica(self, index: int) -> None:
        """SIGKILL replica ``index`` (its API server and engine core)."""
        self.members[index].kill()

    def restart_replica(self, index: int, wait: bool = True) -> Replica:
        """Start replica ``index`` again on its port (and KV-event port); wait until it is ready."""
        old = self.members[index]
        old.kill()
        replica = self._replica(index, old.port, old.kv_events_port)
        replica.start()
        self.members[index] = replica
        if wait:
            self.wait_ready(replica)
        return replica

    # ------------------------------------------------------------ routers
    def router_command(self, policy: str, port: int, metrics_port: int, options: tuple[str, ...] = (),
                       router: str | None = None) -> list[str]:
        """The router's command line. ``router`` is the engine's own by default (``vllm-router``
        for vLLM, ``smg`` for SGLang); ``"smg"`` in front of vLLM replicas is the one router here
        with per-tenant admission control (its priority scheduler), which ``vllm-router`` lacks;
        smg talks to them over the OpenAI API."""
        urls = [r.url for r in self.members]
        router = router or ROUTER_OF[self.engine]
        if router not in ROUTER_OF.values():
            raise ValueError(f"router must be one of {sorted(ROUTER_OF.values())}, not {router!r}")
        if router == "vllm-router":
            if self.engine != "vllm":
                raise ValueError("vllm-router fronts vLLM replicas; SGLang replicas go behind smg")
            cmd = [self.python, "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                   "--worker-urls", *urls, "--policy", policy, "--prometheus-port", str(metrics_port), "--prometheus-host", "127.0.0.1",
                   # a dead replica leaves the rotation within seconds, and rejoins as soon
                   "--health-check-interval-secs", str(HEALTH_CHECK_INTERVAL_S), "--health-failure-threshold", "1",
                   "--health-success-threshold", "1", "--health-check-timeout-secs", "5", *RETRY_OPTIONS]
            if policy == "kv_aware":
                missing = [r.name for r in self.members if r.kv_events_port is None]
                if missing:
                    raise ValueError("kv_aware needs the replicas' KV events: start the fleet with kv_events=True")
                for r in self.members:
                    cmd += ["--kv-event-source", f"{r.url}={r.kv_events_endpoint}"]
                cmd += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", self.served_name]
        else:
            cmd = [self.smg_python or self.python, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(port),
                   "--worker-urls", *urls, "--policy", policy, "--backend", "sglang",
                   "--prometheus-port", str(metrics_port), "--prometheus-host", "127.0.0.1",
                   # SGLang's /health generates a token when the server is idle, and waits behind
                   # the running batch otherwise: on loaded cores that takes seconds, so a busy
                   # replica is given 30 s (a dead one refuses the connection at once)
                   "--health-check-interval-secs", str(HEALTH_CHECK_INTERVAL_S), "--health-failure-threshold", "1",
                   "--health-success-threshold", "1", "--health-check-timeout-secs", "30", *RETRY_OPTIONS]
        return cmd + list(options)

    def start_router(self, policy: str = "cache_aware", port: int | None = None, options: tuple[str, ...] = (),
                     timeout: float = 120.0, router: str | None = None) -> Process:
        """A router in front of every replica; returned once it answers ``/health``."""
        port = port or free_port()
        cmd = self.router_command(policy, port, free_port(), tuple(options), router)
        kind = router or ROUTER_OF[self.engine]
        router = Process(name=f"router{len(self.routers)}-{policy}", cmd=cmd, env={**os.environ},
                         log=self.log_dir / f"router{len(self.routers)}-{policy}.log", url=f"http://127.0.0.1:{port}")
        router.start()
        self.routers.append(router)
        deadline = time.monotonic() + timeout
        while not self.router_ready(router, kind):
            if not router.alive():
                raise RuntimeError(f"{kind} exited ({shlex.join(cmd)}):\n{router.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{kind} did not answer in {timeout:.0f} s:\n{router.tail()}")
            time.sleep(0.5)
        return router

    def router_ready(self, router: Process, kind: str) -> bool:
        """The router answers ``/health``; smg, which registers its workers in the background after it
        starts answering, must also know the model and list every replica under ``/workers``."""
        if not http_ok(router.url + "/health"):
            return False
        if kind != "smg":
            return True
        try:
            if not json.loads(fetch(router.url + "/v1/models", timeout=5)).get("data"):
                return False
            listed = fetch(router.url + "/workers", timeout=5)
            return all(json.dumps(r.url) in listed for r in self.members)
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def stop_router(self, router: Process) -> None:
        router.kill()
        self.routers.remove(router)

    # ------------------------------------------------------------ the engines' own figures
    def metrics(self, index: int) -> dict[str, float]:
        """Replica ``index``'s Prometheus figures (``name{labels}`` -> value; labels dropped for one-series names)."""
        return parse_metrics(fetch(self.members[index].url + "/metrics"))

    def close(self) -> None:
        for p in [*self.routers, *self.members]:
            p.kill()
        self.routers.clear()

    def __enter__(self) -> Fleet:  # noqa: PYI034
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()


def fetch(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {``name``: value} summed over each name's series (``_created`` left out)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        if name.endswith("_created"):
            continue
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def main() -> None:
    argv = sys.argv[1:]
    engine_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, engine_args = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Arguments after -- go to every engine (vllm serve / sglang.launch_server).")
    parser.add_argument("model", help="a Hugging Face model directory (or name the engine can load)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--engine", choices=ENGINES, default="vllm")
    parser.add_argument("--policy", default="cache_aware", help="the router's policy (default cache_aware)")
    parser.add_argument("--port", type=int, default=30000, help="the router's port (a second router: port + 1)")
    parser.add_argument("--routers", type=int, default=1, help="routers in front of the same replicas (2: HA)")
    parser.add_argument("--kv-events", action="store_true", help="vLLM's KV-event publisher on every replica")
    parser.add_argument("--served-model-name", default="model")
    parser.add_argument("--engine-python", default=sys.executable,
                        help="the interpreter of the engine's venv (default: this one)")
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--router-arg", action="append", default=[],
                        help="one more argument for the router (repeat: --router-arg=--retry-max-retries --router-arg=5)")
    args = parser.parse_args(argv)
    kv_events = args.kv_events or args.policy == "kv_aware"
    if kv_events and args.engine != "vllm":
        parser.error("--kv-events / kv_aware: vLLM replicas only (smg routes SGLang by its own prefix tree)")

    fleet = Fleet(args.model, args.replicas, args.engine, args.engine_python, tuple(engine_args),
                  args.served_model_name, kv_events, args.log_dir)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        print(f"starting {args.replicas} {args.engine} replicas (logs in {fleet.log_dir}) ...", flush=True)
        fleet.start()
        for r in fleet.members:
            print(f"  {r.name}: {r.url}" + (f"  KV events {r.kv_events_endpoint}" if r.kv_events_port else ""), flush=True)
        for i in range(args.routers):
            router = fleet.start_router(args.policy, args.port + i, tuple(args.router_arg))
            print(f"router ({ROUTER_OF[args.engine]}, {args.policy}): {router.url}/v1", flush=True)
        print("serving; Ctrl-C stops the routers and the replicas", flush=True)
        while not stop:
            for p in [*fleet.members, *fleet.routers]:
                if not p.alive():
                    print(f"{p.name} exited; its log ends:\n{p.tail(1500)}", file=sys.stderr, flush=True)
                    stop.append(1)
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        fleet.close()


if __name__ == "__main__":
    main()
