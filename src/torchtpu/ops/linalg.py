"""Linear algebra: matrix products (with PyTorch's opmath accumulation) and decompositions.

Products accumulate fp16/bf16 in fp32 (``preferred_element_type``) and ask for
``Precision.HIGHEST`` so a TPU never silently runs fp32 as bf16 passes. LAPACK-style results
(1-based int32 pivots, ``info`` codes) follow PyTorch's CPU kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchtpu.ops.dtypes import opmath, to_jax_dtype, to_torch_dtype
from torchtpu.ops.registry import aten, lowering

HIGHEST = lax.Precision.HIGHEST


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
    return lax.dot_general(a, b, dims, precision=HIGHEST, preferred_element_type=acc)


_MM = (((1,), (0,)), ((), ()))
_BMM = (((2,), (1,)), ((0,), (0,)))
_MV = (((1,), (0,)), ((), ()))
_VV = (((0,), (0,)), ((), ()))
_ADDBMM = (((0, 2), (0, 1)), ((), ()))


def _scaled_sum(acc, bias, beta, alpha, dtype):
    """``beta * bias + alpha * acc`` in opmath; beta == 0 ignores ``bias`` (NaNs included)."""
    acc = acc * alpha
    if bias is not None:
        bias = jnp.asarray(bias).astype(acc.dtype)
        acc = acc + jnp.where(beta == 0, jnp.zeros_like(bias), bias * beta)
    return acc.astype(dtype)


@lowering(aten.mm.default)
def mm(a, b):
    _same_dtype(a, b)
    _check_mm(a, b)
    return _dot(a, b, _MM).astype(a.dtype)


@lowering(aten.mm.dtype)
def mm_dtype(a, b, out_dtype):
    _same_dtype(a, b)
    _check_mm(a, b)
    dtype = to_jax_dtype(out_dtype)
    return _dot(a, b, _MM, dtype).astype(dtype)


@lowering(aten.bmm.default)
def bmm(a, b):
    _same_dtype(a, b, "batch1 and batch2")
    return _dot(a, b, _BMM).astype(a.dtype)


@lowering(aten.bmm.dtype)
def bmm_dtype(a, b, out_dtype):
    _same_dtype(a, b, "batch1 and batch2")
    dtype = to_jax_dtype(out_dtype)
    return _dot(a, b, _BMM, dtype).astype(dtype)


@lowering(aten.addmm.default)
def addmm(bias, a, b, *, beta=1, alpha=1):
    _same_dtype(a, b)
    _check_mm(a, b)
    return _scaled_sum(_dot(a, b, _MM), bias, beta, alpha, a.dtype)


@lowering(aten.addmm.dtype)
def addmm_dtype(bias, a, b, out_dtype, *, beta=1, alpha=1):
    _same_dtype(a, b)
    dtype = to_jax_dtype(out_dtype)
    return _scaled_sum(_dot(a, b, _MM, dtype), bias, beta, alpha, dtype)


@lowering(aten.baddbmm.default)
def baddbmm(bias, a, b, *, beta=1, alpha=1):
    _same_dtype(a, b, "batch1 and batch2")
    return _scaled_sum(_dot(a, b, _BMM), bias, beta, alpha, a.dtype)


@lowering(aten.baddbmm.dtype)
def baddbmm_dtype(bias, a, b, out_dtype, *, beta=1, alpha=1):
    _same_dtype(a, b, "batch1 and batch2")
    dtype = to_jax_dtype(out_dtype)
    return _scaled_sum(_dot(a, b, _BMM, dtype), bias, beta, alpha, dtype)


@lowering(aten.addbmm.default)
def addbmm(bias, a, b, *, beta=1, alpha=1):
    _same_dtype(a, b, "batch1 and batch2")
    return _scaled_sum(_dot(a, b, _ADDBMM), bias, beta, alpha, a.dtype)


@lowering(aten.mv.default)
def mv(a, v):
    _same_dtype(a, v, "mat and vec")
    return _dot(a, v, _MV).astype(a.dtype)


@lowering(aten.addmv.default)
def addmv(bias, a, v, *, beta=1, alpha=1):
    _same_dtype(a, v, "mat and vec")
    return _scaled_sum(_dot(a, v, _MV), bias, beta, alpha, a.dtype)


@lowering(aten.dot.default)
def dot(a, b):
    _same_dtype(a, b, "self and other")
    if a.ndim != 1 or b.ndim != 1:
        raise RuntimeError(f"1D tensors expected, but got {a.ndim}D and {b.ndim}D tensors")
    return _dot(a, b, _VV).astype(a.dtype)


@lowering(aten.vdot.default)
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
    w = w.astype(jnp.real(jnp.zeros((), A.dtype)).dtype)
    return w, (v if compute_v else jnp.zeros((0,), A.dtype))


@lowering(aten._linalg_svd.default)
def _linalg_svd(A, full_matrices=False, compute_uv=True, *, driver=None):
    real = jnp.real(jnp.zeros((), A.dtype)).dtype
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


@lowering(aten.linalg_matrix_exp.default)
def linalg_matrix_exp(A):
    _check_square(A, "linalg.matrix_exp")
    return jax.scipy.linalg.expm(A)


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
