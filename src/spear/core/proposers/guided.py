"""Guided sampling (paper Section 6.3): sample rows that are likely zero for a missing column.

The rows where sample i's pre-activation ``Z_i = W x_i + b`` is most negative are inactive, so
they are zeros of column i of dL/dZ. Given guesses of inputs, random (b-1)-subsets of the
``pool_fraction * m`` most negative rows, and of all rows predicted negative, are proposed as
zero sets; the core solves each kernel exactly and keeps only exact directions.

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

from spear.core.proposers.base import (
    DirectionProposer,
    ProposalBatch,
    ProposalContext,
    hint_cost,
    orthogonal_complement,
    pool_subsets,
)
from spear.errors import InputError


class GuidedSampler(DirectionProposer):
    """Guided subsets of likely-zero rows.

    Args:
        guesses_per_call: input guesses per call.
        points_per_line: scales scanned on each random line through the complement.
        subsets_per_guess: random (b-1)-subsets drawn from each guess's pool.
        pool_fraction: pool size as a fraction of m.
        approximate_inputs: optional (k, n) approximate inputs; jittered copies are the guesses.
        jitter: relative noise added to approximate inputs for each guess.
    """

    name = "guided"

    def __init__(
        self,
        guesses_per_call: int = 256,
        subsets_per_guess: int = 4,
        points_per_line: int = 16,
        pool_fraction: float = 0.3,
        approximate_inputs: torch.Tensor | None = None,
        jitter: float = 0.05,
    ) -> None:
        self.guesses_per_call = guesses_per_call
        self.points_per_line = points_per_line
        self.subsets_per_guess = subsets_per_guess
        self.pool_fraction = pool_fraction
        self.approximate_inputs = approximate_inputs
        self.jitter = jitter

    def _guessed_preactivations(self, ctx: ProposalContext) -> torch.Tensor:
        """Guessed pre-activations Z (m x G), one column per guess."""
        problem = ctx.problem
        assert problem is not None
        R, W, bias = problem.R, problem.weight, problem.bias
        b, n = R.shape
        dtype, g = R.dtype, ctx.generator
        S = self.guesses_per_call
        if self.approximate_inputs is not None:
            approx = self.approximate_inputs.to(dtype)
            if approx.ndim != 2 or approx.shape[1] != n:
                raise InputError(f"approximate_inputs must be (k, {n}), got {tuple(approx.shape)}")
            base = approx[torch.randint(0, approx.shape[0], (S,), generator=g).to(approx.device)]
            noise = torch.randn(base.shape, generator=g, dtype=dtype).to(base.device) * base.norm(
                dim=1, keepdim=True
            )
            X = (base + self.jitter * noise / math.sqrt(n)).T
            return W @ X + bias[:, None]
        complement = orthogonal_complement(ctx.found.to(dtype), b)  # b x (b-k)
        # lines t * u through the complement; the predicted inactive set {t a_r + bias_r <= 0}
        # (a = W R^T u) changes only at the breakpoints t_r = -bias_r / a_r, so scanning the
        # midpoints between breakpoints covers every scale of the unknown input. With one
        # direction missing the line is exact and the scan contains its true zero set.
        per_line = self.points_per_line if complement.shape[1] > 1 else problem.weight.shape[0] + 1
        lines = max(1, S // per_line) if complement.shape[1] > 1 else 1
        u = complement @ torch.randn(complement.shape[1], lines, generator=g, dtype=dtype).to(R.device)
        a = W @ (R.T @ u)  # m x lines
        columns = []
        for j in range(lines):
            t = self._scan_points(a[:, j], bias, per_line, g)
            columns.append(t[None, :] * a[:, j : j + 1] + bias[:, None])
        return torch.cat(columns, dim=1)

    @staticmethod
    def _scan_points(a: torch.Tensor, bias: torch.Tensor, count: int, g: torch.Generator) -> torch.Tensor:
        """``count`` scales, one inside each of ``count`` (evenly spread) cells of the breakpoints."""
        brk = (-bias / a)[a.abs() > 0].sort().values
        if brk.numel() == 0:
            return torch.tensor([-1.0, 1.0], dtype=a.dtype, device=a.device)
        gaps = brk[1:] - brk[:-1]
        span = float(brk[-1] - brk[0]) or 1.0
        mids = torch.cat([brk[:1] - span, brk[:-1] + gaps / 2, brk[-1:] + span])
        if mids.numel() > count:
            idx = torch.linspace(0, mids.numel() - 1, count, device=a.device).round().long()
            mids = mids[idx]
        return mids

    def cost(self, ctx: ProposalContext) -> float:
        # the (b-1)-subsets, plus one eigh-snapped hint (m x b^2) per guess's whole inactive set
        guesses = self.guesses_per_call
        return hint_cost(ctx, guesses * self.subsets_per_guess) + guesses * ctx.rows * ctx.batch_size**2

    def propose(self, ctx: ProposalContext, max_proposals: int) -> ProposalBatch:
        problem = ctx.problem
        b, m = ctx.batch_size, ctx.rows
        if problem is None or problem.mode != "output" or ctx.L is not problem.L:
            raise InputError("guided sampling needs the output-sparsity layer problem (W, b)")
        Z = self._guessed_preactivations(ctx)  # m x G
        order = Z.T.argsort(dim=1)  # most negative rows first
        inactive = Z.T <= 0  # the rows each guess predicts to be zero (ReLU: Z <= 0)
        inactive_count = inactive.sum(dim=1)
        # two pools per guess: the most negative rows (reliable when the guess is rough), and all
        # rows predicted inactive (generic rows: the most negative ones of one sample are often
        # inactive for similar samples too, and a subset zero in two columns has a 2-D kernel)
        tight = min(m, max(b + 1, int(self.pool_fraction * m)))
        negative = inactive_count.clamp(min=tight, max=m)  # (G,)
        k = self.subsets_per_guess
        pool = torch.where(
            torch.arange(k, device=Z.device).repeat(order.shape[0]) % 2 == 0,
            tight,
            negative.repeat_interleave(k),
        )  # (G*k,)
        subsets = pool_subsets(order.repeat_interleave(k, dim=0), pool, b, m, ctx.generator)
        # plus the whole predicted-inactive set of each guess: when a guess is exact, this set has
        # a one-dimensional kernel even if nearly all its rows are also zero for a similar sample
        # (then few (b-1)-subsets of it work)
        hint = torch.cat([subsets, inactive[inactive_count >= b - 1]])
        directions = torch.zeros(hint.shape[0], b, dtype=ctx.L.dtype, device=ctx.L.device)  # hint = kernel
        return ProposalBatch(directions, n_drawn=int(hint.shape[0]), zero_hint=hint)
