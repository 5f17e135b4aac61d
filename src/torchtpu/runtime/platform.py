"""Which PJRT platform backs the ``tpu`` device, and its devices (importing this imports JAX;
``state`` is the part that does not)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import jax

from torchtpu.runtime import multiprocess, pjrt, state

@functools.cache
def platform() -> str:
    """The PJRT platform in use: ``tpu``, ``gpu`` or ``cpu`` (starts the runtime)."""
    state.start()
    return pjrt.platform()


@functools.cache
def devices() -> tuple[jax.Device, ...]:
    """The PJRT devices that ``tpu:0``, ``tpu:1``, ... map to, in order (starts the runtime).
    Under a multi-process launch a process drives one device, its first local one (``tpu:LOCAL_RANK``)."""
    state.start()
    return pjrt.devices()


def device_count() -> int:
    """How many devices this process drives."""
    return len(devices())


def first_index() -> int:
    """The ``tpu`` index of this process's first device: 0, or under a multi-process launch
    ``LOCAL_RANK`` (the host's devices are numbered across its processes, as CUDA's are)."""
    return multiprocess.local_rank() if multiprocess.active() else 0


def local_indices() -> range:
    """The ``tpu`` indices of the devices this process drives."""
    base = first_index()
    return range(base, base + device_count())


def jax_device(index: int) -> jax.Device:
    """The PJRT device behind ``tpu:index``."""
    devs = devices()
    base = first_index()
    if not base <= index < base + len(devs):
        if multiprocess.active() and 0 <= index < multiprocess.local_world_size():
            raise RuntimeError(
                f"tpu:{index} belongs to local rank {index}; this process (local rank {base}) drives "
                f"tpu:{base}. Under torchrun each process uses its own device: "
                f"torch.device('tpu', int(os.environ['LOCAL_RANK'])), or plain 'tpu'")
        raise RuntimeError(
            f"Invalid device ordinal tpu:{index}: {len(devs)} {platform().upper()} device(s) are available"
        )
    return devs[index - base]


def device_name(index: int | None = None) -> str:
    """A truthful name for what backs ``tpu:index``, e.g. ``XLA:CPU`` or ``TPU v5 lite``."""
    dev = jax_device(first_index() if index is None else index)
    if dev.platform == "cpu":
        return "XLA:CPU"
    kind = getattr(dev, "device_kind", "") or dev.platform.upper()
    return kind if dev.platform == "tpu" else f"{kind} (XLA:{dev.platform.upper()})"


def pjrt_stats(index: int) -> dict | None:
    """PJRT's allocator statistics for ``tpu:index``, or None where the platform has none."""
    try:
        return jax_device(index).memory_stats()
    except Exception:
        return None


def total_memory(index: int) -> int:
    """Bytes of memory ``tpu:index`` may use: PJRT's limit where reported (GPU, TPU); on XLA:CPU
    the device's memory is the host's, so the host memory this process may use."""
    stats = pjrt_stats(index)
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return _host_memory()


def _host_memory() -> int:
    """Bytes of memory this process may use: physical memory, or the cgroup's limit if lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return total


@dataclass(frozen=True)
class DeviceProperties:
    name: str
    platform: str
    device_kind: str
    index: int
    total_memory: int

    @property
    def peak_flops(self) -> float | None:
        """Peak FLOP/s of this device, what MFU is measured against (``peak_flops_source`` says
        where it comes from): a TPU's or GPU's published dense bf16 peak, XLA:CPU's measured
        float32 matmul rate, or ``TORCHTPU_PEAK_FLOPS``; None for an accelerator the table lacks."""
        return peak_flops(self.index)[0]

    @property
    def peak_flops_source(self) -> str:
        return peak_flops(self.index)[1]


def device_properties(index: int) -> DeviceProperties:
    """What backs ``tpu:index``: its name, platform, kind and memory (``total_memory``)."""
    dev = jax_device(index)
    return DeviceProperties(name=device_name(index), platform=dev.platform,
                            device_kind=getattr(dev, "device_kind", dev.platform), index=index,
                            total_memory=total_memory(index))


PEAK_FLOPS_ENV = "TORCHTPU_PEAK_FLOPS"


@functools.cache
def peak_flops(index: int) -> tuple[float | None, str]:
    """(peak FLOP/s, where the figure comes from) of ``tpu:index``. ``TORCHTPU_PEAK_FLOPS``
    overrides the table (a chip it lacks); XLA:CPU is measured once per process."""
    from torchtpu.runtime import chips

    if os.environ.get(PEAK_FLOPS_ENV):
        return float(os.environ[PEAK_FLOPS_ENV]), f"{PEAK_FLOPS_ENV}"
    dev = jax_device(index)
    kind = getattr(dev, "device_kind", "")
    if dev.platform == "tpu":
        peak = chips.tpu_peak_flops(kind, getattr(dev, "num_cores", None))
        chip = chips.TPU_CHIPS.get(kind)
        return peak, (f"published bf16 peak of TPU {chip.name} ({chip.source})" if chip else
                      f"unknown TPU {kind!r}: set {PEAK_FLOPS_ENV}")
    if dev.platform == "cpu":
        return measured_matmul_flops(dev), "measured: XLA:CPU float32 matmul, 1024x1024, best of 10"
    peak = chips.gpu_peak_flops(kind)
    return peak, (f"published dense bf16 peak of {kind}" if peak else
                  f"unknown accelerator {kind!r}: set {PEAK_FLOPS_ENV}")


def measured_matmul_flops(dev: jax.Device, n: int = 1024, repeats: int = 10) -> float:
    """FLOP/s of the fastest of ``repeats`` float32 ``n x n`` matmuls on ``dev``: the host's
    matmul peak as XLA:CPU reaches it (the fastest run, so other load on the host shows less)."""
    import time

    import jax.numpy as jnp

    a = jax.device_put(jnp.linspace(-1.0, 1.0, n * n, dtype=jnp.float32).reshape(n, n), dev)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()  # compile and warm
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best
