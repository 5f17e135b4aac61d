"""A warm process that forks one child per job, so that a job does not pay for ``import torch``,
JAX and dynamo (tens of seconds on a small machine) each time.

It imports the heavy modules but starts no device runtime (torchtpu starts it at the first
``tpu`` op, so a forked child may use the device). Protocol, one JSON object per line: requests
on stdin ``{"id", "job", "result", "stdout", "stderr"}``; replies on stdout ``{"id", "pid"}``
when the child has started and ``{"id", "rc"}`` when it ended (``rc`` negative: killed by that
signal). A child calls ``setsid()``, so the server can kill its whole process group.
"""

from __future__ import annotations

import json
import os
import select
import sys


def preload() -> None:
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch.optim  # noqa: F401

    import torchtpu  # noqa: F401
    import torchtpu.compile.introspect  # noqa: F401
    import torchtpu.debug  # noqa: F401
    import torchtpu.metrics  # noqa: F401
    import torchtpu.profiler  # noqa: F401
    from torchtpu_agent import jobs  # noqa: F401


def _child(request: dict) -> None:
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
    sys.stdin = open(os.devnull)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    code = 1
    try:
        from torchtpu_agent import jobs

        code = jobs.execute(request["job"], request["result"])
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main() -> None:
    preload()
    out = sys.stdout
    out.write(json.dumps({"ready": os.getpid()}) + "\n")
    out.flush()
    children: dict[int, str] = {}
    buffer = b""
    stdin = sys.stdin.fileno()
    while True:
        readable, _, _ = select.select([stdin], [], [], 0.05)
        if readable:
            chunk = os.read(stdin, 65536)
            if not chunk:  # the server went away: so do we (children keep their own groups)
                break
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                if not line.strip():
                    continue
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(request)
                children[pid] = request["id"]
                out.write(json.dumps({"id": request["id"], "pid": pid}) + "\n")
                out.flush()
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            rc = os.waitstatus_to_exitcode(status)
            out.write(json.dumps({"id": children.pop(pid), "rc": rc}) + "\n")
            out.flush()


if __name__ == "__main__":
    main()
