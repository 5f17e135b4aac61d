"""Published figures of the accelerators behind ``tpu``: peak FLOP/s, HBM, interconnect.

One table, read by ``torch.tpu.get_device_properties(i).peak_flops`` (what MFU is measured
against) and by ``tools/pod_plan.py`` (step time and MFU at pod scale). Importing it imports
nothing beyond the standard library.

TPU figures are per chip, as Google publishes them (Cloud TPU system architecture pages:
https://cloud.google.com/tpu/docs/v4, .../v5e, .../v5p, .../v6e, .../tpu7x). A PJRT device is a
whole chip on v5e and v6e (one TensorCore), on v4 and v5p (two TensorCores run as one megacore
device), but one TensorCore on TPU7x (each of its two chiplets is a device), so the per-device
peak is the chip's times ``device cores / chip cores``. GPU figures are NVIDIA's dense (no
sparsity) BF16 Tensor Core peaks from its data sheets.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
GIB = 2**30


@dataclass(frozen=True)
class Chip:
    """One TPU generation's published per-chip figures."""

    name: str
    """Google's name (``v5e``); PJRT's ``device_kind`` is the key of ``TPU_CHIPS``."""
    bf16_flops: float
    """Dense bf16 peak FLOP/s per chip."""
    tensor_cores: int
    hbm_bytes: float
    hbm_bandwidth: float
    """Bytes/s per chip."""
    ici_bandwidth: float | None
    """Bidirectional inter-chip interconnect bytes/s per chip (all links); None: not in the table."""
    dcn_bandwidth: float | None
    """Data-center network bytes/s per chip (between slices); None: not in the table."""
    max_slice_chips: int
    """Chips in the largest ICI-connected slice (a pod); more chips span slices over DCN."""
    torus_dims: int
    """Dimensions of the ICI torus (2 for v5e/v6e, 3 for v4/v5p/TPU7x)."""
    source: str
    devices: int = 1
    """PJRT devices (ranks) per chip: 2 on TPU7x (a device per TensorCore), else 1."""


# PJRT device_kind -> figures. v5e's DCN is its pod figure (6.4 Tbps over 256 chips); v4's
# interconnect figures are left out (the plan covers v5e, v5p, v6e and TPU7x).
TPU_CHIPS: dict[str, Chip] = {
    "TPU v4": Chip("v4", 275e12, 2, 32 * GIB, 1200 * GB, None, None, 4096, 3,
                   "https://cloud.google.com/tpu/docs/v4"),
    "TPU v5 lite": Chip("v5e", 197e12, 1, 16 * GB, 819 * GB, 400 * GB, 25e9 / 8, 256, 2,
                        "https://cloud.google.com/tpu/docs/v5e"),
    "TPU v5": Chip("v5p", 459e12, 2, 95 * GIB, 2765 * GB, 1200 * GB, 50e9 / 8, 8960, 3,
                   "https://cloud.google.com/tpu/docs/tpu7x (table with v5p, v6e)"),
    "TPU v6 lite": Chip("v6e", 918e12, 1, 32 * GIB, 1638 * GB, 800 * GB, 100e9 / 8, 256, 2,
                        "https://cloud.google.com/tpu/docs/tpu7x (table with v5p, v6e)"),
    "TPU7x": Chip("v7x", 2307e12, 2, 192 * GIB, 7380 * GB, 1200 * GB, 100e9 / 8, 9216, 3,
                  "https://cloud.google.com/tpu/docs/tpu7x", devices=2),
}
TPU_CHIPS["TPU v5e"] = TPU_CHIPS["TPU v5 lite"]
TPU_CHIPS["TPU v5p"] = TPU_CHIPS["TPU v5"]
TPU_CHIPS["TPU v6e"] = TPU_CHIPS["TPU v6 lite"]

# Substring of the GPU's name -> dense BF16 FLOP/s (NVIDIA data sheets), most specific first.
GPU_PEAKS: tuple[tuple[str, float], ...] = (
    ("GB300", 2.5e15), ("GB200", 2.5e15), ("B300", 2.25e15), ("B200", 2.25e15),
    ("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H200", 989e12), ("H100", 989e12),
    ("A100", 312e12), ("L40S", 362e12), ("L4", 121e12),
)


def chip_by_name(name: str) -> Chip:
    """The chip called ``name`` (``v5e`` or a PJRT device kind such as ``TPU v5 lite``)."""
    for kind, chip in TPU_CHIPS.items():
        if name in (kind, chip.name):
            return chip
    known = sorted({c.name for c in TPU_CHIPS.values()})
    raise KeyError(f"no published figures for TPU {name!r}; known: {known}")


def tpu_peak_flops(device_kind: str, device_cores: int | None) -> float | None:
    """Dense bf16 FLOP/s of one PJRT device of ``device_kind`` driving ``device_cores``
    TensorCores (None: the whole chip), or None for a kind the table lacks."""
    chip = TPU_CHIPS.get(device_kind)
    if chip is None:
        return None
    cores = device_cores or chip.tensor_cores
    return chip.bf16_flops * min(cores, chip.tensor_cores) / chip.tensor_cores


def gpu_peak_flops(device_kind: str) -> float | None:
    """Dense BF16 FLOP/s of the GPU named ``device_kind``, or None if the table lacks it."""
    for key, flops in GPU_PEAKS:
        if key in device_kind:
            return flops
    return None
