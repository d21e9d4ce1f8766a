"""Neuron-guided sampling: the server's own gradient yields approximate inputs (Section 6.3).

Section 6.3 of the paper guides the sampler with an approximate reconstruction of the batch;
this proposer gets one from the gradient itself, with no optimization and no prior. In the
notation of Theorem 3.3 (``dL/dZ = L Q``, ``X^T = Q^-1 R``), write ``p_j`` for row j of
``Q^-1`` so that sample j is ``x_j = R^T p_j`` with pre-activations ``Z_j = p_j R W^T + b``.
Then

* row i of L is ``L_i = sum_j (dL/dZ)_ij p_j``: a combination of the samples that activate
  neuron i only (the others have ``(dL/dZ)_ij = 0``), and
* ``L_i . s = (dL/db)_i`` for ``s = L^+ dL/db = Q 1`` (Theorem 3.6), since ``p_j . s = 1``.

So ``L_i / (L_i . s)``, the server's ``(dL/dW)_i / (dL/db)_i`` in input space, is an affine
combination of the inputs that activate neuron i: a *virtual sample*. Neurons active for few
samples give virtual samples close to a true one, whose most negative pre-activations are rows
that are zero in one column of dL/dZ. Their ``b - 1`` most negative rows, and random
(b-1)-subsets of a slightly larger pool, are proposed as zero sets; the core solves and checks
each one exactly.

Once k directions ``q_j`` are known, the coefficient of sample j in any ``p`` is ``p . q_j``
(``Q^-1 Q = I``), so projecting the virtual samples onto the orthogonal complement of the found
directions removes the recovered samples from them (renormalized to ``p . s = 1``). The virtual
samples then concentrate on the missing samples, and each round finds more.
"""

from __future__ import annotations

import torch

from spear.core.linalg import solve_ex
from spear.core.proposers.base import (
    DirectionProposer,
    ProposalBatch,
    ProposalContext,
    hint_cost,
    pool_subsets,
    rows_to_mask,
)
from spear.errors import InputError

#: a virtual sample whose ``|p . s|`` is below this (relative to ``|p| |s|``) has no usable scale
DEGENERATE_SCALE_RTOL = 1e-8
#: a deflated virtual sample shorter than this (relative to the neuron's row of L) is zero
DEFLATED_NOISE_RTOL = 1e-9


class NeuronGuidedSampler(DirectionProposer):
    """Guided sampling from the per-neuron virtual samples ``L_i / (L_i . s)``.

    Each call takes the next ``neurons_per_call`` neurons of a seeded permutation (so a call
    costs about the same at any width), deflates their virtual samples against the directions
    found so far, and proposes per neuron the ``b - 1`` most negative rows plus
    ``subsets_per_neuron`` random (b-1)-subsets of the ``pool_factors[t] * b`` most negative rows.
    After a full pass over the neurons the next pass uses the next of ``scales`` (the virtual
    sample times a factor: a deflated combination's weights need not sum to one).

    Args:
        neurons_per_call: virtual samples per call.
        subsets_per_neuron: random subsets per virtual sample and call.
        pool_factors: pool sizes, as multiples of b, cycled over the subsets.
        scales: factors applied to the virtual samples, one per pass.
    """

    name = "neurons"

    def __init__(
        self,
        neurons_per_call: int = 512,
        subsets_per_neuron: int = 2,
        pool_factors: tuple[float, ...] = (1.1, 1.3),
        scales: tuple[float, ...] = (1.0, 0.5, 2.0),
    ) -> None:
        if neurons_per_call < 1 or subsets_per_neuron < 0 or not pool_factors or not scales:
            raise InputError("NeuronGuidedSampler needs neurons_per_call >= 1 and non-empty pools/scales")
        self.neurons_per_call = neurons_per_call
        self.subsets_per_neuron = subsets_per_neuron
        self.pool_factors = pool_factors
        self.scales = scales
        self._key: int | None = None
        self._order = torch.empty(0, dtype=torch.long)
        self._cursor = 0
        self._pass = 0

    def _prepare(self, ctx: ProposalContext) -> None:
        if self._key == ctx.key:
            return
        problem = ctx.problem
        if problem is None or problem.mode != "output" or ctx.L is not problem.L:
            raise InputError(
                "neuron-guided sampling needs the output-sparsity layer problem (W, b, dL/db): "
                "use sparsity='output' or another proposer"
            )
        self._key = ctx.key
        self._gram = ctx.L.T @ ctx.L
        norms = ctx.L.norm(dim=1)
        live = (norms > 1e-12 * norms.max()).nonzero()[:, 0]  # dead neurons carry no sample
        perm = torch.randperm(live.numel(), generator=ctx.generator).to(live.device)
        self._order = live[perm]
        self._cursor = 0
        self._pass = 0

    def cost(self, ctx: ProposalContext) -> float:
        self._prepare(ctx)
        neurons = min(self.neurons_per_call, max(1, self._order.numel()))
        return hint_cost(ctx, neurons * (1 + self.subsets_per_neuron))

    def _next_neurons(self) -> torch.Tensor:
        if self._cursor >= self._order.numel():
            self._cursor = 0
            self._pass += 1
        chunk = self._order[self._cursor : self._cursor + self.neurons_per_call]
        self._cursor += chunk.numel()
        return chunk

    def virtual_preactivations(
        self, ctx: ProposalContext, neurons: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Pre-activations (G x m) of the deflated virtual samples of ``neurons``."""
        self._prepare(ctx)
        problem = ctx.problem
        assert problem is not None
        L, s = ctx.L, problem.pinv_grad_bias
        rows = L[neurons]
        u = rows
        if ctx.found.shape[0]:
            # drop the recovered samples: u . q_j = 0 for every found q_j. The projection runs
            # along G F (G = L^T L, the metric in which the columns of dL/dZ are compared),
            # where the remaining samples' weights change least: the columns of dL/dZ are
            # nearly orthogonal there
            F = ctx.found.to(L.dtype).T  # b x k
            GF = self._gram @ F
            gram, rhs = F.T @ GF, GF.T
            coefficients, info = solve_ex(gram, rhs)
            if int(info):  # found directions that are linearly dependent (two copies of one
                # float32 column): the projection onto their span, through the pseudo-inverse
                coefficients = torch.linalg.pinv(gram, hermitian=True) @ rhs
            u = u - (u @ F) @ coefficients
        weight_sum = u @ s
        usable = weight_sum.abs() > DEGENERATE_SCALE_RTOL * u.norm(dim=1) * s.norm()
        # a neuron whose samples were all recovered leaves only rounding noise
        usable &= u.norm(dim=1) > DEFLATED_NOISE_RTOL * rows.norm(dim=1)
        u = u[usable] * (scale / weight_sum[usable])[:, None]
        return u @ problem.R_Wt + problem.bias

    def propose(self, ctx: ProposalContext, max_proposals: int) -> ProposalBatch:
        self._prepare(ctx)
        b, m = ctx.batch_size, ctx.rows
        neurons = self._next_neurons()
        Z = self.virtual_preactivations(ctx, neurons, self.scales[self._pass % len(self.scales)])
        if Z.shape[0] == 0:  # every virtual sample degenerate: count them, so budgets still end
            empty = torch.empty(0, b, dtype=ctx.L.dtype, device=ctx.L.device)
            return ProposalBatch(empty, n_drawn=max(1, neurons.numel()), exhausted=self._order.numel() == 0)
        order = Z.argsort(dim=1)[:, : min(m, int(max(self.pool_factors) * b) + 1)]  # most negative first
        hints = [rows_to_mask(order[:, : b - 1], m)]
        for t in range(self.subsets_per_neuron):
            pool = min(order.shape[1], max(b, int(self.pool_factors[t % len(self.pool_factors)] * b)))
            hints.append(pool_subsets(order, pool, b, m, ctx.generator))
        hint = torch.cat(hints)[: max(1, max_proposals)]
        directions = torch.zeros(hint.shape[0], b, dtype=ctx.L.dtype, device=ctx.L.device)  # hint = kernel
        return ProposalBatch(directions, n_drawn=int(hint.shape[0]), zero_hint=hint)
