"""Linear algebra: matrix products (with PyTorch's opmath accumulation) and decompositions.

Products accumulate fp16/bf16 in fp32 (``preferred_element_type``) at the precision
``torch.set_float32_matmul_precision`` asks for (``precision.py``; PyTorch's default "highest" is
``Precision.HIGHEST``, so a TPU never silently runs fp32 as bf16 passes). Decompositions'
internal products stay HIGHEST whatever the setting. LAPACK-style results
(1-based int32 pivots, ``info`` codes) follow PyTorch's CPU kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchtpu.ops.dtypes import opmath, to_jax_dtype, to_torch_dtype
from torchtpu.ops.precision import matmul_precision
from torchtpu.ops.registry import aten, lowering

HIGHEST = lax.Precision.HIGHEST  # decompositions' internal products (``_mm``)


# ---------------------------------------------------------------- products

def _same_dtype(a, b, what: str = "m1 and m2") -> None:
    if a.dtype != b.dtype:
        raise RuntimeError(f"expected {what} to have the same dtype, but got: "
                           f"{to_torch_dtype(a.dtype)} != {to_torch_dtype(b.dtype)}")


def _check_mm(a, b) -> None:
    if a.shape[-1] != b.shape[-2]:
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied "
                           f"({'x'.join(map(str, a.shape[-2:]))} and {'x'.join(map(str, b.shape[-2:]))})")


def _dot(a, b, dims, out_dtype=None):
    """``dot_general`` accumulating in PyTorch's opmath dtype, result in ``out_dtype``."""
    out_dtype = np.dtype(out_dtype or a.dtype)
    acc = opmath(out_dtype) if out_dtype == a.dtype else out_dtype
    return lax.dot_general(a, b, dims, precision=matmul_precision(), preferred_element_type=acc)


_MM = (((1,), (0,)), ((), ()))
_BMM = (((2,), (1,)), ((0,), (0,)))
_MV = (((1,), (0,)), ((), ()))
_VV = (((0,), (0,)), ((), ()))
_ADDBMM = (((0, 2), (0, 1)), ((), ()))


def _scaled_sum(acc, bias, beta, alpha, dtype):
    """``beta * bias + alpha * acc`` in opmath; beta == 0 ignores ``bias`` (NaNs included)."""
    if jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.bool_:
        # PyTorch converts the scalars to the tensors' type first: 0.6 is 0 for int64 tensors
        alpha, beta = (jnp.asarray(v) != 0 if dtype == jnp.bool_ else jnp.trunc(jnp.asarray(v)).astype(dtype)
                       for v in (alpha, beta))
    acc = acc * alpha
    if bias is not None:
        bias = jnp.asarray(bias).astype(acc.dtype)
        acc = acc + jnp.where(beta == 0, jnp.zeros_like(bias), bias * beta)
    return acc.astype(dtype)


@lowering(aten.mm.default, dots=True)
def mm(a, b):
    _same_dtype(a, b)
    _check_mm(a, b)
    return _dot(a, b, _MM).astype(a.dtype)


@lowering(aten.mm.dtype, dots=True)
def mm_dtype(a, b, out_dtype):
    _same_dtype(a, b)
    _check_mm(a, b)
    dtype = to_jax_dtype(out_dtype)
    return _dot(a, b, _MM, dtype).astype(dtype)


@lowering(aten.bmm.default, dots=True)
def bmm(a, b):
    _same_dtype(a, b, "batch1 and batch2")
    return _dot(a, b, _BMM).astype(a.dtype)


@lowering(aten.bmm.dtype, dots=True)
def bmm_dtype(a, b, out_dtype):
    _same_dtype(a, b, "batch1 and batch2")
    dtype = to_jax_dtype(out_dtype)
    return _dot(a, b, _BMM, dtype).astype(dtype)


@lowering(aten.addmm.default, dots=True)
def addmm(bias, a, b, *, beta=1, alpha=1):
    _same_dtype(a, b)
    _check_mm(a, b)
    return _scaled_sum(_dot(a, b, _MM), bias, beta, alpha, a.dtype)


@lowering(aten.addmm.dtype, dots=True)
def addmm_dtype(bias, a, b, out_dtype, *, beta=1, alpha=1):
    _same_dtype(a, b)
    dtype = to_jax_dtype(out_dtype)
    return _scaled_sum(_dot(a, b, _MM, dtype), bias, beta, alpha, dtype)


@lowering(aten.baddbmm.default, dots=True)
def baddbmm(bias, a, b, *, beta=1, alpha=1):
    _same_dtype(a, b, "batch1 and batch2")
    return _scaled_sum(_dot(a, b, _BMM), bias, beta, alpha, a.dtype)


@lowering(aten.baddbmm.dtype, dots=True)
def baddbmm_dtype(bias, a, b, out_dtype, *, beta=1, alpha=1):
    _same_dtype(a, b, "batch1 and batch2")
    dtype = to_jax_dtype(out_dtype)
    return _scaled_sum(_dot(a, b, _BMM, dtype), bias, beta, alpha, dtype)


@lowering(aten.addbmm.default, dots=True)
def addbmm(bias, a, b, *, beta=1, alpha=1):
    _same_dtype(a, b, "batch1 and batch2")
    return _scaled_sum(_dot(a, b, _ADDBMM), bias, beta, alpha, a.dtype)


@lowering(aten.mv.default, dots=True)
def mv(a, v):
    _same_dtype(a, v, "mat and vec")
    return _dot(a, v, _MV).astype(a.dtype)


@lowering(aten.addmv.default, dots=True)
def addmv(bias, a, v, *, beta=1, alpha=1):
    _same_dtype(a, v, "mat and vec")
    return _scaled_sum(_dot(a, v, _MV), bias, beta, alpha, a.dtype)


@lowering(aten.dot.default, dots=True)
def dot(a, b):
    _same_dtype(a, b, "self and other")
    if a.ndim != 1 or b.ndim != 1:
        raise RuntimeError(f"1D tensors expected, but got {a.ndim}D and {b.ndim}D tensors")
    return _dot(a, b, _VV).astype(a.dtype)


@lowering(aten.vdot.default, dots=True)
def vdot(a, b):
    _same_dtype(a, b, "self and other")
    return _dot(jnp.conj(a), b, _VV).astype(a.dtype)


@lowering(aten.addr.default)
def addr(bias, a, b, *, beta=1, alpha=1):
    outer = a.astype(opmath(a.dtype))[:, None] * b.astype(opmath(b.dtype))[None, :]
    return _scaled_sum(outer, bias, beta, alpha, jnp.result_type(a, b, bias))


# ---------------------------------------------------------------- decompositions

def _batch_info(bad):
    """LAPACK's ``info``: the 1-based index of the first failing pivot, 0 when none fails."""
    first = jnp.argmax(bad, axis=-1).astype(jnp.int32) + 1
    return jnp.where(jnp.any(bad, axis=-1), first, 0).astype(jnp.int32)


def _mT(x):
    return jnp.swapaxes(x, -1, -2)


def _mH(x):
    return jnp.conj(_mT(x)) if jnp.iscomplexobj(x) else _mT(x)


def _real_dtype(dtype):
    return jnp.real(jnp.zeros((), dtype)).dtype


def _complex_dtype(dtype):
    return jnp.result_type(dtype, jnp.complex64)


def _mm(a, b):
    return jnp.matmul(a, b, precision=HIGHEST)


def _check_square(A, name: str) -> None:
    if A.ndim < 2:
        raise RuntimeError(f"{name}: The input tensor A must have at least 2 dimensions.")
    if A.shape[-1] != A.shape[-2]:
        raise RuntimeError(f"{name}: A must be batches of square matrices, but they are "
                           f"{A.shape[-2]} by {A.shape[-1]} matrices")


def _check_float(A, name: str) -> None:
    if not (jnp.issubdtype(A.dtype, jnp.floating) or jnp.iscomplexobj(A)) or A.dtype in (jnp.float16, jnp.bfloat16):
        raise RuntimeError(f"{name}: Expected a floating point or complex tensor as input. "
                           f"Got {to_torch_dtype(A.dtype)}")


def _cholesky_info(A):
    """LAPACK's potrf ``info``: the order of the first leading minor that is not positive-definite.

    XLA's Cholesky turns a whole failed factorisation into NaNs, so the failing order is found by
    an unblocked elimination; ``lax.cond`` runs it only when some matrix failed.
    """
    n = A.shape[-1]
    rows = jnp.arange(n)

    def step(k, carry):
        M, info = carry
        d = jnp.real(M[..., k, k])
        bad = ~(d > 0)
        info = jnp.where((info == 0) & bad, k + 1, info)
        col = M[..., :, k] / jnp.sqrt(jnp.where(bad, 1, d)).astype(M.dtype)[..., None]
        col = jnp.where(rows > k, col, 0)
        return M - col[..., :, None] * jnp.conj(col[..., None, :]), info

    return lax.fori_loop(0, n, step, (A, jnp.zeros(A.shape[:-2], jnp.int32)))[1]


@lowering(aten.linalg_cholesky_ex.default)
def linalg_cholesky_ex(A, *, upper=False, check_errors=False):
    _check_square(A, "linalg.cholesky")
    _check_float(A, "linalg.cholesky")
    if A.size == 0:  # an empty batch or 0x0 matrices: nothing to factor, nothing failed
        return A, jnp.zeros(A.shape[:-2], jnp.int32)
    L = jnp.tril(lax.linalg.cholesky(A, symmetrize_input=False))
    failed = jnp.any(jnp.isnan(L))
    info = lax.cond(failed, _cholesky_info, lambda A: jnp.zeros(A.shape[:-2], jnp.int32), A)
    return (_mH(L) if upper else L), info


def _lu(A):
    """(LU, 1-based int32 pivots, permutation, info) of a batch of matrices (partial pivoting)."""
    lu, pivots, perm = lax.linalg.lu(A)
    k = min(A.shape[-2:])
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)[..., :k]
    info = _batch_info(diag == 0) if k else jnp.zeros(A.shape[:-2], jnp.int32)
    return lu, (pivots + 1).astype(jnp.int32), perm, info


def _lu_solve(lu, perm, B, adjoint: bool = False):
    """Solve ``A X = B`` (or ``A^H X = B``) from A's LU factors; B is a batch of matrices."""
    lu, B = _broadcast_batch(lu, B)
    perm = jnp.broadcast_to(perm, lu.shape[:-2] + perm.shape[-1:])
    tri = lax.linalg.triangular_solve
    if not adjoint:
        pb = jnp.take_along_axis(B, perm[..., :, None], axis=-2)
        y = tri(lu, pb, left_side=True, lower=True, unit_diagonal=True)
        return tri(lu, y, left_side=True, lower=False)
    y = tri(lu, B, left_side=True, lower=False, transpose_a=True, conjugate_a=True)
    x = tri(lu, y, left_side=True, lower=True, unit_diagonal=True, transpose_a=True, conjugate_a=True)
    inverse = jnp.argsort(perm, axis=-1)
    return jnp.take_along_axis(x, inverse[..., :, None], axis=-2)


def _broadcast_batch(A, B):
    batch = jnp.broadcast_shapes(A.shape[:-2], B.shape[:-2])
    return jnp.broadcast_to(A, batch + A.shape[-2:]), jnp.broadcast_to(B, batch + B.shape[-2:])


def _perm_from_pivots(pivots, m: int):
    """The row permutation ``perm`` (``A[perm] = L U``) from 1-based LAPACK pivots."""
    batch = pivots.shape[:-1]
    perm = jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32), batch + (m,))

    def swap(i, perm):
        j = pivots[..., i] - 1
        pi = perm[..., i]
        pj = jnp.take_along_axis(perm, j[..., None], axis=-1)[..., 0]
        perm = perm.at[..., i].set(pj)
        return jnp.where(jnp.arange(m) == j[..., None], pi[..., None], perm)

    if pivots.size == 0:  # (fori_loop traces its body even for no steps)
        return perm
    return lax.fori_loop(0, pivots.shape[-1], swap, perm)


@lowering(aten.linalg_lu_factor_ex.default)
def linalg_lu_factor_ex(A, *, pivot=True, check_errors=False):
    if not pivot:
        raise RuntimeError("linalg.lu_factor: LU without pivoting is not implemented on the tpu device")
    lu, pivots, _, info = _lu(A)
    return lu, pivots, info


@lowering(aten.linalg_lu.default)
def linalg_lu(A, *, pivot=True):
    if not pivot:
        raise RuntimeError("linalg.lu: LU without pivoting is not implemented on the tpu device")
    m, n = A.shape[-2:]
    k = min(m, n)
    lu, _, perm, _ = _lu(A)
    L = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=A.dtype)
    U = jnp.triu(lu[..., :k, :])
    P = _mT(jax.nn.one_hot(perm, m, dtype=A.dtype))
    return P, L, U


@lowering(aten.linalg_lu_solve.default)
def linalg_lu_solve(LU, pivots, B, *, left=True, adjoint=False):
    perm = _perm_from_pivots(pivots, LU.shape[-1])
    if left:
        return _lu_solve(LU, perm, B, adjoint)
    # X A = B  <=>  A^H X^H = B^H
    return _mH(_lu_solve(LU, perm, _mH(B), not adjoint))


@lowering(aten.linalg_inv_ex.default)
def linalg_inv_ex(A, *, check_errors=False):
    _check_square(A, "linalg.inv")
    _check_float(A, "linalg.inv")
    lu, _, perm, info = _lu(A)
    eye = jnp.broadcast_to(jnp.eye(A.shape[-1], dtype=A.dtype), A.shape)
    return _lu_solve(lu, perm, eye), info


def _vector_rhs(A, B) -> bool:
    """PyTorch's rule: B is a (batch of) vector(s) when 1-D or shaped like A without its last dim."""
    return B.ndim == 1 or (B.ndim == A.ndim - 1 and B.shape == A.shape[:-1])


@lowering(aten._linalg_solve_ex.default)
def _linalg_solve_ex(A, B, *, left=True, check_errors=False):
    _check_square(A, "linalg.solve")
    _check_float(A, "linalg.solve")
    vector = _vector_rhs(A, B)
    rhs = B[..., None] if vector else B
    # PyTorch returns the LU of A for both sides (its backward relies on it); X A = B is A^H X^H = B^H
    lu, pivots, perm, info = _lu(A)
    x = _lu_solve(lu, perm, rhs) if left else _mH(_lu_solve(lu, perm, _mH(rhs), adjoint=True))
    return (x[..., 0] if vector else x), lu, pivots, info


@lowering(aten.linalg_solve_triangular.default)
def linalg_solve_triangular(A, B, *, upper, left=True, unitriangular=False):
    A, B = _broadcast_batch(A, B)
    return lax.linalg.triangular_solve(A, B, left_side=left, lower=not upper,
                                       unit_diagonal=unitriangular)


@lowering(aten.triangular_solve.default)
def triangular_solve(B, A, upper=True, transpose=False, unitriangular=False):
    A, B = _broadcast_batch(A, B)
    x = lax.linalg.triangular_solve(A, B, left_side=True, lower=not upper, transpose_a=transpose,
                                    unit_diagonal=unitriangular)
    return x, A


@lowering(aten.cholesky_solve.default)
def cholesky_solve(B, L, upper=False):
    L, B = _broadcast_batch(L, B)
    tri = lax.linalg.triangular_solve
    if upper:  # A = U^H U
        y = tri(L, B, left_side=True, lower=False, transpose_a=True, conjugate_a=True)
        return tri(L, y, left_side=True, lower=False)
    y = tri(L, B, left_side=True, lower=True)
    return tri(L, y, left_side=True, lower=True, transpose_a=True, conjugate_a=True)


@lowering(aten.cholesky_inverse.default)
def cholesky_inverse(L, upper=False):
    eye = jnp.broadcast_to(jnp.eye(L.shape[-1], dtype=L.dtype), L.shape)
    return cholesky_solve(eye, L, upper)


@lowering(aten.linalg_qr.default)
def linalg_qr(A, mode="reduced"):
    if mode not in ("reduced", "complete", "r"):
        raise RuntimeError(f"qr received unrecognized mode '{mode}' but expected one of "
                           "'reduced' (default), 'r', or 'complete'")
    full = mode == "complete"
    q, r = lax.linalg.qr(A, full_matrices=full)
    if mode == "r":
        return jnp.zeros((0,), A.dtype), r
    return q, r


@lowering(aten._linalg_eigh.default)
def _linalg_eigh(A, UPLO="L", compute_v=True):
    if UPLO not in ("L", "U"):
        raise RuntimeError(f"Expected UPLO argument to be 'L' or 'U', but got {UPLO}")
    v, w = lax.linalg.eigh(A, lower=UPLO == "L", symmetrize_input=False, sort_eigenvalues=True)
    w = w.astype(_real_dtype(A.dtype))
    return w, (v if compute_v else jnp.zeros((0,), A.dtype))


@lowering(aten._linalg_svd.default)
def _linalg_svd(A, full_matrices=False, compute_uv=True, *, driver=None):
    real = _real_dtype(A.dtype)
    if not compute_uv:
        s = lax.linalg.svd(A, full_matrices=False, compute_uv=False)
        return jnp.zeros((0,), A.dtype), s.astype(real), jnp.zeros((0,), A.dtype)
    u, s, vh = lax.linalg.svd(A, full_matrices=full_matrices, compute_uv=True)
    return u, s.astype(real), vh


def _det_parts(A):
    # PyTorch factors A^T for real A (LAPACK reads a contiguous A^T without a copy), and its
    # backward solves with that LU accordingly; the determinant is the same either way.
    lu, pivots, _, _ = _lu(A if jnp.iscomplexobj(A) else _mT(A))
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    swaps = jnp.sum(pivots != jnp.arange(1, A.shape[-1] + 1, dtype=jnp.int32), axis=-1)
    parity = jnp.where(swaps % 2 == 1, -1, 1).astype(A.dtype)
    return lu, pivots, diag, parity


@lowering(aten._linalg_det.default)
def _linalg_det(A):
    _check_square(A, "linalg.det")
    lu, pivots, diag, parity = _det_parts(A)
    return parity * jnp.prod(diag, axis=-1), lu, pivots


@lowering(aten._linalg_slogdet.default)
def _linalg_slogdet(A):
    _check_square(A, "linalg.slogdet")
    lu, pivots, diag, parity = _det_parts(A)
    absdiag = jnp.abs(diag)
    phase = diag / jnp.where(absdiag == 0, 1, absdiag).astype(diag.dtype)
    sign = parity * jnp.prod(phase, axis=-1)
    logabsdet = jnp.sum(jnp.log(absdiag), axis=-1)
    sign = jnp.where(jnp.any(absdiag == 0, axis=-1), jnp.zeros_like(sign), sign)
    return sign, logabsdet, lu, pivots


@lowering(aten._trilinear.default)
def _trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """``nn.functional.bilinear``'s kernel: the three inputs, unsqueezed, multiplied, summed over ``sumdim``."""
    def expand(x, dims):
        for d in sorted(dims):
            x = jnp.expand_dims(x, d)
        return x

    dtype = jnp.result_type(i1, i2, i3)
    out = expand(i1, expand1).astype(dtype) * expand(i2, expand2) * expand(i3, expand3)
    return jnp.sum(out, axis=tuple(sumdim)) if sumdim else out


@lowering(aten.linalg_matrix_exp.default)
def linalg_matrix_exp(A):
    _check_square(A, "linalg.matrix_exp")
    if A.dtype in (jnp.bfloat16, jnp.float16):  # XLA's expm wants 32 bits; PyTorch's CPU takes halves
        return jax.scipy.linalg.expm(A.astype(jnp.float32)).astype(A.dtype)
    return jax.scipy.linalg.expm(A)


def linalg_matrix_sqrth(A):
    """The principal root via ``eigh`` of the lower triangle; negative eigenvalues count as 0, as on CPU."""
    _check_square(A, "linalg.matrix_sqrth")
    _check_float(A, "linalg.matrix_sqrth")
    v, w = lax.linalg.eigh(A, lower=True, symmetrize_input=False)
    root = jnp.sqrt(jnp.maximum(w, 0)).astype(A.dtype)
    return _mm(v * root[..., None, :], _mH(v))


def linalg_polar(A):
    """``A = U H`` from the SVD ``A = W S V^H``: ``U = W V^H``, ``H = V S V^H`` (PyTorch's CPU method)."""
    m, n = A.shape[-2:]
    if m < n:
        raise RuntimeError(f"linalg.polar: input must have at least as many rows as columns, but got "
                           f"{m} by {n} matrices")
    _check_float(A, "linalg.polar")
    w, s, vh = lax.linalg.svd(A, full_matrices=False)
    return _mm(w, vh), _mm(_mH(vh) * s.astype(A.dtype)[..., None, :], vh)


# torch 2.14 added linalg.matrix_sqrth and linalg.polar; older releases have no such op to lower.
for _name, _fn in (("linalg_matrix_sqrth", linalg_matrix_sqrth), ("linalg_polar", linalg_polar)):
    if hasattr(aten, _name):
        lowering(getattr(aten, _name).default)(_fn)


def _pinv_rtol(A, atol, rtol):
    """PyTorch's default: ``rtol = eps * max(m, n)``, or 0 where a positive ``atol`` is given."""
    if rtol is not None:
        return rtol
    default = np.finfo(_real_dtype(A.dtype)).eps * max(A.shape[-2:])
    return default if atol is None else jnp.where(atol > 0, 0.0, default)


@lowering(aten.linalg_pinv.atol_rtol_tensor)
def linalg_pinv(A, *, atol=None, rtol=None, hermitian=False):
    """Pseudo-inverse as PyTorch computes it: singular values (``|eigenvalues|`` when Hermitian)
    at most ``max(atol, rtol * largest)`` count as zero."""
    if A.ndim < 2 or not (jnp.issubdtype(A.dtype, jnp.floating) or jnp.iscomplexobj(A)) \
            or A.dtype in (jnp.float16, jnp.bfloat16):
        raise RuntimeError(f"linalg.pinv({to_torch_dtype(A.dtype)}{{{list(A.shape)}}}): expected a tensor with "
                           "2 or more dimensions of float, double, cfloat or cdouble types")
    m, n = A.shape[-2:]
    if A.size == 0:
        return jnp.zeros(A.shape[:-2] + (n, m), A.dtype)
    rtol = _pinv_rtol(A, atol, rtol)
    atol = 0.0 if atol is None else atol
    if hermitian:
        u, w = lax.linalg.eigh(A, lower=True, symmetrize_input=False)
        magnitude = jnp.abs(w)
        largest = jnp.max(magnitude, axis=-1, keepdims=True)
        left, right = u, _mH(u)
    else:
        u, magnitude, vh = lax.linalg.svd(A, full_matrices=False)
        w, largest = magnitude, magnitude[..., :1]
        left, right = _mH(vh), _mH(u)
    tol = jnp.maximum(jnp.expand_dims(jnp.asarray(atol), -1),
                      jnp.expand_dims(jnp.asarray(rtol), -1) * largest).astype(magnitude.dtype)
    inverse = jnp.where(magnitude > tol, 1 / jnp.where(magnitude > tol, w, 1), 0).astype(A.dtype)
    return _mm(left * inverse[..., None, :], right)


# ---------------------------------------------------------------- non-symmetric eigenproblem

def _check_eig(A, name: str):
    """The checks of eig and eigvals; returns their (complex) result dtype."""
    from torchtpu.runtime.platform import platform

    _check_square(A, f"linalg.{name}")
    _check_float(A, f"linalg.{name}")
    if platform() == "tpu":
        raise NotImplementedError(f"torch.linalg.{name}: XLA has no non-symmetric eigendecomposition on TPU "
                                  f"(only on CPU and GPU); compute it on the host with torch.linalg.{name}(A.cpu())")
    return _complex_dtype(A.dtype)


@lowering(aten.linalg_eig.default)
def linalg_eig(A):
    """LAPACK's ``geev`` through XLA (CPU and GPU only): unit-norm eigenvectors, as PyTorch's CPU."""
    dtype = _check_eig(A, "eig")
    if A.size == 0:
        return jnp.zeros(A.shape[:-1], dtype), jnp.zeros(A.shape, dtype)
    w, v = lax.linalg.eig(A, compute_left_eigenvectors=False)
    return w.astype(dtype), v.astype(dtype)


@lowering(aten._linalg_eigvals.default)
def _linalg_eigvals(A):
    dtype = _check_eig(A, "eigvals")
    if A.size == 0:
        return jnp.zeros(A.shape[:-1], dtype)
    (w,) = lax.linalg.eig(A, compute_left_eigenvectors=False, compute_right_eigenvectors=False)
    return w.astype(dtype)


# ---------------------------------------------------------------- Householder (LAPACK geqrf form)

@lowering(aten.geqrf.default)
def geqrf(A):
    """LAPACK's compact QR: R on and above the diagonal, the reflectors below it, and their ``tau``."""
    if A.ndim < 2:
        raise RuntimeError("torch.geqrf: input must have at least 2 dimensions.")
    m, n = A.shape[-2:]
    if A.size == 0:
        return A, jnp.zeros(A.shape[:-2] + (min(m, n),), A.dtype)
    h, tau = jnp.linalg.qr(A, mode="raw")  # h is the transposed geqrf matrix
    return _mT(h), tau


def _check_reflectors(A, tau, name: str) -> None:
    if A.ndim < 2:
        raise RuntimeError(f"{name}: input must have at least 2 dimensions.")
    if tau.ndim != A.ndim - 1:
        raise RuntimeError(f"{name}: input.dim() must be greater than or equal to tau.dim() by 1")
    if A.shape[:-2] != tau.shape[:-1]:
        raise RuntimeError(f"{name}: Expected batch dimensions of tau to be equal to input.shape[:-2], but "
                           f"got {tau.shape[:-1]}")
    _same_dtype(A, tau, "input and tau")


@lowering(aten.linalg_householder_product.default)
def linalg_householder_product(A, tau):
    """The first ``n`` columns of ``H_1 ... H_k`` (LAPACK's ``orgqr``)."""
    name = "torch.linalg.householder_product"
    _check_reflectors(A, tau, name)
    m, n = A.shape[-2:]
    if m < n:
        raise RuntimeError(f"{name}: input.shape[-2] must be greater than or equal to input.shape[-1]")
    if tau.shape[-1] > n:
        raise RuntimeError(f"{name}: input.shape[-1] must be greater than or equal to tau.shape[-1]")
    if A.size == 0 or tau.shape[-1] == 0:  # no reflectors: the first n columns of the identity
        return jnp.broadcast_to(jnp.eye(m, n, dtype=A.dtype), A.shape)
    return lax.linalg.householder_product(A, tau)


@lowering(aten.ormqr.default)
def ormqr(A, tau, C, left=True, transpose=False):
    """``Q C``, ``Q^H C``, ``C Q`` or ``C Q^H`` for the ``Q`` of geqrf's reflectors (LAPACK's ``ormqr``)."""
    name = "torch.ormqr"
    _check_reflectors(A, tau, name)
    _same_dtype(A, C, "input and other")
    if A.shape[:-2] != C.shape[:-2]:
        raise RuntimeError(f"{name}: Expected batch dimensions of other to be equal to input.shape[:-2]")
    size = C.shape[-2] if left else C.shape[-1]
    if A.shape[-2] != size:
        raise RuntimeError(f"{name}: Incompatible dimensions: input.shape[-2] must equal "
                           f"other.shape[{-2 if left else -1}]")
    if C.size == 0 or tau.shape[-1] == 0:  # Q of no reflectors is the identity
        return C
    return lax.linalg.ormqr(A, tau, C, left=left, transpose=transpose)


# ---------------------------------------------------------------- LU unpacking

@lowering(aten.lu_unpack.default)
def lu_unpack(LU, pivots, unpack_data=True, unpack_pivots=True):
    """(P, L, U) with ``A = P L U`` from ``lu_factor``'s packed LU and 1-based pivots."""
    m, n = LU.shape[-2:]
    k = min(m, n)
    empty = jnp.zeros((0,), LU.dtype)
    L = jnp.tril(LU[..., :, :k], -1) + jnp.eye(m, k, dtype=LU.dtype) if unpack_data else empty
    U = jnp.triu(LU[..., :k, :]) if unpack_data else empty
    if not unpack_pivots:
        return empty, L, U
    perm = _perm_from_pivots(pivots.astype(jnp.int32), m)
    P = _mT(jax.nn.one_hot(perm, m, dtype=LU.dtype))
    return jnp.broadcast_to(P, LU.shape[:-2] + (m, m)), L, U


# ---------------------------------------------------------------- LDL (LAPACK sytrf form)

_BK_ALPHA = (1 + 17 ** 0.5) / 8  # Bunch-Kaufman's bound: the element growth of a 2x2 pivot


def _cabs1(x):
    """LAPACK's pivot-search magnitude: |re| + |im| for complex numbers."""
    return jnp.abs(jnp.real(x)) + jnp.abs(jnp.imag(x)) if jnp.iscomplexobj(x) else jnp.abs(x)


class _Sym:
    """Symmetric (``x^T``) or Hermitian (``x^H``, real diagonal) flavour of LAPACK's LDL routines."""

    def __init__(self, dtype, hermitian: bool):
        self.hermitian = hermitian and jnp.issubdtype(dtype, jnp.complexfloating)
        self.conj = jnp.conj if self.hermitian else (lambda x: x)

    def diag(self, x):
        return jnp.real(x).astype(x.dtype) if self.hermitian else x

    def diag_abs(self, x):
        return jnp.abs(jnp.real(x)) if self.hermitian else _cabs1(x)


def _bunch_kaufman(A, k, idx, sym: _Sym):
    """sytf2's pivot choice at column ``k``: (kp, 2x2 block?, zero column?)."""
    col = jnp.where(idx > k, _cabs1(A[:, k]), -1)
    imax = jnp.argmax(col)
    colmax = jnp.maximum(col[imax], 0)
    absakk = sym.diag_abs(A[k, k])
    zero = (jnp.maximum(absakk, colmax) == 0) | jnp.isnan(absakk)
    rowmax = jnp.maximum(jnp.max(jnp.where((idx >= k) & (idx < imax), _cabs1(A[imax, :]), -1)),
                         jnp.max(jnp.where(idx > imax, _cabs1(A[:, imax]), -1)))
    rowmax = jnp.where(rowmax > 0, rowmax, 1)
    keep = zero | (absakk >= _BK_ALPHA * colmax) | (absakk >= _BK_ALPHA * colmax * (colmax / rowmax))
    one = keep | (sym.diag_abs(A[imax, imax]) >= _BK_ALPHA * rowmax)
    return jnp.where(keep, k, imax), ~one, zero


def _swap_trailing(A, k, kk, kp, idx, sym: _Sym):
    """Swap rows and columns ``kk`` and ``kp`` of the trailing matrix ``A[k:, k:]`` (lower part stored)."""
    strict = jnp.tril(A, -1)
    full = strict + sym.conj(strict.T) + jnp.diag(sym.diag(jnp.diagonal(A)))
    perm = jnp.where(idx == kk, kp, jnp.where(idx == kp, kk, idx))
    swapped = full[perm][:, perm]
    trailing = (idx[:, None] >= k) & (idx[None, :] >= k) & (idx[:, None] >= idx[None, :])
    return jnp.where(trailing, swapped, A)


def _ldl_update1(A, k, idx, sym: _Sym):
    """Eliminate column ``k`` with the 1x1 pivot ``A[k, k]`` (sytf2's ``syr`` + ``scal``)."""
    r1 = 1 / sym.diag(A[k, k])
    x = jnp.where(idx > k, A[:, k], 0)
    lower = (idx[:, None] >= idx[None, :])
    A = A - jnp.where(lower, x[:, None] * (r1 * sym.conj(x))[None, :], 0)
    return A.at[:, k].set(jnp.where(idx > k, A[:, k] * r1, A[:, k]))


def _ldl_update2(A, k, idx, sym: _Sym):
    """Eliminate columns ``k, k+1`` with the 2x2 pivot block (sytf2's explicit loop, vectorised)."""
    ak, ak1 = A[:, k], A[:, k + 1]
    if sym.hermitian:
        d = jnp.abs(A[k + 1, k])
        d11, d22 = jnp.real(A[k + 1, k + 1]) / d, jnp.real(A[k, k]) / d
        d21 = A[k + 1, k] / d
        scale = (1 / (d11 * d22 - 1)) / d
        wk = scale * (d11 * ak - d21 * ak1)
        wk1 = scale * (d22 * ak1 - jnp.conj(d21) * ak)
    else:
        d21 = A[k + 1, k]
        d11, d22 = A[k + 1, k + 1] / d21, A[k, k] / d21
        d21 = (1 / (d11 * d22 - 1)) / d21
        wk = d21 * (d11 * ak - ak1)
        wk1 = d21 * (d22 * ak1 - ak)
    below = idx > k + 1
    wk, wk1 = jnp.where(below, wk, 0), jnp.where(below, wk1, 0)
    lower = idx[:, None] >= idx[None, :]
    A = A - jnp.where(lower, ak[:, None] * sym.conj(wk)[None, :], 0) \
          - jnp.where(lower, ak1[:, None] * sym.conj(wk1)[None, :], 0)
    A = A.at[:, k].set(jnp.where(below, wk, A[:, k]))
    return A.at[:, k + 1].set(jnp.where(below, wk1, A[:, k + 1]))


def _ldl_factor_one(A, sym: _Sym):
    """LAPACK's unblocked ``sytf2``/``hetf2`` (lower): compact LD, 1-based pivots (< 0: 2x2), info."""
    n = A.shape[-1]
    idx = jnp.arange(n)

    def step(state):
        A, piv, k, info = state
        kp, two, zero = _bunch_kaufman(A, k, idx, sym)
        A = _swap_trailing(A, k, k + two, kp, idx, sym)
        eliminated = lax.cond(two, lambda A: _ldl_update2(A, k, idx, sym), lambda A: _ldl_update1(A, k, idx, sym), A)
        A = jnp.where(zero, A, eliminated)
        entry = jnp.where(two, -(kp + 1), kp + 1).astype(jnp.int32)
        piv = piv.at[k].set(entry)
        piv = jnp.where(two & (idx == k + 1), entry, piv)
        info = jnp.where((info == 0) & zero, k + 1, info).astype(jnp.int32)
        return A, piv, k + 1 + two.astype(k.dtype), info

    state = (A, jnp.zeros(n, jnp.int32), jnp.asarray(0), jnp.asarray(0, jnp.int32))
    A, piv, _, info = lax.while_loop(lambda s: s[2] < n, step, state)
    LD = jnp.tril(A)
    return LD.at[idx, idx].set(sym.diag(jnp.diagonal(LD))), piv, info


def _batched(fn, A, *rest):
    """``fn`` on each matrix of a batch (``vmap`` over the flattened batch dimensions)."""
    batch = A.shape[:-2]
    flat = [x.reshape((-1,) + x.shape[len(batch):]) for x in (A, *rest)]
    out = jax.vmap(fn)(*flat)
    return jax.tree.map(lambda y: y.reshape(batch + y.shape[1:]), out)


@lowering(aten.linalg_ldl_factor_ex.default)
def linalg_ldl_factor_ex(A, *, hermitian=False, check_errors=False):
    """Bunch-Kaufman LDL in LAPACK's ``sytrf`` form, by its unblocked algorithm (``sytf2``): the
    same pivots as PyTorch's CPU; the blocked LAPACK code (n > 64) takes the same pivots in exact
    arithmetic, so only rounding may differ there (it matched at n = 70 and 130 in our tests)."""
    _check_square(A, "torch.linalg.ldl_factor_ex")
    _check_float(A, "torch.linalg.ldl_factor_ex")
    if A.size == 0:
        return A, jnp.zeros(A.shape[:-1], jnp.int32), jnp.zeros(A.shape[:-2], jnp.int32)
    sym = _Sym(A.dtype, hermitian)
    return _batched(lambda a: _ldl_factor_one(a, sym), A)


def _swap_rows(B, i, j):
    rows = B[jnp.stack([i, j])]
    return B.at[i].set(rows[1]).at[j].set(rows[0])


def _ldl_solve_one(LD, piv, B, sym: _Sym):
    """LAPACK's ``sytrs``/``hetrs`` (lower): ``A X = B`` from sytrf's factors."""
    n = LD.shape[-1]
    idx = jnp.arange(n)

    def forward(state):  # L D Y = P B, one pivot block at a time
        B, k = state
        two = piv[k] < 0
        kp = jnp.abs(piv[k]) - 1
        B = _swap_rows(B, k + two, kp)
        B = B - jnp.where((idx > k + two)[:, None], LD[:, k][:, None] * B[k][None, :], 0)
        B = lax.cond(two, _solve_block2, _solve_block1, B, k)
        return B, k + 1 + two.astype(k.dtype)

    def _solve_block1(B, k):
        return B.at[k].multiply(1 / sym.diag(LD[k, k]))

    def _solve_block2(B, k):
        B = B - jnp.where((idx > k + 1)[:, None], LD[:, k + 1][:, None] * B[k + 1][None, :], 0)
        akm1k = LD[k + 1, k]
        akm1, ak = LD[k, k] / sym.conj(akm1k), LD[k + 1, k + 1] / akm1k
        denom = akm1 * ak - 1
        bkm1, bk = B[k] / sym.conj(akm1k), B[k + 1] / akm1k
        return B.at[k].set((ak * bkm1 - bk) / denom).at[k + 1].set((akm1 * bk - bkm1) / denom)

    def backward(state):  # L^T X = Y (L^H when Hermitian), undoing the interchanges
        B, k = state
        two = piv[k] < 0
        below = (idx > k)[:, None]
        B = B.at[k].add(-jnp.sum(jnp.where(below, sym.conj(LD[:, k])[:, None] * B, 0), axis=0))
        prev = jnp.maximum(k - 1, 0)
        update = B[prev] - jnp.sum(jnp.where(below, sym.conj(LD[:, prev])[:, None] * B, 0), axis=0)
        B = B.at[prev].set(jnp.where(two, update, B[prev]))
        B = _swap_rows(B, k, jnp.abs(piv[k]) - 1)
        return B, k - 1 - two.astype(k.dtype)

    B, _ = lax.while_loop(lambda s: s[1] < n, forward, (B, jnp.asarray(0)))
    B, _ = lax.while_loop(lambda s: s[1] >= 0, backward, (B, jnp.asarray(n - 1)))
    return B


@lowering(aten.linalg_ldl_solve.default)
def linalg_ldl_solve(LD, pivots, B, *, hermitian=False):
    name = "torch.linalg.ldl_solve"
    _check_square(LD, name)
    if B.ndim < 2:
        raise RuntimeError(f"{name}: The input tensor B must have at least 2 dimensions.")
    if LD.shape[:-1] != pivots.shape:
        raise RuntimeError(f"{name}: Expected LD.shape[:-1] and pivots.shape to be the same")
    if pivots.dtype != jnp.int32:
        raise RuntimeError(f"{name}: Expected pivots to be integers. Got {to_torch_dtype(pivots.dtype)}")
    _same_dtype(LD, B, "LD and B")
    batch = jnp.broadcast_shapes(LD.shape[:-2], B.shape[:-2])
    LD, B = jnp.broadcast_to(LD, batch + LD.shape[-2:]), jnp.broadcast_to(B, batch + B.shape[-2:])
    pivots = jnp.broadcast_to(pivots, batch + pivots.shape[-1:])
    if B.size == 0:
        return B
    sym = _Sym(LD.dtype, hermitian)
    return _batched(lambda ld, p, b: _ldl_solve_one(ld, p, b, sym), LD, pivots, B)


# ---------------------------------------------------------------- least squares

_LSTSQ_DRIVERS = ("gels", "gelsy", "gelsd", "gelss")


@functools.partial(jax.jit, static_argnames=("rcond",))
def _lstsq_svd(A, B, rcond):
    """(minimum-norm solution, rank, singular values, squared residual norms) through the SVD."""
    m, n = A.shape[-2:]
    u, s, vh = lax.linalg.svd(A, full_matrices=False)
    cutoff = (rcond if rcond is not None else np.finfo(s.dtype).eps * max(m, n)) * s[..., :1]
    keep = s > cutoff if min(m, n) else jnp.zeros(s.shape, bool)
    inv = jnp.where(keep, 1 / jnp.where(keep, s, 1), 0).astype(A.dtype)
    x = _mm(_mH(vh), inv[..., :, None] * _mm(_mH(u), B))
    residuals = jnp.sum(jnp.abs(_mm(A, x) - B) ** 2, axis=-2)
    return x, jnp.sum(keep, axis=-1).astype(jnp.int64), s.astype(_real_dtype(A.dtype)), residuals


@lowering(aten.linalg_lstsq.default, jit=False)
def linalg_lstsq(A, B, rcond=None, *, driver=None):
    """Least squares as PyTorch's CPU drivers report it (which outputs are filled depends on the
    driver); solved through the SVD, so rank-deficient ``gels`` inputs get the minimum-norm
    solution where LAPACK's QR would divide by ~0. ``jit=False``: whether ``gelsd``/``gelss``
    return residuals depends on the computed rank, as in PyTorch."""
    name = "torch.linalg.lstsq"
    driver = driver or "gelsy"  # PyTorch's default on the CPU, the device we match
    if driver not in _LSTSQ_DRIVERS:
        raise RuntimeError(f"{name}: parameter `driver` should be one of (gels, gelsy, gelsd, gelss)")
    if A.ndim < 2:
        raise RuntimeError(f"{name}: input must have at least 2 dimensions.")
    _check_float(A, name)
    _same_dtype(A, B, "input and other")
    vector = B.ndim == A.ndim - 1
    rhs = B[..., None] if vector else B
    m, n = A.shape[-2:]
    if rhs.shape[-2] != m:
        raise RuntimeError(f"{name}: input.size(-2) should match other.size(-2)")
    A, rhs = _broadcast_batch(A, rhs)
    x, rank, s, residuals = _lstsq_svd(A, rhs, rcond)
    real = _real_dtype(A.dtype)
    full_rank = driver == "gels" or bool(jnp.all(rank == n))
    if not (m > n and driver != "gelsy" and full_rank):
        residuals = jnp.zeros((0,), real)
    rank = jnp.zeros((0,), jnp.int64) if driver == "gels" else rank
    s = s if driver in ("gelsd", "gelss") else jnp.zeros((0,), real)
    return (x[..., 0] if vector else x), residuals.astype(real), rank, s


# ---------------------------------------------------------------- error checks

@lowering(aten._linalg_check_errors.default, jit=False)
def _linalg_check_errors(info, api_name, *, is_matrix):
    """Raise PyTorch's LinAlgError for a nonzero ``info`` (a host sync, as on every backend).

    Eager passes concrete arrays; inside a traced graph the check runs as a host callback.
    """
    if isinstance(info, jax.core.Tracer):
        jax.debug.callback(lambda i: _raise_for_info(np.asarray(i), api_name, is_matrix), info)
    else:
        _raise_for_info(np.asarray(info), api_name, is_matrix)
    return None


def _raise_for_info(info: np.ndarray, api_name: str, is_matrix: bool) -> None:
    if not info.any():
        return
    flat = info.reshape(-1)
    where = int(np.flatnonzero(flat)[0])
    code = int(flat[where])
    batch = "" if is_matrix else f"(Batch element {where}): "
    if code < 0:
        raise RuntimeError(f"{api_name}: {batch}Argument {-code} has illegal value.")
    if "cholesky" in api_name:
        raise torch.linalg.LinAlgError(
            f"{api_name}: {batch}The factorization could not be completed because the input is not "
            f"positive-definite (the leading minor of order {code} is not positive-definite).")
    raise torch.linalg.LinAlgError(
        f"{api_name}: {batch}The diagonal element {code} is zero, the inversion could not be "
        f"completed because the input matrix is singular.")
