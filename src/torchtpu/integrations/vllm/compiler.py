"""``TpuCompiler``: the compiler vLLM's piecewise backend hands each piece of the forward to.

vLLM's ``VLLM_COMPILE`` mode traces the model forward once with Dynamo, splits the graph at
its attention ops (run eagerly: they read the step's metadata from vLLM's forward context)
and compiles every piece in between with the platform's compiler. Here a piece goes to the
``tpu`` backend of ``torch.compile``: aot_autograd, then one XLA program per input shape. The
model runner pads the number of tokens to a bucket, so the programs per piece stay bounded.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import fx
from vllm.compilation.compiler_interface import CompilerInterface


class TpuCompiler(CompilerInterface):
    """vLLM compiler interface over torchtpu's ``tpu`` backend (no on-disk artifacts)."""

    name = "tpu"

    def compile(self, graph: fx.GraphModule, example_inputs: list[Any],
                compiler_config: dict[str, Any], compile_range, key: str | None = None,
                ) -> tuple[Callable[..., Any] | None, Any | None]:
        from torchtpu.compile.backend import backend
        from torchtpu.runtime import compat

        # No handle: vLLM's cache cannot reload it, so every start traces the pieces again
        # (XLA's own persistent cache still skips recompiling the programs). AOTAutograd's cache
        # skips some pieces (a tensor-parallel piece's collectives name this process's groups);
        # vLLM compiles with that cache strict, which would turn the skip into an error.
        with compat.functorch_config.patch(strict_autograd_cache=False):
            return backend(graph, example_inputs), None
