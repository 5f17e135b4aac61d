"""Matrix products and linear algebra on tpu vs PyTorch CPU, forward and gradients."""

import pytest
import torch

from test_ops_nn import check, randn

pytestmark = pytest.mark.usefixtures("no_fallback")


# ---------------------------------------------------------------- products

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_mm_family(dtype):
    a, b, c = randn(5, 7, dtype=dtype), randn(7, 3, dtype=dtype, seed=1), randn(5, 3, dtype=dtype, seed=2)
    check(torch.mm, a, b)
    check(lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0), c, a, b)
    check(lambda c, a, b: torch.addmm(c[0], a, b), c, a, b)  # broadcast bias, as nn.Linear
    check(torch.mv, a, randn(7, dtype=dtype, seed=3))
    check(lambda c, a, v: torch.addmv(c, a, v, beta=2, alpha=-1), randn(5, dtype=dtype), a, randn(7, dtype=dtype))
    check(torch.dot, randn(6, dtype=dtype), randn(6, dtype=dtype, seed=1))


def test_batched_products():
    a, b = randn(4, 5, 6), randn(4, 6, 3, seed=1)
    check(torch.bmm, a, b)
    check(lambda c, a, b: torch.baddbmm(c, a, b, beta=0.3, alpha=1.5), randn(4, 5, 3, seed=2), a, b)
    check(lambda c, a, b: torch.addbmm(c, a, b, beta=0.3, alpha=1.5), randn(5, 3, seed=2), a, b, atol=1e-4)
    check(torch.matmul, randn(2, 1, 5, 6), randn(3, 6, 2, seed=1))  # broadcast batch dims
    check(torch.matmul, randn(6), randn(2, 6, 3, seed=1))


def test_linear_noncontiguous_and_empty():
    x, w = randn(3, 8, 5).transpose(1, 2), randn(4, 8, seed=1)
    check(torch.nn.functional.linear, x, w, randn(4, seed=2))
    check(torch.mm, randn(0, 4), randn(4, 3))
    check(torch.mm, randn(3, 0), randn(0, 2))


def test_beta_zero_ignores_nan_bias():
    c = torch.full((2, 2), float("nan"))
    check(lambda c, a, b: torch.addmm(c, a, b, beta=0), c, randn(2, 3), randn(3, 2, seed=1), grad=False)
    check(lambda c, a, b: torch.baddbmm(c, a, b, beta=0), torch.full((2, 2, 2), float("nan")), randn(2, 2, 3),
          randn(2, 3, 2), grad=False)


def test_int_mm():
    a = torch.randint(-5, 5, (3, 4), generator=torch.Generator().manual_seed(0))
    b = torch.randint(-5, 5, (4, 2), generator=torch.Generator().manual_seed(1))
    check(torch.mm, a, b, grad=False)
    check(torch.dot, a[0], b[:, 0], grad=False)


def test_mm_errors():
    a, b = torch.randn(2, 3).to("tpu"), torch.randn(4, 5).to("tpu")
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        torch.mm(a, b)
    with pytest.raises(RuntimeError, match="same dtype"):
        torch.mm(a, torch.randn(3, 2, dtype=torch.float64).to("tpu"))


def test_bf16_accumulates_in_fp32():
    # a long bf16 dot product: fp32 accumulation agrees with CPU's within bf16 rounding of the result
    a, b = randn(1, 4096, dtype=torch.bfloat16), randn(4096, 1, dtype=torch.bfloat16, seed=1)
    ref = (a.float() @ b.float()).to(torch.bfloat16)
    torch.testing.assert_close((a.to("tpu") @ b.to("tpu")).cpu(), ref, atol=0, rtol=1e-2)


# ---------------------------------------------------------------- decompositions

def spd(n, batch=(), seed=0):
    a = randn(*batch, n, n, seed=seed, dtype=torch.float64)
    return a @ a.mT + n * torch.eye(n, dtype=torch.float64)


def test_cholesky():
    A = spd(4, (2,))
    check(torch.linalg.cholesky, A)
    check(lambda A: torch.linalg.cholesky(A, upper=True), A)
    check(lambda A: torch.linalg.cholesky_ex(A), A, grad=False)


def test_cholesky_not_pd_raises():
    A = torch.tensor([[1.0, 2.0], [2.0, 1.0]]).to("tpu")
    with pytest.raises(torch.linalg.LinAlgError, match="positive-definite"):
        torch.linalg.cholesky(A)
    L, info = torch.linalg.cholesky_ex(A)
    assert info.cpu().item() == 2


def test_inv_and_solve():
    A = randn(3, 4, 4, dtype=torch.float64) + 4 * torch.eye(4, dtype=torch.float64)
    B = randn(3, 4, 2, dtype=torch.float64, seed=1)
    check(torch.linalg.inv, A)
    check(torch.linalg.solve, A, B)
    check(lambda A, B: torch.linalg.solve(A, B, left=False), A, B.mT)
    check(torch.linalg.solve, A, randn(3, 4, dtype=torch.float64, seed=2))  # batch of vectors
    check(torch.linalg.solve, A[0], randn(4, 3, dtype=torch.float64, seed=2))
    check(lambda A: torch.linalg.inv_ex(A), A, grad=False)


def test_inv_singular_raises():
    A = torch.tensor([[1.0, 2.0], [2.0, 4.0]]).to("tpu")
    with pytest.raises(torch.linalg.LinAlgError, match="singular"):
        torch.linalg.inv(A)


def test_float32_inv():
    A = randn(4, 4) + 4 * torch.eye(4)
    check(torch.linalg.inv, A, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("upper", [True, False])
@pytest.mark.parametrize("left", [True, False])
def test_solve_triangular(upper, left):
    A = randn(2, 4, 4, dtype=torch.float64) + 4 * torch.eye(4, dtype=torch.float64)
    A = A.triu() if upper else A.tril()
    B = randn(2, 4, 3, dtype=torch.float64, seed=1)
    if not left:
        B = B.mT
    check(lambda A, B: torch.linalg.solve_triangular(A, B, upper=upper, left=left), A, B)
    check(lambda A, B: torch.linalg.solve_triangular(A, B, upper=upper, left=left, unitriangular=True), A, B)


def test_triangular_solve_legacy():
    A = (randn(4, 4, dtype=torch.float64) + 4 * torch.eye(4, dtype=torch.float64)).triu()
    B = randn(2, 4, 3, dtype=torch.float64, seed=1)
    check(lambda B, A: torch.triangular_solve(B, A), B, A)
    check(lambda B, A: torch.triangular_solve(B, A, transpose=True), B, A, grad=False)


def test_cholesky_solve_and_inverse():
    A = spd(4, (2,))
    L = torch.linalg.cholesky(A)
    B = randn(2, 4, 3, dtype=torch.float64, seed=1)
    check(torch.cholesky_solve, B, L)
    check(lambda B, U: torch.cholesky_solve(B, U, upper=True), B, L.mT.contiguous())
    check(torch.cholesky_inverse, L[0], grad=False)


def _fix_signs(q, r):
    """QR is unique up to the signs of R's diagonal: normalise them to positive."""
    s = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))
    return q * s.unsqueeze(-2), r * s.unsqueeze(-1)


@pytest.mark.parametrize("shape,mode", [((5, 3), "reduced"), ((3, 5), "reduced"), ((2, 5, 3), "complete")])
def test_qr(shape, mode):
    A = randn(*shape, dtype=torch.float64)
    q, r = torch.linalg.qr(A.to("tpu"), mode=mode)
    qc, rc = torch.linalg.qr(A, mode=mode)
    k = min(shape[-2:])
    q1, r1 = _fix_signs(q.cpu()[..., :k], r.cpu()[..., :k, :])
    q2, r2 = _fix_signs(qc[..., :k], rc[..., :k, :])
    torch.testing.assert_close(q1, q2)
    torch.testing.assert_close(r1, r2)
    torch.testing.assert_close((q @ r).cpu(), A)
    assert q.shape == qc.shape and r.shape == rc.shape
    assert torch.linalg.qr(A.to("tpu"), mode="r")[0].numel() == 0


def test_qr_grad():
    # sign-invariant function of the factors: Q R = A, so the gradient of sum((QR)^2) is 2A
    check(lambda A: torch.linalg.qr(A)[1].abs().sum(), randn(5, 3, dtype=torch.float64))


def test_eigh():
    A = spd(4, (2,))
    w, v = torch.linalg.eigh(A.to("tpu"))
    torch.testing.assert_close(w.cpu(), torch.linalg.eigvalsh(A))
    torch.testing.assert_close((v @ torch.diag_embed(w) @ v.mT).cpu(), A)
    check(torch.linalg.eigvalsh, A)
    check(lambda A: torch.linalg.eigvalsh(A, UPLO="U"), A.triu(), grad=False)


def test_svd():
    A = randn(2, 5, 3, dtype=torch.float64)
    U, S, Vh = torch.linalg.svd(A.to("tpu"), full_matrices=False)
    torch.testing.assert_close(S.cpu(), torch.linalg.svdvals(A))
    torch.testing.assert_close((U @ torch.diag_embed(S) @ Vh).cpu(), A)
    Uf, _, Vhf = torch.linalg.svd(A.to("tpu"))
    assert Uf.shape == (2, 5, 5) and Vhf.shape == (2, 3, 3)
    check(torch.linalg.svdvals, A)


def test_det_slogdet():
    A = randn(3, 4, 4, dtype=torch.float64)
    check(torch.linalg.det, A)
    check(torch.linalg.slogdet, A)
    check(torch.linalg.det, randn(4, 4))  # float32 with pivoting sign
    check(torch.linalg.det, torch.tensor([[1.0, 2.0], [2.0, 4.0]]), grad=False)  # singular


def test_lu_family():
    A = randn(2, 4, 4, dtype=torch.float64)
    check(torch.linalg.lu_factor, A, grad=False)
    check(torch.linalg.lu, A)
    check(torch.linalg.lu, randn(5, 3, dtype=torch.float64), grad=False)
    LU, piv = torch.linalg.lu_factor(A)
    B = randn(2, 4, 3, dtype=torch.float64, seed=1)
    for kw in (dict(), dict(adjoint=True), dict(left=False)):
        rhs = B.mT if kw.get("left") is False else B
        check(lambda LU, rhs: torch.linalg.lu_solve(LU, piv.to(LU.device), rhs, **kw), LU, rhs, grad=False)


def test_matrix_exp():
    check(torch.linalg.matrix_exp, randn(2, 3, 3, dtype=torch.float64) * 0.5, grad=False)


def test_vector_and_matrix_norm():
    x = randn(3, 4)
    check(torch.linalg.vector_norm, x)
    check(lambda x: torch.linalg.vector_norm(x, ord=1, dim=1), x)
    check(lambda x: torch.linalg.matrix_norm(x), x)


def test_cholesky_info_batched():
    A = torch.stack([spd(3), torch.tensor([[4.0, 2, 0], [2, 1, 0], [0, 0, 1]], dtype=torch.float64)])
    check(lambda A: torch.linalg.cholesky_ex(A)[1], A, grad=False)


@pytest.mark.xfail(strict=True, reason="PyTorch's det backward reads the LU of A^T when A is contiguous and "
                   "of A otherwise; a lowering cannot see contiguity, so ours always factors A^T")
def test_det_grad_noncontiguous():
    check(lambda A: torch.linalg.det(A.mT), randn(4, 4, dtype=torch.float64))


# ---------------------------------------------------------------- empty batches

def test_cholesky_empty():
    check(torch.linalg.cholesky, torch.zeros(0, 3, 3, dtype=torch.float64), grad=False)
    check(lambda A: torch.linalg.cholesky_ex(A, upper=True), torch.zeros(2, 0, 0), grad=False)


def test_lu_solve_empty():
    for n, batch in ((0, ()), (0, (2,)), (3, (0,))):
        LU, piv = torch.zeros(*batch, n, n), torch.zeros(*batch, n, dtype=torch.int32)
        check(lambda LU, piv, B: torch.linalg.lu_solve(LU, piv, B), LU, piv, torch.zeros(*batch, n, 4), grad=False)


# ---------------------------------------------------------------- LAPACK-form factorisations

def crandn(*shape, seed=0, dtype=torch.complex128):
    g = torch.Generator().manual_seed(seed)
    return torch.complex(torch.randn(*shape, generator=g, dtype=torch.float64),
                         torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64])
@pytest.mark.parametrize("shape", [(5, 3), (3, 5), (2, 4, 4), (0, 3, 2), (4, 0)])
def test_geqrf_exact_lapack_form(shape, dtype):
    A = crandn(*shape, dtype=dtype) if dtype.is_complex else randn(*shape, dtype=dtype)
    check(torch.geqrf, A, grad=False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_householder_product_and_ormqr(dtype):
    A = crandn(2, 5, 3, dtype=dtype) if dtype.is_complex else randn(2, 5, 3, dtype=dtype)
    a, tau = torch.geqrf(A)
    check(torch.linalg.householder_product, a, tau, grad=not dtype.is_complex)
    check(torch.linalg.householder_product, a[..., :2], tau[..., :1], grad=False)  # k < n
    check(torch.linalg.householder_product, a, tau[..., :0], grad=False)  # no reflectors
    C = randn(2, 5, 4, dtype=torch.float64, seed=1).to(dtype)
    for left in (True, False):
        for transpose in (True, False):
            other = C if left else C.mT
            check(lambda a, tau, c: torch.ormqr(a, tau, c, left=left, transpose=transpose), a, tau, other,
                  grad=False)


def test_householder_product_errors():
    with pytest.raises(RuntimeError, match="greater than or equal"):
        torch.linalg.householder_product(torch.randn(3, 5).to("tpu"), torch.randn(3).to("tpu"))


def _lu_factors(*shape):
    LU, piv = torch.linalg.lu_factor(randn(*shape, dtype=torch.float64))
    return LU, piv


@pytest.mark.parametrize("shape", [(4, 4), (6, 4), (3, 5), (2, 3, 3), (0, 4, 3)])
def test_lu_unpack(shape):
    LU, piv = _lu_factors(*shape)
    check(torch.lu_unpack, LU, piv, grad=False)
    check(lambda LU, piv: torch.lu_unpack(LU, piv, unpack_data=False), LU, piv, grad=False)
    check(lambda LU, piv: torch.lu_unpack(LU, piv, unpack_pivots=False), LU, piv, grad=False)


def test_lu_unpack_grad():
    LU, piv = _lu_factors(2, 4, 4)
    check(lambda LU: torch.lu_unpack(LU, piv.to(LU.device))[1:], LU)


def _indefinite(n, batch=(), seed=0):
    """Symmetric with a small diagonal: Bunch-Kaufman takes 2x2 pivots and interchanges."""
    a = randn(*batch, n, n, dtype=torch.float64, seed=seed)
    return a + a.mT - 1.9 * torch.diag_embed(torch.diagonal(a + a.mT, dim1=-2, dim2=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ldl_factor_pivots_match_lapack(dtype):
    A = _indefinite(6, (4,)).to(dtype)
    LD, piv, info = torch.linalg.ldl_factor_ex(A)
    assert (piv < 0).any()  # the samples exercise 2x2 blocks
    check(torch.linalg.ldl_factor_ex, A, grad=False)
    check(torch.linalg.ldl_factor, torch.tensor([[1.0, 5.0, 2.0], [5.0, 1.0, 3.0], [2.0, 3.0, 0.0]]), grad=False)
    check(torch.linalg.ldl_factor, spd(5, (2,)), grad=False)


def test_ldl_factor_complex():
    C = crandn(3, 5, 5)
    C = C - 1.9 * torch.diag_embed(torch.diagonal(C, dim1=-2, dim2=-1))
    check(lambda A: torch.linalg.ldl_factor_ex(A, hermitian=True), C + C.mH, grad=False)
    check(lambda A: torch.linalg.ldl_factor_ex(A, hermitian=False), C + C.mT, grad=False)


def test_ldl_factor_singular_and_empty():
    check(torch.linalg.ldl_factor_ex, torch.zeros(2, 2), grad=False)  # info = 1, as LAPACK
    check(torch.linalg.ldl_factor_ex, torch.zeros(0, 0), grad=False)
    check(torch.linalg.ldl_factor_ex, torch.zeros(0, 2, 2), grad=False)


@pytest.mark.parametrize("hermitian,dtype", [(False, torch.float64), (False, torch.float32),
                                             (True, torch.complex128), (False, torch.complex128)])
def test_ldl_solve(hermitian, dtype):
    if dtype.is_complex:
        C = crandn(3, 6, 6, dtype=dtype)
        C = C - 1.9 * torch.diag_embed(torch.diagonal(C, dim1=-2, dim2=-1))
        A = C + (C.mH if hermitian else C.mT)
    else:
        A = _indefinite(6, (3,)).to(dtype)
    LD, piv, _ = torch.linalg.ldl_factor_ex(A, hermitian=hermitian)
    B = randn(3, 6, 2, dtype=torch.float64, seed=1).to(dtype)
    solve = lambda LD, piv, B: torch.linalg.ldl_solve(LD, piv, B, hermitian=hermitian)  # noqa: E731
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else {}
    check(solve, LD, piv, B, grad=False, **tol)
    check(solve, LD, piv, B[0], grad=False, **tol)  # B's batch broadcasts
    check(solve, torch.zeros(0, 2, 2, dtype=dtype), torch.zeros(0, 2, dtype=torch.int32),
          torch.zeros(2, 5, dtype=dtype), grad=False)


# ---------------------------------------------------------------- eig, sqrth, polar, lstsq

def test_eig():
    A = randn(2, 5, 5, dtype=torch.float64)
    # eigenvectors are unique up to a phase: compare magnitudes, as PyTorch's own tests do
    check(lambda A: (lambda w, v: (w, v.abs()))(*torch.linalg.eig(A)), A, grad=False)
    check(torch.linalg.eigvals, randn(4, 4), grad=False)
    check(torch.linalg.eigvals, crandn(3, 3, dtype=torch.complex64), grad=False)
    check(torch.linalg.eig, torch.zeros(2, 0, 0), grad=False)
    check(lambda A: torch.linalg.eigvals(A).abs(), A)  # gradient through eig's backward


@pytest.mark.skipif(not hasattr(torch.linalg, "matrix_sqrth"), reason="torch.linalg.matrix_sqrth is new in torch 2.14")
def test_matrix_sqrth():
    check(torch.linalg.matrix_sqrth, spd(4, (2,)))
    check(torch.linalg.matrix_sqrth, torch.tensor([[1.0, 2.0], [2.0, 1.0]]), grad=False)  # clamps w < 0
    check(torch.linalg.matrix_sqrth, torch.zeros(0, 3, 3), grad=False)


@pytest.mark.skipif(not hasattr(torch.linalg, "polar"), reason="torch.linalg.polar is new in torch 2.14")
def test_polar():
    check(torch.linalg.polar, randn(2, 5, 3, dtype=torch.float64))
    check(torch.linalg.polar, randn(4, 4), grad=False, atol=1e-5, rtol=1e-4)
    with pytest.raises(RuntimeError, match="at least as many rows"):
        torch.linalg.polar(torch.randn(2, 3).to("tpu"))


@pytest.mark.parametrize("driver", ["gels", "gelsy", "gelsd", "gelss", None])
@pytest.mark.parametrize("rows", [2, 3, 5])
def test_lstsq(driver, rows):
    A, B = randn(3, rows, 3, dtype=torch.float64), randn(3, rows, 2, dtype=torch.float64, seed=1)
    check(lambda A, B: torch.linalg.lstsq(A, B, driver=driver), A, B, grad=False)
    check(lambda A, B: torch.linalg.lstsq(A, B, driver=driver).solution, A, B)


def test_lstsq_vector_and_rank_deficient():
    check(lambda A, b: torch.linalg.lstsq(A, b, driver="gelsd"), randn(4, 3), randn(4, seed=1), grad=False)
    A = randn(5, 3, dtype=torch.float64)
    A[:, 2] = A[:, 1]
    # rank 2 < 3: gelsd reports the rank and no residuals; the solution is the minimum-norm one
    check(lambda A, B: torch.linalg.lstsq(A, B, driver="gelsd"), A, randn(5, 2, dtype=torch.float64), grad=False)


def test_pinv():
    A = randn(2, 5, 3, dtype=torch.float64)
    check(torch.linalg.pinv, A)
    check(lambda A: torch.linalg.pinv(A, hermitian=True), spd(4, (2,)) - 6 * torch.eye(4, dtype=torch.float64))
    singular = A @ A.mT  # rank 3 of 5: small singular values are cut off
    check(torch.linalg.pinv, singular, grad=False)
    check(lambda A: torch.linalg.pinv(A, atol=0.5), A, grad=False)
    check(lambda A, rtol: torch.linalg.pinv(A, rtol=rtol), A, torch.tensor([0.0, 0.9], dtype=torch.float64),
          grad=False)  # a batch of tolerances
    check(torch.linalg.pinv, torch.zeros(2, 0, 3), grad=False)
    check(torch.compile(torch.linalg.pinv, backend="tpu"), randn(4, 3), grad=False)
