"""Runs jobs (``torchtpu_agent.jobs``) in their own processes with a time bound, from the server.

Imports no torch: the server stays light and starts at once. Jobs are forked from a warm zygote
(``torchtpu_agent.zygote``, started in the background when the executor is made) or, where fork is
not available or ``TORCHTPU_AGENT_FORK=0``, spawned as ``python -m torchtpu_agent.jobs``. Each
job's process leads its own process group; past its time bound the whole group is killed.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class Outcome:
    """What a job's process left: its result (or error), exit status, output tails, whether it timed out."""

    ok: bool
    result: Any
    error: dict | None
    rc: int | None
    timed_out: bool
    stdout: str
    stderr: str
    seconds: float


def _tail(path: str, limit: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


class _Zygote:
    def __init__(self, workdir: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "torchtpu_agent.zygote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=open(os.path.join(workdir, "zygote.log"), "wb"),
                                     start_new_session=True, env=os.environ.copy())
        self.ready = threading.Event()
        self.lock = threading.Lock()
        self.waiting: dict[str, dict] = {}  # id -> {"pid": ..., "rc": ..., "event": Event}
        threading.Thread(target=self._read, daemon=True, name="torchtpu-agent-zygote").start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if "ready" in msg:
                self.ready.set()
                continue
            with self.lock:
                entry = self.waiting.get(msg.get("id"))
            if entry is None:
                continue
            if "pid" in msg:
                entry["pid"] = msg["pid"]
                entry["started"].set()
            if "rc" in msg:
                entry["rc"] = msg["rc"]
                entry["done"].set()
        # the zygote died: wake everyone waiting
        self.ready.set()
        with self.lock:
            for entry in self.waiting.values():
                entry["started"].set()
                entry["done"].set()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def submit(self, request: dict) -> dict:
        entry = {"pid": None, "rc": None, "started": threading.Event(), "done": threading.Event()}
        with self.lock:
            self.waiting[request["id"]] = entry
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        return entry

    def forget(self, job_id: str) -> None:
        with self.lock:
            self.waiting.pop(job_id, None)

    def close(self) -> None:
        if self.alive():
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass


class Executor:
    def __init__(self, fork: bool | None = None):
        self.workdir = tempfile.mkdtemp(prefix="torchtpu_agent_")
        if fork is None:
            fork = hasattr(os, "fork") and os.environ.get("TORCHTPU_AGENT_FORK", "1") != "0"
        self.fork = fork
        self._ids = itertools.count()
        self._zygote: _Zygote | None = None
        self._zlock = threading.Lock()
        if fork:
            self._ensure_zygote()

    def _ensure_zygote(self) -> _Zygote | None:
        with self._zlock:
            if self._zygote is None or not self._zygote.alive():
                self._zygote = _Zygote(self.workdir)
            return self._zygote

    def run(self, job: dict, timeout_s: float) -> Outcome:
        job_id = f"job{next(self._ids)}"
        base = os.path.join(self.workdir, job_id)
        paths = {"result": base + ".result.json", "stdout": base + ".stdout", "stderr": base + ".stderr"}
        job = {**job, "cwd": job.get("cwd") or os.getcwd()}
        start = time.monotonic()
        zygote = self._ensure_zygote() if self.fork else None
        if zygote is not None:
            zygote.ready.wait(timeout=600)  # the first job waits for the warm imports
        if zygote is not None and zygote.alive():
            rc, timed_out = self._run_forked(zygote, job_id, job, paths, timeout_s, start)
        else:
            rc, timed_out = self._run_spawned(job, paths, timeout_s, base)
        seconds = time.monotonic() - start
        try:
            with open(paths["result"]) as f:
                payload = json.load(f)
        except (OSError, ValueError):
            payload = None
        out = Outcome(ok=bool(payload and payload.get("ok")) and not timed_out,
                      result=(payload or {}).get("result"), error=(payload or {}).get("error"), rc=rc,
                      timed_out=timed_out, stdout=_tail(paths["stdout"]), stderr=_tail(paths["stderr"]),
                      seconds=round(seconds, 3))
        for p in paths.values():
            try:
                os.remove(p)
            except OSError:
                pass
        return out

    def _run_forked(self, zygote: _Zygote, job_id, job, paths, timeout_s, start) -> tuple[int | None, bool]:
        entry = zygote.submit({"id": job_id, "job": job, **paths})
        try:
            entry["started"].wait(timeout=60)
            remaining = max(0.0, timeout_s - (time.monotonic() - start))
            if entry["done"].wait(timeout=remaining):
                return entry["rc"], False
            _kill_group(entry["pid"])
            entry["done"].wait(timeout=30)
            return entry["rc"], True
        finally:
            zygote.forget(job_id)

    def _run_spawned(self, job, paths, timeout_s, base) -> tuple[int | None, bool]:
        job_file = base + ".job.json"
        with open(job_file, "w") as f:
            json.dump(job, f)
        with open(paths["stdout"], "wb") as out, open(paths["stderr"], "wb") as err:
            proc = subprocess.Popen([sys.executable, "-m", "torchtpu_agent.jobs", job_file, paths["result"]],
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
            try:
                return proc.wait(timeout=timeout_s), False
            except subprocess.TimeoutExpired:
                _kill_group(proc.pid)
                return proc.wait(), True
            finally:
                os.remove(job_file)

    def close(self) -> None:
        if self._zygote is not None:
            self._zygote.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _kill_group(pid: int | None) -> None:
    """Kill the job's process and every process it started (its own group)."""
    if not pid:
        return
    for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            kill()
        except OSError:
            pass
