"""The paper's proposer: kernels of random (b-1)-row submatrices of L (Algorithm 1, lines 4-5)."""

from __future__ import annotations

import math

import torch

from spear.core.proposers.base import DirectionProposer, ProposalBatch, ProposalContext

#: relative magnitude below which an entry of ``L q`` counts as zero in the fast pre-filter
PREFILTER_RTOL = {torch.float32: 1e-3, torch.float64: 1e-7}


def _distinct_tuple_acceptance(rows: int, k: int) -> float:
    """Probability that k uniform draws from ``rows`` indices are pairwise distinct."""
    return math.exp(sum(math.log1p(-i / rows) for i in range(k)))


def sample_row_subsets(rows: int, k: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """Uniformly random k-subsets of ``range(rows)``, as an (<= count, k) index tensor.

    Draws k indices with replacement and keeps the tuples whose indices are all distinct: that is
    exactly uniform over k-subsets and far cheaper than a permutation per row. When most tuples
    would collide (k close to sqrt(rows) or beyond), it uses the top-k of uniform noise instead.
    May return fewer than ``count`` rows; callers count what they got.
    """
    if _distinct_tuple_acceptance(rows, k) >= 0.25:
        idx = torch.randint(0, rows, (count, k), generator=generator)
        ordered, _ = idx.sort(dim=1)
        distinct = (ordered[:, 1:] != ordered[:, :-1]).all(dim=1)
        return idx[distinct]
    return torch.rand(count, rows, generator=generator).topk(k, dim=1).indices


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
        key = (id(ctx.L), ctx.proposal_dtype)
        if key != self._cache_key:
            self._L_cast = ctx.L.to(ctx.proposal_dtype)
            self._cache_key = key
        assert self._L_cast is not None
        return self._L_cast

    def propose(self, ctx: ProposalContext, max_proposals: int) -> ProposalBatch:
        L = self._cast(ctx)
        rows, b = L.shape
        count = max(1, min(self.chunk_size, max_proposals))
        idx = sample_row_subsets(rows, b - 1, count, ctx.generator).to(L.device)
        L_A = L[idx]  # (k, b-1, b)
        y, _ = torch.linalg.solve_ex(L_A[:, :, : b - 1], -L_A[:, :, b - 1 :])
        q = torch.cat([y.squeeze(-1), torch.ones(y.shape[0], 1, dtype=L.dtype, device=L.device)], dim=1)
        magnitude = (q @ L.T).abs()
        rtol = PREFILTER_RTOL.get(L.dtype, 1e-3)
        zero = magnitude <= magnitude.amax(dim=1, keepdim=True) * rtol
        keep = zero.sum(dim=1) >= math.floor(0.9 * ctx.threshold_count)
        keep &= torch.isfinite(q).all(dim=1)
        # the exact hint is the sampled row set A itself: ker(L_A) is the direction (Theorem 3.4)
        kept_idx = idx[keep]
        hint = torch.zeros(kept_idx.shape[0], rows, dtype=torch.bool, device=L.device)
        hint.scatter_(1, kept_idx, True)
        return ProposalBatch(directions=q[keep], n_drawn=int(idx.shape[0]), zero_hint=hint)
