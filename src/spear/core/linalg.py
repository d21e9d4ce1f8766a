"""Linear algebra the attack needs bit-reproducible (the same seed, the same result).

``torch.linalg.lstsq``'s default CPU driver, LAPACK's gelsy (QR with column pivoting), rounds
differently depending on where its inputs sit in memory: two identical calls in one process can
differ by an ulp, and peeling's decisions on an ill-conditioned batch amplified that into
different reconstructions. gelsd (SVD-based, minimum-norm like gelsy for rank-deficient systems)
does not. CUDA offers only gels, which needs full-rank systems: there the pseudo-inverse
solves them (:func:`lstsq`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def lstsq(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """The least-squares (minimum-norm) solution X of ``A X = B`` for ``A`` (*, m, n) and
    ``B`` (*, m, k) with the same batch dimensions, reproducible bit for bit on the CPU.

    On other devices ``pinv(A) B``: CUDA's only lstsq driver, gels, assumes A has full rank
    and returns garbage, silently, otherwise (an H200, torch 2.11: a 30 x 12 system of rank 4
    came back with a solution of norm 3.9e15, the minimum-norm one has 0.18). The
    pseudo-inverse (an SVD) cuts singular values at the same relative ``max(rows, cols) * eps``
    as gelsd's default."""
    if A.device.type == "cpu":
        return torch.linalg.lstsq(A, B, driver="gelsd").solution
    return torch.linalg.pinv(A) @ B


def row_products(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """Each row's outer product ``A_i B_i^T`` of ``A`` (m, a) and ``B`` (m, c), flattened to
    (m, a c): masked Gram matrices ``sum_i w_i A_i B_i^T`` over weights ``w`` (S, m) are then
    one matmul, ``(w @ row_products(A, B)).reshape(S, a, c)``."""
    return (A[:, :, None] * B[:, None, :]).reshape(A.shape[0], -1)


def unit_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (S, k) scaled to unit norm (zero rows stay zero)."""
    norms = torch.linalg.vector_norm(rows, dim=1, keepdim=True)
    return rows / norms.clamp_min(torch.finfo(rows.dtype).tiny)


def gram_ridge(gram: torch.Tensor) -> torch.Tensor:
    """A ridge for Gram matrices (S, k, k) that may be singular (a mask with fewer rows than
    k): 1e-14 of each one's largest diagonal entry (and 1e-300) times the identity."""
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    return (1e-14 * gram.diagonal(dim1=-2, dim2=-1).amax(-1)[..., None, None] + 1e-300) * eye


#: batched LU factorizations of matrices this large are run one matrix at a time on the CPU
#: (:func:`solve_ex`); MKL's getrf goes wrong from n = 150 (measured on two machines, with 2 to 16
#: threads; below 150 never)
LU_BATCH_SAFE_N = 128


def _lu_batch_unsafe(A: torch.Tensor) -> bool:
    """Whether torch's batched CPU LU could factor several of these matrices concurrently with
    a parallel MKL getrf (:func:`solve_ex`)."""
    batched = A.dim() > 2 and A[..., 0, 0].numel() > 1
    large = A.shape[-1] >= LU_BATCH_SAFE_N
    return batched and large and A.device.type == "cpu" and torch.get_num_threads() > 1


def solve_ex(A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.linalg.solve_ex(A, B)`` (LU with partial pivoting), safe for batches on the CPU.

    torch's batched CPU LU factors the matrices of a batch on several threads at once. Once the
    thread count has been set (``torch.set_num_threads(k)``, k > 1), MKL's getrf then corrupts
    its pivots for matrices from n = 150 on (pytorch/pytorch#142815, #141358; measured with
    torch 2.13.0 on batches of two or more): at n = 150 the call never returns (its threads
    spin), from 151 it raises ("Pivots given to lu_solve must all be greater or equal to 1") or,
    silently, returns solutions off by 1e10 to 1e28. Such batches are factored here one matrix
    at a time (each call may use every thread inside; where ``B`` broadcasts one matrix over
    several systems, it is factored once and the batched ``lu_solve``, not affected, solves
    them all); smaller matrices and a single thread keep the batched call. Shapes are torch's:
    ``B`` is a batch of vectors when its shape is ``A``'s without the last dimension (or it is
    one vector), else a batch of matrices; batch dimensions broadcast, and ``info`` has ``A``'s
    batch shape (each matrix is factored once)."""
    if A.numel() == 0 or not _lu_batch_unsafe(A):
        return torch.linalg.solve_ex(A, B)
    vector = B.dim() == 1 or B.shape == A.shape[:-1]
    rhs = B.unsqueeze(-1) if vector else B
    if torch.broadcast_shapes(A.shape[:-2], rhs.shape[:-2]) == A.shape[:-2]:
        X, info = _solve_each(A, rhs)  # one right-hand side per matrix: the attack's case
    else:
        X, info = _factor_each(A, rhs)
    return (X.squeeze(-1) if vector else X), info


def _solve_each(A: torch.Tensor, rhs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One ``solve_ex`` per matrix of ``A`` (the fastest way, measured), for right-hand sides
    ``rhs`` (..., n, k) whose batch broadcasts to ``A``'s."""
    n, k = A.shape[-1], rhs.shape[-1]
    systems = A.reshape(-1, n, n)
    sides = rhs.expand(*A.shape[:-1], k).reshape(len(systems), n, k)
    parts = [torch.linalg.solve_ex(a, s) for a, s in zip(systems, sides, strict=True)]
    X = torch.stack([x for x, _ in parts]).reshape(*A.shape[:-1], k)
    return X, torch.stack([i for _, i in parts]).reshape(A.shape[:-2])


def _factor_each(A: torch.Tensor, rhs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each matrix of ``A`` factored once, one at a time, and every system of the broadcast
    batch solved by one batched ``lu_solve``."""
    n = A.shape[-1]
    factors = [torch.linalg.lu_factor_ex(a) for a in A.reshape(-1, n, n)]
    LU = torch.stack([f.LU for f in factors]).reshape(A.shape)
    pivots = torch.stack([f.pivots for f in factors]).reshape(A.shape[:-1])
    info = torch.stack([f.info for f in factors]).reshape(A.shape[:-2])
    return torch.linalg.lu_solve(LU, pivots, rhs), info


#: a row whose leverage is within this of 1 is essential to the kernel (see
#: :func:`spear.core.filtering.kernel_of_rows`)
ESSENTIAL_ROW_TOL = 1e-6
#: largest ``s_1 / s_(b-1)`` of a masked matrix whose kernel :func:`masked_kernels` takes from
#: its Gram matrix (beyond it, from an SVD): the Gram's eigenvectors carry errors of about
#: ``eps * (s_1 / s_(b-1))^2``, 2e-8 here, which one refinement step against the matrix itself
#: brings down to the SVD's ``eps * s_1 / s_(b-1)``
GRAM_CONDITION_LIMIT = 1e4
#: bound on the rounding of a computed Gram matrix's eigenvalues, relative to the largest (about
#: b * eps for the matrix product and the eigensolver together; 1e3 * eps covers b <= 1000)
GRAM_EIGENVALUE_ERROR = 1e3 * torch.finfo(torch.float64).eps


@dataclass
class MaskedKernels:
    """The kernel direction and spectrum of ``A[rows_i]`` for k row masks (see
    :func:`masked_kernels`).

    Attributes:
        kernel: (k, b) unit right singular vectors of the smallest singular value.
        singular_values: (k, b) descending; the last is ``|A[rows_i] kernel_i|``.
        leverage: (k, m) each row's squared norm in the leading b - 1 left singular vectors
            (1 for a row the rank-(b - 1) row space cannot do without; 0 for masked-out rows).
        degenerate: (k,) matrices whose ``s_(b-1)`` is certainly at most ``degenerate_below``
            times ``s_1`` (a kernel of two or more dimensions at that tolerance); their kernel
            is NaN, their leverage 0 and their singular values the Gram's estimates.
    """

    kernel: torch.Tensor
    singular_values: torch.Tensor
    leverage: torch.Tensor
    degenerate: torch.Tensor

    @property
    def robust(self) -> torch.Tensor:
        """(k,) no row is essential (every leverage below ``1 - ESSENTIAL_ROW_TOL``); False for
        degenerate matrices, whose leverages are not computed."""
        return (self.leverage < 1.0 - ESSENTIAL_ROW_TOL).all(dim=1) & ~self.degenerate

    def one_dimensional(self, rtol: float) -> torch.Tensor:
        """(k,) the kernel is one-dimensional at ``rtol``: ``s_b <= rtol * s_1 < s_(b-1)``."""
        S = self.singular_values
        return (S[:, -1] <= rtol * S[:, 0]) & (S[:, -2] > rtol * S[:, 0]) & ~self.degenerate


def masked_kernels(
    A: torch.Tensor, masks: torch.Tensor, degenerate_below: float | None = None
) -> MaskedKernels:
    """Kernel, singular values and row leverages of ``A`` (m, b) restricted to the rows of each
    mask (k, m), as a thin SVD of the masked matrix (rows outside the mask zeroed) gives them.

    Each mask's rows are gathered into a compact matrix (in their order, padded with zero rows
    to a height that depends only on the mask's own row count, ``MASK_HEIGHT_STEP``): the work
    follows the rows kept (a zero set of ~80 of 485 rows costs a sixth of the full masked
    matrix), and a mask's result does not depend on the masks beside it.
    In float64, a matrix whose ``s_1 / s_(b-1)`` is at most ``GRAM_CONDITION_LIMIT`` is solved
    from its Gram matrix ``A^T D A`` (one eigendecomposition of b x b, about 4x cheaper than the
    SVD of m x b at m = 485, b = 64) and its kernel refined once against the masked matrix
    itself (a Rayleigh-shifted correction along the other eigenvectors): the same kernel as the
    SVD's to its own rounding, and the same whatever other masks share the call.
    ``degenerate_below``: a caller that only needs to know that ``s_(b-1) <= degenerate_below *
    s_1`` gets that answer from the Gram's eigenvalues where their rounding
    (``GRAM_EIGENVALUE_ERROR``) cannot change it, with no SVD (``MaskedKernels.degenerate``).
    The other matrices, and every other dtype, take the SVD."""
    k, (m, b) = masks.shape[0], A.shape
    masks = masks != 0  # boolean (0/1 floats accepted)
    # each masked matrix divided by a power of two near its largest entry (exact): no underflow
    # or overflow in its Gram matrix, the SVD path's arithmetic unchanged; scaled back below
    rows = A.abs().amax(dim=1) if b else A.new_zeros(m)
    size = (masks.to(A.dtype) * rows.unsqueeze(0)).amax(dim=1) if m else A.new_ones(k)
    size = torch.where(torch.isfinite(size) & (size > 0), size, torch.ones_like(size))
    size = torch.ldexp(torch.ones_like(size), torch.frexp(size).exponent - 1)  # in (size / 2, size]
    out = MaskedKernels(
        kernel=A.new_full((k, b), torch.nan),
        singular_values=A.new_empty(k, b),
        leverage=A.new_zeros(k, m),
        degenerate=torch.zeros(k, dtype=torch.bool, device=A.device),
    )
    height = _compact_height(masks.sum(dim=1), b)
    padded = torch.cat([A, A.new_zeros(1, b)])  # row m: the padding
    for h in torch.unique(height).tolist():
        group = (height == h).nonzero().squeeze(1)
        index = _kept_rows(masks[group], int(h))
        compact = padded[index] / size[group].view(-1, 1, 1)  # (n, h, b)
        kernel, S, leverage, degenerate = _solve_compact(compact, degenerate_below)
        out.kernel[group], out.singular_values[group] = kernel, S * size[group].unsqueeze(1)
        out.degenerate[group] = degenerate
        spread = A.new_zeros(group.numel(), m + 1).scatter_(1, index, leverage)
        out.leverage[group] = spread[:, :m]
    return out


#: a mask's compact matrix has its row count rounded up to a multiple of this (and at least b)
MASK_HEIGHT_STEP = 16


def _compact_height(counts: torch.Tensor, b: int) -> torch.Tensor:
    """Height of each mask's compact matrix: its row count rounded up to a multiple of
    ``MASK_HEIGHT_STEP``, at least ``b`` (a thin SVD then has b singular values)."""
    step = MASK_HEIGHT_STEP
    return ((counts + step - 1) // step * step).clamp_min(max(b, 1))


def _kept_rows(masks: torch.Tensor, height: int) -> torch.Tensor:
    """(n, height) indices of each mask's rows in order, padded with m (the zero row)."""
    n, m = masks.shape
    index = torch.full((n, height), m, dtype=torch.long, device=masks.device)
    which, row = masks.nonzero(as_tuple=True)
    place = masks.cumsum(dim=1)[which, row] - 1
    index[which, place] = row
    return index


def _solve_compact(
    compact: torch.Tensor, degenerate_below: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`masked_kernels` for compact matrices (n, h, b), already scaled: kernels (n, b),
    descending singular values (n, b), row leverages (n, h) and the degenerate flags (n,)."""
    n, _, b = compact.shape
    kernel = compact.new_full((n, b), torch.nan)
    S = compact.new_empty(n, b)
    leverage = compact.new_zeros(n, compact.shape[1])
    gram_ok = torch.zeros(n, dtype=torch.bool, device=compact.device)
    degenerate = torch.zeros_like(gram_ok)
    if compact.dtype == torch.float64 and b > 1 and n and bool(torch.isfinite(compact).all()):
        lam, vecs = torch.linalg.eigh(compact.mT @ compact)  # ascending: lam[:, 1] is s_(b-1)^2
        top = lam[:, -1]
        gram_ok = (top > 0) & (lam[:, 1] * GRAM_CONDITION_LIMIT**2 >= top)
        if degenerate_below is not None:
            slack = GRAM_EIGENVALUE_ERROR * top
            degenerate = ~gram_ok & (lam[:, 1] + slack <= degenerate_below**2 * (top - slack))
            S[degenerate] = lam[degenerate].clamp_min(0).sqrt().flip(1)
        if bool(gram_ok.any()):
            kernel[gram_ok], S[gram_ok], leverage[gram_ok] = _from_gram(
                compact[gram_ok], lam[gram_ok], vecs[gram_ok]
            )
    rest = ~gram_ok & ~degenerate
    if bool(rest.any()):
        U, s, Vh = torch.linalg.svd(compact[rest], full_matrices=False)
        kernel[rest], S[rest] = Vh[:, -1, :], s
        leverage[rest] = (U[:, :, :-1] ** 2).sum(dim=-1)
    return kernel, S, leverage, degenerate


def _from_gram(
    masked: torch.Tensor, lam: torch.Tensor, vecs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`masked_kernels`' Gram path for well-conditioned masked matrices (c, m, b), given
    their Gram's ascending eigenvalues (c, b) and eigenvectors: kernels (c, b), descending
    singular values (c, b) and leverages (c, m)."""
    rest_vecs, rest_lam = vecs[:, :, 1:], lam[:, 1:]  # the leading b - 1 (all > 0 here)
    v = vecs[:, :, 0]
    # one refinement step (Rayleigh-shifted): remove v's components along the leading right
    # singular vectors, measured through the matrix itself (A^T A v - rho v, rho = |A v|^2),
    # not through the rounded Gram matrix; the shift keeps it exact when s_b nears s_(b-1).
    # Products with one vector are sums of elementwise products: a matrix-vector kernel rounds
    # differently for a batch of one, and a matrix's result must not depend on its chunk
    residual = (masked * v.unsqueeze(1)).sum(dim=2)  # (c, m)
    rho = (residual**2).sum(dim=1, keepdim=True)
    pull = (masked * residual.unsqueeze(2)).sum(dim=1) - rho * v  # (c, b)
    gap = (rest_lam - rho).clamp_min(GRAM_EIGENVALUE_ERROR * lam[:, -1:])
    along = (rest_vecs * pull.unsqueeze(2)).sum(dim=1) / gap  # (c, b - 1)
    v = v - (rest_vecs * along.unsqueeze(1)).sum(dim=2)
    v = v / v.norm(dim=1, keepdim=True)
    smallest = (masked * v.unsqueeze(1)).sum(dim=2).norm(dim=1)
    S = torch.cat([rest_lam.clamp_min(0).sqrt().flip(1), smallest.unsqueeze(1)], dim=1)
    left = masked @ rest_vecs / rest_lam.sqrt().unsqueeze(1)  # (c, m, b - 1)
    return v, S, (left**2).sum(dim=-1)
