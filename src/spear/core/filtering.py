"""Exact acceptance of proposals: snapping, the sparsity filter and deduplication (Section 4.1).

Whatever a proposer returns, a direction enters the candidate pool only after it was re-solved
in float64 as the one-dimensional kernel of the rows where ``L q`` vanishes, and only if ``L q``
then has at least ``tau * m`` zeros. Mixtures of true directions (whose zero sets are the
intersections of two columns' zero sets) have a two-dimensional kernel there or too few zeros,
and are rejected. Approximate directions never reach the output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: default relative magnitude below which an entry of ``L q`` counts as an exact zero
DEFAULT_ZERO_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4}
#: smallest ratio s_{b-1} / s_1 of the zero rows for the kernel to count as one-dimensional
KERNEL_GAP_RTOL = 1e-7
#: two unit directions with |cos| above this are the same direction
DUPLICATE_COS = 1.0 - 1e-9


def zero_mask(values: torch.Tensor, zero_rtol: float) -> torch.Tensor:
    """Entries of each row of ``values`` (k x rows) that are zero relative to the row's max."""
    magnitude = values.abs()
    return magnitude <= magnitude.amax(dim=-1, keepdim=True) * zero_rtol


def _kernel_of_rows(L: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Smallest right singular vector of ``L[rows_i]`` for each mask ``rows_i`` (k x m), and
    whether that kernel is one-dimensional. Masked-out rows are zeroed, which changes neither
    the right singular vectors nor the nonzero singular values."""
    masked = L.unsqueeze(0) * rows.unsqueeze(-1).to(L.dtype)  # (k, m, b)
    _, S, Vh = torch.linalg.svd(masked, full_matrices=False)
    kernel = Vh[:, -1, :]
    one_dimensional = S[:, -2] > KERNEL_GAP_RTOL * S[:, 0]
    return kernel, one_dimensional


@dataclass
class SnapResult:
    """Exact directions that passed the filter, with their zero masks and counts."""

    directions: torch.Tensor  # (k, b) unit vectors, float64
    zero_masks: torch.Tensor  # (k, rows) bool
    zero_counts: torch.Tensor  # (k,) int


def snap_and_filter(
    L: torch.Tensor,
    directions: torch.Tensor,
    zero_hint: torch.Tensor | None,
    threshold_count: int,
    zero_rtol: float,
    hint_rtol: float = 1e-3,
) -> SnapResult:
    """Make rough directions exact and keep those that pass the sparsity filter.

    1. The zero set is ``zero_hint`` (or the rows with ``|L q| <= hint_rtol max|L q|``).
    2. ``q`` is replaced by the kernel of those rows of L (rejected unless one-dimensional).
    3. The exact zero set of the new ``L q`` (``zero_rtol``) is computed; the kernel is solved
       once more on it, and the direction is kept iff it has >= ``threshold_count`` zeros.
    """
    b = L.shape[1]
    empty = SnapResult(
        torch.empty(0, b, dtype=L.dtype, device=L.device),
        torch.empty(0, L.shape[0], dtype=torch.bool, device=L.device),
        torch.empty(0, dtype=torch.long, device=L.device),
    )
    if directions.shape[0] == 0:
        return empty
    q = directions.to(L.dtype)
    rows = zero_hint if zero_hint is not None else zero_mask(q @ L.T, hint_rtol)
    enough = rows.sum(dim=1) >= b - 1
    q, rows = q[enough], rows[enough]
    for _ in range(2):  # snap on the hinted rows, then once more on the exact zero set
        if q.shape[0] == 0:
            return empty
        q, one_dim = _kernel_of_rows(L, rows)
        rows = zero_mask(q @ L.T, zero_rtol)
        keep = one_dim & (rows.sum(dim=1) >= threshold_count)
        q, rows = q[keep], rows[keep]
    if q.shape[0] == 0:
        return empty
    # canonical sign: the largest-magnitude entry is positive
    pivot = q.abs().argmax(dim=1, keepdim=True)
    q = q * torch.sign(q.gather(1, pivot))
    return SnapResult(q, rows, rows.sum(dim=1))


@dataclass
class CandidatePool:
    """The deduplicated set C of exact candidate directions (Section 4.1, "Filtering Duplicates")."""

    batch_size: int
    rows: int
    dtype: torch.dtype = torch.float64
    device: torch.device | str = "cpu"
    directions: torch.Tensor = field(init=False)
    zero_masks: torch.Tensor = field(init=False)
    zero_counts: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.directions = torch.empty(0, self.batch_size, dtype=self.dtype, device=self.device)
        self.zero_masks = torch.empty(0, self.rows, dtype=torch.bool, device=self.device)
        self.zero_counts = torch.empty(0, dtype=torch.long, device=self.device)

    def __len__(self) -> int:
        return int(self.directions.shape[0])

    def add(self, snapped: SnapResult) -> int:
        """Add the directions not yet in the pool (up to sign); return how many were new."""
        added = 0
        for i in range(snapped.directions.shape[0]):
            q = snapped.directions[i]
            if len(self) and (self.directions @ q).abs().max() >= DUPLICATE_COS:
                continue
            self.directions = torch.cat([self.directions, q[None]])
            self.zero_masks = torch.cat([self.zero_masks, snapped.zero_masks[i : i + 1]])
            self.zero_counts = torch.cat([self.zero_counts, snapped.zero_counts[i : i + 1]])
            added += 1
        return added
