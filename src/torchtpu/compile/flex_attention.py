"""The flex_attention higher-order ops on tpu: one JAX program (``ops/flex_attention.py``) for
compiled graphs and for eager calls.

``torch.ops.higher_order.flex_attention`` and ``flex_attention_backward`` carry ``score_mod`` and
``mask_mod`` as functions of one element. In a compiled graph they are aten GraphModules
(``get_attr`` nodes) and ``LOWERINGS`` lowers the HOP nodes: each subgraph runs through the graph
interpreter (``graph.GraphFunction``) on JAX values, so the modifiers are traced into the graph's
one program. In eager (PyTorch runs the HOPs through its ``eager`` dynamo backend), the
PrivateUse1 kernels ``eager_forward``/``eager_backward`` trace the modifiers to aten with
``make_fx`` once per function and build one jitted program per (modifiers, block sizes, scale,
matmul precision setting). Both follow ``torch.set_float32_matmul_precision`` as the ``dots=True``
lowerings do: the setting is in the programs' keys and pinned while they are traced.

PyTorch's HOPs return log-sum-exp and row maxima in log2 (its math implementation divides by
ln 2 and the frontend multiplies back); these lowerings do the same.
"""

from __future__ import annotations

import copy
import math
from typing import Callable

import jax
import torch
from torch.fx import GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx

from torchtpu import caches
from torchtpu.compile import graph as graph_lowering
from torchtpu.device import bridge
from torchtpu.ops import flex_attention as flex
from torchtpu.ops import precision
from torchtpu.runtime.compat import HigherOrderOperator, TransformGetItemToIndex, captured_grad_buffer_mask


def _every_capture(joint_graph, num_captures: int) -> tuple[bool, ...]:
    """torch < 2.14 has no captured_grad_buffer_mask: it materialises every capture's gradient."""
    return (True,) * num_captures


_captured_grad_buffer_mask = captured_grad_buffer_mask or _every_capture

LN2 = math.log(2.0)
_LARGE_BLOCK = 1 << 30  # PyTorch's block size for "no BlockMask given": one block, nothing skipped
# Positions of the block sizes in BlockMask.as_tuple(): the two before mask_mod (the last); from
# its start they moved (10, 11 in torch 2.11/2.12; 14, 15 since 2.13 added four arrays).
_Q_BS, _KV_BS = -3, -2


def element_function(gm: GraphModule) -> Callable:
    """An aten graph of one element (a score_mod or mask_mod) as a JAX function of its inputs."""
    graph = copy.deepcopy(gm.graph)
    output = next(n for n in graph.nodes if n.op == "output")
    result = output.args[0]
    first = isinstance(result, Node)
    if first:  # the interpreter returns a sequence of outputs
        output.args = ((result,),)
    fn = graph_lowering.GraphFunction(GraphModule(gm, graph))

    def run(*args):
        outputs, _ = fn(None, list(args))
        return outputs[0]

    return run


def _sparsity(block_mask: tuple) -> tuple:
    """((q block, kv block), (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices))."""
    return (int(block_mask[_Q_BS]), int(block_mask[_KV_BS])), tuple(block_mask[2:6])


def blocks(sizes: tuple[int, int], arrays: tuple, q_len: int, kv_len: int) -> flex.Blocks:
    """A BlockMask's sparsity (its arrays already JAX values); every block for "no BlockMask"."""
    if max(sizes) >= _LARGE_BLOCK:
        return flex.dense_blocks(q_len, kv_len)
    return flex.Blocks(*sizes, *arrays)


def _forward(q, k, v, score_fn, mask_fn, sparsity, scale, score_buffers, mask_buffers):
    out, lse, row_max = flex.forward(q, k, v, score_fn, mask_fn, blocks(*sparsity, q.shape[2], k.shape[2]),
                                     scale, score_buffers, mask_buffers)
    return out, lse / LN2, row_max / LN2


def _backward(q, k, v, out, lse, grad_out, grad_lse, score_fn, mask_fn, sparsity, scale,
              score_buffers, mask_buffers, wanted):
    if grad_out is None:
        grad_out = jax.numpy.zeros_like(out)
    grad_lse = None if grad_lse is None else grad_lse / LN2  # the HOP's lse is log2(natural lse)
    return flex.backward(q, k, v, out, lse * LN2, grad_out, grad_lse, score_fn, mask_fn,
                         blocks(*sparsity, q.shape[2], k.shape[2]), scale, score_buffers, mask_buffers, wanted)


# ---------------------------------------------------------------- compiled graphs

def lower_forward(q, k, v, score_mod, block_mask, scale, kernel_options, score_buffers=(), mask_buffers=()):
    """``flex_attention`` in a compiled graph: (out, lse, max_scores), the modifiers traced in."""
    return _forward(q, k, v, element_function(score_mod), element_function(block_mask[-1]),
                    _sparsity(block_mask), scale, score_buffers, mask_buffers)


def lower_backward(q, k, v, out, lse, grad_out, grad_lse, fw_graph, joint_graph, block_mask, scale,
                   kernel_options, score_buffers=(), mask_buffers=()):
    """``flex_attention_backward`` in a compiled graph: (dq, dk, dv, captured buffers' grads)."""
    wanted = _captured_grad_buffer_mask(joint_graph, len(score_buffers))
    return _backward(q, k, v, out, lse, grad_out, grad_lse, element_function(fw_graph),
                     element_function(block_mask[-1]), _sparsity(block_mask), scale, score_buffers,
                     mask_buffers, wanted)


# their dots follow torch's matmul precision: a graph holding them keys its programs on the setting
lower_forward.dots = lower_backward.dots = True
LOWERINGS = {"flex_attention": lower_forward, "flex_attention_backward": lower_backward}
graph_lowering.HOP_LOWERINGS.update(LOWERINGS)  # the graph interpreter lowers the HOPs through these


def lowering_for(target) -> Callable | None:
    """The lowering of a higher-order op node's target, if it is one of these."""
    name = getattr(target, "_name", None) if isinstance(target, HigherOrderOperator) else None
    return LOWERINGS.get(name)


# ---------------------------------------------------------------- eager kernels (PrivateUse1)

_graphs = caches.LRU("flex_attention_modifiers", "kernel_cache_size")  # (function, inputs) -> aten graph
_programs = caches.LRU("flex_attention_programs", "kernel_cache_size")  # (graphs, statics) -> jitted


def _aten_graph(fn: Callable, scalars: tuple, device: torch.device, buffers: tuple) -> GraphModule:
    """``fn`` (a score_mod or mask_mod: a Python function or dynamo's GraphModule) traced to aten,
    on 0-d tensors of the dtypes ``scalars`` and the captured ``buffers``."""
    key = (fn, scalars, device, tuple((tuple(b.shape), b.dtype, b.device) for b in buffers))
    gm = _graphs.get(key)
    if gm is None:
        from torchtpu.compile.decompositions import decompositions

        examples = [torch.zeros((), dtype=dtype, device=device) for dtype in scalars]
        with TransformGetItemToIndex():  # buffer[h] with a tensor index traces as aten.index
            # tensors a plain function closes over (no dynamo to lift them) become constants
            gm = make_fx(fn, decomposition_table=decompositions(), tracing_mode="fake",
                         _allow_non_fake_inputs=True)(*examples, *buffers)
        _graphs[key] = gm
    return gm


def _modifier_graphs(query, score_mod, mask_mod, score_buffers, mask_buffers) -> tuple:
    work = torch.float64 if query.dtype == torch.float64 else torch.float32  # scores' dtype in the kernel
    index = (torch.int32,) * 4
    return (_aten_graph(score_mod, (work, *index), query.device, tuple(score_buffers)),
            _aten_graph(mask_mod, index, query.device, tuple(mask_buffers)))


def _present(values) -> tuple[bool, ...]:
    return tuple(v is not None for v in values)


def _filled(present: tuple[bool, ...], arrays: list) -> tuple:
    """The arrays back in their slots, None where ``present`` says there was none."""
    it = iter(arrays)
    return tuple(next(it) if p else None for p in present)


def _program(kind: str, graphs: tuple, statics: tuple) -> Callable:
    """The jitted program of one (modifiers, statics) at the current matmul precision setting."""
    setting = precision.setting()
    key = (kind, graphs, statics, setting)
    program = _programs.get(key)
    if program is None:
        build = _build_forward if kind == "forward" else _build_backward
        program = _programs[key] = jax.jit(_pinned(build(*map(element_function, graphs), *statics), setting,
                                                   f"flex_attention's {kind}"))
    return program


def _pinned(run: Callable, setting: str, what: str) -> Callable:
    """``run`` tracing with the matmul precision ``setting`` its program's key carries (it may be
    traced later, when a deferred eager program runs)."""
    def pinned(*args):
        with precision.tracing(setting, what):
            return run(*args)

    pinned.__name__ = what.replace("'s ", "_")  # names the program (profiles, IR dumps)
    return pinned


def _build_forward(score_fn, mask_fn, scale, sizes, present, n_score) -> Callable:
    def run(q, k, v, *rest):
        arrays, buffers = _filled(present, rest), rest[sum(present):]
        return _forward(q, k, v, score_fn, mask_fn, (sizes, arrays), scale, buffers[:n_score], buffers[n_score:])

    return run


def _build_backward(score_fn, mask_fn, scale, sizes, present, n_score, grads_present, wanted) -> Callable:
    def run(q, k, v, out, lse, *rest):
        grads, rest = _filled(grads_present, rest), rest[sum(grads_present):]
        arrays, buffers = _filled(present, rest), rest[sum(present):]
        dq, dk, dv, dbuf = _backward(q, k, v, out, lse, *grads, score_fn, mask_fn, (sizes, arrays), scale,
                                     buffers[:n_score], buffers[n_score:], wanted)
        return (dq, dk, dv, *[g for g in dbuf if g is not None])

    return run


def _array(t: torch.Tensor, device_index: int):
    if t.device.type == "tpu":
        return bridge.read(t)
    if t.dim() == 0:  # PyTorch lets a CPU 0-d tensor join a device op as a scalar
        return jax.numpy.asarray(t.detach().numpy())
    raise RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, tpu:{device_index} "
        f"and {t.device}! (flex_attention on tpu: move the tensors score_mod/mask_mod use to tpu)")


def _run(program: Callable, tensors: list, device_index: int) -> list[torch.Tensor]:
    """Run a program on tpu tensors (in the eager mode in force) and wrap its outputs."""
    outs = bridge.apply(program, *[_array(t, device_index) for t in tensors])
    return [bridge.wrap(o, device_index) for o in outs]


def eager_forward(query, key, value, score_mod, block_mask, scale, kernel_options,
                  score_mod_other_buffers=(), mask_mod_other_buffers=()) -> tuple:
    """The HOP's tpu kernel: (out, lse, max_scores), one jitted program per modifiers and sizes."""
    graphs = _modifier_graphs(query, score_mod, block_mask[-1], score_mod_other_buffers, mask_mod_other_buffers)
    sizes, arrays = _sparsity(block_mask)
    statics = (float(scale), sizes, _present(arrays), len(score_mod_other_buffers))
    tensors = [query, key, value, *[a for a in arrays if a is not None],
               *score_mod_other_buffers, *mask_mod_other_buffers]
    return tuple(_run(_program("forward", graphs, statics), tensors, query.get_device()))


def eager_backward(query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph, joint_graph,
                   block_mask, scale, kernel_options, score_mod_other_buffers=(), mask_mod_other_buffers=()):
    """The backward HOP's tpu kernel: (dq, dk, dv, captured score buffers' grads)."""
    buffers = tuple(score_mod_other_buffers)
    graphs = _modifier_graphs(query, fw_graph, block_mask[-1], buffers, mask_mod_other_buffers)
    mask = _captured_grad_buffer_mask(joint_graph, len(buffers))
    wanted = tuple(m and isinstance(b, torch.Tensor) and b.is_floating_point() for m, b in zip(mask, buffers))
    sizes, arrays = _sparsity(block_mask)
    grads = (grad_out, grad_logsumexp)
    statics = (float(scale), sizes, _present(arrays), len(buffers), _present(grads), wanted)
    tensors = [query, key, value, out, logsumexp, *[g for g in grads if g is not None],
               *[a for a in arrays if a is not None], *buffers, *mask_mod_other_buffers]
    dq, dk, dv, *dbuf = _run(_program("backward", graphs, statics), tensors, query.get_device())
    return dq, dk, dv, _filled(wanted, dbuf)
