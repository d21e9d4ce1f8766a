"""The default strategy: the cheapest proposer first, falling back and combining until done."""

from __future__ import annotations

from spear.core.proposers.base import DirectionProposer, ProposalBatch, ProposalContext
from spear.core.proposers.guided import GuidedSampler
from spear.core.proposers.sampling import RandomSubmatrixSampler
from spear.core.proposers.sparse_recovery import SparseRecoveryProposer


class AutoProposer(DirectionProposer):
    """Combines the proposers by what they are good at.

    * ``b <= sampling_only_below``: the paper's random sampler (milliseconds at this size), with
      every 4th call complement-guided sampling once a direction is known: it finds the least
      sparse columns that uniform sampling reaches only after millions of proposals.
    * Otherwise ICA + IRLS (:class:`SparseRecoveryProposer`) while it finds new directions; when
      it stalls, complement-guided sampling (:class:`GuidedSampler`) for the remaining columns,
      alternating with IRLS, and every ``sampling_every``-th call the random sampler as a safety
      net whose cost does not depend on IRLS's basins. In input-sparsity mode guided sampling is
      unavailable and IRLS alternates with random sampling.
    """

    name = "auto"

    def __init__(
        self, chunk_size: int = 4096, sampling_only_below: int = 14, sampling_every: int = 6
    ) -> None:
        self.sampler = RandomSubmatrixSampler(chunk_size)
        self.recovery = SparseRecoveryProposer()
        self.guided = GuidedSampler()
        self.sampling_only_below = sampling_only_below
        self.sampling_every = sampling_every
        self._last_found = 0
        self._turn = 0

    def propose(self, ctx: ProposalContext, max_proposals: int) -> ProposalBatch:
        self._turn += 1
        found = ctx.found.shape[0]
        guided_ok = ctx.problem is not None and ctx.problem.mode == "output" and found > 0
        if ctx.batch_size <= self.sampling_only_below:
            # sampling finds most columns in milliseconds; guided sampling takes the least sparse
            if guided_ok and self._turn % 4 == 0:
                return self.guided.propose(ctx, max_proposals)
            return self.sampler.propose(ctx, max_proposals)
        progressed = found > self._last_found
        self._last_found = found
        if self._turn % self.sampling_every == 0:
            return self.sampler.propose(ctx, max_proposals)
        if progressed or self._turn == 1:  # IRLS keeps the turn while it finds new directions
            return self.recovery.propose(ctx, max_proposals)
        if guided_ok and self._turn % 2 == 0:
            return self.guided.propose(ctx, max_proposals)
        return self.recovery.propose(ctx, max_proposals)
