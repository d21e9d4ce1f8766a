"""The default strategy: the cheapest proposer first, falling back and combining until done."""

from __future__ import annotations

from dataclasses import replace

from spear import theory
from spear.core.proposers.base import DirectionProposer, ProposalBatch, ProposalContext
from spear.core.proposers.guided import GuidedSampler
from spear.core.proposers.masked_subspace import MaskedSubspaceProposer
from spear.core.proposers.neurons import NeuronGuidedSampler
from spear.core.proposers.next_layer import NextLayerProposer
from spear.core.proposers.sampling import RandomSubmatrixSampler
from spear.core.proposers.sparse_recovery import SparseRecoveryProposer
from spear.core.proposers.vertices import VertexProposer
from spear.core.proposers.vertices import applicable as vertices_apply

#: Lemma 5.2 proposal count beyond which the random sampler is not worth its turns (b > ~45)
SAMPLING_HOPELESS = 1e12
#: cost-estimate equivalent of the fixed work of any call (snapping, sorting, bookkeeping)
CALL_OVERHEAD = 2e8


class AutoProposer(DirectionProposer):
    """Combines the proposers by what they are good at.

    * ``b <= sampling_only_below``: the paper's random sampler (milliseconds at this size), with
      every 4th call complement-guided sampling once a direction is known: it finds the least
      sparse columns that uniform sampling reaches only after millions of proposals. Where the
      next layer's gradient has zero sets, every 4th call (offset by two) is the next-layer
      proposer: the last samples of a trained hidden layer have columns with a quarter zeros,
      which took the sampler 9M proposals (MNIST, 6-layer MLP trained 200 steps, layer 2,
      b = 32: 227k with it). Where the layer above is a known narrow head, calls 3, 7, 15, 31,
      ... are the head's pattern search (:class:`MaskedSubspaceProposer`): it needs no zeros
      beyond the ReLU's, and its converged patterns pass below the threshold.
      A binary head (UCI Adult, a shallow network trained 100 steps, b = 3) gives columns
      whose differences are sparser than themselves, and the faint sample's column (90 zeros
      of 255 live rows) lay under the threshold of 94: 1M proposals for nothing, verified in
      0.06 s with it.
    * Otherwise a rotation, cheapest first, that stays with a proposer while it finds new
      directions, and moves on once its fruitless calls cost as much as one call of the most
      expensive proposer (:meth:`DirectionProposer.cost`), so stalled proposers share compute:
      next-layer zero sets (:class:`NextLayerProposer`, when the next layer's gradient is
      known), neuron-guided sampling (:class:`NeuronGuidedSampler`, approximate inputs from the
      gradient itself), complement-guided sampling (:class:`GuidedSampler`), then ICA + IRLS
      (:class:`SparseRecoveryProposer`). Every ``sampling_every``-th call is the random
      sampler, a safety net whose success does not depend on the other proposers' guesses, as
      long as Lemma 5.2 gives it a chance (up to b ~ 45).
      In input-sparsity mode the rotation is vertex descent (:class:`VertexProposer`, where the
      inputs are nonnegative) and IRLS, with the sampler as above (the guided proposers need W,
      b on the output side).

    With peeling (:mod:`spear.core.peeling`) the attack hands it residual problems of the
    samples not yet recovered; the rules above then apply to their smaller batch size, so the
    last samples go to the random sampler. Progress is judged by ``ctx.known``, which counts
    the directions of the whole attack.

    The paper's noise-robust sampler (:class:`NoisySubmatrixSampler`, ``proposer="noisy"``) is
    not in the schedule: on DP-noised gradients the schedule above, with near-parallel copies of
    a column counted once (:func:`spear.core.reconstruct.noisy_duplicate_cos`), recovers as much
    and faster (measured in the README's Protocols section).

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
        self.subspace = MaskedSubspaceProposer()
        self.vertices = VertexProposer()
        self.sampling_only_below = sampling_only_below
        self.sampling_every = sampling_every
        self._last_found = 0
        self._turn = 0
        self._current = 0  # index into the rotation
        self._stalled_work = 0.0  # estimated work of the current proposer's fruitless calls
        self._last_cost: float | None = None  # estimated work of the rotation's call, if last
        self._subspace_turn = 3  # the next turn for the pattern search when b is small

    def _rotation(self, ctx: ProposalContext) -> list[DirectionProposer]:
        """The proposers in order of cost."""
        if ctx.problem is None or ctx.problem.mode != "output":
            return [self.vertices, self.recovery] if vertices_apply(ctx) else [self.recovery]
        rotation: list[DirectionProposer] = []
        # first where it applies: slower than neurons where neurons suffices (LT MNIST b = 128:
        # 17 s instead of 3.4 s), but neurons' stalls cost far more where it does not
        # (Fashion-MNIST b = 128: all 128 columns in 75 s first, budget-bound at 240 s after)
        if self.subspace.has_work(ctx):
            rotation.append(self.subspace)
        if self._next_layer_applies(ctx):
            rotation.append(self.next_layer)
        return [*rotation, self.neurons, self.guided, self.recovery]

    def _next_layer_applies(self, ctx: ProposalContext) -> bool:
        """Whether the next layer's gradient is known here and has usable zero sets."""
        problem = ctx.problem
        if problem is None or problem.mode != "output" or problem.next_grad_weight is None:
            return False
        return self.next_layer.has_zero_sets(ctx)

    def propose(self, ctx: ProposalContext, max_proposals: int) -> ProposalBatch:
        self._turn += 1
        found = ctx.found.shape[0]
        guided_ok = ctx.problem is not None and ctx.problem.mode == "output" and found > 0
        if ctx.batch_size <= self.sampling_only_below:
            # sampling finds most columns in milliseconds; guided sampling takes the least sparse
            if guided_ok and self._turn % 4 == 0:
                return self.guided.propose(ctx, max_proposals)
            if self._turn >= self._subspace_turn and self.subspace.has_work(ctx):
                # pinned by the head: columns below the threshold (faint, trained, binary heads).
                # At turns 3, 7, 15, ... (or the next with work): a call can cost a hundred of
                # the sampler's, which finds most columns here, so its share shrinks as runs go on
                self._subspace_turn = 2 * self._turn + 1
                return replace(self.subspace.propose(ctx, max_proposals), exhausted=False)
            if self._turn % 4 == 2 and self._next_layer_applies(ctx):
                # a trained network's last columns can be too dense for sampling (a quarter
                # zeros: ~1e-6 per proposal at b = 11), not for the next layer's zero sets
                return replace(self.next_layer.propose(ctx, max_proposals), exhausted=False)
            return self.sampler.propose(ctx, max_proposals)
        known = max(found, ctx.known)  # found restarts on a residual problem; known does not
        progressed = known > self._last_found
        self._last_found = known
        sampling_useful = theory.expected_proposals(ctx.batch_size) <= SAMPLING_HOPELESS
        if sampling_useful and self._turn % self.sampling_every == 0:
            self._last_cost = None
            return self.sampler.propose(ctx, max_proposals)
        if self._last_cost is not None:  # judge the rotation's last call, not the sampler's
            self._stalled_work = 0.0 if progressed else self._stalled_work + self._last_cost
        rotation = self._rotation(ctx)
        costs = [p.cost(ctx) + CALL_OVERHEAD for p in rotation]
        # a stalled proposer keeps the turn until it has spent as much work as one call of the
        # most expensive one: when all stall, each gets the same compute
        if self._stalled_work > 0 and self._stalled_work >= max(costs):
            self._current += 1
            self._stalled_work = 0.0
        index = self._current % len(rotation)
        self._last_cost = costs[index]  # the estimate for this call, before it moves any cursor
        batch = rotation[index].propose(ctx, max_proposals)
        # one proposer running dry is not the end of the schedule: the rotation moves on
        return replace(batch, exhausted=False)
