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
positive feature and (almost) none to the others, and solves again, until the vertex repeats
or has ``DEGENERATE`` times b - 1 zeros.
Since ``1^T x = 1`` on ``P``, this pushes the vertex's mass into a few large features and the
rest to zero: it converges to samples (MNIST 6 x 500 MLP, layer 2, b = 64, seed 1: 29-30 of 30
starts land on a sample, 22-24 distinct ones, for caps of 1.5-2.5), where plain l1 on the sphere
(:mod:`sparse_recovery`) lands near none. Raw MNIST pixels (the first layer) are harder: their
background zeros, shared by many samples, make vertices that are not samples but have more than
b - 1 zeros; at b = 64 every start still lands on a sample, at b = 128 one in six, at b = 256 none.
Each converged vertex gives hints for the exact snapping stage: its near-exact zero set,
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
import threading

import highspy
import numpy as np
import torch

from spear import checks
from spear.core.deadline import NEVER, Deadline
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


_BANNER_LOCK = threading.Lock()
_BANNER = [True]  # HiGHS prints its banner to the process's stdout once, at the first Highs()


def _highs() -> highspy.Highs:
    """A silent HiGHS instance. Its one-time banner goes to file descriptor 1 from C++, past
    Python's ``sys.stdout``: it would land in the CLI's JSON output, so it is sent to devnull
    (where file descriptor 1 is open; a daemon without one has nothing to protect)."""
    with _BANNER_LOCK:
        if _BANNER[0]:
            _BANNER[0] = False
            solver = _quietly(highspy.Highs)
        else:
            solver = highspy.Highs()
    solver.setOptionValue("output_flag", False)
    solver.setOptionValue("threads", 1)
    # primal simplex: a new objective leaves the last optimal basis primal feasible, so the
    # primal method starts from it where the dual one must first repair dual feasibility
    # (measured: 37 against 62 ms per solve at m = 1000, b = 128)
    solver.setOptionValue("simplex_strategy", 4)
    return solver


def _quietly(make):
    """``make()`` with file descriptor 1 sent to devnull, where there is one to redirect."""
    stream = sys.stdout
    if stream is not None and not getattr(stream, "closed", False):
        stream.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no file descriptor 1 (a daemon): nothing reaches a stdout
        return make()
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        return make()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


class SliceLP:
    """Linear programs over the slice ``P = {L q >= 0, 1^T L q = 1}`` of one factor L (n x b).

    One HiGHS model per factor: only the objective changes between solves, so each solve starts
    from the last optimal basis, which is still feasible (a few pivots instead of hundreds).
    Rows are equilibrated (each row of L divided by its largest entry): the same vertices,
    better-scaled pivots. Rows at most ``dead_rtol`` of the largest are features zero in every
    sample (a residual problem's features of the peeled samples alone): rounding noise, which
    equilibrated would become random constraints that cut the samples off, so they are left out
    (``live``).
    """

    def __init__(self, L: np.ndarray, dead_rtol: float = ZERO_RTOL) -> None:
        scale = np.abs(L).max(axis=1)
        self.live = scale > dead_rtol * scale.max(initial=0.0)
        self.scale = np.where(self.live, scale, 1.0)
        self.A = np.where(self.live[:, None], L, 0.0) / self.scale[:, None]
        self.infeasible = False  # no nonnegative direction at all: the inputs are signed
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

    def vertex(self, weights: np.ndarray, deadline: Deadline = NEVER) -> np.ndarray | None:
        """The q of the vertex of P minimizing ``weights . L q``; None when the solve fails, P is
        empty (``infeasible``), or ``deadline`` passes first (HiGHS stops the solve there: a cold
        solve of a wide factor takes ~0.5 s, m = 1000, b = 256)."""
        left = deadline.seconds_left()
        if left is not None:
            if left <= 0:
                return None
            # HiGHS's time limit counts the instance's whole run time, over every solve
            self.solver.setOptionValue("time_limit", self.solver.getRunTime() + left)
        self.solver.changeColsCost(self.columns.size, self.columns, (weights * self.scale) @ self.A)
        self.solver.run()
        status = self.solver.getModelStatus()
        if status != highspy.HighsModelStatus.kOptimal:
            self.infeasible |= status == highspy.HighsModelStatus.kInfeasible
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
        if not (checks.finite_real(cap) and cap > 0) or not pool_factors:
            raise InputError(
                f"VertexProposer needs a finite cap > 0 and pool factors, got {cap!r}, {pool_factors!r}"
            )
        if not all(checks.finite_real(f) and f >= 1 for f in pool_factors):
            raise InputError(
                f"VertexProposer's pool factors are multiples of b, at least 1: got {pool_factors!r}"
            )
        self.starts_per_call = checks.integer("starts_per_call", starts_per_call, 1)
        self.max_steps = checks.integer("max_steps", max_steps, 1)
        self.subsets_per_vertex = checks.integer("subsets_per_vertex", subsets_per_vertex, 0)
        self.cap = float(cap)
        self.pool_factors = tuple(float(f) for f in pool_factors)
        self._key: int | None = None

    def _prepare(self, ctx: ProposalContext) -> None:
        if self._key == ctx.key:
            return
        if ctx.problem is None or ctx.problem.mode != "input":
            raise InputError(
                "vertex descent needs nonnegative inputs on the searched side: use sparsity='input' "
                "or another proposer"
            )
        self._key = ctx.key
        self._lp = SliceLP(ctx.L.to(torch.float64).cpu().numpy(), max(ZERO_RTOL, ctx.zero_rtol))

    def cost(self, ctx: ProposalContext) -> float:
        m, b = ctx.rows, ctx.batch_size
        solves = self.starts_per_call * self.max_steps / 2
        hints = self.starts_per_call * (2 + self.subsets_per_vertex)
        return solves * LP_WORK_PER_ENTRY * m * b + hint_cost(ctx, hints)

    def _descend(self, weights: np.ndarray, ctx: ProposalContext) -> np.ndarray | None:
        """Capped-l1 steps from the vertex of ``weights`` until the vertex repeats or has
        ``DEGENERATE`` times a generic vertex's b - 1 zeros; its q."""
        zero, live = max(ZERO_RTOL, ctx.zero_rtol), self._lp.live
        q = self._lp.vertex(weights, ctx.deadline)
        for _ in range(self.max_steps):
            if q is None or ctx.deadline.passed():
                return q
            x = self._lp.inputs(q)
            nonzero = live & (x > zero * x.max())
            zeros = int(live.sum()) - int(nonzero.sum())
            if not nonzero.any() or zeros >= DEGENERATE * (ctx.batch_size - 1):
                return q
            small = x < self.cap * np.median(x[nonzero])
            step = self._lp.vertex(np.where(small, 1.0, FREE_WEIGHT), ctx.deadline)
            if step is None or np.allclose(step, q, rtol=1e-9, atol=1e-12 * np.abs(q).max()):
                return q if step is None else step
            q = step
        return q

    def propose(self, ctx: ProposalContext, max_proposals: int) -> ProposalBatch:
        self._prepare(ctx)
        b, m = ctx.batch_size, ctx.rows
        empty = torch.empty(0, b, dtype=ctx.L.dtype, device=ctx.L.device)
        vertices = []
        for _ in range(self.starts_per_call):
            if self._lp.infeasible or ctx.deadline.passed():
                break
            noise = torch.randn(m, generator=ctx.generator, dtype=torch.float64).numpy()
            q = self._descend(noise, ctx)
            if q is not None:  # None: a failed solve, or no nonnegative direction at all
                vertices.append(q)
        live = torch.as_tensor(self._lp.live, device=ctx.L.device)
        if not vertices or int(live.sum()) < b - 1:
            return ProposalBatch(empty, n_drawn=self.starts_per_call, exhausted=self._lp.infeasible)
        q = torch.as_tensor(np.stack(vertices), dtype=ctx.L.dtype, device=ctx.L.device)
        x = q @ ctx.L.T
        x = x / x.abs().amax(dim=1, keepdim=True)
        # features zero in every sample (rounding noise) pin nothing: never in a hint
        order = torch.where(live, x, torch.inf).argsort(dim=1)
        hints = [live & (x <= max(ZERO_RTOL, ctx.zero_rtol)), rows_to_mask(order[:, : b - 1], m)]
        for t in range(self.subsets_per_vertex):
            pool = min(int(live.sum()), max(b, int(self.pool_factors[t % len(self.pool_factors)] * b)))
            hints.append(pool_subsets(order, pool, b, m, ctx.generator))
        hint = torch.cat(hints)
        directions = q.repeat(len(hints), 1)
        enough = hint.sum(dim=1) >= b - 1
        return ProposalBatch(directions[enough], n_drawn=int(hint.shape[0]), zero_hint=hint[enough])
