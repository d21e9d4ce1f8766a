"""The default strategy: the cheapest proposer first, falling back and combining until done."""

from __future__ import annotations

from spear import theory
from spear.core.proposers.base import DirectionProposer, ProposalBatch, ProposalContext
from spear.core.proposers.guided import GuidedSampler
from spear.core.proposers.neurons import NeuronGuidedSampler
from spear.core.proposers.next_layer import NextLayerProposer
from spear.core.proposers.sampling import RandomSubmatrixSampler
from spear.core.proposers.sparse_recovery import SparseRecoveryProposer

#: Lemma 5.2 proposal count beyond which the random sampler is not worth its turns (b > ~45)
SAMPLING_HOPELESS = 1e12


class AutoProposer(DirectionProposer):
    """Combines the proposers by what they are good at.

    * ``b <= sampling_only_below``: the paper's random sampler (milliseconds at this size), with
      every 4th call complement-guided sampling once a direction is known: it finds the least
      sparse columns that uniform sampling reaches only after millions of proposals.
    * Otherwise a rotation, cheapest first, that stays with a proposer until it stalls (a whole
      pass over its zero sets or neurons, or one call of the others, without a new direction):
      next-layer zero sets (:class:`NextLayerProposer`, when the next layer's gradient is
      known), neuron-guided sampling (:class:`NeuronGuidedSampler`, approximate inputs from the
      gradient itself), complement-guided sampling (:class:`GuidedSampler`), then ICA + IRLS
      (:class:`SparseRecoveryProposer`). Every ``sampling_every``-th call is the random
      sampler, a safety net whose success does not depend on the other proposers' guesses, as
      long as Lemma 5.2 gives it a chance (up to b ~ 45).
      In input-sparsity mode only IRLS and the sampler apply (the guided proposers need W, b on
      the output side).

    The schedule depends only on what was found, never on timing, so runs are reproducible.
    """

    name = "auto"

    def __init__(
        self, chunk_size: int = 4096, sampling_only_below: int = 14, sampling_every: int = 6
    ) -> None:
        self.sampler = RandomSubmatrixSampler(chunk_size)
        self.neurons = NeuronGuidedSampler()
        self.next_layer = NextLayerProposer()
        self.guided = GuidedSampler()
        self.recovery = SparseRecoveryProposer()
        self.sampling_only_below = sampling_only_below
        self.sampling_every = sampling_every
        self._last_found = 0
        self._turn = 0
        self._current = 0  # index into the rotation
        self._stalls = 0  # consecutive calls of the current proposer that found nothing
        self._rotation_called = False  # whether the previous call was the rotation's

    def _rotation(self, ctx: ProposalContext) -> list[tuple[DirectionProposer, int]]:
        """The proposers in order of cost, each with its patience (stalled calls before moving on)."""
        if ctx.problem is None or ctx.problem.mode != "output":
            return [(self.recovery, 1)]
        rotation: list[tuple[DirectionProposer, int]] = []
        if ctx.problem.next_grad_weight is not None:
            passes = self.next_layer.calls_per_pass(ctx)
            if self.next_layer.zero_sets:
                rotation.append((self.next_layer, passes))
        rotation.append((self.neurons, self.neurons.calls_per_pass(ctx)))  # a whole pass
        return [*rotation, (self.guided, 1), (self.recovery, 1)]

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
        sampling_useful = theory.expected_proposals(ctx.batch_size) <= SAMPLING_HOPELESS
        if sampling_useful and self._turn % self.sampling_every == 0:
            self._rotation_called = False
            return self.sampler.propose(ctx, max_proposals)
        rotation = self._rotation(ctx)
        if self._rotation_called:  # judge the rotation's last call, not the sampler's
            self._stalls = 0 if progressed else self._stalls + 1
        if self._stalls >= rotation[self._current % len(rotation)][1]:
            self._current += 1  # the current proposer stalled: the next one's turn
            self._stalls = 0
        self._rotation_called = True
        return rotation[self._current % len(rotation)][0].propose(ctx, max_proposals)
