"""The paper's noise-robust sampler (App. E.6): kernels of random (b+1)-row submatrices of L.

A noisy gradient (DP-SGD's Gaussian noise) blurs the exact zeros of dL/dZ: the kernel of b-1
rows, solved exactly, carries the noise amplified by their conditioning. With b+1 rows the
direction is the least-squares kernel of an overdetermined system (the smallest right singular
vector of ``L_A``), and the *rank filter* keeps only row sets whose ``L_A`` is numerically of rank
b-1 (its smallest singular value well below the next): exactly the sets drawn from one column's
zero set (Theorem 3.3), whatever the noise did to the others. The pre-filter counts zeros at the
noise-widened threshold (``ctx.zero_rtol``). The core then re-solves every survivor on its whole
zero set by SVD (:mod:`spear.core.filtering`), which averages the noise over ~m/2 rows.
"""

from __future__ import annotations

import torch

from spear.core.proposers.base import DirectionProposer, ProposalBatch, ProposalContext, hint_cost
from spear.core.proposers.sampling import PREFILTER_RTOL, hinted_batch, prefilter, sample_row_subsets

#: the rank filter: the smallest singular value of ``L_A`` must be below this fraction of the
#: second smallest (the paper keeps "matrices L_A of rank exactly b-1")
RANK_GAP = 0.05
#: rows beyond b-1 (the paper: b+1 rows, two more than the exact sampler's b-1)
EXTRA_ROWS = 2


class NoisySubmatrixSampler(DirectionProposer):
    """Least-squares kernels of random (b-1+``extra_rows``)-row submatrices with the rank filter.

    Args:
        chunk_size: proposals per vectorized step (a batched SVD of (b+1) x b matrices each).
        extra_rows: rows beyond b-1 (2: the paper's b+1).
        rank_gap: the rank filter's ratio s_b / s_(b-1) of ``L_A``.
    """

    name = "noisy"

    def __init__(
        self, chunk_size: int = 2048, extra_rows: int = EXTRA_ROWS, rank_gap: float = RANK_GAP
    ) -> None:
        if chunk_size < 1 or extra_rows < 1 or not 0 < rank_gap < 1:
            raise ValueError("chunk_size and extra_rows must be positive, rank_gap in (0, 1)")
        self.chunk_size, self.extra_rows, self.rank_gap = chunk_size, extra_rows, rank_gap

    def cost(self, ctx: ProposalContext) -> float:
        return hint_cost(ctx, self.chunk_size)

    def propose(self, ctx: ProposalContext, max_proposals: int) -> ProposalBatch:
        L = ctx.L.to(ctx.proposal_dtype)
        rows, b = L.shape
        k = min(rows, b - 1 + self.extra_rows)
        count = max(1, min(self.chunk_size, max_proposals))
        idx = sample_row_subsets(rows, k, count, ctx.generator).to(L.device)
        _, S, Vh = torch.linalg.svd(L[idx], full_matrices=False)  # (count, k, b) -> S (count, b)
        q = Vh[:, -1, :]
        # the rank filter: L_A of rank b-1 (one direction: nothing to filter)
        gap = S[:, -2] if b > 1 else torch.full_like(S[:, 0], float("inf"))
        ranked = S[:, -1] <= self.rank_gap * gap
        # zeros at the noise-widened band, but never below what the proposal dtype can resolve
        zero_rtol = max(ctx.zero_rtol, PREFILTER_RTOL.get(L.dtype, 1e-3))
        keep = ranked & prefilter(L, q, ctx, zero_rtol) & torch.isfinite(q).all(dim=1)
        return hinted_batch(q, idx, keep, rows)
