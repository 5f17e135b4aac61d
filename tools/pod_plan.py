"""Plan TorchTitan's Qwen3 training on a TPU pod we cannot run: per-chip FLOPs, HBM, collective
bytes, step time and MFU at 256 to 8,192 chips, from XLA's analysis of the per-chip program.

    python tools/pod_plan.py                                  (Qwen3-8B on TPU7x, FSDP and FSDP x TP)
    python tools/pod_plan.py --chip v5p --seq-len 8192 --tp 1,4
    python tools/pod_plan.py --check                          (the debug model: the checks below)

Run it in TorchTitan's venv (tools/torchtitan_env.sh). What it does:

1. **The per-chip program, abstractly.** TorchTitan's own model (``qwen3_configs[flavor]``, its
   classes and FlexAttention) is built on the meta device, with the shapes one chip holds under
   tensor parallelism of degree ``t`` (heads, KV heads, FFN width and vocabulary divided by ``t``,
   as TorchTitan's colwise/rowwise plan shards them). One training step (forward, TorchTitan's
   cross-entropy on float32 logits, backward) on bf16 weights is traced with ``make_fx`` over fake
   tensors, lowered by torchtpu's compiler to one XLA program with abstract inputs
   (``jax.ShapeDtypeStruct``: no weights exist): XLA's cost analysis of the lowered program gives
   its FLOPs; compiled on XLA:CPU, its bytes accessed (after fusion) and memory analysis (argument,
   output and temporary bytes).
   FSDP does not change the per-chip computation, only what is resident and what is exchanged.
2. **Layers by difference.** The layers are identical, so the program is analysed with 1 and with 2
   layers and the full model's figures are ``one + (L - 1) x (two - one)`` (``--check`` compares this
   with the whole debug model's program).
3. **The pod.** For each chip count N and TP degree t (ranks R = N x devices per chip, 2 on TPU7x;
   FSDP degree D = R / t; ``--local-batch`` sequences per rank, a TP group sharing t times that:
   weak scaling), from the chip's
   published figures
   (``torchtpu.runtime.chips``): HBM = 16 bytes per parameter / N (float32 master weights and
   gradients, AdamW's two moments, as TorchTitan's FSDP2 keeps them) + the program's temporaries
   (activations, bf16 gradients, logits) + two layers of gathered bf16 weights (the one in use and
   the one prefetched); collectives per step: FSDP's bf16 all-gather in forward and again in
   backward and its float32 reduce-scatter of gradients, ((D - 1) / D) x size each, and TP's
   all-reduce of the block output twice per layer in forward and twice in backward,
   2 (t - 1) / t x activation size each; step time = max(compute, FSDP collectives) + TP
   collectives, compute = max(FLOPs / peak, bytes accessed / HBM bandwidth) (a roofline: every op
   at its bound, overlapped perfectly), FSDP overlapped with compute (TorchTitan prefetches), TP
   exposed (no async TP); collectives over ICI at ``--link-efficiency`` of the chip's published
   bidirectional ICI bandwidth, over DCN (its per-chip share) where N exceeds one slice.
   MFU = TorchTitan's model FLOPs (its ``get_nparams_and_flops``) / (step time x peak).

The assumptions are printed above the table. Checks (``--check``, on qwen3's debugmodel): XLA's
FLOPs of the whole one-chip program against TorchTitan's own count, and the layer-difference
prediction of memory against what XLA:CPU allocates for the whole program (its buffer assignment).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from torchtpu.runtime import chips  # noqa: E402  (standard library only)

CHIP_COUNTS = (256, 512, 1024, 2048, 4096, 8192)


@dataclass
class Program:
    """XLA's analysis of one per-chip training-step program."""

    layers: int
    flops: float
    bytes_accessed: float
    argument_bytes: float
    output_bytes: float
    temp_bytes: float
    params: int
    """Parameters of this (TP-local) program."""
    seconds: float


def _model_config(flavor: str, n_layers: int | None, tp: int):
    """TorchTitan's qwen3 config of ``flavor``, with ``n_layers`` layers and one TP rank's shapes."""
    from torchtitan.models.common.embedding import Embedding
    from torchtitan.models.common.linear import Linear
    import torchtitan.models.qwen3 as q

    base = q.qwen3_configs[flavor](attn_backend="flex")
    att, ffn = base.layers[0].attention, base.layers[0].feed_forward
    hidden = ffn.w1.out_features
    for name, value in (("heads", att.n_heads), ("KV heads", att.n_kv_heads), ("FFN width", hidden),
                        ("vocabulary", base.vocab_size)):
        if value % tp:
            raise SystemExit(f"TP degree {tp} does not divide the {name} ({value}) of qwen3 {flavor}")
    vocab = base.vocab_size // tp
    layers = q._build_qwen3_layers(
        fuse_qkv=True, n_layers=n_layers or len(base.layers), dim=base.dim, n_heads=att.n_heads // tp,
        n_kv_heads=att.n_kv_heads // tp, head_dim=att.head_dim, hidden_dim=hidden // tp,
        attn_backend="flex", rope=att.rope)
    config = q.Qwen3Model.Config(
        vocab_size=vocab, dim=base.dim, norm=base.norm, enable_weight_tying=base.enable_weight_tying,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=base.dim,
                                        param_init=base.tok_embeddings.param_init),
        lm_head=Linear.Config(in_features=base.dim, out_features=vocab, param_init=base.lm_head.param_init),
        layers=layers)
    return base, config


def titan_flops_per_token(flavor: str, seq_len: int) -> tuple[int, float]:
    """TorchTitan's own (parameters, training FLOPs per token) of the full model."""
    import torch

    base, _ = _model_config(flavor, None, 1)
    with torch.device("meta"):
        model = base.build()
    return base.get_nparams_and_flops(model, seq_len)


def analyse(flavor: str, n_layers: int | None, tp: int, batch: int, seq_len: int, dense: bool = False) -> Program:
    """Trace, lower and compile one per-chip step program; XLA's cost and memory analysis.

    torchtpu's FlexAttention is blocked (flash-style loops over KV blocks), and XLA's cost analysis
    counts a loop's body once, so the program's FLOPs miss most of attention's. ``dense``: attention
    computed densely instead (the BlockMask as a boolean mask, as tools/torchtitan_cpu.py does), every
    FLOP in straight-line code: for counting, not for memory (it holds the S x S scores)."""
    import jax
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.models.common.attention import FlexAttention

    from torchtpu.compile.decompositions import decompositions
    from torchtpu.compile.graph import GraphFunction
    from torchtpu.runtime import dtypes

    start = time.perf_counter()
    # TorchTitan compiles flex_attention itself; traced here, the HOP lowers to torchtpu's kernel
    if dense:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from torchtitan_cpu import _dense_flex_attention

        FlexAttention._compiled_flex_attn = staticmethod(_dense_flex_attention)
    else:
        FlexAttention._compiled_flex_attn = staticmethod(flex_attention)
    _, config = _model_config(flavor, n_layers, tp)
    with torch.device("meta"):
        model = config.build()
    params = sum(p.numel() for p in model.parameters())
    # the document mask of TorchTitan's loader: one document per sequence (block-causal = causal)
    positions = torch.arange(seq_len, device="tpu").repeat(batch, 1)
    masks = model.get_attention_masks(positions)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        weights = {k: torch.empty(v.shape, dtype=torch.bfloat16, device="tpu", requires_grad=True)
                   for k, v in model.named_parameters()}
        buffers = {k: torch.empty(v.shape, dtype=v.dtype, device="tpu") for k, v in model.named_buffers()}
        tokens = torch.zeros(batch, seq_len, dtype=torch.long, device="tpu")

    def step(weights, buffers, tokens, labels):
        logits = functional_call(model, {**weights, **buffers}, (tokens,), {"attention_masks": masks})
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        return loss, torch.autograd.grad(loss, list(weights.values()))

    with warnings_quiet():
        gm = make_fx(step, tracing_mode="fake", decomposition_table=decompositions())(
            weights, buffers, tokens, tokens)
    _out_of_place(gm)
    graph = GraphFunction(gm)
    structs = [jax.ShapeDtypeStruct(tuple(p.meta["val"].shape), dtypes.to_jax_dtype(p.meta["val"].dtype))
               for p in graph.placeholders]
    # a random op (none in a training step; the dense mask's construction may trace one) needs a key
    key = jax.random.key(0, impl="threefry2x32") if graph.random_ops else None
    lowered = jax.jit(lambda *inputs: graph(key, list(inputs))).lower(*structs)
    compiled = lowered.compile()
    # FLOPs from the program as traced: XLA:CPU's own passes turn some dots into runtime calls that
    # its cost analysis does not count; bytes accessed after its fusion (closer to a TPU's than the
    # unfused program's)
    flops, cost = _costs(lowered), _costs(compiled)
    memory = compiled.memory_analysis()
    return Program(layers=n_layers or len(config.layers), flops=float(flops.get("flops", 0.0)),
                   bytes_accessed=float(cost.get("bytes accessed", 0.0)),
                   argument_bytes=float(memory.argument_size_in_bytes),
                   output_bytes=float(memory.output_size_in_bytes), temp_bytes=float(memory.temp_size_in_bytes),
                   params=params, seconds=time.perf_counter() - start)


def _costs(stage) -> dict:
    cost = stage.cost_analysis()
    return (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}


def _out_of_place(gm) -> None:
    """Rewrite the few in-place ops on intermediates (flex_attention's unfused backward) as their
    out-of-place forms, later uses reading the result: the same arithmetic, so the same cost.
    (torch.func.functionalize cannot trace the BlockMask's mask_mod.)"""
    import torch

    for node in list(gm.graph.nodes):
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        name = target._schema.name.split("::")[-1]
        if not name.endswith("_") or name.startswith("_") or node.args[0].op == "placeholder":
            continue
        functional = getattr(getattr(torch.ops.aten, name[:-1]), target._overloadname)
        mutated = node.args[0]
        with gm.graph.inserting_after(node):
            replacement = gm.graph.call_function(functional, node.args, node.kwargs)
        replacement.meta = dict(node.meta)
        node.replace_all_uses_with(replacement)
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        for user in list(mutated.users):
            if user not in (node, replacement) and order[user] > order[node]:
                user.replace_input_with(mutated, replacement)  # later uses read the new value
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()


@contextlib.contextmanager
def warnings_quiet():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex_attention's "called without torch.compile" note
        yield


def extrapolate(one: Program, two: Program, layers: int) -> Program:
    """The ``layers``-layer program's figures from the 1- and 2-layer ones (identical layers)."""
    def f(a, b):
        return a + (layers - 1) * (b - a)

    return Program(layers=layers, flops=f(one.flops, two.flops), bytes_accessed=f(one.bytes_accessed, two.bytes_accessed),
                   argument_bytes=f(one.argument_bytes, two.argument_bytes),
                   output_bytes=f(one.output_bytes, two.output_bytes), temp_bytes=f(one.temp_bytes, two.temp_bytes),
                   params=int(f(one.params, two.params)), seconds=one.seconds + two.seconds)


def cached_program(cache: dict, flavor: str, layers: int, tp: int, batch: int, seq_len: int) -> Program:
    key = f"{flavor}|L{layers}|tp{tp}|b{batch}|s{seq_len}"
    if key not in cache:
        print(f"  analysing {key} ...", file=sys.stderr, flush=True)
        cache[key] = asdict(analyse(flavor, layers, tp, batch, seq_len))
    return Program(**cache[key])


@dataclass
class Row:
    chips: int
    tp: int
    fsdp: int
    global_batch: int
    flops: float
    hbm: float
    fsdp_bytes: float
    tp_bytes: float
    compute_s: float
    comm_s: float
    step_s: float
    mfu: float
    fits: bool


def plan_row(chip: chips.Chip, n: int, tp: int, prog: Program, layer_weight_bytes: float, total_params: int,
             model_flops_per_token: float, dim: int, layers: int, batch: int, seq_len: int,
             link_efficiency: float) -> Row:
    """One layout. ``prog`` is one rank's program; a chip runs ``chip.devices`` ranks (TPU7x: 2,
    each with half the chip's peak, HBM and HBM bandwidth)."""
    per_chip = chip.devices
    ranks = n * per_chip
    d = ranks // tp
    states = 16 * total_params / ranks
    hbm = per_chip * (states + prog.temp_bytes + 2 * layer_weight_bytes)
    local_params = total_params / tp
    fsdp_bytes = per_chip * (2 * 2 * local_params + 4 * local_params) * (d - 1) / d if d > 1 else 0.0
    activation = batch * seq_len * dim * 2
    tp_bytes = per_chip * 4 * layers * 2 * (tp - 1) / tp * activation if tp > 1 else 0.0
    ici = chip.ici_bandwidth * link_efficiency
    fsdp_bw = ici if n <= chip.max_slice_chips else chip.dcn_bandwidth
    model_flops = model_flops_per_token * per_chip * batch * seq_len / tp  # per chip
    # the work is at least TorchTitan's count (XLA's count of the traced program is below it: docs)
    flops = max(per_chip * prog.flops, model_flops)
    compute = max(flops / chip.bf16_flops, per_chip * prog.bytes_accessed / chip.hbm_bandwidth)
    fsdp_s, tp_s = fsdp_bytes / fsdp_bw, tp_bytes / ici
    step = max(compute, fsdp_s) + tp_s
    return Row(chips=n, tp=tp, fsdp=d, global_batch=d * batch, flops=flops, hbm=hbm,
               fsdp_bytes=fsdp_bytes, tp_bytes=tp_bytes, compute_s=compute, comm_s=fsdp_s + tp_s, step_s=step,
               mfu=model_flops / (step * chip.bf16_flops), fits=hbm <= chip.hbm_bytes)


def assumptions(args, chip: chips.Chip) -> list[str]:
    dcn = f"{chip.dcn_bandwidth / 1e9:.2f} GB/s" if chip.dcn_bandwidth else "n/a"
    return [
        f"model: TorchTitan qwen3 {args.flavor} (its config and classes, FlexAttention, bf16 compute, "
        f"float32 loss), seq_len {args.seq_len}, {args.local_batch} sequence(s) per rank and step (a TP group "
        "of t ranks shares t x that batch; weak scaling: the global batch grows with the chips)",
        f"chip: TPU {chip.name}: {chip.bf16_flops / 1e12:.0f} TFLOP/s bf16, {chip.hbm_bytes / 2**30:.0f} GiB HBM "
        f"at {chip.hbm_bandwidth / 1e9:.0f} GB/s, ICI {chip.ici_bandwidth / 1e9:.0f} GB/s bidirectional, "
        f"DCN {dcn} per chip, {chip.max_slice_chips} chips per slice, {chip.devices} device(s) (ranks) per "
        f"chip ({chip.source})",
        "per-chip FLOPs: XLA's cost analysis of the per-rank program as lowered; bytes accessed: of that "
        "program compiled for XLA:CPU (TPU fusion differs: an estimate); layers by difference of 1- and "
        "2-layer programs",
        "compute time: roofline max(FLOPs / peak, bytes / HBM bandwidth), every op at its bound; FLOPs: the "
        "larger of XLA's count and TorchTitan's (XLA counts a loop body once, and torchtpu's FlexAttention "
        "loops over KV blocks, so XLA's count misses most attention FLOPs: see --check)",
        f"collectives at {args.link_efficiency:.0%} of the published ICI bandwidth; FSDP over DCN beyond one "
        "slice; FSDP overlapped with compute, TP exposed (no async TP)",
        "HBM: 16 B/parameter / ranks (fp32 weights, fp32 grads, AdamW m and v) + the program's temporaries "
        "+ two layers of gathered bf16 weights; no activation checkpointing (TorchTitan's selective AC "
        "would trade HBM for recompute)",
        "MFU: TorchTitan's model FLOPs per token x tokens per chip / (step time x peak); not modelled: "
        "MXU efficiency below peak, host/input overhead, stragglers, non-overlapped FSDP at small layers",
    ]


def _fmt_bytes(b: float) -> str:
    return f"{b / 2**30:.1f} GiB" if b >= 2**30 else f"{b / 2**20:.0f} MiB"


def plan(args) -> None:
    for name in args.chip.split(","):
        plan_chip(args, chips.chip_by_name(name))
        print()


def plan_chip(args, chip: chips.Chip) -> None:
    cache_path = Path(args.cache)
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    total_params, flops_per_token = titan_flops_per_token(args.flavor, args.seq_len)
    base, _ = _model_config(args.flavor, None, 1)
    layers = len(base.layers)
    print(f"# Pod plan: TorchTitan qwen3 {args.flavor} on TPU {chip.name}")
    print("Assumptions:")
    for line in assumptions(args, chip):
        print(f"  - {line}")
    print(f"  - TorchTitan's count: {total_params / 1e9:.2f} B parameters, {flops_per_token / 1e9:.1f} GFLOP "
          f"per token at seq_len {args.seq_len}")
    print()
    print("| chips | layout (mesh) | global batch | FLOPs/chip/step | HBM/chip | FSDP bytes/chip | TP bytes/chip "
          "| compute s | comm s | step s | MFU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for tp in args.tp:
        # a TP group of t ranks shares one data-parallel batch: t x --local-batch sequences, so that
        # every layout puts the same tokens on a rank
        group_batch = args.local_batch * tp
        one = cached_program(cache, args.flavor, 1, tp, group_batch, args.seq_len)
        two = cached_program(cache, args.flavor, 2, tp, group_batch, args.seq_len)
        cache_path.write_text(json.dumps(cache, indent=1))
        prog = extrapolate(one, two, layers)
        layer_weight_bytes = two.argument_bytes - one.argument_bytes  # bf16 weights of one layer (TP-local)
        for n in args.chips:
            if n % tp:
                continue
            r = plan_row(chip, n, tp, prog, layer_weight_bytes, total_params, flops_per_token, base.dim, layers,
                         group_batch, args.seq_len, args.link_efficiency)
            layout = f"FSDP {r.fsdp}" if tp == 1 else f"FSDP {r.fsdp} x TP {tp}"
            hbm = _fmt_bytes(r.hbm) + ("" if r.fits else " (does not fit)")
            print(f"| {n} | {layout} | {r.global_batch} x {args.seq_len} | {r.flops / 1e12:.1f} T | {hbm} "
                  f"| {_fmt_bytes(r.fsdp_bytes)} | {_fmt_bytes(r.tp_bytes)} | {r.compute_s:.3f} | {r.comm_s:.3f} "
                  f"| {r.step_s:.3f} | {r.mfu:.0%} |")


def check(args) -> None:
    """The debug model on one chip: XLA's FLOPs (attention dense) against TorchTitan's count; the
    layer-difference prediction against the whole program's XLA:CPU figures."""
    flavor, batch, seq = "debugmodel", args.local_batch, args.seq_len
    params, per_token = titan_flops_per_token(flavor, seq)
    dense = analyse(flavor, None, 1, batch, seq, dense=True)
    whole = analyse(flavor, None, 1, batch, seq)
    one, two = analyse(flavor, 1, 1, batch, seq), analyse(flavor, 2, 1, batch, seq)
    predicted = extrapolate(one, two, whole.layers)
    titan = per_token * batch * seq
    mem_whole = whole.argument_bytes + whole.output_bytes + whole.temp_bytes
    mem_pred = predicted.argument_bytes + predicted.output_bytes + predicted.temp_bytes
    print(f"# Check: TorchTitan qwen3 {flavor}, {batch} x {seq} tokens, one chip")
    print("| quantity | reference | predicted | ratio |")
    print("|---|---|---|---|")
    print(f"| FLOPs per step: TorchTitan's count vs XLA's (whole program, attention dense) | {titan:.4e} "
          f"| {dense.flops:.4e} | {dense.flops / titan:.3f} |")
    print(f"| FLOPs per step: the same, torchtpu's blocked attention (loop bodies counted once) | {titan:.4e} "
          f"| {whole.flops:.4e} | {whole.flops / titan:.3f} |")
    print(f"| FLOPs per step: whole program vs layer difference | {whole.flops:.4e} | {predicted.flops:.4e} "
          f"| {predicted.flops / whole.flops:.3f} |")
    print(f"| memory XLA:CPU allocates (args + outputs + temps) vs layer difference | {mem_whole:.4e} "
          f"| {mem_pred:.4e} | {mem_pred / mem_whole:.3f} |")
    print(f"| parameters: TorchTitan vs traced | {params} | {whole.params} | {whole.params / params:.3f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="8B", help="qwen3 flavor (TorchTitan's qwen3_configs)")
    parser.add_argument("--chip", default="v7x", help="v5e, v5p, v6e or v7x (several: comma-separated)")
    parser.add_argument("--chips", type=lambda s: [int(x) for x in s.split(",")], default=list(CHIP_COUNTS))
    parser.add_argument("--tp", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--local-batch", type=int, default=1, help="sequences per rank and step")
    parser.add_argument("--link-efficiency", type=float, default=0.5,
                        help="fraction of the published bidirectional ICI bandwidth a collective reaches")
    parser.add_argument("--cache", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "pod_plan_cache.json"),
                        help="where the analysed programs are kept between runs")
    parser.add_argument("--check", action="store_true", help="check against the debug model (see above)")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.check:
        if args.seq_len == 4096:
            args.seq_len = 256
        if args.local_batch == 1:
            args.local_batch = 2
        check(args)
    else:
        plan(args)


if __name__ == "__main__":
    main()
