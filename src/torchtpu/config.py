"""The one home of torchtpu's settings: read once from ``TORCHTPU_*`` environment variables.

Every setting is listed in ``SETTINGS`` with its environment variable, type, default and a
one-line description; the README's table is generated from this list (``torchtpu info --env``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


def _bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {raw!r}")


def _platform(raw: str) -> str:
    value = raw.strip().lower()
    if value not in ("", "tpu", "gpu", "cuda", "rocm", "cpu"):
        raise ValueError(f"expected one of tpu, gpu, cpu, got {raw!r}")
    return {"cuda": "gpu", "rocm": "gpu"}.get(value, value)


def _count(raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"expected a whole number, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"expected a number >= 0 (0: no limit), got {raw!r}")
    return value


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _size(raw: str) -> int:
    """Bytes: a whole number, or a number with a K, M, G or T suffix (powers of 1024; ``1.5G``)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", raw, re.IGNORECASE)
    if not match:
        raise ValueError(f"expected a size in bytes such as 1073741824, 512M or 1G (0: no limit), got {raw!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def _warm_start(raw: str) -> str:
    value = raw.strip().lower()
    if value == "dynamo":
        return value
    try:
        return "aot" if value == "aot" or _bool(value) else "off"
    except ValueError:
        raise ValueError(f"expected aot (or 1), dynamo or off (or 0), got {raw!r}") from None


def _seconds(raw: str) -> int:
    value = _count(raw)
    if value == 0:
        raise ValueError(f"expected a number of seconds > 0, got {raw!r}")
    return value


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "torchtpu")


@dataclass(frozen=True)
class Setting:
    name: str
    env: str
    parse: Callable[[str], Any]
    default: Callable[[], Any]
    help: str
    shown: str = ""  # the default as the README's table writes it, where not the value itself


SETTINGS = [
    Setting("platform", "TORCHTPU_PLATFORM", _platform, lambda: "",
            "PJRT platform to use: tpu, gpu or cpu (default: the first available of tpu, gpu, cpu)"),
    Setting("launch_blocking", "TORCHTPU_LAUNCH_BLOCKING", _bool, lambda: False,
            "wait for every eager op to finish so errors surface at the op that caused them"),
    Setting("defer_and_fuse", "TORCHTPU_DEFER_AND_FUSE", _bool, lambda: False,
            "start in the DEFER_AND_FUSE eager mode"),
    Setting("cpu_fallback", "TORCHTPU_CPU_FALLBACK", _bool, lambda: True,
            "run ops without a lowering on the CPU (with a warning) instead of raising"),
    Setting("require_native", "TORCHTPU_REQUIRE_NATIVE", _bool, lambda: False,
            "fail instead of warning when the C++ hooks cannot be built (CI sets it)"),
    Setting("native_eager", "TORCHTPU_NATIVE_EAGER", _bool, lambda: True,
            "run the common eager ops through the C++ kernel (`csrc/eager.cpp`); 0: every op through its Python "
            "kernel (the reference path)"),
    Setting("cpu_fast_compile", "TORCHTPU_CPU_FAST_COMPILE", _bool, lambda: True,
            "on XLA:CPU, compile with XLA's elemental fusion emitters (small programs compile in about half the "
            "time and run about as fast); 0: XLA's default (MLIR-based) emitters"),
    Setting("cache_dir", "TORCHTPU_CACHE_DIR", str, _default_cache_dir,
            "directory of the persistent compilation cache"),
    Setting("cache_max_size", "TORCHTPU_CACHE_MAX_SIZE", _size, lambda: 1 << 30,
            "bytes of XLA executables kept in the persistent compilation cache (`$TORCHTPU_CACHE_DIR/xla`, shared "
            "by processes), least recently used deleted first; K/M/G suffixes (0: no limit)", shown="`1G`"),
    Setting("warm_start", "TORCHTPU_WARM_START", _warm_start, lambda: "aot",
            "what a new process reuses of torch.compile's work: `aot` (aot_autograd's graphs, PyTorch's AOTAutograd "
            "cache), `dynamo` (also dynamo's, PyTorch's experimental Dynamo cache, saved at exit) or `off`"),
    Setting("warm_cache_size", "TORCHTPU_WARM_CACHE_SIZE", _count, lambda: 512,
            "entries kept in PyTorch's AOTAutograd cache directory, least recently written deleted first (0: no limit)"),
    Setting("dump_dir", "TORCHTPU_DUMP_DIR", str, lambda: "",
            "if set, write the StableHLO of every compiled graph here"),
    Setting("kernel_cache_size", "TORCHTPU_KERNEL_CACHE_SIZE", _count, lambda: 1024,
            "jitted programs kept per eager op, one per static arguments (LRU; 0: no limit)"),
    Setting("fused_program_cache_size", "TORCHTPU_FUSED_PROGRAM_CACHE_SIZE", _count, lambda: 512,
            "DEFER_AND_FUSE programs kept, one per recorded graph structure (LRU; 0: no limit)"),
    Setting("fused_shape_cache_size", "TORCHTPU_FUSED_SHAPE_CACHE_SIZE", _count, lambda: 65536,
            "output shapes kept for DEFER_AND_FUSE recording, one per op and input shapes (LRU; 0: no limit)"),
    Setting("distributed", "TORCHTPU_DISTRIBUTED", _bool, lambda: True,
            "under a launcher with WORLD_SIZE > 1 (torchrun), join the processes' devices with jax.distributed"),
    Setting("coordinator", "TORCHTPU_COORDINATOR", str, lambda: "",
            "host:port of the jax.distributed coordinator (default: MASTER_ADDR, a free port chosen by rank 0)"),
    Setting("distributed_timeout", "TORCHTPU_DISTRIBUTED_TIMEOUT", _seconds, lambda: 300,
            "seconds to wait for every process to join jax.distributed"),
]


def _read(setting: Setting) -> Any:
    raw = os.environ.get(setting.env)
    if raw is None:
        return setting.default()
    try:
        return setting.parse(raw)
    except ValueError as exc:
        raise ValueError(f"bad value for {setting.env}: {exc}") from None


class _Config:
    """Attribute access to the settings; values are read from the environment once."""

    def __init__(self) -> None:
        for setting in SETTINGS:
            object.__setattr__(self, setting.name, _read(setting))

    def __setattr__(self, name: str, value: Any) -> None:
        if not any(s.name == name for s in SETTINGS):
            raise AttributeError(f"torchtpu has no setting {name!r}")
        object.__setattr__(self, name, value)

    def reload(self) -> None:
        """Re-read every setting from the environment."""
        self.__init__()


config = _Config()


def env_table() -> str:
    """A Markdown table of every environment variable, for the README."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for s in SETTINGS:
        default = s.default()
        if s.shown:
            shown = s.shown
        elif s.name == "cache_dir":
            shown = "`~/.cache/torchtpu`"
        elif default == "":
            shown = "(auto)" if s.name == "platform" else "(unset)"
        else:
            shown = f"`{int(default) if isinstance(default, bool) else default}`"
        rows.append(f"| `{s.env}` | {shown} | {s.help} |")
    return "\n".join(rows)
