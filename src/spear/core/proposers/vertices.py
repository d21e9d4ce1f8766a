"""Nonnegative inputs are vertices: linear programs over the cone of the input space.

With input sparsity (Section 3.2) the samples are the columns of ``X = L Q`` up to scale, and
when the layer is preceded by a ReLU (or reads raw [0, 1] pixels) they are also *nonnegative*.
Every sample then lies in the polyhedral cone ``{L q >= 0}``, and on the slice
``P = {L q >= 0, 1^T L q = 1}`` it is a vertex: its zero features are tight constraints, and a
sample with at least b - 1 of them spanning the rank (Theorem 3.3's condition) is the only point
of ``P`` where all of them vanish. What sets the samples apart from the other vertices of ``P``
is *degeneracy*: a generic vertex has exactly b - 1 zero features, a sample has all of its own
(a hidden layer's input has about half its features zero: 242 of 500 against b - 1 = 63 at
b = 64). A linear program with a random objective lands on some vertex of ``P``; near a sample
(in its face lattice) most features of the vertex are small.

The proposer therefore minimizes a *capped* l1 norm over ``P`` by linear programs: starting from
a random vertex, each step gives weight 1 to the features below ``cap`` times the median
positive feature and (almost) none to the others, and solves again, until the vertex repeats.
Since ``1^T x = 1`` on ``P``, this pushes the vertex's mass into a few large features and the
rest to zero: it converges to samples (MNIST 6 x 500 MLP, layer 2, b = 64: 30 of 30 starts land
on a sample, 24 distinct ones), where plain l1 on the sphere (:mod:`sparse_recovery`) lands near
none. Each converged vertex gives hints for the exact snapping stage: its near-exact zero set,
its b - 1 smallest features, and random (b-1)-subsets of its smallest features (guided sampling,
Section 6.3). A vertex that is not a sample costs a few solves, never correctness: every hint
is re-solved exactly and filtered (Section 4.1).

Found samples need no deflation here: with the model certificate the attack peels them off
(:mod:`spear.core.input_peeling`) and the residual problem has none of them; without it, random
objectives still spread the starts over the vertices.
"""

from __future__ import annotations

import os
import sys

import highspy
import numpy as np
import torch

from spear.core.proposers.base import (
    DirectionProposer,
    ProposalBatch,
    ProposalContext,
    hint_cost,
    pool_subsets,
    rows_to_mask,
)
from spear.errors import InputError

#: weight of the features above the cap: small, not zero, so that every solve stays bounded
FREE_WEIGHT = 1e-3
#: a vertex's feature at most this times its largest is an exact zero (true zeros of a
#: degenerate vertex come back at rounding level), or at most the gradient's ``zero_rtol`` where
#: that is larger (float32: the samples lie off the rounded factor's span by about that)
ZERO_RTOL = 1e-9
#: a vertex with this many times b - 1 zeros ends its descent: a sample (hidden layers' inputs
#: have 2.5-4 times b - 1 at b = 64, trained or not). Raw MNIST pixels, whose background zeros
#: many samples share, have vertices that are not samples with 1.1-1.2 times b - 1 (b = 128,
#: 256): stopping at any vertex beyond a generic one's b - 1 ended every start there
DEGENERATE = 1.5
#: cost-estimate equivalent of one linear program per row and column of the factor: a cold
#: solve takes a few hundred pivots, a warm one (the same slice, new costs) tens
LP_WORK_PER_ENTRY = 2e3


def applicable(ctx: ProposalContext) -> bool:
    """Input-sparsity problems without noise: the searched factor holds the inputs themselves."""
    problem = ctx.problem
    return problem is not None and problem.mode == "input" and not ctx.noisy


_BANNER = [True]  # HiGHS prints its banner to the process's stdout once, at the first Highs()


def _highs() -> highspy.Highs:
    """A silent HiGHS instance. Its one-time banner goes to file descriptor 1 from C++, past
    Python's ``sys.stdout``: it would land in the CLI's JSON output, so it is sent to devnull."""
    if not _BANNER[0]:
        solver = highspy.Highs()
    else:
        sys.stdout.flush()
        saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, 1)
            solver = highspy.Highs()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
            os.close(devnull)
        _BANNER[0] = False
    solver.setOptionValue("output_flag", False)
    solver.setOptionValue("threads", 1)
    return solver


class SliceLP:
    """Linear programs over the slice ``P = {L q >= 0, 1^T L q = 1}`` of one factor L (n x b).

    One HiGHS model per factor: only the objective changes between solves, so each solve starts
    from the last optimal basis, which is still feasible (a few pivots instead of hundreds).
    Rows are equilibrated (each row of L divided by its largest entry): the same vertices,
    better-scaled pivots.
    """

    def __init__(self, L: np.ndarray) -> None:
        scale = np.abs(L).max(axis=1)
        self.scale = np.where(scale > 0, scale, 1.0)
        self.A = L / self.scale[:, None]
        n, b = self.A.shape
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = b, n + 1
        lp.col_cost_ = np.zeros(b)
        lp.col_lower_ = np.full(b, -highspy.kHighsInf)
        lp.col_upper_ = np.full(b, highspy.kHighsInf)
        lp.row_lower_ = np.r_[np.zeros(n), 1.0]
        lp.row_upper_ = np.r_[np.full(n, highspy.kHighsInf), 1.0]
        matrix = np.vstack([self.A, (self.scale @ self.A)[None]])  # the last row: 1^T L q = 1
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = np.arange(0, (n + 1) * b + 1, n + 1, dtype=np.int32)
        lp.a_matrix_.index_ = np.tile(np.arange(n + 1, dtype=np.int32), b)
        lp.a_matrix_.value_ = np.ascontiguousarray(matrix.T).reshape(-1)
        self.solver = _highs()
        self.solver.passModel(lp)
        self.columns = np.arange(b, dtype=np.int32)

    def inputs(self, q: np.ndarray) -> np.ndarray:
        """``L q``, in the factor's own units."""
        return (self.A @ q) * self.scale

    def vertex(self, weights: np.ndarray) -> np.ndarray | None:
        """The q of the vertex of P minimizing ``weights . L q``; None when P is empty (no
        nonnegative direction: the inputs are signed) or the solve fails."""
        self.solver.changeColsCost(self.columns.size, self.columns, (weights * self.scale) @ self.A)
        self.solver.run()
        if self.solver.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return None
        return np.array(self.solver.getSolution().col_value)


class VertexProposer(DirectionProposer):
    """Capped-l1 vertex descent over ``{L q >= 0, 1^T L q = 1}`` (module doc).

    Args:
        starts_per_call: random starting objectives per call.
        max_steps: reweighted solves per start, at most (the vertex usually repeats within 3-6).
        cap: features below ``cap`` times the median positive feature carry weight 1.
        pool_factors: guided-sampling pool sizes, as multiples of b, cycled over the subsets.
        subsets_per_vertex: random (b-1)-subsets of the pool per converged vertex.
    """

    name = "vertices"

    def __init__(
        self,
        starts_per_call: int = 4,
        max_steps: int = 15,
        cap: float = 2.0,
        pool_factors: tuple[float, ...] = (1.3, 1.6, 2.0),
        subsets_per_vertex: int = 24,
    ) -> None:
        if starts_per_call < 1 or max_steps < 1 or cap <= 0 or not pool_factors or subsets_per_vertex < 0:
            raise InputError(
                "VertexProposer needs starts_per_call, max_steps >= 1, cap > 0 and non-empty pool_factors"
            )
        self.starts_per_call = starts_per_call
        self.max_steps = max_steps
        self.cap = cap
        self.pool_factors = pool_factors
        self.subsets_per_vertex = subsets_per_vertex
        self._key: int | None = None
        self._infeasible = False

    def _prepare(self, ctx: ProposalContext) -> None:
        if self._key == ctx.key:
            return
        if ctx.problem is None or ctx.problem.mode != "input":
            raise InputError(
                "vertex descent needs nonnegative inputs on the searched side: use sparsity='input' "
                "or another proposer"
            )
        self._key = ctx.key
        self._lp = SliceLP(ctx.L.to(torch.float64).cpu().numpy())
        self._infeasible = False

    def cost(self, ctx: ProposalContext) -> float:
        m, b = ctx.rows, ctx.batch_size
        solves = self.starts_per_call * self.max_steps / 2
        hints = self.starts_per_call * (2 + self.subsets_per_vertex)
        return solves * LP_WORK_PER_ENTRY * m * b + hint_cost(ctx, hints)

    def _descend(self, weights: np.ndarray, ctx: ProposalContext) -> np.ndarray | None:
        """Capped-l1 steps from the vertex of ``weights`` until the vertex repeats or has
        ``DEGENERATE`` times a generic vertex's b - 1 zeros; its q."""
        zero = max(ZERO_RTOL, ctx.zero_rtol)
        q = self._lp.vertex(weights)
        for _ in range(self.max_steps):
            if q is None or ctx.deadline.passed():
                return q
            x = self._lp.inputs(q)
            positive = x[x > zero * x.max()]
            if positive.size == 0 or x.size - positive.size >= DEGENERATE * (ctx.batch_size - 1):
                return q
            small = x < self.cap * np.median(positive)
            step = self._lp.vertex(np.where(small, 1.0, FREE_WEIGHT))
            if step is None or np.allclose(step, q, rtol=1e-9, atol=1e-12 * np.abs(q).max()):
                return q if step is None else step
            q = step
        return q

    def propose(self, ctx: ProposalContext, max_proposals: int) -> ProposalBatch:
        self._prepare(ctx)
        b, m = ctx.batch_size, ctx.rows
        empty = torch.empty(0, b, dtype=ctx.L.dtype, device=ctx.L.device)
        if self._infeasible:
            return ProposalBatch(empty, n_drawn=1, exhausted=True)
        vertices = []
        for _ in range(self.starts_per_call):
            if ctx.deadline.passed():
                break
            noise = torch.randn(m, generator=ctx.generator, dtype=torch.float64).numpy()
            q = self._descend(noise, ctx)
            if q is None:  # no nonnegative direction at all: these inputs are not nonnegative
                self._infeasible = not vertices
                break
            vertices.append(q)
        if not vertices:
            return ProposalBatch(empty, n_drawn=1, exhausted=self._infeasible)
        q = torch.as_tensor(np.stack(vertices), dtype=ctx.L.dtype, device=ctx.L.device)
        x = q @ ctx.L.T
        x = x / x.abs().amax(dim=1, keepdim=True)
        order = x.argsort(dim=1)
        hints = [x <= max(ZERO_RTOL, ctx.zero_rtol), rows_to_mask(order[:, : b - 1], m)]
        for t in range(self.subsets_per_vertex):
            pool = min(m, max(b, int(self.pool_factors[t % len(self.pool_factors)] * b)))
            hints.append(pool_subsets(order, pool, b, m, ctx.generator))
        hint = torch.cat(hints)
        directions = q.repeat(len(hints), 1)
        enough = hint.sum(dim=1) >= b - 1
        return ProposalBatch(directions[enough], n_drawn=int(hint.shape[0]), zero_hint=hint[enough])
