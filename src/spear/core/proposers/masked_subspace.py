"""Directions from a known narrow layer above: every column of dL/dZ is a masked, known subspace.

When the attacked layer's ReLU feeds a linear layer ``W'`` (k x m) that the server knows, the
chain rule gives each sample's column ``dL/dZ_j = D_j W'^T delta_j``: the sample's ReLU pattern
``D_j`` (a 0/1 diagonal) applied to a vector of the k-dimensional column space of ``W'^T``
(``delta_j = dL/dZ'_j``). In a classifier head (k = 10 classes, as in the LT-code paper's
shallow network or a CNN's ``Linear -> ReLU -> Linear(., 10)``) that space is tiny. Theorem 3.3
puts the same column in the b-dimensional column space of L. So a pattern D is some sample's
exactly when ``range(D W'^T)`` meets ``range(L)``: with ``P`` the projector onto the complement
of ``range(L)``, when

    ratio(D) = min over delta of ||P D W'^T delta||^2 / ||D W'^T delta||^2 = 0,

which generically holds for no other pattern once m - b > k (k unknowns against m - b
equations; the proposer asks for m - b >= 2k + 8). ``ratio`` is small for patterns *near* a
sample's (a wrong row i adds about ``(W'^T delta)_i^2``), so a local search over patterns finds
the exact one from a guess with a sixth to a fifth of its rows wrong: blocks of the best
improving flips at fixed ``delta`` (each flip's change is closed-form in the projectors'
diagonals and the running residuals), then ``delta`` re-fitted by a k x k
generalized eigenproblem, until the pattern is a fixed point. This needs no sparsity beyond the
ReLU's, so it works where ~50% zeros are far too few for Lemma 5.2's sampling (b in the
hundreds).

Guesses come from what the server sees:

* rows: ``x_i = (dL/dW)_i / (dL/db)_i`` is a weighted mean of the inputs that activate neuron i
  (exactly one input for a singleton neuron); its pattern ``W x_i + bias > 0`` is a guess.
* input features (columns of dL/dW): column p is ``sum_j x_jp dL/dZ_j`` over the samples whose
  feature p is nonzero, few of them for sparse inputs (raw pixels, ReLU features). Found
  directions are explained away exactly: on the rows where sample j alone (of those) is active
  the column equals ``x_jp dL/dZ_j``, so ``column / (L q_j)`` repeats one value there
  (``MIN_RUN`` times or more). What is left is one sample's column (its zero set is a hint as
  it stands: the pixel-side LT cascade) or a mixture of fewer samples, whose larger half is a
  new guess.

Before any guess is searched, feature columns that mix a few samples are *split*
(:mod:`~spear.core.proposers.column_split`, for batches larger than ``SPLIT_ABOVE_BATCH`` and
heads up to ``MOST_ONE_HOT`` wide): each row of such a column is a subset sum of the
contributors' vectors ``x_jp delta_j`` seen through ``W'``, and once those are fitted exactly,
every contributor's pattern is read off the rows whose subset holds it, then pinned
(:func:`pin_columns`). Each call explains the new directions away first, so the columns they
leave split next; once the splits run dry, every found direction is explained away again from
every column (:meth:`MaskedSubspaceProposer._explain_deeply`).

Once every guess has been searched and no new pass is due, every guess is searched again from
*hypotheses of its delta* (:func:`delta_hypotheses`: the found columns' own and, for a narrow
head, every ``e_a - e_c``; a confident classifier's ``delta = softmax - onehot`` lies near one
of those, and samples of one prediction and label near each other's). Held at a delta near the
sample's, a convex relaxation (:meth:`PatternSearch.relax`) rounds a guess with a quarter to a
third of its rows wrong into the search's basin, where the search from the guess itself, whose
fitted delta the wrong rows pull away, finds nothing.

Every hint goes through the core's exact snapping and sparsity filter, so a wrong pattern costs
time, never correctness. A converged pattern's hint is *confirmed* (``ProposalBatch.confirmed``):
the layer above pins it, so it needs only a kernel's b - 1 zero rows, not Section 4.1's
threshold, which true columns with fewer zeros than 50% miss. Only server-side quantities
are used: W, bias, W', dL/dW and dL/db.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spear.core.deadline import NEVER, Deadline
from spear.core.linalg import gram_ridge, lstsq, row_products, unit_rows
from spear.core.proposers import column_split
from spear.core.proposers.base import (
    DirectionProposer,
    ProposalBatch,
    ProposalContext,
    hint_cost,
    orthogonal_complement,
)
from spear.errors import InputError

#: weight of ||y||^2 in the deflated objective (PatternSearch): the score of an unfound pattern
ETA = 1e-10
#: at most this many flips per pattern and step of the search
MAX_BLOCK = 16
#: sweeps a search takes on average, for the cost estimate
TYPICAL_SWEEPS = 8
#: with at most this many samples left, candidates of their inputs are guessed too
#: (:func:`remainder_patterns`)
REMAINDER_MAX = 32
#: ... and with at most this many left, those guesses go first, once per growth of the found
#: directions: one or two samples' inputs are then pinned by few zero features (with one
#: left, exactly), where the queue of the row and column guesses can hold the proposer for
#: the rest of a run (a float32 CNN head, b = 32: its last sample's exact guess was never
#: reached in 1.3M proposals)
REMAINDER_FIRST = 2
#: a found direction counts as part of a feature column when its ratio repeats this often
MIN_RUN = 8
#: two ratios are the same value within this (relative; float64 rounding is ~1e-15), or within
#: ``RATIO_ZERO_SHARE`` times the zero tolerance when that is larger (float32 gradients: 1e-6)
RATIO_RTOL = 1e-9
RATIO_ZERO_SHARE = 1e-2
#: a pattern is converged at a ratio below this times the squared zero tolerance (float32
#: gradients: 1e-6) ...
CONVERGED = 100.0
#: ... or below this, the float64 floor of the ratio (PatternSearch.fit cancels ||y||^2 - ||U^T y||^2)
RATIO_FLOOR = 1e4 * torch.finfo(torch.float64).eps
#: ... or, where the batch has faint columns (a rounding map), below the squared precision of
#: the pattern's own column (:meth:`PatternSearch.thresholds`), up to this: a faint column lies
#: outside the computed range(L) by its rounding. A float32 CNN head trained 200 steps (MNIST,
#: m = 500, b = 64, seed 0) sent two columns at 3.5e-5 and 6.5e-5 of the largest whose exact
#: patterns read ratios of 2e-6 and 1.2e-6, over the 1e-6 above (every other column's: at most
#: 1.6e-8); both were guessed exactly and never converged, and the batch was never whole. A
#: wrong row adds about 1 / (active rows), 4e-3 there: this cap stays far below it
MOST_CONVERGED = 1e-4
#: a converged pattern's zero set leaves out the rows whose own cost if wrong, ``h_i^2 P_ii``, is
#: below this times ``||y||^2`` times the ratio the pattern reached (at least ``done``): such a
#: row could be wrong without the ratio showing it
FIRM = 100.0
#: a pattern pins its column (:func:`pin_columns`) when the smallest singular value of
#: ``[U, -D W'^T]`` is at most PIN_RTOL times the zero tolerance (relative to the largest; true
#: columns: ~5e-8 in float32, against 1e-6) and the second one at least PIN_GAP times it (no
#: second column of that form near range(L); true columns: 1.5e-2 to 4e-2 at m = 91, b = 11)
PIN_RTOL = 1e-2
PIN_GAP = 10.0
#: a pinned column's zero rows that its kernel cannot do without, at most (:func:`_shared_rows`)
MAX_ESSENTIAL = 4
#: patterns pinned per batched SVD, between deadline checks
PIN_CHUNK = 8
#: once the plain passes run dry, each guess is searched again from this many hypotheses of
#: its delta (:func:`delta_hypotheses`) ...
HYPOTHESES_PER_GUESS = 3
#: ... each held fixed in a relaxation (:meth:`PatternSearch.relax`) of this weight on the
#: column's part outside range(L) against the distance to the guess ...
RELAX_WEIGHT = 16.0
#: ... solved by this many projected gradient steps; the search then takes at most this many
#: sweeps of at most this many flips (a relaxed guess in the basin settles within a few; on 128
#: of MNIST b = 512's guesses, 5 sweeps find 25 samples, 10 or 30 sweeps 26)
RELAX_STEPS = 100
RELAXED_SWEEPS = 10
RELAXED_FLIPS = 150
#: one-hot differences join the hypotheses for heads at most this wide
MOST_ONE_HOT = 32
#: feature columns split per call (:mod:`~spear.core.proposers.column_split`) ...
SPLITS_PER_CALL = 16
#: ... in batches of more than this many samples: a mechanism for large batches, where the
#: pattern search runs short of guesses (LT MNIST b = 512). Up to it the search alone finds the
#: batches measured whole, and faster: with splits first, LT MNIST b = 128 took 20-59 s (4.3 s
#: median without) and b = 256 seed 0 89 s (37 s), and below b = 64 split calls took the turns
#: the float32 CNN heads of test_realism and small trained MLPs need
SPLIT_ABOVE_BATCH = 256
#: ... of those with at least a 2^-MOST_CONTRIBUTORS share of zero rows (about as many
#: contributors, each active on half the rows; beyond that a split rarely finds them all)
MOST_CONTRIBUTORS = 6
#: once the splits run dry, every found direction is explained away, at most this many times
#: over the columns that changed, with runs this short where ratios are equal to within
#: ``SHORT_RUN_RTOL`` (float64: three equal ratios among a column's ~500 by chance, ~1e-10)
DEEP_ROUNDS = 8
SHORT_RUN = 3
SHORT_RUN_RTOL = 1e-8


def applicable(ctx: ProposalContext) -> bool:
    """Whether the layer above is known and narrow enough to pin patterns (m - b > k + margin)."""
    p = ctx.problem
    upper = getattr(p, "next_weight", None)
    if p is None or p.mode != "output" or upper is None or ctx.noisy:
        return False
    k = upper.shape[0]
    return ctx.rows - ctx.batch_size >= 2 * k + 8


@dataclass
class PatternSearch:
    """The local search over ReLU patterns (module doc) for one layer problem.

    Found columns are *deflated*: the search minimizes

        (||P y||^2 + eta ||y||^2) / ||Pi y||^2,   y = D W'^T delta,

    with ``Pi`` the projector onto the complement of the found columns. An unfound sample's
    pattern still scores about eta (its column has a part outside the found ones, being
    independent of them), while a found pattern's column lies in their span: its score is
    unbounded, and patterns near it score like random ones. So guesses that converged to found
    samples can be searched again and reach others (unfound patterns score about eta, not 0,
    which is why convergence is judged on the plain ratio
    ``||P y||^2 / ||y||^2``).

    Attributes:
        U: orthonormal basis of range(L) (m x b).
        B: ``W'^T`` (m x k).
        found: found columns of dL/dZ (m x f, any scale; f may be 0).
        rounding: the rounding map of the columns in ``U``'s coordinates (b x b: the column
            ``U c`` is off by about ``||rounding c||``), or None (:meth:`thresholds`).
    """

    U: torch.Tensor
    B: torch.Tensor
    found: torch.Tensor
    rounding: torch.Tensor | None = None

    def __post_init__(self) -> None:
        m = self.B.shape[0]
        eye = torch.eye(m, dtype=self.U.dtype, device=self.U.device)
        self.P = eye - self.U @ self.U.T
        self.P_diag = self.P.diagonal().clone()
        # per-row outer products, so masked Gram matrices are one matmul each
        self.BB = row_products(self.B, self.B)
        self.UB = row_products(self.U, self.B)
        self.deflate(self.found)

    def deflate(self, found: torch.Tensor) -> None:
        """Deflate the found columns (m x f) from now on (``P`` does not change, only ``Pi``)."""
        self.found = found
        V = torch.linalg.qr(found)[0] if found.shape[1] else found
        self.Pi = torch.eye(found.shape[0], dtype=self.U.dtype, device=self.U.device) - V @ V.T
        self.Pi_diag = self.Pi.diagonal().clone()
        self.stacked = torch.cat([self.P, self.Pi], dim=1)  # one gather updates both residuals
        self.VB = row_products(V, self.B)

    def fit(self, masks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For patterns (S, m): the delta (S, k) the deflated objective prefers (the search's
        direction), the plain ratio's minimizer (S, k) and that minimum (S,), which is what
        convergence is judged on: deflation shifts its own optimum by about eta / ||Pi y||^2."""
        S, k = masks.shape[0], self.B.shape[1]
        w = masks.to(self.U.dtype)
        gram = (w @ self.BB).reshape(S, k, k)  # (D B)^T (D B)
        inside = (w @ self.UB).reshape(S, -1, k)  # U^T D B
        perp = gram - inside.transpose(1, 2) @ inside  # (D B)^T P (D B)
        outside = (w @ self.VB).reshape(S, -1, k)  # V^T D B
        fresh = gram - outside.transpose(1, 2) @ outside  # (D B)^T Pi (D B)
        floor = gram_ridge(gram)
        # the deflated objective: the largest ||Pi y||^2 / (||P y||^2 + eta ||y||^2)
        values, delta = _generalized_eigh(fresh, perp + ETA * gram + floor)
        search = delta[:, :, -1]
        # the plain ratio ||P y||^2 / ||y||^2: its smallest value
        values, delta = _generalized_eigh(perp, gram + floor)
        return search, delta[:, :, 0], values[:, 0].clamp_min(0.0)

    def thresholds(self, masks: torch.Tensor, delta: torch.Tensor, done: float) -> torch.Tensor:
        """(S,) the plain ratio below which each pattern (S, m) with its fitted ``delta`` (S, k)
        has converged: ``done``, or the squared relative rounding of its column ``y``'s part in
        range(L) where that is larger (a faint column: its rounding puts it that far outside the
        computed range), up to ``MOST_CONVERGED``."""
        at_done = torch.full((masks.shape[0],), done, dtype=self.U.dtype, device=masks.device)
        if self.rounding is None:
            return at_done
        inside = (masks.to(self.U.dtype) * (delta @ self.B.T)) @ self.U  # (S, b): U^T y
        tiny = torch.finfo(self.U.dtype).tiny
        precision = (inside @ self.rounding.T).norm(dim=1) / inside.norm(dim=1).clamp_min(tiny)
        return torch.maximum(at_done, precision.square().clamp_max(MOST_CONVERGED))

    def descend(
        self, masks: torch.Tensor, sweeps: int, flips: int, done: float, deadline: Deadline = NEVER
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Improving flips at fixed delta, then delta re-fitted, ``sweeps`` times at most or until
        every plain ratio is below its threshold (``done``, :meth:`thresholds`) or ``deadline``
        passes; returns the patterns (S, m), their plain ratios (S,) and the deltas (S, k) that
        attain them (every pattern's last fit is of its final state)."""
        masks = masks.clone()
        ratio = torch.full((masks.shape[0],), float("inf"), dtype=self.U.dtype, device=masks.device)
        plain = torch.zeros(masks.shape[0], self.B.shape[1], dtype=self.U.dtype, device=masks.device)
        live = torch.arange(masks.shape[0], device=masks.device)
        for _ in range(sweeps):
            if deadline.passed():
                break
            delta, plain[live], ratio[live] = self.fit(masks[live])
            open_ = ratio[live] >= self.thresholds(masks[live], plain[live], done)
            live, delta = live[open_], delta[open_]
            if live.numel() == 0:
                break
            part = masks[live]
            moved = self._flip(part, delta @ self.B.T, flips, deadline)
            masks[live] = part
            live = live[moved]
            if live.numel() == 0:
                break
        if live.numel():
            _, plain[live], ratio[live] = self.fit(masks[live])
        return masks, ratio, plain

    def descend_from(
        self,
        masks: torch.Tensor,
        deltas: torch.Tensor,
        sweeps: int,
        flips: int,
        done: float,
        deadline: Deadline = NEVER,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`descend` from the patterns that :meth:`relax` makes of guesses (S, m) with
        hypotheses of their deltas (S, k).

        A guess with a quarter of its rows wrong fits a delta that those rows pull away, and the
        flips it directs lead elsewhere. MNIST b = 512 in the LT setting (seed 0, 32 samples, rows
        flipped at random): from a quarter wrong, :meth:`descend` alone finds none of them; from
        ``e_pred - e_label`` (:func:`delta_hypotheses`), flips at that fixed delta first find 6
        of 24, the relaxation first 25 of 32 (28 from the true delta); from 30% wrong, 13 of 32.
        On 256 of the server's own guesses, at their 3 nearest one-hot hypotheses, 36 samples
        where :meth:`descend` alone finds 13 (measured with 300 relaxation steps and full sweeps;
        100 steps and 10 sweeps find as many on 128 of them)."""
        return self.descend(self.relax(masks, deltas, deadline), sweeps, flips, done, deadline)

    def relax(self, masks: torch.Tensor, deltas: torch.Tensor, deadline: Deadline = NEVER) -> torch.Tensor:
        """The patterns (S, m) nearest guesses ``masks`` (S, m) whose columns, with ``delta``
        held at ``deltas`` (S, k), lie in range(L): the box-constrained least squares

            min over a in [0, 1]^m of  c^T a + (RELAX_WEIGHT / 2) ||P (h * a)||^2,

        ``h = W'^T delta`` scaled to mean magnitude 1, ``c`` = -1 on the guess's active rows and
        +1 on the others (``c^T a`` is the L1 distance to the guess, up to a constant), solved by
        ``RELAX_STEPS`` accelerated projected gradient steps (FISTA) and rounded at 1/2. The
        rounding errs where the wrong rows' pull and the guess's disagree; what it returns is a
        guess for :meth:`descend`, which the pinning then checks exactly."""
        h = deltas.to(self.B.dtype) @ self.B.T
        h = h / h.abs().mean(dim=1, keepdim=True).clamp_min(torch.finfo(h.dtype).tiny)
        toward = 1.0 - 2.0 * masks.to(h.dtype)  # c
        step = 1.0 / (RELAX_WEIGHT * (h * h).amax(dim=1, keepdim=True))  # 1 / Lipschitz constant
        a = masks.to(h.dtype)
        ahead, momentum = a.clone(), 1.0
        for _ in range(RELAX_STEPS):
            if deadline.passed():
                break
            y = h * ahead
            outside = y - (y @ self.U) @ self.U.T  # P y
            following = (ahead - step * (toward + RELAX_WEIGHT * h * outside)).clamp_(0.0, 1.0)
            faster = 0.5 * (1.0 + (1.0 + 4.0 * momentum**2) ** 0.5)
            ahead = following + ((momentum - 1.0) / faster) * (following - a)
            a, momentum = following, faster
        return a > 0.5

    def _flip(
        self, masks: torch.Tensor, h: torch.Tensor, flips: int, deadline: Deadline = NEVER
    ) -> torch.Tensor:
        """Up to ``flips`` improving flips per pattern at fixed values ``h`` (S, m), in place;
        returns which patterns moved. Each step takes the best flips of every pattern, a
        quarter of its improving ones (at most ``MAX_BLOCK``, at least one): their interactions
        (off-diagonal entries of the projectors, about sqrt(b)/m) are small, and every step
        recomputes the objective exactly from running residuals (:class:`_FlipState`). Past
        ``deadline`` no further step starts (a call can take hundreds of steps, seconds on a
        loaded machine)."""
        moved = torch.zeros(masks.shape[0], dtype=torch.bool, device=masks.device)
        state = _FlipState(self, masks, h)
        done = 0
        while done < flips and state.live.numel() and not deadline.passed():
            gain, improving, count = state.gains()
            still = count > 0
            if not bool(still.all()):  # finished patterns leave the loop
                masks[state.live] = state.masks
                keep = still.nonzero()[:, 0]
                state.keep(keep)
                gain, improving, count = gain[keep], improving[keep], count[keep]
                if state.live.numel() == 0:
                    break
            block = int(min(MAX_BLOCK, max(1, int(count.max()) // 4)))
            rows = gain.topk(block, dim=1).indices
            take = improving.gather(1, rows)
            take[:, 1:] &= torch.arange(1, block, device=h.device)[None, :] < (count[:, None] + 3) // 4
            state.apply(rows, take)
            moved[state.live] = True
            done += block
        masks[state.live] = state.masks
        return moved


class _FlipState:
    """The running state of :meth:`PatternSearch._flip` for the patterns still moving.

    Every flip's objective is closed-form in running quantities (per pattern: the residuals
    ``r = P y`` and ``t = Pi y``, kept side by side as ``rt``; per row: ``2 s h``, with
    ``s = +1`` switching the row on and -1 off, and the row's own terms ``h^2 P_ii + eta s h^2``
    and ``h^2 Pi_ii``). A step updates them at the flipped rows only, ``rt`` by those rows of
    the stacked projectors ``[P, Pi]``, so a step reads each (S, m) array a few times.
    """

    def __init__(self, search: PatternSearch, masks: torch.Tensor, h: torch.Tensor) -> None:
        self.search = search
        self.live = torch.arange(masks.shape[0], device=masks.device)
        self.masks, self.h = masks.clone(), h
        self.h2 = h * h
        on = self.masks.to(h.dtype)
        self.y = on * h
        U = search.U
        self.rt = torch.cat([self.y - (self.y @ U) @ U.T, self.y @ search.Pi], dim=1)  # [P y, Pi y]
        sign = 1.0 - 2.0 * on
        self.twice_sh = 2.0 * sign * h
        self.own_num = self.h2 * (search.P_diag + ETA * sign)
        self.own_den = self.h2 * search.Pi_diag  # no sign in it: a flip leaves it as it is

    def keep(self, index: torch.Tensor) -> None:
        """Keep only the patterns at ``index`` (positions among the live ones)."""
        for name in ("live", "masks", "h", "h2", "y", "rt", "twice_sh", "own_num", "own_den"):
            setattr(self, name, getattr(self, name)[index])

    def gains(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's gain (S, m) if flipped alone, whether it improves (S, m), how many do (S,)."""
        m = self.h.shape[1]
        r, t = self.rt[:, :m], self.rt[:, m:]
        rr = torch.linalg.vecdot(r, r)
        tt = torch.linalg.vecdot(t, t)
        base = rr + ETA * torch.linalg.vecdot(self.y, self.y)
        tiny = torch.finfo(self.h.dtype).tiny
        now = base / tt.clamp_min(tiny)
        num = torch.addcmul(self.own_num, self.twice_sh, r).add_(base[:, None])
        den = torch.addcmul(self.own_den, self.twice_sh, t).add_(tt[:, None]).clamp_min_(tiny)
        gain = torch.sub(now[:, None], num.div_(den))
        improving = gain > 1e-12 * now[:, None]
        return gain, improving, improving.sum(1)

    def apply(self, rows: torch.Tensor, take: torch.Tensor) -> None:
        """Flip ``rows`` (S, block) where ``take``; update the running quantities there."""
        pattern, slot = take.nonzero(as_tuple=True)
        row = rows[pattern, slot]
        step = 0.5 * self.twice_sh[pattern, row]  # s h of each flip
        if self.rt.device.type == "cpu":  # the flipped rows of [P, Pi] alone, added in order
            change = self.search.stacked.index_select(0, row).mul_(step[:, None])
            self.rt.index_add_(0, pattern, change)
        else:  # CUDA's index_add_ adds atomically (not reproducible): the block's rows, batched
            steps = torch.zeros(rows.shape, dtype=step.dtype, device=step.device)
            steps[pattern, slot] = step
            self.rt += torch.bmm(steps[:, None, :], self.search.stacked[rows])[:, 0]
        flipped = self.masks.gather(1, rows) ^ take
        self.masks.scatter_(1, rows, flipped)
        h_rows, h2_rows = self.h.gather(1, rows), self.h2.gather(1, rows)
        sign = 1.0 - 2.0 * flipped.to(self.h.dtype)
        self.y.scatter_(1, rows, torch.where(flipped, h_rows, torch.zeros_like(h_rows)))
        self.twice_sh.scatter_(1, rows, 2.0 * sign * h_rows)
        self.own_num.scatter_(1, rows, h2_rows * (self.search.P_diag[rows] + ETA * sign))


def _generalized_eigh(A: torch.Tensor, M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (S, k, ascending) and M-orthonormal eigenvectors (S, k, k; columns) of the
    symmetric pencils ``A v = lambda M v``, M positive definite."""
    chol, _ = torch.linalg.cholesky_ex(M)
    left = torch.linalg.solve_triangular(chol, A, upper=False)
    sym = torch.linalg.solve_triangular(chol, left.transpose(1, 2), upper=False)
    values, vectors = torch.linalg.eigh(sym)
    return values, torch.linalg.solve_triangular(chol.transpose(1, 2), vectors, upper=True)


def pin_columns(
    U: torch.Tensor, B: torch.Tensor, masks: torch.Tensor, zero_rtol: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The columns (S, m) that patterns (S, m) pin, and which do (S,).

    A column of pattern D is ``D W'^T delta`` in range(L) = range(U): ``(c, delta)`` spans the
    kernel of ``[U, -D B]`` (m x (b + k), ``B = W'^T`` scaled to unit norm), solved by one SVD
    per pattern, exact to the gradient's rounding (the search's ratio is not: it cancels
    ``||y||^2 - ||U^T y||^2``). The pattern pins it when that kernel is one-dimensional (the
    smallest singular value below ``PIN_RTOL * zero_rtol`` of the largest, the second above
    ``PIN_GAP * zero_rtol``) and the column's zero set is exactly D's inactive rows. Then no
    zero set is needed: a mixture of samples whose patterns differ is not of the form
    ``D W'^T delta`` (each region where a different set of them is active would need its own
    delta), so only a sample's column is. Samples sharing a whole pattern leave a kernel of two
    dimensions and are refused, and so are their mixtures that vanish on rows they share
    (:func:`_shared_rows`)."""
    scaled = B / torch.linalg.matrix_norm(B, ord=2)
    columns, ok, zeros = _pin(U, scaled, masks, zero_rtol)
    # an active row whose value is below the zero tolerance (``W'^T delta`` nearly vanishes
    # there) cannot be told from an inactive one: solved again with it inactive
    again = ~ok & (zeros | masks).all(dim=1) & (zeros & masks).any(dim=1)
    if bool(again.any()):
        columns[again], ok[again], _ = _pin(U, scaled, ~zeros[again], zero_rtol)
    return columns, ok


def _pattern_systems(U: torch.Tensor, scaled: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """``[U, -D B]`` (S, m, b + k) for patterns D (S, m)."""
    S, (m, b) = masks.shape[0], U.shape
    return torch.cat([U.expand(S, m, b), -masks.to(U.dtype)[:, :, None] * scaled], dim=2)


def _pin(
    U: torch.Tensor, scaled: torch.Tensor, masks: torch.Tensor, zero_rtol: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One solve of :func:`pin_columns` (``scaled``: ``W'^T`` at unit norm); also the columns'
    zero masks (S, m)."""
    S, m = masks.shape
    if S == 0:
        none = torch.zeros(0, dtype=torch.bool, device=masks.device)
        return U.new_zeros(0, m), none, masks
    b = U.shape[1]
    left, sv, Vh = torch.linalg.svd(_pattern_systems(U, scaled, masks), full_matrices=False)
    columns = (Vh[:, -1, :b] @ U.T).to(U.dtype)  # (S, m): U c, the kernel's column part
    alone = sv[:, -1] <= PIN_RTOL * zero_rtol * sv[:, 0]
    clear = sv[:, -2] >= PIN_GAP * zero_rtol * sv[:, 0]
    zeros = columns.abs() <= zero_rtol * columns.abs().amax(dim=1, keepdim=True)
    exact = (zeros == ~masks).all(dim=1)
    # a zero row the kernel cannot do without: without it, the kernel would be two-dimensional
    # (its leverage in the range of the other singular vectors is 1)
    leverage = left[:, :, :-1].square().sum(dim=2)
    essential = zeros & (1.0 - leverage < PIN_GAP * zero_rtol)
    ok = alone & clear & exact
    ok[ok.clone()] &= ~_shared_rows(U, scaled, masks[ok], essential[ok], zero_rtol)
    return columns, ok, zeros


def _shared_rows(
    U: torch.Tensor, scaled: torch.Tensor, masks: torch.Tensor, essential: torch.Tensor, zero_rtol: float
) -> torch.Tensor:
    """(S,) whether a pattern's column may be a mixture of samples that share the pattern with
    one of its ``essential`` zero rows (S, m) switched on. Such samples leave a two-dimensional
    kernel on that pattern, and their combination that vanishes on the shared row is of the
    form ``(D minus that row) W'^T delta``: pinned by D, but no sample's. A near duplicate
    active on one more row makes the row essential too, with a one-dimensional kernel (only its
    own column) on the larger pattern: that column is pinned. More than ``MAX_ESSENTIAL``
    essential rows: refused."""
    count = essential.sum(dim=1)
    refused = count > MAX_ESSENTIAL
    pattern, row = (essential & ~refused[:, None]).nonzero(as_tuple=True)
    if pattern.numel() == 0:
        return refused
    larger = masks[pattern].clone()
    larger[torch.arange(row.numel(), device=row.device), row] = True
    sv = torch.linalg.svdvals(_pattern_systems(U, scaled, larger))
    two = sv[:, -2] < PIN_GAP * zero_rtol * sv[:, 0]
    refused[pattern[two]] = True
    return refused


def delta_hypotheses(B: torch.Tensor, found: torch.Tensor, zero_rtol: float) -> torch.Tensor:
    """Unit deltas (h, k) that the samples still unfound may have nearly: the found columns'
    own (m x f; ``y = D B delta`` solved on its active rows) and, for a head at most
    ``MOST_ONE_HOT`` wide, every ``e_a - e_c``.

    A confident classifier's ``delta = softmax - onehot`` is near ``e_pred - e_label``, and
    samples with the same prediction and label have nearly parallel deltas (MNIST b = 512 in the
    LT setting, seed 0: median cosine 0.996 to ``e_pred - e_label``, 0.9996 to the nearest other
    sample's delta). A hypothesis only steers the search (:meth:`PatternSearch.descend_from`):
    what it finds is pinned exactly as any other pattern."""
    k = B.shape[1]
    parts = []
    if k <= MOST_ONE_HOT:
        parts.append(column_split.one_hot_differences(k, B.dtype, B.device))
    if found.shape[1]:
        size = found.abs()
        active = (size > zero_rtol * size.amax(dim=0, keepdim=True)).to(B.dtype).T  # (f, m)
        gram = (active @ row_products(B, B)).reshape(-1, k, k)
        parts.append(torch.linalg.solve(gram + gram_ridge(gram), (found.T @ B)[:, :, None])[:, :, 0])
    if not parts:
        return B.new_zeros(0, k)
    return unit_rows(torch.cat(parts))


def row_guesses(ctx: ProposalContext) -> torch.Tensor:
    """Patterns (k, m) of the weighted mean inputs ``(dL/dW)_i / (dL/db)_i`` of the neurons."""
    p = ctx.problem
    assert p is not None
    db = p.grad_bias
    usable = db.abs() > ctx.zero_rtol * db.abs().amax()
    z = (p.L[usable] @ p.R_Wt) / db[usable, None] + p.bias  # W x_i + bias for each usable row
    return z > 0


def explain_away(
    columns: torch.Tensor,
    known: torch.Tensor,
    chunk: int = 8,
    rtol: float = RATIO_RTOL,
    zero_rtol: float = 0.0,
    deadline: Deadline = NEVER,
    min_run: int = MIN_RUN,
) -> torch.Tensor | None:
    """Feature columns (n, m) minus the found columns of dL/dZ (f, m) each one contains,
    detected by a run of ``min_run`` equal ratios (module doc). Each component is read off the
    rows where its sample alone is active, which the others leave untouched, so they can be
    removed together, and columns explained before by other found directions are fine.

    Entries within ``zero_rtol`` of a column's largest count as zero: ratios are taken on a
    found column's active rows only (its zero set's rounding holds no run). A feature column
    explained down to ``RATIO_ZERO_SHARE * zero_rtol`` of its largest entry (the rounding of
    what was subtracted, 1e-15 to 1e-13 at MNIST b = 256) is explained whole: it becomes 0,
    not a pattern guess made of rounding. An unfound sample whose share of the column is that
    faint goes with it (its own columns still give its guesses). A zero feature column holds
    no sample and is skipped. None when ``deadline`` passes first (thousands of photo pixels
    against a hundred found columns take many seconds)."""
    if known.shape[0] == 0 or columns.shape[0] == 0:
        return columns
    tiny = torch.finfo(columns.dtype).tiny
    rows, denominators = _active_rows(known, zero_rtol)
    nan = torch.full((columns.shape[0], 1), float("nan"), dtype=columns.dtype, device=columns.device)
    padded = torch.cat([columns, nan], dim=1)  # rows[] pads with index m: NaN
    result = columns.clone()
    nonzero = (columns != 0).any(dim=1).nonzero()[:, 0]
    if nonzero.numel() == 0:  # every column explained whole already (split would give one empty part)
        return result
    for index in nonzero.split(chunk):
        if deadline.passed():
            return None
        values = padded[index][:, rows]  # (c, f, width)
        ratio = torch.where(values.abs() > tiny, values / denominators, torch.nan)
        ordered = ratio.reshape(-1, rows.shape[1]).sort(dim=1).values  # NaNs last
        weight = _most_repeated(ordered, rtol, min_run).reshape(index.shape[0], -1)
        v = columns[index]
        rest = v - weight @ known
        # explained whole: what is left is rounding, far below the zero tolerance
        whole = rest.abs().amax(dim=1) <= RATIO_ZERO_SHARE * zero_rtol * v.abs().amax(dim=1)
        rest[whole & weight.ne(0).any(dim=1)] = 0.0
        result[index] = rest
    return result


def _active_rows(known: torch.Tensor, zero_rtol: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each found column's active rows (f, width; padded with the index m) and its values there
    (padded with NaN); width is the most active rows any of them has."""
    f, m = known.shape
    size = known.abs()
    floor = (zero_rtol * size.amax(dim=1, keepdim=True)).clamp_min(torch.finfo(known.dtype).tiny)
    active = size > floor
    width = max(1, int(active.sum(dim=1).max()))
    order = torch.argsort((~active).to(torch.uint8), dim=1, stable=True)[:, :width]
    rows = torch.where(active.gather(1, order), order, m)
    values = torch.cat([known, known.new_full((f, 1), float("nan"))], dim=1).gather(1, rows)
    return rows, values


def _most_repeated(values: torch.Tensor, rtol: float = RATIO_RTOL, min_run: int = MIN_RUN) -> torch.Tensor:
    """For each sorted row (NaNs last), the mean of the longest run of values equal within
    ``rtol`` of their neighbours (the first such run on ties), if at least ``min_run`` long,
    else 0. Runs are read off one cumulative count: a position's run length is its count of
    links minus the count at its run's start (the running maximum over the breaks before it)."""
    rows, n = values.shape
    valid = ~torch.isnan(values)
    link = valid[:, 1:] & valid[:, :-1]
    link &= (values[:, 1:] - values[:, :-1]).abs() <= rtol * values[:, 1:].abs()
    links = torch.zeros(rows, n, dtype=torch.long, device=values.device)
    torch.cumsum(link, dim=1, out=links[:, 1:])
    starts = torch.ones(rows, n, dtype=torch.bool, device=values.device)
    starts[:, 1:] = ~link
    start_links = torch.where(starts, links, torch.zeros_like(links)).cummax(dim=1).values
    length = torch.where(valid, links - start_links + 1, torch.zeros_like(links))
    size, end = length.max(dim=1)
    position = torch.arange(n, device=values.device)[None, :]
    inside = (position <= end[:, None]) & (position > (end - size)[:, None])
    total = torch.where(inside, values, torch.zeros_like(values)).sum(dim=1)
    mean = total / size.clamp_min(1)
    return torch.where(size >= min_run, mean, torch.zeros_like(mean))


def unfound(ctx: ProposalContext) -> int:
    """How many samples the found directions leave, near-copies of one column counted once
    (``ctx.copy_angle``, :func:`orthogonal_complement`)."""
    found = ctx.found.to(ctx.L.dtype)
    return orthogonal_complement(found, ctx.batch_size, ctx.copy_angle).shape[1]


def remainder_patterns(ctx: ProposalContext, count: int) -> torch.Tensor:
    """Patterns (k, m) of candidate inputs of the last r = b - f samples (f found directions).

    ``sum_j q_j p_j^T = I`` makes the duals ``p`` of the unfound samples orthogonal to every found
    ``q``, so their inputs ``x = R^T p`` span ``R^T`` of the found directions' complement, an
    r-dimensional subspace. Each candidate vanishes on r - 1 random live features of it: one
    sample's input when those features are zero for that sample (sparse inputs: pixels, ReLU
    features); ``r . L^+ dL/db = 1`` gives its scale. Its pattern ``W x + bias > 0`` is then
    exact; otherwise it is a guess. Near-copies of one found column (``ctx.copy_angle``) count
    once: a float32 CNN head (trained 200 steps, b = 32) held two copies of a faint column
    1e-3 apart among its 32 found directions, for 31 samples, so r came out 0 and its last
    sample (every other one found) was never guessed in 1.3M proposals. None where r is 0 or
    above ``REMAINDER_MAX``.
    """
    p = ctx.problem
    assert p is not None
    b, found = ctx.batch_size, ctx.found.to(ctx.L.dtype)
    basis = orthogonal_complement(found, b, ctx.copy_angle)  # (b, r)
    r = basis.shape[1]
    if r == 0 or r > REMAINDER_MAX:
        return torch.zeros(0, ctx.rows, dtype=torch.bool, device=ctx.L.device)
    inputs = (basis.T @ p.R).T  # (n, r): the unfound samples' inputs are its column combinations
    if r == 1:
        coefficients = basis.new_ones(1, 1)
    else:
        size = inputs.abs().amax(dim=1)
        live = (size > ctx.zero_rtol * size.amax()).nonzero()[:, 0]
        if live.numel() < r - 1:
            return torch.zeros(0, ctx.rows, dtype=torch.bool, device=ctx.L.device)
        noise = torch.rand(count, live.numel(), generator=ctx.generator).to(live.device)
        picks = live[noise.argsort(dim=1)[:, : r - 1]]
        coefficients = torch.linalg.svd(inputs[picks], full_matrices=True).Vh[:, -1, :]
    r, scaled = p.input_coefficients(coefficients @ basis.T, ctx.zero_rtol)
    z = r[scaled] @ p.R_Wt + p.bias
    return torch.unique(z > 0, dim=0)


def column_guesses(
    columns: torch.Tensor, zero_rtol: float, threshold: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """From feature columns (n, m), with found samples explained away: the zero sets of those
    that are one sample's column already (exact hints), and the larger halves of the others
    (mixtures of a few samples) as pattern guesses."""
    scale = columns.abs().amax(dim=1, keepdim=True)
    alive = scale[:, 0] > 0
    columns, scale = columns[alive], scale[alive]
    zeros = columns.abs() <= zero_rtol * scale
    single = zeros.sum(1) >= threshold
    size = columns.abs()
    larger = size > size.median(dim=1, keepdim=True).values
    return zeros[single], larger[~single]


def _run_length(ctx: ProposalContext) -> int:
    """The run of equal ratios that explains a found direction away: ``SHORT_RUN`` where
    ratios are compared to float64 rounding, ``MIN_RUN`` otherwise."""
    return SHORT_RUN if max(RATIO_RTOL, RATIO_ZERO_SHARE * ctx.zero_rtol) <= SHORT_RUN_RTOL else MIN_RUN


def _splitter(
    B: torch.Tensor, next_grad_weight: torch.Tensor | None, zero_rtol: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``W'^T`` and the one-hot delta hypotheses in the coordinates of the deltas' span, for
    :func:`column_split.split_column`, or None for a head wider than ``MOST_ONE_HOT``.

    The deltas span the range of the next layer's weight gradient ``sum_j delta_j a_j^T``
    (``a_j >= 0``, independent): for softmax cross-entropy the k - 1 dimensions that sum to 0.
    Fits in that span need a row fewer, which a split's random minimal fits feel: MNIST b = 512 in
    the LT setting reaches 182 of 512 samples with k = 10 unknowns, all 512 with the span's 9."""
    k = B.shape[1]
    if k > MOST_ONE_HOT:
        return None
    span = torch.eye(k, dtype=B.dtype, device=B.device)
    if next_grad_weight is not None:
        left, size, _ = torch.linalg.svd(next_grad_weight.to(B.dtype), full_matrices=False)
        span = left[:, size > zero_rtol * size[0]] if size.numel() and size[0] > 0 else span
    hypotheses = column_split.one_hot_differences(k, B.dtype, B.device) @ span
    hypotheses = hypotheses[hypotheses.norm(dim=1) > 0.5]  # those (nearly) in the span
    if span.shape[1] < 2 or hypotheses.shape[0] == 0:
        # one delta direction (k = 2 with softmax): every row class is parallel, and a column's
        # ratio to a found one repeats on shared rows too (review 49): no splits, no short runs
        return None
    return B @ span, unit_rows(hypotheses)


class MaskedSubspaceProposer(DirectionProposer):
    """Zero sets from the pattern search of the module doc, started from the server's guesses.

    Every call deflates all directions found so far (:class:`PatternSearch`), so guesses
    that would converge to a sample found meanwhile move on to others. All guesses are searched
    once; whenever the found directions have grown by ``requeue_growth`` (a fraction of b)
    since, they are searched again, so that guesses captured by found samples before can reach
    the others. Between passes, new directions are explained away from the feature columns; the
    columns that changed give new hints and guesses, which join the queue.

    Args:
        guesses_per_call: patterns searched per call.
        sweeps: delta re-fits per search, at most.
        flips: single flips per sweep, at most.
        requeue_growth: growth of the found directions, as a fraction of b, that starts a new
            pass over all guesses.
    """

    name = "subspace"

    def __init__(
        self,
        guesses_per_call: int = 128,
        sweeps: int = 30,
        flips: int = 400,
        requeue_growth: float = 0.05,
    ) -> None:
        if guesses_per_call < 1 or sweeps < 1 or flips < 1 or requeue_growth <= 0:
            raise InputError(
                "MaskedSubspaceProposer needs guesses_per_call, sweeps, flips >= 1 and requeue_growth > 0"
            )
        self.guesses_per_call = guesses_per_call
        self.sweeps = sweeps
        self.flips = flips
        self.requeue_growth = requeue_growth
        self._key: int | None = None

    def _prepare(self, ctx: ProposalContext) -> None:
        if self._key == ctx.key:
            return
        if not applicable(ctx):
            raise InputError(
                "the subspace proposer needs the known next linear layer (attack_layer supplies it, "
                "or reconstruct(..., next_weight=, next_grad_weight=)), output sparsity, an exact "
                "gradient, and m - b >= 2k + 8 for its k outputs; use proposer='auto'"
            )
        p = ctx.problem
        assert p is not None and p.next_weight is not None
        self._key = ctx.key
        self.U, triangle = torch.linalg.qr(ctx.L)
        self.B = p.next_weight.T.to(self.U.dtype)
        self.columns = (ctx.L @ p.R).T  # (n, m): dL/dW's feature columns
        self.explained = 0  # found directions explained away from the columns so far
        self.passed = -1  # found directions when the last pass over all guesses began (-1: none)
        self.remainder_at = -1  # found directions when the remainder's guesses last went first
        rounding = None  # the map in U's coordinates: U c = L q with q = triangle^-1 c
        if ctx.rounding is not None:
            rounding = ctx.rounding.to(triangle)
            rounding = torch.linalg.solve_triangular(triangle, rounding, upper=True, left=False)
        self.search = PatternSearch(self.U, self.B, self.U[:, :0], rounding)
        self.hints, column = column_guesses(self.columns, ctx.zero_rtol, ctx.threshold_count)
        self.guesses = torch.cat([row_guesses(ctx), column])
        self.queue = self.guesses[:0]
        self.hypothesis_queue = self.guesses[:0]  # guesses to search from delta hypotheses
        self.hypothesized = -1  # found directions when the last hypothesis pass began (-1: none)
        self.splitter = None
        if ctx.batch_size > SPLIT_ABOVE_BATCH:
            self.splitter = _splitter(self.B, p.next_grad_weight, ctx.zero_rtol)
        self.deeply = -1  # found directions when every one was last explained away (-1: never)
        self.split_queue = self._splittable(ctx, torch.arange(self.columns.shape[0], device=self.B.device))

    def has_work(self, ctx: ProposalContext) -> bool:
        """Whether a call would search anything."""
        if not applicable(ctx):
            return False
        self._prepare(ctx)
        queued = bool(self.queue.shape[0] or self.hints.shape[0] or self.hypothesis_queue.shape[0])
        queued = queued or bool(self.split_queue.numel())
        if queued or self._due(ctx) or ctx.found.shape[0] > self.explained:
            return True
        if ctx.found.shape[0] != self.hypothesized:  # a hypothesis pass is due
            return True
        if self.splitter is not None and ctx.found.shape[0] != self.deeply:  # a deep explanation
            return True
        return 0 < unfound(ctx) <= REMAINDER_MAX  # an SVD of the found: only where it decides

    def _due(self, ctx: ProposalContext) -> bool:
        """Whether a new pass over all guesses is due."""
        if self.passed < 0:
            return True
        grown = ctx.found.shape[0] - self.passed
        return grown >= max(1.0, self.requeue_growth * ctx.batch_size)

    def _refill(self, ctx: ProposalContext) -> None:
        """Explain away the directions found since the last refill (the pixel-side cascade): the
        columns that changed give new hints and guesses; start a new pass over all guesses when
        one is due."""
        found = ctx.found.to(ctx.L.dtype)
        if not self._explain(ctx):  # out of time: the run ends, nothing half-explained is kept
            return
        if self._due(ctx):
            self.passed = found.shape[0]
            self.queue = self.guesses
        elif self.queue.shape[0] == 0:
            self.queue = remainder_patterns(ctx, self.guesses_per_call)
        # the plain passes ran dry: every guess again, from hypotheses of its delta, once per
        # growth of the found directions (theirs join the hypotheses)
        empty = self.queue.shape[0] == 0 and self.hypothesis_queue.shape[0] == 0
        if empty and self.hypothesized != found.shape[0]:
            self.hypothesized = found.shape[0]
            self.hypothesis_queue = self.guesses

    def _explain(self, ctx: ProposalContext) -> bool:
        """Explain away the directions found since the last call from the feature columns: the
        columns that changed give new hints and guesses, and go to the front of the splits.
        False when the deadline cut it short."""
        found = ctx.found.to(ctx.L.dtype)
        if found.shape[0] <= self.explained:
            return True
        rows = torch.arange(self.columns.shape[0], device=self.columns.device)
        run = _run_length(ctx) if self.splitter is not None else MIN_RUN  # below: as before splits
        if self._explain_rows(ctx, found[self.explained :], rows, run) is None:
            return False
        self.explained = found.shape[0]
        return True

    def _explain_deeply(self, ctx: ProposalContext) -> None:
        """Once the splits run dry: explain away *every* found direction, again and again on the
        columns that changed, with runs as short as ``SHORT_RUN`` where the gradient is exact
        to float64 rounding. A found sample is read off a column only on the rows where it is
        the only active contributor; in a column of eight, that is about 4 of 1000 rows, too few
        for a run, until others leave it. MNIST b = 512 in the LT setting, seed 0 (columns
        split and explained with the ground truth scoring): the splits stall at 158 samples with
        the new directions explained once, at 226 like this."""
        found = ctx.found.to(ctx.L.dtype)
        self.deeply = found.shape[0]
        run = _run_length(ctx)
        rows = torch.arange(self.columns.shape[0], device=self.columns.device)
        for _ in range(DEEP_ROUNDS):
            changed = self._explain_rows(ctx, found, rows, run)
            if changed is None or changed.numel() == 0:
                return
            rows = changed

    def _explain_rows(
        self, ctx: ProposalContext, found: torch.Tensor, rows: torch.Tensor, run: int
    ) -> torch.Tensor | None:
        """Explain ``found`` (f, b) away from the feature columns at ``rows``; the columns that
        changed (their hints and guesses queued, their splits first), or None out of time."""
        known = found @ ctx.L.T
        rtol = max(RATIO_RTOL, RATIO_ZERO_SHARE * ctx.zero_rtol)
        before = self.columns[rows]
        unit = known / known.abs().amax(dim=1, keepdim=True)
        after = explain_away(
            before, unit, rtol=rtol, zero_rtol=ctx.zero_rtol, deadline=ctx.deadline, min_run=run
        )
        if after is None:  # out of time: the run ends, nothing half-explained is kept
            return None
        changed = rows[(after != before).any(dim=1)]
        self.columns[rows] = after
        hints, column = column_guesses(self.columns[changed], ctx.zero_rtol, ctx.threshold_count)
        self.hints = torch.cat([self.hints, hints])
        self.guesses = torch.cat([self.guesses, column])
        self.queue = torch.cat([self.queue, column])
        again = self._splittable(ctx, changed)
        self.split_queue = torch.cat([again, self.split_queue[~torch.isin(self.split_queue, again)]])
        return changed

    def _splittable(self, ctx: ProposalContext, index: torch.Tensor) -> torch.Tensor:
        """Of the feature columns at ``index``, those worth a split (none without a splitter):
        a mixture (fewer zero rows than the threshold; one sample's column is a hint as it
        stands) with at least a 2^-MOST_CONTRIBUTORS share of zero rows, most zero rows first."""
        if self.splitter is None or index.numel() == 0:
            return index[:0]
        columns = self.columns[index]
        scale = columns.abs().amax(dim=1, keepdim=True)
        zeros = (columns.abs() <= ctx.zero_rtol * scale).sum(dim=1)
        least = ctx.rows / 2**MOST_CONTRIBUTORS
        worth = (scale[:, 0] > 0) & (zeros >= least) & (zeros < ctx.threshold_count)
        order = torch.argsort(zeros[worth], descending=True, stable=True)
        return index[worth][order]

    def _split(self, ctx: ProposalContext, max_proposals: int) -> ProposalBatch:
        """Split up to ``SPLITS_PER_CALL`` queued feature columns (:func:`column_split.split_column`)
        and pin the patterns of those split whole: a proposal per column."""
        assert self.splitter is not None
        B, hypotheses = self.splitter
        count = min(SPLITS_PER_CALL, self.split_queue.numel(), max(1, max_proposals))
        patterns, done = [], 0
        for index in self.split_queue[:count].tolist():
            if ctx.deadline.passed():
                break
            column = self.columns[index]
            tol = ctx.zero_rtol * float(column.abs().max())
            split = column_split.split_column(column, B, hypotheses, tol, ctx.generator, ctx.deadline)
            done += 1
            if split is not None and split.complete:
                patterns.append(split.patterns)
        self.split_queue = self.split_queue[done:]
        b = ctx.batch_size
        pinned = self._pinned(ctx, torch.cat(patterns)) if patterns else ctx.L.new_zeros(0, b)
        hints, self.hints = self.hints, self.hints[:0]  # one sample's columns: exact zero sets
        hints = hints[hints.sum(dim=1) >= b - 1]
        directions = torch.zeros(hints.shape[0], b, dtype=ctx.L.dtype, device=ctx.L.device)
        return ProposalBatch(directions, n_drawn=max(1, done), zero_hint=hints, pinned=pinned)

    def _remainder_first(self, ctx: ProposalContext) -> None:
        """With at most ``REMAINDER_FIRST`` samples left, their inputs' guesses
        (:func:`remainder_patterns`) go to the front of the queue, once per growth of the found
        directions."""
        found = ctx.found.shape[0]
        if found == self.remainder_at or not 0 < unfound(ctx) <= REMAINDER_FIRST:
            return
        self.remainder_at = found
        self.queue = torch.cat([remainder_patterns(ctx, self.guesses_per_call), self.queue])

    def cost(self, ctx: ProposalContext) -> float:
        m, b = ctx.rows, ctx.batch_size
        upper = ctx.problem.next_weight if ctx.problem is not None else None
        k = upper.shape[0] if upper is not None else 1
        # a few sweeps on average (most guesses settle early), each two masked Gram products
        # and some dozens of flip steps
        search = self.guesses_per_call * TYPICAL_SWEEPS * (2 * m * b * k + 1000 * m)
        return search + hint_cost(ctx, self.guesses_per_call)

    def propose(self, ctx: ProposalContext, max_proposals: int) -> ProposalBatch:
        self._prepare(ctx)
        b = ctx.batch_size
        if self.splitter is not None:  # the splits come first: each found column shrinks others
            self._explain(ctx)
            if not self.split_queue.numel() and self.deeply != ctx.found.shape[0]:
                self._explain_deeply(ctx)
            if self.split_queue.numel():
                return self._split(ctx, max_proposals)
        if self.queue.shape[0] == 0:
            self._refill(ctx)
        self._remainder_first(ctx)
        hypotheses = self.queue.shape[0] == 0 and self.hypothesis_queue.shape[0] > 0
        found = (ctx.found.to(ctx.L.dtype) @ ctx.L.T).T  # every call deflates all found (cheap)
        if found.shape != self.search.found.shape or not torch.equal(found, self.search.found):
            self.search.deflate(found)
        hints, self.hints = self.hints, self.hints[:0]
        confirmed = torch.zeros(hints.shape[0], dtype=torch.bool, device=hints.device)
        queue = self.hypothesis_queue if hypotheses else self.queue
        per_call = (
            max(1, self.guesses_per_call // HYPOTHESES_PER_GUESS) if hypotheses else self.guesses_per_call
        )
        count = min(per_call, queue.shape[0], max(1, max_proposals))
        if ctx.deadline.passed():
            count = 0
        pinned = None
        guesses, queue = queue[:count], queue[count:]
        if hypotheses:
            self.hypothesis_queue = queue
        else:
            self.queue = queue
        if count:
            done = max(CONVERGED * ctx.zero_rtol**2, RATIO_FLOOR)
            if hypotheses:
                masks, ratio, delta = self._search_hypotheses(ctx, guesses, found, done)
            else:
                masks, ratio, delta = self.search.descend(
                    guesses, self.sweeps, self.flips, done, ctx.deadline
                )
            h = delta @ self.B.T
            y2 = ((masks * h) ** 2).sum(dim=1, keepdim=True)
            # a row is firm where flipping it would cost far more than the ratio reached
            firm = h**2 * self.search.P_diag > FIRM * ratio.clamp_min(done)[:, None] * y2
            settled = ratio < self.search.thresholds(masks, delta, done)
            converged = (~masks & firm)[settled]
            hints = torch.cat([hints, converged])
            # the layer above pins a converged pattern: its zero count need not pass the threshold
            confirmed = torch.cat([confirmed, torch.ones_like(converged[:, 0])])
            # too few zero rows for a kernel: the pattern itself may pin the column
            pinned = self._pinned(ctx, masks[settled][converged.sum(dim=1) < b - 1])
        enough = hints.sum(dim=1) >= b - 1
        hints, confirmed = hints[enough], confirmed[enough]
        directions = torch.zeros(hints.shape[0], b, dtype=ctx.L.dtype, device=ctx.L.device)
        # a call that had nothing to search or emit: nothing is left (auto moves on instead)
        spent = not count and hints.shape[0] == 0 and not ctx.deadline.passed()
        return ProposalBatch(
            directions,
            n_drawn=max(1, count),
            zero_hint=hints,
            exhausted=spent,
            confirmed=confirmed,
            pinned=pinned,
        )

    def _search_hypotheses(
        self, ctx: ProposalContext, guesses: torch.Tensor, found: torch.Tensor, done: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`PatternSearch.descend_from` each guess, from the ``HYPOTHESES_PER_GUESS``
        deltas of :func:`delta_hypotheses` nearest (in angle) the delta its pattern fits."""
        bank = delta_hypotheses(self.B, found, ctx.zero_rtol)
        if bank.shape[0] == 0:
            return self.search.descend(guesses, self.sweeps, self.flips, done, ctx.deadline)
        fitted = unit_rows(self.search.fit(guesses)[1])
        nearest = (fitted @ bank.T).abs().topk(min(HYPOTHESES_PER_GUESS, bank.shape[0]), dim=1).indices
        starts = guesses.repeat_interleave(nearest.shape[1], dim=0)
        sweeps, flips = min(self.sweeps, RELAXED_SWEEPS), min(self.flips, RELAXED_FLIPS)
        return self.search.descend_from(starts, bank[nearest.reshape(-1)], sweeps, flips, done, ctx.deadline)

    def _pinned(self, ctx: ProposalContext, patterns: torch.Tensor) -> torch.Tensor:
        """Directions (p, b) of the columns that converged ``patterns`` pin (:func:`pin_columns`),
        in ``ctx.L``'s coordinates (``L q`` is the column)."""
        patterns = torch.unique(patterns, dim=0)
        found = []
        for part in patterns.split(PIN_CHUNK):  # an SVD of m x (b + k) each: ~0.1 s at b = 512
            if ctx.deadline.passed():
                break
            columns, ok = pin_columns(self.U, self.B, part, ctx.zero_rtol)
            found.append(columns[ok])
        columns = torch.cat(found) if found else ctx.L.new_zeros(0, ctx.rows)
        if columns.shape[0] == 0:
            return ctx.L.new_zeros(0, ctx.batch_size)
        return lstsq(ctx.L, columns.T).T


__all__ = ["MaskedSubspaceProposer", "PatternSearch", "applicable", "explain_away"]
