"""The paper's proposer: kernels of random (b-1)-row submatrices of L (Algorithm 1, lines 4-5)."""

from __future__ import annotations

import math

import torch

from spear.core.linalg import solve_ex
from spear.core.proposers.base import DirectionProposer, ProposalBatch, ProposalContext, hint_cost

#: relative magnitude below which an entry of ``L q`` counts as zero in the fast pre-filter
PREFILTER_RTOL = {torch.float32: 1e-3, torch.float64: 1e-7}


#: rows the pre-filter looks at in wide layers
PREFILTER_ROWS = 128


def prefilter_count(threshold_count: int, rows: int, checked: int) -> int:
    """Zeros a proposal needs among ``checked`` of ``rows`` rows to survive the pre-filter.

    A true direction has >= ``threshold_count`` zeros (else the exact filter rejects it anyway),
    so its zeros among ``checked`` random rows are hypergeometric with mean
    ``checked * threshold_count / rows``; 0.6 of that mean lies 3.4 (m = 2000) to 5.6 (m = 200)
    standard deviations below it for ``checked = 128`` even at the threshold itself, and columns
    with the usual ~50% zeros are further away. A rejection only delays a direction: the rows
    are drawn afresh every chunk. The default m <= 128 checks all rows against 0.9 of the exact
    threshold (float32 rounding can hide a few zeros).
    """
    if checked >= rows:
        return math.floor(0.9 * threshold_count)
    return math.floor(0.6 * checked * threshold_count / rows)


def prefilter(L: torch.Tensor, q: torch.Tensor, ctx: ProposalContext, zero_rtol: float) -> torch.Tensor:
    """Which proposals ``q`` (k x b) have enough near-zero entries of ``L q`` (below ``zero_rtol``
    of their largest) to be worth snapping, judged on a fresh random subset of rows: cheap for
    wide layers, and no column can be rejected systematically because the subset changes every
    chunk. Non-finite proposals (a singular system) never pass."""
    rows = L.shape[0]
    if rows > PREFILTER_ROWS:
        subset = torch.randperm(rows, generator=ctx.generator)[:PREFILTER_ROWS].to(L.device)
        L_check = L[subset]
    else:
        L_check = L
    magnitude = (q @ L_check.T).abs()
    peak = magnitude.amax(dim=1, keepdim=True)
    zeros = (magnitude <= peak * zero_rtol).sum(dim=1, dtype=torch.int32)
    needed = prefilter_count(ctx.threshold_count, rows, L_check.shape[0])
    return (zeros >= needed) & torch.isfinite(peak[:, 0])


def hinted_batch(q: torch.Tensor, idx: torch.Tensor, keep: torch.Tensor, rows: int) -> ProposalBatch:
    """The kept proposals with their sampled row sets as exact zero hints (Theorem 3.4: the
    kernel of ``L_A`` is the direction)."""
    kept_idx = idx[keep]
    hint = torch.zeros(kept_idx.shape[0], rows, dtype=torch.bool, device=q.device)
    hint.scatter_(1, kept_idx, True)
    return ProposalBatch(directions=q[keep], n_drawn=int(idx.shape[0]), zero_hint=hint)


def sample_row_subsets(rows: int, k: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` uniformly random k-subsets of ``range(rows)``, as a (count, k) index tensor.

    Each random permutation of the rows is cut into ``rows // k`` consecutive blocks of k: every
    block is a uniformly random k-subset, and one argsort yields many of them. (Blocks of one
    permutation are disjoint, hence not independent; each proposal is still uniform, which is all
    Lemma 5.1 uses, and disjointness only avoids re-drawing the same rows.)
    """
    blocks = rows // k
    perms = math.ceil(count / blocks)
    order = torch.rand(perms, rows, generator=generator).argsort(dim=1)
    return order[:, : blocks * k].reshape(perms * blocks, k)[:count]


class RandomSubmatrixSampler(DirectionProposer):
    """Kernels of random (b-1)-row submatrices ``L_A`` of L, vectorized over a chunk.

    For each sampled row set A it solves ``L_A[:, :b-1] y = -L_A[:, b-1]`` (batched LU), so
    ``q = (y, 1)`` spans ``ker(L_A)`` (Theorem 3.4), then counts the near-zero entries of ``L q``
    and returns only proposals with at least ``0.9 * tau * m`` of them. The pre-filter runs in
    ``ctx.proposal_dtype``; the core re-solves survivors exactly in float64 on the same rows A.

    Args:
        chunk_size: proposals per vectorized step (memory ~ chunk * (b^2 + 2 m) numbers).
    """

    name = "sampling"

    def __init__(self, chunk_size: int = 4096) -> None:
        if chunk_size < 1:
            raise ValueError("chunk_size must be positive")
        self.chunk_size = chunk_size
        self._cache_key: tuple | None = None
        self._L_cast: torch.Tensor | None = None

    def _cast(self, ctx: ProposalContext) -> torch.Tensor:
        key = (ctx.key, ctx.proposal_dtype)
        if key != self._cache_key:
            self._L_cast = ctx.L.to(ctx.proposal_dtype)
            self._cache_key = key
        assert self._L_cast is not None
        return self._L_cast

    def cost(self, ctx: ProposalContext) -> float:
        return hint_cost(ctx, self.chunk_size)

    def propose(self, ctx: ProposalContext, max_proposals: int) -> ProposalBatch:
        L = self._cast(ctx)
        rows, b = L.shape
        count = max(1, min(self.chunk_size, max_proposals))
        idx = sample_row_subsets(rows, b - 1, count, ctx.generator).to(L.device)
        L_A = L[idx]  # (k, b-1, b)
        y, _ = solve_ex(L_A[:, :, : b - 1], -L_A[:, :, b - 1 :])
        q = torch.cat([y.squeeze(-1), torch.ones(y.shape[0], 1, dtype=L.dtype, device=L.device)], dim=1)
        keep = prefilter(L, q, ctx, PREFILTER_RTOL.get(L.dtype, 1e-3))  # a singular L_A: inf/nan
        return hinted_batch(q, idx, keep, rows)
