"""spear.core.linalg: batched LU solves that survive torch's multi-threaded batched-LU bug."""

import subprocess
import sys

import pytest
import torch

import spear.core.linalg as linalg
from spear.core.linalg import solve_ex


def _shapes(n: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(A, B) shapes covering torch's reading of B: batches of vectors, of matrices, broadcast."""
    return [
        ((3, n, n), (3, n)),  # a batch of vectors
        ((3, n, n), (3, n, 4)),  # a batch of matrices
        ((3, n, n), (n, 2)),  # one matrix, broadcast over the batch
        ((3, n, n), (n,)),  # one vector, broadcast
        ((2, 3, n, n), (3, n, 1)),  # two batch dimensions, broadcast
        ((3, n, n), (2, 3, n, 1)),  # B adds a batch dimension: each matrix solves two systems
        ((1, n, n), (4, n, 2)),  # B broadcasts one matrix over four systems
        ((3, n, n), (3, n, 0)),  # no right-hand sides: the factorizations' info only
        ((3, n, n), (0, 3, n, 2)),  # an empty broadcast batch
        ((0, 3, n, n), (3, n, 2)),  # no matrices
    ]


@pytest.mark.parametrize("case", range(10))
def test_solve_ex_one_at_a_time_matches_torch(monkeypatch, case):
    """The one-matrix-at-a-time path returns torch.linalg.solve_ex's shapes and values, and its
    ``info`` (one per matrix of A, however many systems B makes of it)."""
    monkeypatch.setattr(linalg, "_lu_batch_unsafe", lambda A: True)
    g = torch.Generator().manual_seed(case)
    a_shape, b_shape = _shapes(20)[case]
    A = torch.randn(a_shape, generator=g, dtype=torch.float64)
    B = torch.randn(b_shape, generator=g, dtype=torch.float64)
    X, info = solve_ex(A, B)
    X_ref, info_ref = torch.linalg.solve_ex(A, B)
    assert X.shape == X_ref.shape and info.shape == info_ref.shape
    assert torch.equal(info, info_ref) and not bool(info.any())
    assert torch.allclose(X, X_ref, rtol=1e-10, atol=1e-12)
    if A.numel():
        A.view(-1, 20, 20)[0, 0] = 0.0  # a singular matrix: info > 0 there, like torch's
        assert torch.equal(solve_ex(A, B)[1], torch.linalg.solve_ex(A, B)[1])


#: run in a fresh interpreter: the explicit thread count is what exposes the bug, and it would
#: leak into every later test of this process
MULTI_THREADED = """
import torch
torch.set_num_threads(2)
from spear.core.filtering import _kernel_of_exact_subsets
from spear.core.linalg import solve_ex
from spear.core.scale import LayerProblem

g = torch.Generator().manual_seed(0)
n, m = 160, 400
for size in (150, n):
    A = torch.randn(4, size, size, generator=g, dtype=torch.float64)
    B = torch.randn(4, size, 3, generator=g, dtype=torch.float64)
    X, info = solve_ex(A, B)
    ref = torch.stack([torch.linalg.solve(a, b) for a, b in zip(A, B)])
    assert bool((info == 0).all()), info
    assert torch.allclose(X, ref, rtol=1e-9, atol=1e-12), float((X - ref).abs().max())

L = torch.randn(m, n, generator=g, dtype=torch.float64)
rows = torch.zeros(6, m, dtype=torch.bool)
for i in range(6):
    rows[i, torch.randperm(m, generator=g)[: n - 1]] = True
q = _kernel_of_exact_subsets(L, rows)
residual = max(float((L[r] @ v).abs().max()) for r, v in zip(rows, q))
assert residual < 1e-9 * float(L.abs().max()), residual

problem = LayerProblem(
    torch.randn(m, 300, generator=g, dtype=torch.float64),
    torch.zeros(m, dtype=torch.float64),
    torch.randn(m, generator=g, dtype=torch.float64),
    L,
    torch.randn(n, 300, generator=g, dtype=torch.float64),
)
Qbar = torch.randn(4, n, n, generator=g, dtype=torch.float64)
c, valid = problem.scales(Qbar)
c_ref = torch.stack([torch.linalg.solve(Q, problem.pinv_grad_bias) for Q in Qbar])
assert bool(valid.all()) and torch.allclose(c, c_ref, rtol=1e-9), float((c - c_ref).abs().max())
Z = problem.pre_activations_t(Qbar, c)
Z_ref = torch.stack([torch.linalg.solve(Q, problem.R_Wt) / s[:, None] for Q, s in zip(Qbar, c)])
assert torch.allclose(Z, Z_ref, rtol=1e-9, atol=1e-9), float((Z - Z_ref).abs().max())
from spear.core.proposers import ProposalContext, RandomSubmatrixSampler

bs = 151  # the sampler solves (b - 1) x (b - 1) systems
Ls = torch.randn(3 * bs, bs, generator=g, dtype=torch.float64)
ctx = ProposalContext(
    L=Ls, batch_size=bs, threshold_count=0, generator=torch.Generator().manual_seed(0),
    proposal_dtype=torch.float64, found=torch.empty(0, bs, dtype=torch.float64), problem=None,
)
batch = RandomSubmatrixSampler(chunk_size=4).propose(ctx, 4)
assert batch.directions.shape[0] == 4 and bool(batch.zero_hint.sum(dim=1).eq(bs - 1).all())
for q, hint in zip(batch.directions, batch.zero_hint):
    residual = float((Ls[hint] @ q).abs().max())
    assert residual < 1e-9 * float(q.abs().max()) * float(Ls.abs().max()), residual
print("ok")
"""


def test_batched_solves_survive_an_explicit_thread_count():
    """After ``torch.set_num_threads(2)``, torch 2.13's batched CPU LU of 150 x 150 systems
    never returns, and from 151 it raises or returns solutions off by 1e10
    (pytorch/pytorch#142815); every batched LU in the attack (hint snapping, the sampler,
    scales, pre-activations) must still be right."""
    # at n = 150 torch's batched call never returns: a hang there is a failure, not a stuck suite
    done = subprocess.run([sys.executable, "-c", MULTI_THREADED], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def _masked_reference(A: torch.Tensor, masks: torch.Tensor):
    """The thin SVD of each masked matrix: kernel, singular values, leverages."""
    U, S, Vh = torch.linalg.svd(A.unsqueeze(0) * masks.unsqueeze(-1).to(A.dtype), full_matrices=False)
    return Vh[:, -1, :], S, (U[:, :, :-1] ** 2).sum(dim=-1)


def _kernel_batch(seed: int, decades: float, m: int = 600, b: int = 40, exact: int = 8, rows: int = 70):
    """A factor (m, b) with columns scaled over ``decades`` decades, and 2 * ``exact`` masks:
    ``exact`` disjoint groups of ``rows`` rows, each built to vanish on its own direction (a
    true column's zero set: a one-dimensional kernel), then as many random halves of all rows."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(m, b, generator=g, dtype=torch.float64)
    A = A * torch.logspace(0, -decades, b, dtype=torch.float64)[torch.randperm(b, generator=g)]
    masks = torch.zeros(2 * exact, m, dtype=torch.bool)
    for i in range(exact):
        q = torch.randn(b, generator=g, dtype=torch.float64)
        group = slice(i * rows, (i + 1) * rows)
        A[group] -= (A[group] @ q).unsqueeze(1) * q / q.dot(q)
        masks[i, group] = True
    masks[exact:] = torch.rand(exact, m, generator=g) < 0.5
    return A, masks


@pytest.mark.parametrize(("seed", "decades", "gram"), [(0, 2.0, True), (1, 3.0, True), (2, 6.0, False)])
def test_masked_kernels_match_the_svd(monkeypatch, seed, decades, gram):
    """Both paths (the Gram matrix's eigenvectors refined once for well-conditioned matrices,
    the SVD for ill-conditioned ones) give the SVD's kernel, singular values and leverages
    (torchmetrics-style: checked against the reference implementation)."""
    A, masks = _kernel_batch(seed, decades)
    calls = []
    svd = torch.linalg.svd
    monkeypatch.setattr(torch.linalg, "svd", lambda M, **kw: calls.append(M.shape[0]) or svd(M, **kw))
    got = linalg.masked_kernels(A, masks)
    monkeypatch.setattr(torch.linalg, "svd", svd)
    assert sum(calls) == (0 if gram else masks.shape[0])
    kernel, S, leverage = _masked_reference(A, masks)
    sign = torch.sign((kernel * got.kernel).sum(dim=1, keepdim=True))
    gap = (S[:, -2] - S[:, -1]) / S[:, 0]  # the smallest singular vector's conditioning
    assert ((got.kernel * sign - kernel).norm(dim=1) <= 1e-13 / gap).all()
    assert torch.allclose(got.singular_values[:, :-1], S[:, :-1], rtol=1e-9)
    assert ((got.singular_values[:, -1] - S[:, -1]).abs() <= 1e-13 * S[:, 0]).all()
    assert (got.leverage - leverage).abs().max() <= 1e-9
    assert not got.degenerate.any()  # nothing asked


def test_masked_kernels_solve_only_the_kept_rows(monkeypatch):
    """Each mask's rows are gathered into a compact matrix (its row count rounded up to
    ``MASK_HEIGHT_STEP``, at least b): the SVD sees 80 rows for a mask of 70 of 600, not 600,
    and rows outside a mask have leverage exactly 0."""
    A, masks = _kernel_batch(2, decades=6.0)  # ill-conditioned: the SVD path
    heights = []
    svd = torch.linalg.svd
    monkeypatch.setattr(torch.linalg, "svd", lambda M, **kw: heights.append(M.shape[1]) or svd(M, **kw))
    got = linalg.masked_kernels(A, masks[:8])
    assert heights == [80]
    heights.clear()
    few = masks[:1] & (torch.arange(600) < 2)  # 2 rows of b = 40: height b (float32: the SVD)
    linalg.masked_kernels(A.float(), few)
    assert heights == [40]
    assert not got.leverage[~masks[:8]].any()
    assert (got.leverage[masks[:8]] > 0).all()


def test_masked_kernels_of_exact_kernels_are_exact():
    """Where the masked rows share a one-dimensional kernel, the Gram path finds it to float64's
    rounding times the conditioning, as the SVD does."""
    A, masks = _kernel_batch(7, decades=3.0)
    got = linalg.masked_kernels(A, masks[:8])
    S = got.singular_values
    assert (S[:, -1] <= 1e-14 * S[:, 0]).all() and (S[:, -2] > 1e-4 * S[:, 0]).all()
    residual = (A.unsqueeze(0) * masks[:8].unsqueeze(-1)) @ got.kernel.unsqueeze(-1)
    assert float(residual.abs().max()) <= 1e-14 * float(A.abs().max())


def test_masked_kernels_call_degenerate_only_what_surely_is():
    """``degenerate`` (no SVD) only where ``s_(b-1) <= degenerate_below * s_1`` holds beyond the
    Gram's rounding; just above the threshold the matrix is solved."""
    g = torch.Generator().manual_seed(3)
    m, b, rtol = 200, 30, 1e-3
    base = torch.randn(m, b, generator=g, dtype=torch.float64)
    U, _, Vh = torch.linalg.svd(base, full_matrices=False)
    cases = []
    for second in (0.0, 1e-9, 1e-5, 0.5e-3, 2e-3, 1e-2):
        spectrum = torch.logspace(0, -1, b, dtype=torch.float64)
        spectrum[-2], spectrum[-1] = second, 0.0
        cases.append(U @ torch.diag(spectrum) @ Vh)
    masks = torch.ones(1, m, dtype=torch.bool)
    flags = [bool(linalg.masked_kernels(M, masks, degenerate_below=rtol).degenerate) for M in cases]
    # 5e-4 is below the threshold too, but well-conditioned enough for the Gram path: solved
    assert flags == [True, True, True, False, False, False]
    for M, flag in zip(cases, flags, strict=True):
        got = linalg.masked_kernels(M, masks, degenerate_below=rtol)
        _, S, _ = _masked_reference(M, masks)
        if flag:
            assert bool(torch.isnan(got.kernel).all()) and float(S[0, -2]) <= rtol * float(S[0, 0])
        else:
            assert bool(torch.isfinite(got.kernel).all())
            assert torch.allclose(got.singular_values[0, :-1], S[0, :-1], rtol=1e-9)


def test_masked_kernels_keep_the_svd_for_other_dtypes_and_scale_freely(monkeypatch):
    """float32 takes the SVD (of the compact matrix: the reference's to float32 rounding), never
    the Gram matrix; a factor scaled by 1e-200 (a Gram matrix would underflow) gives the same
    kernel and the scaled singular values."""
    A, masks = _kernel_batch(5, decades=2.0)
    A32 = A.float()
    eigh = torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda *a, **kw: pytest.fail("eigh in float32"))
    got = linalg.masked_kernels(A32, masks)
    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    kernel, S, leverage = _masked_reference(A32, masks)
    sign = torch.sign((kernel * got.kernel).sum(dim=1, keepdim=True))
    gap = (S[:, -2] - S[:, -1]) / S[:, 0]
    assert ((got.kernel * sign - kernel).norm(dim=1) <= 1e-5 / gap).all()
    assert torch.allclose(got.singular_values, S, rtol=1e-5, atol=1e-6 * float(S.max()))
    assert (got.leverage - leverage).abs().max() <= 1e-5
    tiny = linalg.masked_kernels(A * 1e-200, masks)
    same = linalg.masked_kernels(A, masks)
    assert torch.allclose(tiny.kernel, same.kernel, atol=1e-15)
    assert torch.allclose(tiny.singular_values * 1e200, same.singular_values, rtol=1e-12)


def test_masked_kernels_scale_each_mask_on_its_own():
    """A mask whose rows are all 1e-170 of the factor's largest entry (the review's case: its
    Gram matrix underflowed when the factor was scaled as a whole) gets the SVD's kernel."""
    A, masks = _kernel_batch(9, decades=2.0)
    group = masks[0]
    A[group] *= 1e-170
    got = linalg.masked_kernels(A, masks[:2])
    kernel, S, _ = _masked_reference(A, masks[:2])
    sign = torch.sign((kernel * got.kernel).sum(dim=1, keepdim=True))
    assert (got.kernel * sign - kernel).abs().max() <= 1e-13
    assert torch.allclose(got.singular_values[:, :-1], S[:, :-1], rtol=1e-9)


def test_masked_kernels_refine_near_a_double_smallest_singular_value():
    """s_b within 0.1% of s_(b-1) at s_1 / s_(b-1) ~ 1e4: the refinement's Rayleigh shift keeps
    the Gram path's kernel to the SVD's (unshifted it was 6e-7 off, the review measured)."""
    g = torch.Generator().manual_seed(11)
    m, b = 300, 30
    U, _, Vh = torch.linalg.svd(torch.randn(m, b, generator=g, dtype=torch.float64), full_matrices=False)
    spectrum = torch.logspace(0, -2, b, dtype=torch.float64)
    spectrum[-2], spectrum[-1] = 1.2e-4, 1.2e-4 * 0.999
    M = U @ torch.diag(spectrum) @ Vh
    masks = torch.ones(1, m, dtype=torch.bool)
    got = linalg.masked_kernels(M, masks)
    kernel, _, _ = _masked_reference(M, masks)
    assert float((got.kernel[0] * torch.sign(got.kernel[0] @ kernel[0]) - kernel[0]).norm()) <= 1e-9


def test_masked_kernels_do_not_depend_on_the_batch_around_a_mask():
    """Each mask's result is the same bit for bit whether it is solved alone or among others
    (peeling's memory of failed directions assumes a check always gives the same answer)."""
    A, masks = _kernel_batch(4, decades=2.0)
    together = linalg.masked_kernels(A, masks)
    for i in range(masks.shape[0]):
        alone = linalg.masked_kernels(A, masks[i : i + 1])
        assert torch.equal(alone.kernel[0], together.kernel[i])
        assert torch.equal(alone.singular_values[0], together.singular_values[i])
