"""Low-rank split of the weight gradient (Theorem 3.1, Algorithm 1 line 2)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from spear.errors import RankError


@dataclass(frozen=True)
class LowRankSplit:
    """``dL/dW = L R`` with ``L = U S^1/2`` (m x b) and ``R = S^1/2 V^T`` (b x n).

    ``singular_values`` holds every singular value of dL/dW (descending), so callers can see the
    gap the batch size was read from.
    """

    L: torch.Tensor
    R: torch.Tensor
    batch_size: int
    singular_values: torch.Tensor
    rank_rtol: float
    numerical_rank: int = 0  # the rank rule's own estimate (batch_size may be given instead)
    #: the batch size was read off the largest singular-value gap of a full-rank (noisy)
    #: gradient instead of its numerical rank
    from_gap: bool = False

    @property
    def noisy(self) -> bool:
        """The gradient's rank exceeds the batch: noise (DP-SGD) fills it, and the batch size was
        read off the gap or given."""
        return self.from_gap or self.numerical_rank > self.batch_size

    @property
    def noise_ratio(self) -> float:
        """``s_(b+1) / s_b``: how close the gradient's noise comes to the batch's weakest
        singular value (0 for a batch as wide as the layer)."""
        S, b = self.singular_values, self.batch_size
        return float(S[b] / S[b - 1]) if b < S.numel() and float(S[b - 1]) > 0 else 0.0


#: source dtypes less precise than this (float32, float16, bfloat16) get the jump rule
#: (``jump_rank``): their rounding noise (~0.2 eps s_max, measured) lies far below
#: numpy's max(m, n) eps, and a pair of near-duplicate samples leaves a singular value in between
LOW_PRECISION_EPS = 1e-10
#: the gap rule looks for the noise floor below this many eps times s_max
GAP_FLOOR_EPS = 10
#: the drop between the batch's singular values and the rounding noise is at least this
RANK_JUMP = 10


def default_rank_rtol(shape: tuple[int, int], source_dtype: torch.dtype) -> float:
    """numpy's ``matrix_rank`` rule: ``max(m, n) * eps``, with eps of the dtype the gradient was
    *computed* in (a float32 gradient carries float32 noise even after casting to float64)."""
    return max(shape) * torch.finfo(source_dtype).eps


def gap_rank(singular_values: torch.Tensor, floor_rtol: float) -> int:
    """The rank at the largest drop ``s_k / s_(k+1)`` among the k whose next singular value is
    already below ``floor_rtol * s_max`` (the noise floor). For half-precision gradients, whose
    noise (~0.1 eps s_max) lies far above numpy's rule but well below the batch's signal."""
    S = singular_values
    if S.numel() < 2 or float(S[0]) == 0.0:
        return int(S.numel() > 0 and float(S[0]) > 0)
    ratio = S[:-1] / S[1:].clamp_min(torch.finfo(S.dtype).tiny)
    eligible = S[1:] <= floor_rtol * S[0]
    if not bool(eligible.any()):
        return int(S.numel())
    ratio = torch.where(eligible, ratio, torch.zeros_like(ratio))
    return int(ratio.argmax()) + 1


def jump_rank(singular_values: torch.Tensor, eps: float) -> int | None:
    """The last k where the singular values drop ``RANK_JUMP``-fold from a value still above
    ``eps * s_max`` (the rounding noise of a gradient computed with this eps stays below ~0.3
    eps s_max and decays smoothly, measured); None when there is no such drop."""
    S = singular_values
    if S.numel() < 2 or float(S[0]) == 0.0:
        return None
    ratio = S[:-1] / S[1:].clamp_min(torch.finfo(S.dtype).tiny)
    drops = ((ratio >= RANK_JUMP) & (S[:-1] >= eps * S[0])).nonzero()[:, 0]
    return int(drops[-1]) + 1 if drops.numel() else None


def numerical_rank(
    singular_values: torch.Tensor,
    shape: tuple[int, int],
    source_dtype: torch.dtype,
    rank_rtol: float | None = None,
) -> int:
    """The rank of a gradient computed in ``source_dtype`` from its singular values: those above
    ``rank_rtol * s_max`` (default numpy's rule, :func:`default_rank_rtol`); gradients computed
    in float32 or half precision (unless ``rank_rtol`` is given) end at the last 10-fold drop of
    the singular values above eps (:func:`jump_rank`, else :func:`gap_rank`)."""
    S = singular_values
    rtol = rank_rtol if rank_rtol is not None else default_rank_rtol(shape, source_dtype)
    estimate = int((rtol * S[0] < S).sum()) if S.numel() else 0
    if rank_rtol is None and torch.finfo(source_dtype).eps > LOW_PRECISION_EPS:
        eps = torch.finfo(source_dtype).eps
        by_jump = jump_rank(S, eps)
        estimate = by_jump if by_jump is not None else gap_rank(S, GAP_FLOOR_EPS * eps)
    return estimate


#: a full-rank gradient (DP noise) is read as a batch of the size at its largest singular-value
#: gap when that gap is at least this large; below it the batch is buried in the noise
NOISY_GAP = 10.0


def largest_gap(singular_values: torch.Tensor) -> tuple[int, float]:
    """The k with the largest drop ``s_k / s_(k+1)`` among nonzero singular values, and that
    drop (0 when there are fewer than two): where a batch stands out of full-rank noise."""
    S = singular_values
    positive = S[S > 0]
    if positive.numel() < 2:
        return int(positive.numel()), 0.0
    ratio = positive[:-1] / positive[1:]
    k = int(ratio.argmax())
    return k + 1, float(ratio[k])


#: extra columns of the randomized range finder beyond the rank bound (:func:`leading_svd`)
RANGE_OVERSAMPLE = 10


def leading_svd(matrix: torch.Tensor, rank_bound: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reduced SVD of a matrix of rank at most ``rank_bound`` (plus rounding), without a
    full SVD of a wide one: a randomized range finder (Halko, Martinsson & Tropp 2011, Alg. 4.1)
    with ``rank_bound + RANGE_OVERSAMPLE`` fixed-seed Gaussian columns and one subspace
    iteration, then the SVD of the small projection. For a matrix of that rank the range is
    captured exactly up to rounding, so the leading singular triplets are the full SVD's (as
    close to the noise-free ones, tested), and the trailing ones show the noise floor that the
    rank rules (:func:`numerical_rank`) need. Returns (U, S, Vh) with
    ``rank_bound + RANGE_OVERSAMPLE`` triplets, or all of them for a small matrix."""
    k = rank_bound + RANGE_OVERSAMPLE
    if min(matrix.shape) <= 2 * k:
        return torch.linalg.svd(matrix, full_matrices=False)
    generator = torch.Generator(device="cpu").manual_seed(0)
    probe = torch.randn(matrix.shape[1], k, generator=generator, dtype=matrix.dtype).to(matrix.device)
    basis, _ = torch.linalg.qr(matrix @ probe)
    # one subspace iteration (Alg. 4.4): the probe's rounding noise would tilt the column space
    basis, _ = torch.linalg.qr(matrix @ torch.linalg.qr(matrix.T @ basis)[0])
    U_small, S, Vh = torch.linalg.svd(basis.T @ matrix, full_matrices=False)
    return basis @ U_small, S, Vh


#: a given batch size whose b-th singular value is within this many eps of zero (relative to
#: the largest) names more samples than the gradient holds independent inputs
DEPENDENT_EPS = 64


def low_rank_split(
    grad_weight: torch.Tensor,
    *,
    batch_size: int | None = None,
    rank_rtol: float | None = None,
    source_dtype: torch.dtype | None = None,
) -> LowRankSplit:
    """Reduced SVD of ``grad_weight`` (m x n, float64) and its numerical rank b.

    The batch size is the number of singular values above ``rank_rtol * s_max`` (Theorem 3.1:
    ``rank(dL/dW) = b``), unless ``batch_size`` is given, which overrides the estimate.
    Gradients computed in float32 or half precision end the batch at the last 10-fold drop of
    the singular values above eps (:func:`jump_rank`, else :func:`gap_rank`); float64 keeps
    numpy's rule.

    Raises:
        RankError: the gradient has full rank ``min(m, n)``, so ``b >= min(m, n)`` and the batch
            cannot be disaggregated (SPEAR needs ``b < m`` and ``b < n``); or a given
            ``batch_size`` exceeds the number of independent inputs the gradient holds.
    """
    m, n = grad_weight.shape
    U, S, Vh = torch.linalg.svd(grad_weight, full_matrices=False)
    source = source_dtype or grad_weight.dtype
    rtol = rank_rtol if rank_rtol is not None else default_rank_rtol((m, n), source)
    estimate = numerical_rank(S, (m, n), source, rank_rtol)
    b = estimate if batch_size is None else int(batch_size)
    if b < 1:
        raise RankError(
            f"dL/dW has numerical rank 0 at rank_rtol={rtol:g}: no singular value is above the "
            "threshold; lower rank_rtol or pass batch_size="
        )
    floor = DEPENDENT_EPS * torch.finfo(source).eps * S[0]
    if batch_size is not None and b <= min(m, n) and S[b - 1] <= floor:
        raise RankError(
            f"batch_size={b} was given, but dL/dW has only {estimate} singular values above its "
            f"rounding (s_{b} / s_1 = {float(S[b - 1] / S[0]):.1e}): the batch's inputs are linearly "
            "dependent (rows sharing few one-hot categories, repeated samples), so no rank-based attack "
            f"can separate its samples. At most {estimate} independent inputs are in this gradient."
        )
    from_gap = False
    if b >= min(m, n) and batch_size is None:
        gap, ratio = largest_gap(S)
        if ratio >= NOISY_GAP:
            b, from_gap = gap, True  # noise fills the rank; the batch stands out above it
    if b >= min(m, n):
        gap, ratio = largest_gap(S)
        hint = (
            f" The largest drop of its singular values comes after {gap} of them (s ratio "
            f"{ratio:.1e}, below the {NOISY_GAP:g} a noisy batch needs to stand out): if the "
            f"gradient carries noise, batch_size={gap} may be right."
            if 0 < gap < min(m, n) and batch_size is None
            else ""
        )
        raise RankError(
            f"dL/dW ({m} x {n}) has numerical rank {b} = min(m, n): either the batch is at least as "
            "large as the layer, or noise added to the gradient (DP-SGD, compression) fills its "
            "spectrum so that no batch stands out of it. SPEAR needs "
            f"batch size < {min(m, n)} "
            f"(the layer's {'output' if m <= n else 'input'} width). Attack a wider layer, or pass "
            f"batch_size= if you know the batch is smaller and the gradient is noisy.{hint}"
        )
    root = S[:b].sqrt()
    L = U[:, :b] * root
    R = root[:, None] * Vh[:b]
    return LowRankSplit(
        L=L, R=R, batch_size=b, singular_values=S, rank_rtol=rtol, numerical_rank=estimate, from_gap=from_gap
    )


#: the equilibrated spectrum beyond the batch must stay below this many eps of its largest
#: value (rounding relative per row: 0.05-0.2 eps measured on float32 clients) for the
#: equilibrated split to be taken
EQUILIBRATED_FLOOR_EPS = 1.0


#: the equilibrated batch may exceed the plain rank by this many samples, or this fraction of
#: it (faint samples sunk below the large rows' rounding are the batch's last few); beyond
#: that, the extra rank comes from rows that are rounding alone (rows of near-duplicate
#: samples that cancel, or a few rows of noise: b = 14-28 for 4 in the review of issue #10),
#: and the plain split is taken
EXTRA_FAINT_MIN = 2
EXTRA_FAINT_FRACTION = 0.25


def _rounding_floor(split: LowRankSplit, source_dtype: torch.dtype | None) -> bool:
    """Whether the spectrum beyond the batch is rounding relative per row. Noise of one size on
    every entry (compression, a FedAvg update's weight difference rounded relative to the
    weights, rows that are rounding alone) is inflated on the small rows by equilibrating and
    lifts this floor; the plain split holds such a gradient's row space better (review of
    issue #10: 17-27x closer on float32 FedAvg updates)."""
    S, b = split.singular_values, split.batch_size
    if b >= S.numel() or float(S[0]) == 0.0:
        return True
    eps = torch.finfo(source_dtype or S.dtype).eps
    return float(S[b]) <= EQUILIBRATED_FLOOR_EPS * eps * float(S[0])


def equilibrated_split(
    grad_weight: torch.Tensor,
    *,
    batch_size: int | None = None,
    rank_rtol: float | None = None,
    source_dtype: torch.dtype | None = None,
) -> LowRankSplit:
    """:func:`low_rank_split` with the batch size and the row space read off the
    row-equilibrated gradient (every row of dL/dW divided by its norm), for gradients whose
    noise is rounding.

    A gradient computed in low precision carries each entry's rounding relative to that entry's
    own terms, so its noise is relative per row, not per matrix. A trained network's
    well-classified samples have columns of dL/dZ far below the largest. In the plain spectrum
    they sink into the large rows' rounding: a float32 CNN head trained 1000 steps (MNIST,
    b = 16) has ``s_16 / s_1 = 2.5e-8``, a fifth of float32's eps, next to ``s_17 / s_1 =
    9.3e-9``, so no rank rule can find the batch; equilibrated, ``s_16 / s_1 = 2.4e-4`` and
    ``s_17 / s_1 = 8.1e-9``. Where the plain SVD puts a faint sample's input 1e-3 off its row
    space (float32 MLP, 1000 steps, a column 2e-6 of the largest), the equilibrated one holds it
    to 1e-5. ``L`` and ``R`` are then the SVD of dL/dW projected on that row space: each row of
    ``L`` keeps its own precision, the factors their form (``L = U S^1/2``, ``R = S^1/2 V^T``)
    and their zero sets their scale (a column's zeros are judged against its own largest entry,
    which equilibrated rows would shrink wherever a strong sample shares them). The singular
    values stay the plain gradient's (the batch's from the projection), for the rounding
    models that read them.

    A gradient whose equilibrated spectrum is noisy (DP-SGD adds noise of one size to every
    row, which dividing by small rows would inflate), has no rank below the layer's, whose
    spectrum beyond the batch rises above rounding (:func:`_rounding_floor`), or whose
    equilibrated batch (not given) exceeds the plain rank by more than a few faint samples
    (:data:`EXTRA_FAINT_MIN`) gets the plain split. A plain rank far above the equilibrated
    one (the CNN head above: 378) does not count against it."""
    norms = grad_weight.norm(dim=1, keepdim=True)
    scaled = grad_weight / torch.where(norms > 0, norms, torch.ones_like(norms))
    kwargs = {"batch_size": batch_size, "rank_rtol": rank_rtol, "source_dtype": source_dtype}
    try:
        equilibrated = low_rank_split(scaled, **kwargs)
    except RankError:
        equilibrated = None
    if equilibrated is None or equilibrated.noisy or not _rounding_floor(equilibrated, source_dtype):
        return low_rank_split(grad_weight, **kwargs)
    singular_values = torch.linalg.svdvals(grad_weight)
    b = equilibrated.batch_size
    if batch_size is None:
        source = source_dtype or grad_weight.dtype
        plain = numerical_rank(singular_values, tuple(grad_weight.shape), source, rank_rtol)
        if b > plain + max(EXTRA_FAINT_MIN, math.ceil(EXTRA_FAINT_FRACTION * plain)):
            return low_rank_split(grad_weight, **kwargs)
    Vh = equilibrated.R / equilibrated.singular_values[:b, None].sqrt()
    U, S, Wh = torch.linalg.svd(grad_weight @ Vh.T, full_matrices=False)
    singular_values[:b] = S
    root = S.sqrt()
    return replace(equilibrated, L=U * root, R=root[:, None] * (Wh @ Vh), singular_values=singular_values)
