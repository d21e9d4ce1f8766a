"""Exact acceptance of proposals: snapping, the sparsity filter and deduplication (Section 4.1).

Whatever a proposer returns, a direction enters the candidate pool only after it was re-solved
in float64 as the one-dimensional kernel of the rows where ``L q`` vanishes, and only if ``L q``
then has at least ``tau * m`` zeros. Mixtures of true directions (whose zero sets are the
intersections of two columns' zero sets) have a two-dimensional kernel there or too few zeros,
and are rejected. Approximate directions never reach the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from spear.core.deadline import NEVER, Deadline
from spear.core.linalg import masked_kernels, solve_ex

#: default relative magnitude below which an entry of ``L q`` counts as an exact zero
DEFAULT_ZERO_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4}
#: smallest ratio s_{b-1} / s_1 of the zero rows for the kernel to count as one-dimensional
KERNEL_GAP_RTOL = 1e-7
#: the rounding floor of an entry of ``L q``, in root mean squares of its error vector (a margin
#: over the typical entry, far below the worst case: the whole error in one entry). The error is
#: not spread evenly: the faint columns of float64 CNN heads trained 1000 steps (MNIST, b = 16
#: to 64, seeds 0-2) had true zeros up to 5.2 root mean squares of the estimated error, where 3
#: kept sigma below 1 to the end of any budget ...
ROUNDING_ENTRY = 10.0
#: ... and at most this fraction of the column's maximum: a column whose rounding reaches
#: further is too faint to judge by its zeros (and the recount after snapping stays a check that
#: the kernel is real). Below float32's ``zero_rtol``: the floor only ever acts in float64
FLOOR_CAP = 1e-5
#: two unit directions with |cos| above this are the same direction
DUPLICATE_COS = 1.0 - 1e-9
#: directions deduplicated together (:meth:`CandidatePool._first_new`)
DEDUP_BLOCK = 256
#: projections on which near-parallel directions are screened (:class:`_ParallelIndex`)
PARALLEL_AXES = 4
#: ... and the most pairs a block screens that way (beyond: every pair is compared)
NEAR_PAIR_LIMIT = 2**21
#: how many numbers one batched kernel step may hold (hints x rows x b)
SNAP_CHUNK_ELEMENTS = 2**24
#: ... and one batched SVD of masked factors (kernel_of_rows)
KERNEL_CHUNK_ELEMENTS = 2**22
#: how much work (rows x b^2 per mask: one masked SVD's or Gram's flops, up to a constant) one
#: batched kernel step may do, so that the deadline is checked every ~0.1 s on an idle 2-core
#: CPU. Counted in work, not measured in time, so that the steps (and their last bits: a
#: batched product's rounding depends on its batch) are the same whatever the machine's load;
#: on a machine oversubscribed enough for OpenMP's threads to wait on each other (one step up to
#: 100x slower, measured) the deadline is still checked within seconds
KERNEL_CHUNK_WORK = 2**26
#: ... counting each mask's fixed cost (one small SVD's call, ~20 us) as this much work: small
#: factors (b = 2 to 20) otherwise made steps of thousands of masks, 0.2-0.4 s idle
KERNEL_MASK_OVERHEAD = 2**15


def kernel_chunk(rows: int, b: int, elements: int) -> int:
    """Masks per batched kernel step for a factor of ``rows`` x ``b``: within ``elements``
    numbers and ``KERNEL_CHUNK_WORK``."""
    per_mask = rows * b * b + KERNEL_MASK_OVERHEAD
    return max(1, min(elements // (rows * b), KERNEL_CHUNK_WORK // per_mask))


def largest_on(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(k,) the largest |value| of each row of ``values`` (k, rows) on its ``mask`` (k, rows),
    relative to the row's largest |value| (0 on an empty mask)."""
    magnitude = values.abs()
    size = magnitude.amax(dim=-1).clamp_min(torch.finfo(values.dtype).tiny)
    return torch.where(mask, magnitude, torch.zeros_like(magnitude)).amax(dim=-1) / size


def zero_mask(
    values: torch.Tensor, zero_rtol: float, floor: torch.Tensor | None = None, cap: float = FLOOR_CAP
) -> torch.Tensor:
    """Entries of each row of ``values`` (k x rows) that are zero relative to the row's max, or
    within the row's rounding ``floor`` (k,), when given (:func:`rounding_floor`), up to
    ``cap`` (``FLOOR_CAP``) of the max."""
    magnitude = values.abs()
    peak = magnitude.amax(dim=-1, keepdim=True)
    threshold = peak * zero_rtol
    if floor is not None:
        threshold = torch.maximum(threshold, torch.minimum(floor.reshape(-1, 1).to(threshold), cap * peak))
    return magnitude <= threshold


def rounding_error(q: torch.Tensor, rounding: torch.Tensor | None) -> torch.Tensor | None:
    """For directions ``q`` (k x b) of a factor whose rounding map is ``rounding`` (B x b,
    :func:`spear.core.consistency.rounding_map`), the norm of the rounding error of each ``L q``
    (k,). None without a map."""
    if rounding is None:
        return None
    return (q.to(rounding.dtype) @ rounding.T).norm(dim=1)


def rounding_floor(q: torch.Tensor, rounding: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """For directions ``q`` (k x b) of a factor with ``rows`` rows whose rounding map is
    ``rounding`` (B x b, :func:`spear.core.consistency.rounding_map`), the rounding floor of the
    entries of ``L q`` (k,): ``ROUNDING_ENTRY`` times the root mean square entry of the error
    vector. Its true zeros lie below it (measured: a faint column's zeros reach 1e-8 of its
    maximum, where the floor is 3e-7). None without a map."""
    return floor_of(rounding_error(q, rounding), rows)


def floor_of(error: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """:func:`rounding_floor` from the rounding errors (k,) of :func:`rounding_error`."""
    return None if error is None else ROUNDING_ENTRY * error / math.sqrt(rows)


def canonical_sign(q: torch.Tensor) -> torch.Tensor:
    """Directions (k x b) with their largest-magnitude entry made positive."""
    pivot = q.abs().argmax(dim=1, keepdim=True)
    return q * torch.sign(q.gather(1, pivot))


def kernel_of_rows(
    L: torch.Tensor, rows: torch.Tensor, deadline: Deadline = NEVER
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Smallest right singular vector of ``L[rows_i]`` for each mask ``rows_i`` (k x m), whether
    that kernel is one-dimensional, and whether it is *robust*. Masked-out rows are zeroed, which
    changes neither the right singular vectors nor the nonzero singular values.

    Robust means no row is essential (leverage 1 in the rank-(b-1) row space). A mixture of t
    true directions vanishes on the rows where all t columns are zero (a t-dimensional kernel)
    plus t-1 further rows that cut it down to one dimension, each of them essential; the ~m/2
    zero rows of a true column are normally in general position. Normally: when a similar
    sample's zero set contains all but one of a true column's zero rows, that row is essential
    too, and L alone cannot tell the two cases apart. Non-robust candidates therefore stay in
    the pool for the greedy selection (which also uses W and b) but are not trusted for
    deflation and guidance.

    Solved in chunks of bounded memory and work (:func:`kernel_chunk`; one SVD of a 1000 x 512
    matrix takes ~0.1 s); once ``deadline`` has passed, the masks left are not solved (not
    one-dimensional).
    """
    k, b = rows.shape[0], L.shape[1]
    if b == 1:  # one direction (the last sample of a residual problem): nothing to solve
        ones = torch.ones(k, dtype=torch.bool, device=L.device)
        return torch.ones(k, 1, dtype=L.dtype, device=L.device), ones, ones
    kernel = torch.full((k, b), torch.nan, dtype=L.dtype, device=L.device)
    one_dimensional = torch.zeros(k, dtype=torch.bool, device=L.device)
    robust = torch.zeros(k, dtype=torch.bool, device=L.device)
    chunk = kernel_chunk(L.shape[0], b, KERNEL_CHUNK_ELEMENTS)
    for part in torch.arange(k, device=L.device).split(chunk):
        if deadline.passed():
            break
        solved = masked_kernels(L, rows[part])
        S = solved.singular_values
        kernel[part] = solved.kernel
        one_dimensional[part] = S[:, -2] > KERNEL_GAP_RTOL * S[:, 0]
        robust[part] = solved.robust
    return kernel, one_dimensional, robust


def _kernel_of_exact_subsets(L: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Kernel of ``L[rows_i]`` for masks with exactly b-1 rows, by a batched LU solve (cheap);
    singular systems give non-finite vectors, which the zero count then rejects."""
    b = L.shape[1]
    idx = rows.nonzero()[:, 1].reshape(rows.shape[0], b - 1)
    L_A = L[idx]
    y, _ = solve_ex(L_A[:, :, : b - 1], -L_A[:, :, b - 1 :])
    ones = torch.ones(y.shape[0], 1, dtype=L.dtype, device=L.device)
    q = torch.cat([y.squeeze(-1), ones], dim=1)
    return q / q.norm(dim=1, keepdim=True)


def _first_kernel(
    L: torch.Tensor, rows: torch.Tensor, chunk: int, deadline: Deadline = NEVER
) -> torch.Tensor:
    """Kernel directions of the hinted rows: LU for (b-1)-row hints, the smallest eigenvector of
    ``L_A^T L_A`` for larger ones (refined exactly later), in chunks of bounded memory and work; past
    ``deadline`` the chunks left are not solved (NaN, which the zero count drops)."""
    b = L.shape[1]
    out = torch.full((rows.shape[0], b), torch.nan, dtype=L.dtype, device=L.device)
    counts = rows.sum(dim=1)
    exact = counts == b - 1
    if bool(exact.any()):
        out[exact] = _kernel_of_exact_subsets(L, rows[exact])
    rest = (~exact).nonzero()[:, 0]
    for part in rest.split(chunk):
        if deadline.passed():
            break
        gram = torch.einsum("mi,km,mj->kij", L, rows[part].to(L.dtype), L)
        _, vecs = torch.linalg.eigh(gram)
        out[part] = vecs[:, :, 0]
    return out


def _mask_signatures(masks: torch.Tensor) -> torch.Tensor:
    """Exact integer fingerprints of bool rows (equal rows, equal fingerprints; distinct rows
    collide with probability ~2^-40)."""
    weights = torch.randint(
        0, 2**40, (masks.shape[1],), generator=torch.Generator().manual_seed(masks.shape[1])
    ).to(masks.device)
    return (masks.long() * weights).sum(dim=1)


def first_occurrences(rows: torch.Tensor, known: torch.Tensor | None) -> torch.Tensor:
    """Indices of the first row of each distinct mask that is not in ``known``."""
    if rows.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long, device=rows.device)
    sig = _mask_signatures(rows)
    unique, inverse = torch.unique(sig, return_inverse=True)
    first = torch.full((unique.shape[0],), rows.shape[0], dtype=torch.long, device=rows.device)
    first.scatter_reduce_(0, inverse, torch.arange(rows.shape[0], device=rows.device), reduce="amin")
    if known is not None and known.shape[0]:
        first = first[~torch.isin(unique, _mask_signatures(known))]
    return first.sort().values


@dataclass
class SnapResult:
    """Exact directions that passed the filter, with their zero masks and counts."""

    directions: torch.Tensor  # (k, b) unit vectors, float64
    zero_masks: torch.Tensor  # (k, rows) bool
    zero_counts: torch.Tensor  # (k,) int
    robust: torch.Tensor | None = None  # (k,) bool: no essential row (see kernel_of_rows)
    certified: torch.Tensor | None = None  # (k,) bool: its sample was peeled (core.peeling)
    certain_zero: torch.Tensor | None = None  # (k, rows) bool: entries below the noise floor
    #: (k,) bool: peeling refuted it, no sample's (core.peeling): not trusted, robust or not
    refuted: torch.Tensor | None = None
    #: the most exact zeros of a direction that the sparsity threshold alone dropped (0: none);
    #: far more than b - 1 says columns sparser than the threshold assumes may be there
    dropped_sparsest: int = 0

    def select(self, keep: torch.Tensor) -> SnapResult:
        """The directions where ``keep`` (bool or indices) holds."""

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[keep]

        return SnapResult(
            self.directions[keep],
            self.zero_masks[keep],
            self.zero_counts[keep],
            pick(self.robust),
            pick(self.certified),
            pick(self.certain_zero),
            pick(self.refuted),
            self.dropped_sparsest,
        )

    @staticmethod
    def concat(parts: list[SnapResult]) -> SnapResult:
        """One result of several (optional fields become None unless every part has them)."""

        def cat(name: str) -> torch.Tensor | None:
            values = [getattr(p, name) for p in parts]
            return None if any(v is None for v in values) else torch.cat(values)

        directions, masks, counts = cat("directions"), cat("zero_masks"), cat("zero_counts")
        assert directions is not None and masks is not None and counts is not None
        dropped = max((p.dropped_sparsest for p in parts), default=0)
        return SnapResult(
            directions,
            masks,
            counts,
            cat("robust"),
            cat("certified"),
            cat("certain_zero"),
            cat("refuted"),
            dropped,
        )


def snap_and_filter(
    L: torch.Tensor,
    directions: torch.Tensor,
    zero_hint: torch.Tensor | None,
    threshold_count: int | torch.Tensor,
    zero_rtol: float,
    hint_rtol: float = 1e-3,
    known_masks: torch.Tensor | None = None,
    zero_floor: float | None = None,
    rounding: torch.Tensor | None = None,
    deadline: Deadline = NEVER,
) -> SnapResult:
    """Make rough directions exact and keep those that pass the sparsity filter.

    1. The zero set is ``zero_hint`` (or, without a hint, the rows with
       ``|L q| <= hint_rtol max|L q|``; a direction that already has enough exact zeros skips 2).
    2. ``q`` is replaced by the kernel of those rows of L (LU for b-1 rows, else eigh).
    3. Directions whose ``L q`` has fewer than ``threshold_count`` exact zeros are dropped (one
       count for all, or one per hint: confirmed hints need only b - 1, see ``ProposalBatch``).
    4. The survivors with distinct zero sets not among ``known_masks`` (the pool's: the same
       exact zero set means the same direction) are re-solved by SVD on their full exact zero
       set (rejected unless that kernel is one-dimensional), counted once more, and flagged
       robust when no zero row is essential (mixtures never are; see ``kernel_of_rows``).

    ``zero_floor`` (default ``zero_rtol``) marks the entries that are certainly zero
    (``SnapResult.certain_zero``, see :mod:`spear.core.consistency`). ``rounding``: the factor's
    rounding map; entries within a direction's rounding floor count as zero too (the columns of
    samples whose gradient is faint, :func:`rounding_floor`). Once ``deadline`` has passed,
    the kernels left are not solved and nothing is returned: past its time budget an attack
    uses no snapped direction, so finishing the step would only overrun the budget.
    """
    b = L.shape[1]
    empty = SnapResult(
        torch.empty(0, b, dtype=L.dtype, device=L.device),
        torch.empty(0, L.shape[0], dtype=torch.bool, device=L.device),
        torch.empty(0, dtype=torch.long, device=L.device),
        torch.empty(0, dtype=torch.bool, device=L.device),
        certain_zero=torch.empty(0, L.shape[0], dtype=torch.bool, device=L.device),
    )
    if directions.shape[0] == 0:
        return empty
    # the hinted rows define the kernel; the rough direction only matters when there is no hint
    if zero_hint is None:
        assert not isinstance(threshold_count, torch.Tensor), "per-hint thresholds need hints"
        q = directions.to(L.dtype)
        q = q / q.norm(dim=1, keepdim=True).clamp_min(torch.finfo(L.dtype).tiny)
        exact = (
            zero_mask(q @ L.T, zero_rtol, rounding_floor(q, rounding, L.shape[0])).sum(dim=1)
            >= threshold_count
        )
        rows = zero_mask(q[~exact] @ L.T, hint_rtol)
        rows = rows[rows.sum(dim=1) >= b - 1]
        q = q[exact]  # already exact (e.g. solved in a subspace): no kernel step needed
    else:
        enough = zero_hint.sum(dim=1) >= b - 1
        q, rows = directions.new_empty(0, b).to(L.dtype), zero_hint[enough]
        if isinstance(threshold_count, torch.Tensor):
            threshold_count = threshold_count.to(enough.device)[enough]
    if rows.shape[0]:
        chunk = kernel_chunk(L.shape[0], b, SNAP_CHUNK_ELEMENTS)
        q = torch.cat([q, _first_kernel(L, rows, chunk, deadline)])
    # past the deadline nothing snapped is used (peeling and pooling stop there): what is left
    # of the work (zero sets of every direction, their exact re-solve) would only overrun it
    if q.shape[0] == 0 or deadline.passed():
        return empty
    rows = zero_mask(q @ L.T, zero_rtol, rounding_floor(q, rounding, L.shape[0]))
    if not isinstance(threshold_count, torch.Tensor):
        threshold_count = torch.full((q.shape[0],), threshold_count, device=rows.device)
    finite = torch.isfinite(q).all(dim=1)
    keep = finite & (rows.sum(dim=1) >= threshold_count)
    below = rows[finite & ~keep].sum(dim=1)
    empty = replace(empty, dropped_sparsest=int(below.max()) if below.numel() else 0)
    q, rows, threshold_count = q[keep], rows[keep], threshold_count[keep]
    # one exact re-solve per distinct zero set, none for directions already known
    fresh = first_occurrences(rows, known_masks)
    q, rows, threshold_count = q[fresh], rows[fresh], threshold_count[fresh]
    if q.shape[0] == 0:
        return empty
    # exact re-solve on the full zero set, with the one-dimensional-kernel check
    q, one_dim, robust = kernel_of_rows(L, rows, deadline)
    if deadline.passed():
        return empty
    values = q @ L.T
    rows = zero_mask(values, zero_rtol, rounding_floor(q, rounding, L.shape[0]))
    keep = one_dim & (rows.sum(dim=1) >= threshold_count)
    q, rows, robust, values = q[keep], rows[keep], robust[keep], values[keep]
    if q.shape[0] == 0:
        return empty
    certain = zero_mask(values, zero_rtol if zero_floor is None else zero_floor)
    return SnapResult(
        canonical_sign(q),
        rows,
        rows.sum(dim=1),
        robust,
        certain_zero=certain,
        dropped_sparsest=empty.dropped_sparsest,
    )


def take_pinned(
    L: torch.Tensor,
    directions: torch.Tensor,
    zero_rtol: float,
    known_masks: torch.Tensor | None = None,
    zero_floor: float | None = None,
) -> SnapResult:
    """Directions (k, b) that other evidence than their zero set pins (``ProposalBatch.pinned``),
    as snapped ones: no kernel step and no sparsity threshold. Their zero masks are counted as
    usual (the pool's duplicate check and the selection read them); they are robust (pinned),
    and those whose zero set the pool already knows are left out."""
    q = directions.to(L.dtype)
    q = q[torch.isfinite(q).all(dim=1)]
    q = q / q.norm(dim=1, keepdim=True).clamp_min(torch.finfo(L.dtype).tiny)
    values = q @ L.T
    masks = zero_mask(values, zero_rtol)
    fresh = first_occurrences(masks, known_masks)
    q, masks, values = q[fresh], masks[fresh], values[fresh]
    certain = zero_mask(values, zero_rtol if zero_floor is None else zero_floor)
    return SnapResult(
        canonical_sign(q),
        masks,
        masks.sum(dim=1),
        torch.ones(q.shape[0], dtype=torch.bool, device=masks.device),
        certain_zero=certain,
    )


def sparsest_first(indices: torch.Tensor, zero_counts: torch.Tensor) -> torch.Tensor:
    """``indices`` ordered by their ``zero_counts``, most zeros first (ties keep their order):
    among mixtures and true columns, the true ones are the sparse ones."""
    return indices[torch.sort(zero_counts[indices], descending=True, stable=True).indices]


@dataclass
class CandidatePool:
    """The deduplicated set C of exact candidate directions (Section 4.1, "Filtering Duplicates")."""

    batch_size: int
    rows: int
    dtype: torch.dtype = torch.float64
    device: torch.device | str = "cpu"
    untrusted_limit: int | None = None  # default 2 * batch_size
    #: directions at least this parallel are one (default ``DUPLICATE_COS``); a noisy gradient
    #: gives each column many slightly different zero sets, hence near-parallel copies
    duplicate_cos: float = 0.0
    directions: torch.Tensor = field(init=False)
    zero_masks: torch.Tensor = field(init=False)
    zero_counts: torch.Tensor = field(init=False)
    robust: torch.Tensor = field(init=False)
    certified: torch.Tensor = field(init=False)
    certain_zero: torch.Tensor = field(init=False)
    refuted: torch.Tensor = field(init=False)
    #: zero masks of rejected candidates (a sample that failed the model certificate): snapping
    #: skips them, so they never come back
    rejected_masks: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.directions = torch.empty(0, self.batch_size, dtype=self.dtype, device=self.device)
        self.zero_masks = torch.empty(0, self.rows, dtype=torch.bool, device=self.device)
        self.zero_counts = torch.empty(0, dtype=torch.long, device=self.device)
        self.robust = torch.empty(0, dtype=torch.bool, device=self.device)
        self.certified = torch.empty(0, dtype=torch.bool, device=self.device)
        self.refuted = torch.empty(0, dtype=torch.bool, device=self.device)
        self.certain_zero = torch.empty(0, self.rows, dtype=torch.bool, device=self.device)
        self.rejected_masks = torch.empty(0, self.rows, dtype=torch.bool, device=self.device)

    @property
    def known_masks(self) -> torch.Tensor:
        """Zero masks snapping need not solve again: the pool's and the rejected ones."""
        return torch.cat([self.zero_masks, self.rejected_masks])

    def reject(self, indices: list[int]) -> None:
        """Remove candidates for good (their masks join ``rejected_masks``)."""
        if not indices:
            return
        drop = torch.zeros(len(self), dtype=torch.bool, device=self.robust.device)
        drop[indices] = True
        self.rejected_masks = torch.cat([self.rejected_masks, self.zero_masks[drop]])
        self._keep(~drop)

    def _keep(self, keep: torch.Tensor) -> None:
        self.directions, self.zero_masks = self.directions[keep], self.zero_masks[keep]
        self.zero_counts, self.robust = self.zero_counts[keep], self.robust[keep]
        self.certified, self.certain_zero = self.certified[keep], self.certain_zero[keep]
        self.refuted = self.refuted[keep]

    @property
    def trusted_mask(self) -> torch.Tensor:
        """Certified candidates (its sample was peeled), and robust ones (no essential zero row)
        that peeling did not refute: in float32, whose zero band holds small active entries of
        a trained network, mixtures can be robust too (MNIST 6 x 500, 200 steps, layer 2,
        b = 64: 347 robust candidates that were no column, which the proposers deflated)."""
        return (self.robust & ~self.refuted) | self.certified

    @property
    def trusted(self) -> torch.Tensor:
        """The trusted candidates: what proposers deflate against and guide from."""
        return self.directions[self.trusted_mask]

    def __len__(self) -> int:
        return int(self.directions.shape[0])

    def add(self, snapped: SnapResult) -> int:
        """Add the directions not yet in the pool (up to sign); return how many were new.

        In order, each direction is a duplicate of the pool's most parallel one (the pool as it
        grows) when at least ``duplicate_cos`` parallel, and passes its certified flag to it;
        the others join at once, with one concatenation per field (a float32 step can bring
        thousands)."""
        n = snapped.directions.shape[0]
        sure = (
            torch.zeros(n, dtype=torch.bool, device=self.robust.device)
            if snapped.certified is None
            else snapped.certified.to(self.robust.device, torch.bool)
        )
        kept, match = self._first_new(snapped.directions)
        duplicate = match >= 0
        certain = snapped.zero_masks if snapped.certain_zero is None else snapped.certain_zero
        flags = torch.ones(n, dtype=torch.bool) if snapped.robust is None else snapped.robust
        wrong = torch.zeros(n, dtype=torch.bool) if snapped.refuted is None else snapped.refuted
        device = self.robust.device
        self.directions = torch.cat([self.directions, snapped.directions[kept]])
        self.zero_masks = torch.cat([self.zero_masks, snapped.zero_masks[kept]])
        self.zero_counts = torch.cat([self.zero_counts, snapped.zero_counts[kept]])
        self.certain_zero = torch.cat([self.certain_zero, certain[kept]])
        self.robust = torch.cat([self.robust, flags.to(device, torch.bool)[kept]])
        self.certified = torch.cat([self.certified, sure[kept]])
        self.refuted = torch.cat([self.refuted, wrong.to(device, torch.bool)[kept]])
        self.certified[match[duplicate & sure]] = True
        self._bound_untrusted()
        return int(kept.numel())

    def _first_new(self, directions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Which of ``directions`` (in order) are new, and for the others the pool index (after
        adding the new ones) of the direction they duplicate: (kept indices, match or -1).

        The rule is sequential: a direction is compared with the pool and with the new ones
        kept before it, and its match is the most parallel of those (ties: the pool's, then the
        earliest). It runs in blocks of ``DEDUP_BLOCK`` directions: the duplicates among
        everything kept before the block come from a :class:`_ParallelIndex` (only directions
        near in a few projections are compared), then the block's own Gram matrix is walked in
        order. A float32 step can bring 35,000 directions, nearly all distinct: comparing each
        with all those before it took 2.6 s (photos32, b = 64), past the attack's deadline."""
        n, before = directions.shape[0], len(self)
        threshold = self.duplicate_cos or DUPLICATE_COS
        index = _ParallelIndex(self.directions, directions, threshold)
        match = torch.full((n,), -1, dtype=torch.long, device=directions.device)
        kept = torch.empty(0, dtype=torch.long, device=directions.device)
        for start in range(0, n, DEDUP_BLOCK):
            block = torch.arange(start, min(n, start + DEDUP_BLOCK), device=directions.device)
            part_best, part_match = index.most_parallel(block)
            mine, part_match = _walk_block(
                directions[block], part_best, part_match, before + kept.numel(), threshold
            )
            match[block] = part_match
            index.insert(start + mine)
            kept = torch.cat([kept, start + mine])
        return kept, match

    def _bound_untrusted(self) -> None:
        """Keep at most ``untrusted_limit`` non-robust candidates, the sparsest: on image data
        thousands of mixtures can pass the filter and would make the greedy swap search
        (b x candidates score evaluations) the bottleneck; true columns among them are the sparse
        ones (a mixture's zeros are the intersection of its columns' zeros)."""
        limit = self.untrusted_limit if self.untrusted_limit is not None else 2 * self.batch_size
        untrusted = (~self.trusted_mask).nonzero()[:, 0]
        if untrusted.numel() <= limit:
            return
        drop = sparsest_first(untrusted, self.zero_counts)[limit:]
        # refuted ones leave for good: found again, they would be peeled again
        gone = drop[self.refuted[drop]]
        self.rejected_masks = torch.cat([self.rejected_masks, self.zero_masks[gone]])
        keep = torch.ones(len(self), dtype=torch.bool, device=self.robust.device)
        keep[drop] = False
        self._keep(keep)


class _ParallelIndex:
    """The pool's directions and the new ones kept so far, for :meth:`CandidatePool._first_new`:
    which of them are at least ``threshold`` parallel (up to sign) to a new direction.

    Two such directions ``u``, ``v`` are near in every projection: ``|a . (u -+ v)| <=
    |u -+ v| = sqrt(|u|^2 + |v|^2 -+ 2 u . v)``, at most ``radius`` for any unit axis ``a``. The
    directions are sorted by their first projection (a window of it is a contiguous run), the
    pairs in that window are screened by the other projections, and only the few left are
    compared exactly. Slots are the pool's indices, then ``before`` + rank of the kept new
    ones, as :meth:`~CandidatePool._first_new` reports matches."""

    def __init__(self, pool: torch.Tensor, new: torch.Tensor, threshold: float) -> None:
        self.threshold, self.before = threshold, pool.shape[0]
        self.vectors = torch.cat([pool.to(new), new])
        generator = torch.Generator().manual_seed(0)
        dim = new.shape[1]
        axes = torch.randn(dim, min(PARALLEL_AXES, dim), generator=generator, dtype=torch.float64)
        axes = torch.linalg.qr(axes)[0].to(new)
        self.keys = self.vectors @ axes
        largest = float(self.vectors.pow(2).sum(dim=1).amax()) if self.vectors.shape[0] else 0.0
        # rounding: of the computed |cos| a pair is judged by and of ``largest`` (inside the
        # root: a float32 pair at cos 1 - 2e-8 reads 1.0), and of the keys themselves
        rounding = 4 * dim * torch.finfo(new.dtype).eps * max(1.0, largest)
        spread = max(2.0 * largest - 2.0 * threshold, 0.0) + 4 * rounding
        self.radius = math.sqrt(spread) * (1 + 1e-6) + rounding
        self.rows = torch.arange(self.before, device=new.device)  # slot -> row of ``vectors``
        self.order = torch.argsort(self.keys[: self.before, 0])  # slots by first projection

    def insert(self, kept: torch.Tensor) -> None:
        """Index the new directions ``kept`` (positions among the new ones), in order."""
        if not kept.numel():
            return
        self.rows = torch.cat([self.rows, self.before + kept])
        self.order = torch.argsort(self.keys[self.rows, 0])

    def most_parallel(self, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For the new directions ``block`` (positions), the largest ``|cos|`` of at least
        ``threshold`` with an indexed direction and its slot (the first of ties), else -1."""
        best = torch.full((block.numel(),), -1.0, dtype=self.vectors.dtype, device=block.device)
        match = torch.full((block.numel(),), -1, dtype=torch.long, device=block.device)
        if not self.rows.numel():
            return best, match
        pairs = self._near_pairs(self.before + block)
        if pairs is None:  # a loose threshold (a very noisy gradient): every pair is near
            cos = (self.vectors[self.before + block] @ self.vectors[self.rows].T).abs()
            query, slot = torch.nonzero(cos >= self.threshold, as_tuple=True)
            cos = cos[query, slot]
        else:
            query, slot = pairs
            cos = (self.vectors[self.before + block[query]] * self.vectors[self.rows[slot]]).sum(dim=1).abs()
        if not query.numel():
            return best, match
        close = cos >= self.threshold
        query, slot, cos = query[close], slot[close], cos[close]
        best.scatter_reduce_(0, query, cos, reduce="amax")
        first = torch.full_like(match, self.rows.numel())
        top = cos == best[query]
        first.scatter_reduce_(0, query[top], slot[top], reduce="amin")
        found = best >= self.threshold
        return best, torch.where(found, first, match)

    def _near_pairs(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(query position, slot) of the indexed directions within ``radius`` of ``rows``'
        directions, or of their negatives, in every projection; None when the first
        projection's windows hold more than ``NEAR_PAIR_LIMIT`` pairs."""
        keys = self.keys[rows]
        ranked = self.keys[self.rows[self.order]]
        first = ranked[:, 0].contiguous()
        windows = []
        for sign in (1.0, -1.0):
            low = torch.searchsorted(first, sign * keys[:, 0] - self.radius)
            high = torch.searchsorted(first, sign * keys[:, 0] + self.radius, right=True)
            windows.append((sign, low, (high - low).clamp_min(0)))
        if sum(int(counts.sum()) for _, _, counts in windows) > NEAR_PAIR_LIMIT:
            return None
        queries, slots = [], []
        for sign, low, counts in windows:
            query = torch.repeat_interleave(torch.arange(rows.numel(), device=rows.device), counts)
            starts = torch.cumsum(counts, 0) - counts
            position = low[query] + torch.arange(query.numel(), device=rows.device) - starts[query]
            near = ((ranked[position, 1:] - sign * keys[query, 1:]).abs() <= self.radius).all(dim=1)
            queries.append(query[near])
            slots.append(self.order[position[near]])
        return torch.cat(queries), torch.cat(slots)


def _walk_block(
    part: torch.Tensor, best: torch.Tensor, match: torch.Tensor, offset: int, threshold: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`CandidatePool._first_new` within one block, in order. ``best``/``match``: each
    direction's most parallel earlier one outside the block; a direction kept here becomes
    pool index ``offset`` + its rank among the block's kept ones. Returns (kept positions,
    match or -1)."""
    cos = (part @ part.T).abs().cpu().numpy()
    best_np, match_np = best.cpu().numpy().copy(), match.cpu().numpy().copy()
    rank = np.full(part.shape[0], -1)  # pool offset of the kept ones, -1 for the others
    kept = 0
    for i in range(part.shape[0]):
        if kept:
            among = np.where(rank[:i] >= 0, cos[i, :i], -1.0)
            k = int(among.argmax())
            if among[k] > best_np[i]:
                best_np[i], match_np[i] = among[k], offset + rank[k]
        if best_np[i] < threshold:
            rank[i], match_np[i] = kept, -1
            kept += 1
    mine = torch.from_numpy(np.flatnonzero(rank >= 0)).to(part.device)
    return mine, torch.from_numpy(match_np).to(part.device)
