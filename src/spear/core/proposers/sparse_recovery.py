"""Polynomial-time proposers: sparse dictionary learning instead of exponential sampling.

SPEAR++-style: the columns of dL/dZ = L Q are the sparsest vectors in the column space of L, so
rough directions from ICA on the whitened rows of L (then random starts deflated against the
directions already found), refined by IRLS for ``min ||L q||_1`` on the sphere, land on (or next
to) true directions. Each refined direction is turned into *hints* for
the exact snapping stage: its near-exact zero set, the ``b + 1`` rows where ``|L q|`` is smallest,
and random (b-1)-subsets of the ``pool_fraction * m`` smallest rows (a few wrong rows in the pool
are then avoided by some subset: guided sampling, Section 6.3). The core re-solves every hint
exactly in float64 and keeps only directions with >= tau*m exact zeros, so approximate
directions never reach the output.
"""

from __future__ import annotations

import math

import torch

from spear.core.deadline import NEVER, Deadline
from spear.core.proposers.base import (
    DirectionProposer,
    ProposalBatch,
    ProposalContext,
    hint_cost,
    orthogonal_complement,
    pool_subsets,
    rows_to_mask,
)


def whiten(L: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``L = U T`` with orthonormal U (m x b) and invertible T (b x b): sparsity of ``L q`` equals
    sparsity of ``U p`` for ``p = T q``."""
    U, T = torch.linalg.qr(L)
    return U, T


def irls_sphere(
    U: torch.Tensor,
    starts: torch.Tensor,
    iterations: int = 80,
    shrink: float = 0.88,
    start_quantile: float = 0.5,
    solver: str = "eigh",
    deadline: Deadline = NEVER,
) -> torch.Tensor | None:
    """Batched IRLS with smoothing continuation for ``min ||U p||_1`` s.t. ``||p|| = 1``.

    Each step minimises ``sum_r w_r (U_r p)^2`` with ``w_r = 1 / sqrt((U_r p)^2 + delta^2)``,
    either under the linear constraint ``p_t^T p = 1`` (``solver="solve"``: one Cholesky
    solve, ``p ~ G^-1 p_t`` with ``G = U^T diag(w) U``, as in Spielman et al.'s and Qu et al.'s
    formulations; cheaper, but weaker on image data) or on the sphere (``solver="eigh"``, default: of
    the two smallest eigenvectors of G, the
    one closest to the iterate), then renormalises. ``delta`` starts at the ``start_quantile`` of
    ``|U p|`` and shrinks by ``shrink`` per step: the smoothed early steps see the global sparse
    structure instead of stalling at a vertex with only b-1 zeros, which plain IRLS
    (``delta`` ~ 0) does on image data. None once ``deadline`` passes between iterations (a
    wide layer's call takes seconds: the time budget is kept, the unfinished starts are lost).
    """
    p = starts / starts.norm(dim=1, keepdim=True)
    r = (p @ U.T).abs()
    delta = r.quantile(start_quantile, dim=1, keepdim=True)
    for _ in range(iterations):
        if deadline.passed():
            return None
        r = (p @ U.T).abs()
        w = 1.0 / torch.sqrt(r**2 + delta**2)
        gram = (U.T.unsqueeze(0) * w.unsqueeze(1)) @ U  # (S, b, b) = U^T diag(w) U
        if solver == "eigh":
            _, vecs = torch.linalg.eigh(gram)
            cand = vecs[:, :, :2]
            overlap = (cand * p.unsqueeze(-1)).sum(dim=1).abs()
            new = cand[torch.arange(p.shape[0], device=p.device), :, overlap.argmax(dim=1)]
        else:  # min sum w (U p)^2 s.t. p_t^T p = 1: p ~ G^-1 p_t (one Cholesky solve)
            chol, info = torch.linalg.cholesky_ex(gram)
            new = torch.cholesky_solve(p.unsqueeze(-1), chol).squeeze(-1)
            new = torch.where((info == 0).unsqueeze(-1) & torch.isfinite(new), new, p)
        sign = torch.where((new * p).sum(dim=1, keepdim=True) < 0, -1.0, 1.0).to(new.dtype)
        p = new * sign / new.norm(dim=1, keepdim=True)
        delta = torch.maximum(delta * shrink, 1e-13 * r.amax(dim=1, keepdim=True))
    return p


def fast_ica(
    X: torch.Tensor,
    generator: torch.Generator,
    iterations: int = 200,
    contrast: str = "logcosh",
    tol: float = 1e-7,
    deadline: Deadline = NEVER,
) -> torch.Tensor:
    """Symmetric FastICA on white data X (samples x b); returns the unmixing rows (b x b),
    orthonormal at every iteration: past ``deadline`` the current ones (IRLS refines them as
    starts, or stops at once itself)."""
    b = X.shape[1]
    W = torch.linalg.qr(torch.randn(b, b, generator=generator, dtype=X.dtype).to(X.device))[0]
    for _ in range(iterations):
        if deadline.passed():
            break
        Y = X @ W.T
        if contrast == "logcosh":
            g, dg = torch.tanh(Y), 1 - torch.tanh(Y) ** 2
        else:  # "exp"
            e = torch.exp(-(Y**2) / 2)
            g, dg = Y * e, (1 - Y**2) * e
        W_new = g.T @ X / X.shape[0] - dg.mean(dim=0)[:, None] * W
        s, u = torch.linalg.eigh(W_new @ W_new.T)
        W_new = u @ torch.diag(s.clamp_min(1e-300).rsqrt()) @ u.T @ W_new
        converged = float((torch.diag(W_new @ W.T).abs() - 1).abs().max()) < tol
        W = W_new
        if converged:
            break
    return W


class SparseRecoveryProposer(DirectionProposer):
    """ICA + IRLS + guided snapping hints (polynomial time per call).

    Args:
        starts_per_call: IRLS starts refined per call, at most.
        work_per_call: fewer starts on large layers, so that starts x m x b^2 (the cost of one
            IRLS iteration) stays below this; at least 8 starts.
        iterations: IRLS iterations.
        ica_restarts: FastICA runs (alternating logcosh / exp contrasts) whose components are the
            first starts. Later calls alternate FastICA restricted to the whitened complement
            of the directions already found (deflation) with random starts in that complement.
        pool_fraction: size of the guided-sampling pool, as a fraction of m.
        subsets_per_direction: random (b-1)-subsets of the pool tried per refined direction.
    """

    name = "irls"

    def __init__(
        self,
        starts_per_call: int = 64,
        work_per_call: float = 6.4e8,
        iterations: int = 80,
        ica_restarts: int = 4,
        pool_fraction: float = 0.3,
        subsets_per_direction: int = 4,
    ) -> None:
        self.starts_per_call = starts_per_call
        self.work_per_call = work_per_call
        self.iterations = iterations
        self.ica_restarts = ica_restarts
        self.pool_fraction = pool_fraction
        self.subsets_per_direction = subsets_per_direction
        self._key: int | None = None
        self._queue: list[torch.Tensor] = []
        self._calls = 0

    def starts_for(self, m: int, b: int) -> int:
        """Starts per call on an m x b factor (see ``work_per_call``)."""
        return int(min(self.starts_per_call, max(8, self.work_per_call // (m * b * b))))

    def _prepare(self, ctx: ProposalContext) -> None:
        if self._key == ctx.key:
            return
        self._key = ctx.key
        self.U, self.T = whiten(ctx.L)
        X = self.U * math.sqrt(self.U.shape[0])  # white: unit variance per coordinate
        self._queue = [
            fast_ica(X, ctx.generator, contrast="logcosh" if i % 2 == 0 else "exp", deadline=ctx.deadline)
            for i in range(self.ica_restarts)
        ]

    def _complement(self, ctx: ProposalContext) -> torch.Tensor | None:
        """Orthonormal basis (b x (b-k)) of the whitened complement of the found directions."""
        b, k = ctx.batch_size, ctx.found.shape[0]
        if k == 0 or k >= b:
            return None
        # the found directions in whitened coordinates
        return orthogonal_complement(ctx.found.to(self.U.dtype) @ self.T.T, b)

    def _starts(self, ctx: ProposalContext, count: int) -> torch.Tensor:
        b = ctx.batch_size
        parts, have = [], 0
        while self._queue and have < count:
            comp = self._queue.pop(0)
            parts.append(comp)
            have += comp.shape[0]
        if have < count:
            basis = self._complement(ctx)
            self._calls += 1
            if basis is not None and basis.shape[1] >= 2 and self._calls % 2 == 0:
                # deflated ICA: FastICA on the whitened rows projected onto the complement
                W_c = fast_ica(
                    self.U @ basis * math.sqrt(self.U.shape[0]),
                    ctx.generator,
                    contrast="logcosh" if self._calls % 4 == 0 else "exp",
                    deadline=ctx.deadline,
                )
                parts.append(W_c @ basis.T)
                have += W_c.shape[0]
            if have < count:
                rand = torch.randn(count - have, b, generator=ctx.generator, dtype=self.U.dtype).to(
                    self.U.device
                )
                if basis is not None:  # random starts deflated against the found directions
                    rand = (rand @ basis) @ basis.T
                parts.append(rand)
        starts = torch.cat(parts)
        if starts.shape[0] > count:  # the rest of an ICA run waits for the next call
            self._queue.insert(0, starts[count:])
        return starts[:count]

    def cost(self, ctx: ProposalContext) -> float:
        m, b = ctx.rows, ctx.batch_size
        starts = self.starts_for(m, b)
        irls = starts * self.iterations * (m * b * b + 4 * b**3)
        return irls + hint_cost(ctx, starts * (2 + self.subsets_per_direction))

    def propose(self, ctx: ProposalContext, max_proposals: int) -> ProposalBatch:
        self._prepare(ctx)
        U, T = self.U, self.T
        m, b = U.shape
        starts = self._starts(ctx, self.starts_for(m, b))
        # IRLS only has to land near a direction (snapping is exact, in float64): draft it in the
        # proposal dtype, 2-3x faster in float32
        drafted = irls_sphere(
            U.to(ctx.proposal_dtype), starts.to(ctx.proposal_dtype), self.iterations, deadline=ctx.deadline
        )
        if drafted is None:  # the time budget ran out mid-call
            return ProposalBatch(torch.empty(0, b, dtype=U.dtype, device=U.device), n_drawn=0)
        p = drafted.to(U.dtype)
        q = torch.linalg.solve_triangular(T, p.T, upper=True).T  # back to L coordinates
        q = q / q.norm(dim=1, keepdim=True)
        if ctx.found.shape[0]:  # skip directions already in the pool
            known = (q @ ctx.found.T.to(q.dtype)).abs().amax(dim=1) > 0.999
            q, p = q[~known], p[~known]
        if q.shape[0] == 0:
            return ProposalBatch(torch.empty(0, b, dtype=U.dtype, device=U.device), n_drawn=starts.shape[0])
        r = (p @ U.T).abs()
        order = r.argsort(dim=1)
        hints, dirs = [], []
        # 1) the near-exact zero set; 2) the b + 1 smallest rows
        near = r <= 1e-7 * r.amax(dim=1, keepdim=True)
        hints += [near, rows_to_mask(order[:, : min(m, b + 1)], m)]
        dirs += [q, q]
        # 3) guided sampling: random (b-1)-subsets of the pool of smallest rows
        pool = max(b + 1, int(self.pool_fraction * m))
        if pool > b - 1 and self.subsets_per_direction > 0:
            repeated = order.repeat_interleave(self.subsets_per_direction, dim=0)
            hints.append(pool_subsets(repeated, pool, b, m, ctx.generator))
            dirs.append(q.repeat_interleave(self.subsets_per_direction, dim=0))
        hint = torch.cat(hints)
        directions = torch.cat(dirs)
        enough = hint.sum(dim=1) >= b - 1
        return ProposalBatch(directions[enough], n_drawn=int(hint.shape[0]), zero_hint=hint[enough])
