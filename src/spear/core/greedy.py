"""GreedyFilter (Algorithm 3) with the sparsity-matching coefficient sigma (Definition 4.1,
Algorithm 2).

Stage 1 (after Spielman et al., 2012) takes the sparsest candidates that raise the rank until
there are b of them. Stage 2 repeatedly applies the single swap (one selected direction for one
unselected candidate) that raises sigma most, until no swap helps or sigma = 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from spear.core.consistency import pattern_matches
from spear.core.deadline import NEVER, Deadline
from spear.core.scale import SINGULAR_RTOL, LayerProblem

#: how many candidate matrices are scored at once (memory ~ chunk * b * rows numbers)
SCORE_CHUNK_ELEMENTS = 2**24
#: residual norm below which a unit vector is in the span of the selected ones
RANK_RTOL = 1e-8
#: a swap whose new column has a component along the column it replaces below this (relative)
#: makes the matrix (nearly) singular: ranked invalid by the rank-one update
SWAP_PIVOT_RTOL = 1e-9
#: numbers per chunk of the rank-one swap scoring (several temporaries of this size are live;
#: 2**20 keeps them near the cache: 3x faster than 2**22 on a 2-core Xeon)
SWAP_CHUNK_ELEMENTS = 2**20
#: how many of the best-ranked swaps are re-scored exactly before a sweep gives up
SWAP_RESCORE = 8
#: how many more of a sweep's ranked swaps are tried, each scored exactly, after its best one
MORE_SWAPS = 64


@dataclass(frozen=True)
class Selection:
    """b candidate indices, their unscaled matrix, scales and score."""

    indices: tuple[int, ...]
    Qbar: torch.Tensor
    scales: torch.Tensor
    sigma: float
    consistent_columns: int  # columns whose every entry matches the ReLU pattern
    #: silent entries (active, gradient below the data's floor) that the model predicts below
    #: the zero band, and that alone hold sigma below 1 (:func:`spear.core.verdict.
    #: model_explains_silent`); 0 when sigma is 1 or not explained
    explained: int = 0
    #: refuting entries (an inactive neuron whose dL/dZ reads above the zero band) of faint
    #: columns, each within its column's rounding floor, that alone (with the silent ones
    #: above) hold sigma below 1 (:meth:`spear.core.reconstruct._Attack._explain_silent`)
    within_rounding: int = 0

    @property
    def perfect(self) -> bool:
        """sigma = 1, or every entry that holds it below 1 explained: by the model (silent
        entries) or by its column's rounding (refuting entries of faint columns)."""
        return self.sigma >= 1.0 or self.explained > 0 or self.within_rounding > 0


def score(
    problem: LayerProblem,
    Qbar: torch.Tensor,
    masks: torch.Tensor,
    certain_zero: torch.Tensor | None = None,
    z_rtol: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Score a batch of unscaled matrices (S, b, b) whose columns have zero masks (S, b, rows).

    Output mode: sigma of Definition 4.1, ``(sigma_- + sigma_+) / (m b)``, where sigma_- counts
    entries with Z <= 0 and dL/dZ = 0, sigma_+ entries with Z > 0 and dL/dZ != 0; made
    tolerance-aware by ``certain_zero`` (entries below the noise floor; default ``masks``) and
    ``z_rtol`` (pre-activations without a sign), see :func:`spear.core.consistency.pattern_matches`.
    Input mode: the fraction of entries of the ReLU-produced input X that are zero (by the
    mask) or positive.

    Returns (sigma, valid, scales, consistent_columns), all per matrix.
    """
    c, valid = problem.scales(Qbar)
    # singular or badly scaled sets are scored -1; give them a harmless stand-in for the algebra
    c = torch.where(valid.unsqueeze(-1), c, torch.ones_like(c))
    eye = torch.eye(Qbar.shape[-1], dtype=Qbar.dtype, device=Qbar.device)
    Qbar = torch.where(valid.view(-1, 1, 1), Qbar, eye)
    if problem.mode == "output":
        matches = pattern_matches(problem.pre_activations_t(Qbar, c), masks, certain_zero, z_rtol)
    else:
        values = (problem.sparse_factor @ Qbar).transpose(1, 2) * c.unsqueeze(-1)  # (S, b, n)
        # a ReLU output is zero (within the mask's tolerance: exact zeros come back as +-1e-16)
        # or positive; only a clearly negative entry contradicts it
        matches = masks | (values > 0)
    per_column = matches.sum(dim=-1)
    rows = masks.shape[-1]
    sigma = per_column.sum(dim=-1).to(torch.float64) / (rows * Qbar.shape[-1])
    consistent = (per_column == rows).sum(dim=-1)
    sigma = torch.where(valid, sigma, torch.full_like(sigma, -1.0))
    return sigma, valid, c, consistent


def sparsest_basis(
    directions: torch.Tensor,
    zero_counts: torch.Tensor,
    b: int,
    certified: torch.Tensor | None = None,
    rank_rtol: float = RANK_RTOL,
    preferred: torch.Tensor | None = None,
    partial: bool = False,
) -> list[int] | None:
    """Stage 1: greedily collect the sparsest candidates that raise the rank (Algorithm 3, l. 2-9),
    certified candidates (samples peeled exactly, :mod:`spear.core.peeling`) first, then the
    ``preferred`` ones (bool per candidate), then the rest. A candidate
    raises the rank when more than ``rank_rtol`` of it lies outside the span chosen so far: at
    least the angle within which candidates can be copies of one column (the gradient's
    precision, :func:`spear.core.reconstruct.copy_angle`).

    Returns b indices, or None when the candidates span fewer than b dimensions (with
    ``partial``: the indices found, however few)."""
    key = zero_counts.to(torch.float64)
    if key.numel():
        tier = float(key.max()) + 1.0
        if preferred is not None:
            key = key + preferred.to(torch.float64) * tier
        if certified is not None:
            key = key + certified.to(torch.float64) * 2 * tier
    order = torch.argsort(key, descending=True, stable=True).tolist()
    basis: list[torch.Tensor] = []
    chosen: list[int] = []
    for i in order:
        v = directions[i]
        for u in basis:
            v = v - (u @ v) * u
        norm = torch.linalg.vector_norm(v)
        if norm > rank_rtol:
            basis.append(v / norm)
            chosen.append(i)
            if len(chosen) == b:
                return chosen
    return chosen if partial else None


def _scored_chunks(
    problem: LayerProblem,
    directions: torch.Tensor,
    masks: torch.Tensor,
    sets: torch.Tensor,
    certain_zero: torch.Tensor | None,
    z_rtol: float,
    deadline: Deadline = NEVER,
) -> Iterator[tuple[torch.Tensor, tuple]]:
    """Candidate index sets (S, b) scored in memory-bounded chunks: for each chunk, its
    positions in ``sets`` and :func:`score`'s result. Past ``deadline`` no further chunk is
    scored."""
    b, rows = directions.shape[1], masks.shape[1]
    chunk = max(1, SCORE_CHUNK_ELEMENTS // (b * rows))
    for part in torch.arange(sets.shape[0], device=sets.device).split(chunk):
        if deadline.passed():
            return
        s = sets[part]
        zeros = None if certain_zero is None else certain_zero[s]
        yield part, score(problem, directions[s].transpose(1, 2), masks[s], zeros, z_rtol)


def _score_sets(
    problem: LayerProblem,
    directions: torch.Tensor,
    masks: torch.Tensor,
    sets: torch.Tensor,
    certain_zero: torch.Tensor | None,
    z_rtol: float,
):
    """Score candidate index sets (S, b) in memory-bounded chunks (:func:`_scored_chunks`)."""
    out = [scored for _, scored in _scored_chunks(problem, directions, masks, sets, certain_zero, z_rtol)]
    return tuple(torch.cat(parts) for parts in zip(*out, strict=True))


def _rank_afresh(
    problem: LayerProblem,
    directions: torch.Tensor,
    masks: torch.Tensor,
    sets: torch.Tensor,
    certain_zero: torch.Tensor | None,
    z_rtol: float,
    deadline: Deadline = NEVER,
) -> torch.Tensor:
    """sigma of each index set (S, b), each scored outright in :func:`_scored_chunks` (the
    swaps of input mode, and of a selection too ill-conditioned for :func:`swap_sigmas`). Past
    ``deadline`` the sets not scored yet stay at -1 (photos32 b = 256: one such ranking held an
    attack 38 s past its 240 s budget)."""
    out = torch.full((sets.shape[0],), -1.0, dtype=torch.float64, device=directions.device)
    for part, scored in _scored_chunks(problem, directions, masks, sets, certain_zero, z_rtol, deadline):
        out[part] = scored[0].to(out.dtype)
    return out


def _best_swap(
    problem: LayerProblem,
    directions: torch.Tensor,
    masks: torch.Tensor,
    certain_zero: torch.Tensor | None,
    z_rtol: float,
    current: torch.Tensor,
    free: torch.Tensor,
    outside: torch.Tensor,
    best_sigma: float,
    deadline: Deadline = NEVER,
    rank_rtol: float = RANK_RTOL,
):
    """The swap (selected position, unselected candidate) that raises sigma most, as (the new
    index set, its exact :func:`score`), or None when no swap raises it. A candidate within
    ``rank_rtol`` of the span of the directions it would join is never swapped in (the rank
    test of stage 1, :func:`sparsest_basis`): it is a copy of one of their samples, or a
    mixture of them, and takes a second place for it (:func:`_outside_the_rest`).

    Swaps are ranked by :func:`swap_sigmas` (rank-one updates, output mode) or scored outright
    (input mode, or a selection too ill-conditioned for the updates: :func:`_rank_afresh`); the
    best ones are then re-scored exactly, in order, and the first that is valid and better than
    ``best_sigma`` is taken, followed by the next-ranked ones that still help
    (:func:`_more_swaps`). Past ``deadline`` the ranking stops where it is (the swaps not ranked
    yet are left out)."""
    b = current.numel()
    pos, new = torch.meshgrid(free, outside, indexing="ij")
    sets = current.expand(pos.numel(), b).clone()
    sets[torch.arange(pos.numel()), pos.reshape(-1)] = new.reshape(-1)
    ranked = None
    if problem.mode == "output":
        ranked = swap_sigmas(
            problem, directions, masks, certain_zero, z_rtol, current, free, outside, deadline
        )
    if ranked is None:
        ranked = _rank_afresh(problem, directions, masks, sets, certain_zero, z_rtol, deadline)
    fresh = _swaps_outside_the_rest(directions, current, free, outside, rank_rtol)
    if fresh is not None:
        ranked = torch.where(fresh.reshape(ranked.shape), ranked, torch.full_like(ranked, -1.0))
    flat = ranked.reshape(-1)
    order = torch.argsort(flat, descending=True, stable=True)

    def exact(trial: torch.Tensor, position: int):
        if not _outside_the_rest(directions, trial, position, rank_rtol):
            return None
        return _score_sets(problem, directions, masks, trial[None], certain_zero, z_rtol)

    for rank, k in enumerate(order[:SWAP_RESCORE].tolist()):
        if float(flat[k]) <= best_sigma:
            return None
        scored = exact(sets[k], int(pos.reshape(-1)[k]))
        if scored is not None and float(scored[0][0]) > best_sigma:
            swaps = torch.stack([pos.reshape(-1), new.reshape(-1)], dim=1)
            rest = order[rank + 1 :]  # the ones ranked above k did not help
            return _more_swaps(exact, swaps, flat, rest, k, (sets[k], scored), best_sigma, deadline)
    return None


def _more_swaps(
    exact: Callable[[torch.Tensor, int], tuple | None],
    swaps: torch.Tensor,
    ranked: torch.Tensor,
    order: torch.Tensor,
    first: int,
    chosen: tuple,
    before: float,
    deadline: Deadline = NEVER,
):
    """After the sweep's best swap ``first`` (giving ``chosen``, a set and its score), the
    next-ranked ``swaps`` (position, candidate; tried in ``order``, those ranked below
    ``first``) that still raise sigma, each at another position with another candidate,
    applied in rank order and each scored ``exact``-ly on the set as it stands (None: not a
    valid swap there; at most ``MORE_SWAPS`` tries). The ranking comes from the set before
    any swap (sigma ``before``), so it only orders the tries; a sweep then does the work of
    several (a trained float32 layer climbed from sigma 0.75 to 0.974 in eight sweeps of
    2.5 s, one swap each). Past ``deadline`` no more are tried."""
    current, scored = chosen
    sigma = float(scored[0][0])
    positions, candidates = {int(swaps[first, 0])}, {int(swaps[first, 1])}
    tries = 0
    for k in order.tolist():
        if tries >= MORE_SWAPS or sigma >= 1.0 or float(ranked[k]) <= before or deadline.passed():
            break
        p, v = int(swaps[k, 0]), int(swaps[k, 1])
        if p in positions or v in candidates:
            continue
        tries += 1
        trial = current.clone()
        trial[p] = v
        result = exact(trial, p)
        if result is not None and float(result[0][0]) > sigma:
            current, scored, sigma = trial, result, float(result[0][0])
            positions.add(p)
            candidates.add(v)
    return current, scored


def _swaps_outside_the_rest(
    directions: torch.Tensor,
    current: torch.Tensor,
    free: torch.Tensor,
    outside: torch.Tensor,
    rank_rtol: float,
) -> torch.Tensor | None:
    """(len(free), len(outside)) whether each swap's candidate lies more than ``rank_rtol``
    (relative) outside the span of the directions that stay, or None where the selection is
    singular. With ``w = Qbar^-1 v``, v lies ``|w_k| / ||(Qbar^-1)_k||`` outside the span of
    the columns but k (row k of the inverse, normalized, is that span's normal)."""
    inverse, info = torch.linalg.inv_ex(directions[current].T)
    if int(info) != 0:
        return None
    rows = inverse[free]
    candidates = directions[outside]
    w = rows @ candidates.T
    reach = rows.norm(dim=1, keepdim=True) * candidates.norm(dim=1)[None, :]
    return w.abs() > rank_rtol * reach


def _outside_the_rest(
    directions: torch.Tensor, chosen: torch.Tensor, position: int, rank_rtol: float
) -> bool:
    """Whether the direction at ``position`` of the index set ``chosen`` lies more than
    ``rank_rtol`` (relative) outside the span of the others (:func:`_swaps_outside_the_rest`)."""
    here = torch.tensor([position], device=chosen.device)
    fresh = _swaps_outside_the_rest(directions, chosen, here, chosen[here], rank_rtol)
    return fresh is not None and bool(fresh[0, 0])


def swap_sigmas(
    problem: LayerProblem,
    directions: torch.Tensor,
    masks: torch.Tensor,
    certain_zero: torch.Tensor | None,
    z_rtol: float,
    current: torch.Tensor,
    free: torch.Tensor,
    outside: torch.Tensor,
    deadline: Deadline = NEVER,
) -> torch.Tensor | None:
    """sigma of every single swap of an output-mode selection (``len(free) x len(outside)``;
    -1 where the swap makes the matrix singular or the scales degenerate), by rank-one updates.

    Replacing column k of ``Qbar`` by v changes its inverse by Sherman-Morrison: with
    ``w = Qbar^-1 v``, row j of ``Qbar'^-1 A`` is ``(Qbar^-1 A)_j - (w_j - [j = k]) (Qbar^-1 A)_k
    / w_k`` for any A. With A = L^+ dL/db (the scales, Theorem 3.6) and A = R W^T (the
    pre-activations), each swap costs O(b m) instead of the O(b^3 + b^2 m) of scoring it
    afresh. Column k's own pre-activations do not change (its row of the inverse is fixed by
    the other columns up to the scale, which the bias gradient then fixes), only its masks
    become the candidate's. The swap :func:`greedy_filter` takes is re-scored exactly. None
    when the current matrix is singular or ill-conditioned (then every swap is scored afresh).
    Past ``deadline`` the positions not reached stay at -1 (one sweep at b = 512 with 500
    candidates held an attack minutes past its budget)."""
    Qbar = directions[current].T
    rhs = torch.cat([problem.pinv_grad_bias[:, None], problem.R_Wt, directions[outside].T], dim=1)
    sv = torch.linalg.svdvals(Qbar)
    if not bool(sv[-1] > SINGULAR_RTOL * sv[0]):
        return None  # the rank-one updates would rank from noise
    solved, info = torch.linalg.solve_ex(Qbar, rhs)
    if int(info) != 0:
        return None
    rows = problem.R_Wt.shape[1]
    # scales (b,), Qbar^-1 R W^T (b, rows), Qbar^-1 v for every unselected v (outside, b)
    c, Y, w_all = solved[:, 0], solved[:, 1 : rows + 1], solved[:, rows + 1 :].T
    sweep = _SwapSweep(problem, masks, certain_zero, z_rtol, current, outside, c, Y)
    out = torch.full((free.numel(), outside.numel()), -1.0, dtype=torch.float64, device=Y.device)
    chunk = max(1, SWAP_CHUNK_ELEMENTS // (Y.shape[0] * rows))
    for i, k in enumerate(free.tolist()):
        if deadline.passed():
            break
        sweep.move_to(k)
        for part in torch.arange(outside.numel(), device=Y.device).split(chunk):
            out[i, part] = sweep.sigmas(part, w_all[part])
    return out


class _SwapSweep:
    """:func:`swap_sigmas`' state: the current selection's scales ``c``, ``Y = Qbar^-1 R W^T``,
    its columns' masks and pre-activations, and what the swaps at the position ``k`` share
    (:meth:`move_to`).

    An entry of a column contradicts the ReLU when its pre-activation is negative (beyond the
    band ``z_rtol * max |z|`` of its column) where dL/dZ is nonzero, or positive where dL/dZ is
    surely zero (:func:`spear.core.consistency.pattern_matches`). sigma counts the entries that
    do not. After a swap, column j's pre-activations are ``z_j = (Y_j - s_j Y_k) / c'_j + bias``;
    the signs and the band are read off ``|c'_j| z_j`` (one batched product per chunk, no
    division), which a positive factor leaves as they are."""

    def __init__(
        self,
        problem: LayerProblem,
        masks: torch.Tensor,
        certain_zero: torch.Tensor | None,
        z_rtol: float,
        current: torch.Tensor,
        outside: torch.Tensor,
        c: torch.Tensor,
        Y: torch.Tensor,
    ) -> None:
        certain_all = masks if certain_zero is None else certain_zero
        b, rows = Y.shape
        self.c, self.z_rtol, self.size = c, z_rtol, b * rows
        self.nonzero, self.certain = ~masks[current], certain_all[current]  # (b, rows)
        # an entry is wrong when f u > band, f = -1 where nonzero, +1 where surely zero, 0
        # else (one product and one comparison per entry); None when an entry is both
        disjoint = not bool((self.nonzero & self.certain).any())
        self.flip = (self.certain.to(Y.dtype) - self.nonzero.to(Y.dtype))[:, None] if disjoint else None
        self.out_nonzero, self.out_certain = ~masks[outside], certain_all[outside]
        self.z_now = Y / c[:, None] + problem.bias  # column k's, before and after a swap at k
        self.band_now = z_rtol * self.z_now.abs().amax(dim=1)
        self.basis = torch.stack([Y, Y, problem.bias.expand(b, rows)], dim=1)  # (b, 3, rows)
        self.Y = Y
        self.k = -1
        self.own = torch.empty(0, dtype=torch.long, device=Y.device)

    def move_to(self, k: int) -> None:
        """The swaps at position k next: the basis of their products, and column k's
        contradictions with each candidate's masks (``own``, (outside,))."""
        self.k = k
        self.basis[:, 1] = self.Y[k]
        z, band = self.z_now[k], self.band_now[k]
        wrong = ((z < -band) & self.out_nonzero) | ((z > band) & self.out_certain)
        self.own = wrong.sum(dim=1)

    def sigmas(self, part: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """sigma (or -1) of swapping column k for the candidates ``part`` (indices into
        ``outside``), whose ``Qbar^-1 v`` are the rows of ``w`` (S, b)."""
        c, k = self.c, self.k
        pivot = w[:, k]
        shift = w.clone()
        shift[:, k] -= 1.0
        step = shift / torch.where(pivot == 0, torch.ones_like(pivot), pivot)[:, None]  # (S, b)
        c_new = c - step * c[k]
        sign, magnitude = torch.sign(c_new), c_new.abs()
        coef = torch.stack([sign, -sign * step, magnitude], dim=2).transpose(0, 1)  # (b, S, 3)
        u = torch.bmm(coef, self.basis)  # (b, S, rows): |c'_j| z_j
        # two reductions: torch.aminmax is about 8x slower than amax and amin apart on CPU
        high, low = u.amax(dim=2, keepdim=True), u.amin(dim=2, keepdim=True)
        band = self.z_rtol * torch.maximum(high, -low)
        if self.flip is not None:
            wrong = u.mul_(self.flip) > band
        else:
            wrong = ((u < -band) & self.nonzero[:, None]) | ((u > band) & self.certain[:, None])
        per_column = wrong.sum(dim=2)  # (b, S); column k's counted with its own masks instead
        contradictions = per_column.sum(dim=0) - per_column[k] + self.own[part]
        sigma = (self.size - contradictions).to(torch.float64) / self.size
        valid = (pivot.abs() > SWAP_PIVOT_RTOL * w.norm(dim=1)) & torch.isfinite(c_new).all(dim=1)
        valid &= magnitude.amin(dim=1) > 1e-12 * magnitude.amax(dim=1).clamp_min(1e-300)
        return torch.where(valid, sigma, torch.full_like(sigma, -1.0))


def _resume(
    problem: LayerProblem,
    directions: torch.Tensor,
    masks: torch.Tensor,
    zero_counts: torch.Tensor,
    certain_zero: torch.Tensor | None,
    z_rtol: float,
    certified: torch.Tensor | None,
    rank_rtol: float,
    start: list[int] | None,
):
    """Stage 1 preferring the candidates ``start`` after the certified ones: (its indices, its
    :func:`score`), or None without ``start``, or when it is not a valid (nonsingular,
    well-scaled) selection."""
    n = directions.shape[0]
    if not start:
        return None
    preferred = torch.zeros(n, dtype=torch.bool, device=directions.device)
    preferred[torch.tensor(start, device=directions.device)] = True
    chosen = sparsest_basis(directions, zero_counts, problem.batch_size, certified, rank_rtol, preferred)
    if chosen is None:
        return None
    current = torch.tensor(chosen, device=directions.device)
    scored = _score_sets(problem, directions, masks, current[None], certain_zero, z_rtol)
    return (current, scored) if bool(scored[1][0]) else None


def greedy_filter(
    problem: LayerProblem,
    directions: torch.Tensor,
    zero_masks: torch.Tensor,
    zero_counts: torch.Tensor,
    max_sweeps: int | None = None,
    certified: torch.Tensor | None = None,
    certain_zero: torch.Tensor | None = None,
    z_rtol: float = 0.0,
    deadline: Deadline = NEVER,
    rank_rtol: float = RANK_RTOL,
    start: list[int] | None = None,
) -> Selection | None:
    """Algorithm 3: stage 1, then greedy swaps that maximise sigma. None if rank < b.

    ``certified`` (bool per candidate) marks directions whose samples were recovered and
    checked one by one (:mod:`spear.core.peeling`): they are selected first and never swapped
    out, so the swaps only search the remaining positions. ``certain_zero`` and ``z_rtol``
    make sigma tolerance-aware (see :func:`score`), ``rank_rtol`` stage 1's rank test (see
    :func:`sparsest_basis`). Past ``deadline`` no further sweep starts: the selection so far is
    returned.

    ``start`` (candidate indices, e.g. where the swaps of the last selection ended) gives a
    second starting point: stage 1 with the certified candidates first, then these. The swaps
    start from it instead of stage 1's basis when it scores at least as high. A pool that grew
    by a few candidates, or a sample or two, then costs a sweep or two, not the climb from
    stage 1 again (a trained float32 layer: eight sweeps of 2.5 s each, per selection)."""
    b = problem.batch_size
    chosen = sparsest_basis(directions, zero_counts, b, certified, rank_rtol)
    if chosen is None:
        return None
    current = torch.tensor(chosen, device=directions.device)
    sigma, valid, c, consistent = _score_sets(
        problem, directions, zero_masks, current[None], certain_zero, z_rtol
    )
    resumed = _resume(
        problem, directions, zero_masks, zero_counts, certain_zero, z_rtol, certified, rank_rtol, start
    )
    if resumed is not None and float(resumed[1][0][0]) >= float(sigma[0]):
        current, (sigma, valid, c, consistent) = resumed
    if certified is not None:
        free = (~certified[current]).nonzero()[:, 0]
    else:
        free = torch.arange(b, device=directions.device)
    best_sigma = float(sigma[0])
    n_cand = directions.shape[0]
    sweeps = 0
    while best_sigma < 1.0 and n_cand > b and free.numel() and (max_sweeps is None or sweeps < max_sweeps):
        if deadline.passed():
            break
        sweeps += 1
        outside = torch.tensor(sorted(set(range(n_cand)) - set(current.tolist())), device=directions.device)
        swap = _best_swap(
            problem,
            directions,
            zero_masks,
            certain_zero,
            z_rtol,
            current,
            free,
            outside,
            best_sigma,
            deadline,
            rank_rtol,
        )
        if swap is None:
            break
        current, (s_sigma, valid, c, consistent) = swap
        best_sigma = float(s_sigma[0])
    if not bool(valid[0]):
        return None
    return Selection(
        indices=tuple(current.tolist()),
        Qbar=directions[current].T.contiguous(),
        scales=c[0],
        sigma=best_sigma,
        consistent_columns=int(consistent[0]),
    )
