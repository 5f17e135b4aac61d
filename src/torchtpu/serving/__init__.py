"""What a serving engine on ``tpu`` computes, without the engine: padded sizes (:mod:`.buckets`),
a slot-major paged KV cache and its attention (:mod:`.paged_kv`, vLLM's backend) and attention
over a token-slot pool (:mod:`.token_pool`, SGLang's backend).

These modules import no engine: the engines' integrations (:mod:`torchtpu.integrations`) call
them, and the default test suite checks them against plain per-request attention on the CPU.
"""
