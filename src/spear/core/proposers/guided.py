"""Guided sampling (paper Section 6.3): sample rows that are likely zero for a missing column.

The rows where sample i's pre-activation ``Z_i = W x_i + b`` is most negative are inactive, so
they are zeros of column i of dL/dZ. Given guesses of inputs, random (b-1)-subsets of the
``pool_fraction * m`` most negative rows are proposed as zero sets; the core solves each kernel
exactly and keeps only exact directions.

The guesses come from one of two places:

* **the complement of the found directions** (default, needs no prior): row i of ``Q^-1`` is
  orthogonal to every other column of Q (``Q^-1 Q = I``), so once k directions are known exactly,
  each missing input ``x_i = R^T p_i`` has ``p_i`` in the (b-k)-dimensional orthogonal complement
  of the found directions. Random points there are good guesses when b-k is small, which is
  exactly when IRLS stalls on the last, least sparse columns;
* **an approximate batch** the user supplies (``approximate_inputs``), e.g. from an
  optimization-based attack, as in the paper.
"""

from __future__ import annotations

import math

import torch

from spear.core.proposers.base import DirectionProposer, ProposalBatch, ProposalContext
from spear.errors import InputError


class GuidedSampler(DirectionProposer):
    """Guided subsets of likely-zero rows.

    Args:
        guesses_per_call: input guesses per call (each tried with both signs).
        subsets_per_guess: random (b-1)-subsets drawn from each guess's pool.
        pool_fraction: pool size as a fraction of m.
        approximate_inputs: optional (k, n) approximate inputs; jittered copies are the guesses.
        jitter: relative noise added to approximate inputs for each guess.
    """

    name = "guided"

    def __init__(
        self,
        guesses_per_call: int = 128,
        subsets_per_guess: int = 4,
        pool_fraction: float = 0.3,
        approximate_inputs: torch.Tensor | None = None,
        jitter: float = 0.05,
    ) -> None:
        self.guesses_per_call = guesses_per_call
        self.subsets_per_guess = subsets_per_guess
        self.pool_fraction = pool_fraction
        self.approximate_inputs = approximate_inputs
        self.jitter = jitter

    def _guesses(self, ctx: ProposalContext) -> torch.Tensor:
        """Input guesses X (n x S)."""
        problem = ctx.problem
        assert problem is not None
        R = problem.R
        b, n = R.shape
        dtype, g = R.dtype, ctx.generator
        S = self.guesses_per_call
        if self.approximate_inputs is not None:
            approx = self.approximate_inputs.to(dtype)
            if approx.ndim != 2 or approx.shape[1] != n:
                raise InputError(f"approximate_inputs must be (k, {n}), got {tuple(approx.shape)}")
            base = approx[torch.randint(0, approx.shape[0], (S,), generator=g)]
            noise = torch.randn(base.shape, generator=g, dtype=dtype) * base.norm(dim=1, keepdim=True)
            return (base + self.jitter * noise / math.sqrt(n)).T
        found = ctx.found.to(dtype)
        if found.shape[0]:
            _, _, Vh = torch.linalg.svd(found, full_matrices=True)
            complement = Vh[found.shape[0] :].T  # b x (b-k), orthonormal
        else:
            complement = torch.eye(b, dtype=dtype)
        p = complement @ torch.randn(complement.shape[1], S, generator=g, dtype=dtype)
        X = R.T @ p
        # inputs of unit feature variance, scale spread over a factor ~3 either way
        scale = math.sqrt(n) * torch.exp(0.5 * torch.randn(1, S, generator=g, dtype=dtype))
        return X / X.norm(dim=0, keepdim=True).clamp_min(1e-300) * scale

    def propose(self, ctx: ProposalContext, max_proposals: int) -> ProposalBatch:
        problem = ctx.problem
        b, m = ctx.batch_size, ctx.rows
        if problem is None or problem.mode != "output" or ctx.L is not problem.L:
            raise InputError("guided sampling needs the output-sparsity layer problem (W, b)")
        X = self._guesses(ctx)
        Z = problem.weight @ torch.cat([X, -X], dim=1) + problem.bias[:, None]  # m x 2S
        order = Z.T.argsort(dim=1)  # most negative rows first
        pool = min(m, max(b + 1, int(self.pool_fraction * m)))
        k = self.subsets_per_guess
        picks = torch.rand(order.shape[0] * k, pool, generator=ctx.generator).argsort(dim=1)[:, : b - 1]
        rows = order[:, :pool].repeat_interleave(k, dim=0).gather(1, picks)
        hint = torch.zeros(rows.shape[0], m, dtype=torch.bool)
        hint.scatter_(1, rows, True)
        directions = torch.zeros(rows.shape[0], b, dtype=ctx.L.dtype)  # the hint defines the kernel
        return ProposalBatch(directions, n_drawn=int(rows.shape[0]), zero_hint=hint)
