"""``torch._grouped_mm``: one matrix product per group, the groups cut by offsets (mixture of experts).

A mixture-of-experts layer sorts its routed tokens by expert and multiplies each expert's run of
rows by that expert's weight: ``_grouped_mm(A, B, offs=offs)``, where ``offs`` holds the groups'
cumulative end offsets (int32). Its four forms, as PyTorch defines them:

========  ========  ==============================  =====================================
``A``     ``B``     ``offs`` cuts                   result
========  ========  ==============================  =====================================
(M, K)    (G, K, N)  the rows of ``A``               (M, N): rows of group g times ``B[g]``
(G, M, K) (K, N)     the columns of ``B``            (M, N): columns of group g from ``A[g]``
(M, K)    (K, N)     the shared ``K``                (G, M, N): one product per K slice
(G, M, K) (G, K, N)  (no offsets)                    (G, M, N): a batched product
========  ========  ==============================  =====================================

The first three are JAX's ``ragged_dot_general`` (ragged rows of the left operand, ragged
contracting dimension); the second is the first transposed. Rows (columns, K slices) past the
last offset belong to no group: they are zeros here (PyTorch leaves them unwritten). Products
accumulate bf16/fp16 in fp32 and round once, as PyTorch's kernels do; the backward is PyTorch's
own (``GroupedMmBackward0`` calls ``_grouped_mm`` in the other forms).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from torchtpu.ops.dtypes import opmath, to_jax_dtype, to_torch_dtype
from torchtpu.ops.precision import matmul_precision
from torchtpu.ops.registry import aten, lowering

_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)


def _group_sizes(offs):
    """Cumulative end offsets → the size of each group."""
    offs = offs.astype(jnp.int32)
    return jnp.diff(offs, prepend=jnp.zeros((1,), jnp.int32))


def _ragged(lhs, rhs, group_sizes, dims, acc):
    return lax.ragged_dot_general(lhs, rhs, group_sizes, dims, precision=matmul_precision(),
                                  preferred_element_type=acc)


# c10's names of the scalar types, as PyTorch's CPU kernel writes them in its messages
_C10_NAMES = {"float32": ("float", "Float"), "float64": ("double", "Double"), "bfloat16": ("c10::BFloat16", "BFloat16"),
              "float16": ("c10::Half", "Half"), "int32": ("int", "Int"), "int64": ("int64_t", "Long"),
              "int16": ("int16_t", "Short"), "int8": ("int8_t", "Char"), "uint8": ("uint8_t", "Byte"),
              "bool": ("bool", "Bool")}


def _c10(dtype, which: int) -> str:
    return _C10_NAMES.get(np.dtype(dtype).name, (str(to_torch_dtype(dtype)),) * 2)[which]


def _check(a, b, offs, bias, out_dtype):
    """PyTorch's CPU kernel's checks, with its messages."""
    if a.dtype not in [np.dtype(d) for d in _FLOATS]:
        raise RuntimeError(f"Expected mat_a to be Float32, BFloat16 or Float16 matrix, got {_c10(a.dtype, 1)}")
    if a.dtype != b.dtype:
        raise RuntimeError(f"expected m1 and m2 to have the same dtype, but got: {_c10(a.dtype, 0)} != "
                           f"{_c10(b.dtype, 0)}")
    if a.ndim not in (2, 3) or b.ndim not in (2, 3):
        raise RuntimeError("mat_a has to be 2 or 3d" if a.ndim not in (2, 3) else "mat_b has to be 2 or 3d")
    if a.shape[-1] != b.shape[-2]:
        raise RuntimeError("contraction dimension of mat_a and mat_b must match")
    if (a.ndim == 2 or b.ndim == 2) != (offs is not None):
        raise RuntimeError("Have to provide offsets if there is a 2d matrix, or no offset if both matrices are 3d")
    if bias is not None:
        raise RuntimeError("Bias not supported yet")
    if out_dtype is not None and to_jax_dtype(out_dtype) != a.dtype:
        raise RuntimeError("Grouped gemm output dtype must match `mat_a` dtype")
    if offs is not None and (offs.ndim != 1 or offs.dtype != jnp.int32):
        raise RuntimeError("offsets have to be 1-d int32 tensor" if offs.ndim != 1 else "Offsets have to be int32")
    if a.ndim == 3 and b.ndim == 3 and a.shape[0] != b.shape[0]:
        raise RuntimeError("batch size of mat_a and mat_b must match")
    for m in (a, b):
        if m.ndim == 3 and offs is not None and m.shape[0] != offs.shape[0]:
            raise RuntimeError("matrix batch sizes have to match")


@lowering(aten._grouped_mm.default, dots=True)
def grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
    _check(a, b, offs, bias, out_dtype)
    dtype = a.dtype
    acc = opmath(a.dtype)
    if a.ndim == 3 and b.ndim == 3:  # batched: (G, M, K) @ (G, K, N)
        out = lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,))), precision=matmul_precision(),
                              preferred_element_type=acc)
    elif a.ndim == 2 and b.ndim == 3:  # ragged rows of A: (M, K) @ (G, K, N) -> (M, N)
        dims = lax.RaggedDotDimensionNumbers((((1,), (1,)), ((), ())), lhs_ragged_dimensions=[0],
                                             rhs_group_dimensions=[0])
        out = _ragged(a, b, _group_sizes(offs), dims, acc)
    elif a.ndim == 3 and b.ndim == 2:  # ragged columns of B: the transpose of the case above
        dims = lax.RaggedDotDimensionNumbers((((0,), (1,)), ((), ())), lhs_ragged_dimensions=[1],
                                             rhs_group_dimensions=[0])
        # B (K, N) with N ragged, against A (G, M, K): B^T (N, K) @ A^T (G, K, M) -> (N, M)
        out = _ragged(b, jnp.swapaxes(a, 1, 2), _group_sizes(offs), dims, acc).T
    else:  # ragged K: (M, K) @ (K, N) -> (G, M, N), one product per slice of K
        dims = lax.RaggedDotDimensionNumbers((((1,), (0,)), ((), ())), lhs_ragged_dimensions=[1],
                                             rhs_group_dimensions=[])
        out = _ragged(a, b, _group_sizes(offs), dims, acc)
    return out.astype(dtype)
