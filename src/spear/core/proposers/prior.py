"""SPEAR with an optimization prior (paper Section 6.3, Table 5): the default schedule, with every
other call given to guided sampling around an approximate batch, e.g. the output of an
optimization attack (:class:`spear.baselines.GeipingAttack`). The approximations only steer
which zero sets are tried; every proposal is still solved and checked exactly, so a poor prior
costs proposals, never exactness.
"""

from __future__ import annotations

import torch

from spear.core.proposers.auto import AutoProposer
from spear.core.proposers.base import DirectionProposer, ProposalBatch, ProposalContext
from spear.core.proposers.guided import GuidedSampler


class PriorGuidedProposer(DirectionProposer):
    """Alternates :class:`GuidedSampler` around ``approximate_inputs`` ((k, n) rough inputs of
    the attacked layer) with :class:`AutoProposer`. Outside the output-sparsity mode, where
    guided sampling does not apply, it is the default schedule."""

    name = "prior"

    def __init__(self, approximate_inputs: torch.Tensor, every: int = 2) -> None:
        self.prior = GuidedSampler(approximate_inputs=approximate_inputs)
        self.auto = AutoProposer()
        self.every = every
        self._turn = 0

    def cost(self, ctx: ProposalContext) -> float:
        return max(self.prior.cost(ctx), self.auto.cost(ctx))

    def propose(self, ctx: ProposalContext, max_proposals: int) -> ProposalBatch:
        self._turn += 1
        guided = ctx.problem is not None and ctx.problem.mode == "output" and ctx.L is ctx.problem.L
        if guided and self._turn % self.every == 1 % self.every:
            return self.prior.propose(ctx, max_proposals)
        return self.auto.propose(ctx, max_proposals)
