"""aten → JAX lowerings, one module per op family, all in one registry (``registry.LOWERINGS``)."""

from torchtpu.ops.registry import LOWERINGS, Lowering, get, load_all, lowering

__all__ = ["LOWERINGS", "Lowering", "get", "load_all", "lowering"]
