"""``TpuGraphRunner``: SGLang's decode graph runner for ``tpu``, made of ``torch.compile``.

SGLang's CUDA-graph runners pad each decode batch up to the next *capture size*
(``--cuda-graph-bs-decode``, at most ``--torch-compile-max-bs``) and replay one graph per size;
its CPU runner compiles the forward per size with ``torch.compile`` instead. This runner does
the same on ``tpu``: with ``--enable-torch-compile`` every decode batch is padded to a capture
size and runs the model forward through ``torch.compile(backend="tpu")``, one compiled variant
per (capture size, key-length bucket of the attention plan). Batch changes therefore compile a
bounded set of programs: the capture sizes times the power-of-two key lengths up to the
context length, times the pieces dynamo splits the forward into (SGLang 0.5.23's layer
boundaries pass their residuals in ``msgspec.Struct`` objects, which dynamo cannot build, so
it breaks the graph there: 8 pieces for the 2-layer tiny Llama). Prefill and mixed batches
stay eager.

The attention plan (:mod:`.attention`) is still built on the host for every step, before the
compiled call; dynamo reads its tensors from the backend object, so they are graph inputs,
never constants (only its padded shape is part of the program's key). Padded requests point
at SGLang's reserved slot 0 (``req_to_token`` row 0, KV slot 0), as in SGLang's own runners.
"""

from __future__ import annotations

import bisect
import logging

import torch
from torchtpu.runtime.compat import dynamo_config, dynamo_counters as counters
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.model_executor.forward_context import forward_context, get_forward_context
from sglang.srt.runtime_context import get_exec

from torchtpu.compile.cache import cache_stats
from torchtpu.serving.token_pool import pad_decode_batch  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)

def programs_built() -> int:
    """XLA programs torch.compile graphs needed so far: compiled, or loaded from the persistent cache."""
    stats = cache_stats()
    return int(stats["compilations"] + stats["persistent_hits"])


def capture_sizes(max_requests: int) -> list[int]:
    """SGLang's decode capture sizes, capped by --torch-compile-max-bs and the request pool."""
    graph = get_exec().graph
    cap = min(graph.torch_compile_max_bs, max_requests)
    sizes = sorted({bs for bs in graph.cuda_graph_config.decode.bs if 0 < bs <= cap})
    if not sizes:
        raise ValueError(f"No decode capture size fits --torch-compile-max-bs {graph.torch_compile_max_bs} "
                         f"and {max_requests} requests; set --cuda-graph-bs-decode.")
    return sizes


class TpuGraphRunner:
    """Decode batches padded to capture sizes, each size's forward compiled with the tpu backend."""

    def __init__(self, model_runner):
        self.model_runner = model_runner
        self.capture_bs = capture_sizes(model_runner.req_to_token_pool.size)
        self.max_bs = self.capture_bs[-1]
        self.bs = self.max_bs  # SGLang reads the runner's current padded size under this name
        # dynamic=False: every (capture size, key bucket) is its own static program, as a CUDA
        # graph per capture size is; their number is bounded, so dynamo's recompile limit is
        # raised to that bound (capture sizes x key-length buckets) for this call only.
        self._compiled = torch.compile(torch.no_grad()(model_runner.model.forward), backend="tpu", dynamic=False)
        key_buckets = max(1, model_runner.req_to_token_pool.req_to_token.shape[1]).bit_length()
        self._recompile_limit = len(self.capture_bs) * key_buckets
        self.shapes: set[tuple] = set()  # (capture size, attention plan shape) seen: one program each
        logger.info("tpu decode graphs: torch.compile(backend='tpu') per capture size %s", self.capture_bs)

    def can_run_graph(self, forward_batch) -> bool:
        return forward_batch.forward_mode.is_decode() and forward_batch.batch_size <= self.max_bs

    def execute(self, forward_batch, pp_proxy_tensors=None, **kwargs):
        """Run one decode step padded to its capture size; logits for the real requests only."""
        if pp_proxy_tensors is not None:
            raise NotImplementedError("The tpu decode graph runner does not support pipeline parallelism.")
        raw_bs = forward_batch.batch_size
        self.bs = self.capture_bs[bisect.bisect_left(self.capture_bs, raw_bs)]
        batch = pad_decode_batch(forward_batch, self.bs) if self.bs > raw_bs else forward_batch
        backend = self.model_runner.attn_backend
        backend.init_forward_metadata(batch)
        key = (self.bs, backend.forward_metadata.shape)
        with forward_context(get_forward_context(), forward_batch=batch), \
                dynamo_config.patch(recompile_limit=self._recompile_limit):
            out = self._compiled(batch.input_ids, batch.positions, batch)
        if key not in self.shapes:  # its program was compiled by the call above
            self.shapes.add(key)
            logger.info("tpu decode graph: new shape (batch %d, attention %s): %d shapes, %d dynamo graphs, "
                        "%d XLA programs in this process", self.bs, key[1], len(self.shapes),
                        counters["stats"]["unique_graphs"], programs_built())
        if self.bs == raw_bs:
            return out
        return LogitsProcessorOutput(next_token_logits=out.next_token_logits[:raw_bs],
                                     hidden_states=None if out.hidden_states is None else out.hidden_states[:raw_bs])
