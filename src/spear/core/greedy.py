"""GreedyFilter (Algorithm 3) with the sparsity-matching coefficient sigma (Definition 4.1,
Algorithm 2).

Stage 1 (after Spielman et al., 2012) takes the sparsest candidates that raise the rank until
there are b of them. Stage 2 repeatedly applies the single swap (one selected direction for one
unselected candidate) that raises sigma most, until no swap helps or sigma = 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spear.core.consistency import pattern_matches
from spear.core.scale import LayerProblem

#: how many candidate matrices are scored at once (memory ~ chunk * b * rows numbers)
SCORE_CHUNK_ELEMENTS = 2**24
#: residual norm below which a unit vector is in the span of the selected ones
RANK_RTOL = 1e-8


@dataclass(frozen=True)
class Selection:
    """b candidate indices, their unscaled matrix, scales and score."""

    indices: tuple[int, ...]
    Qbar: torch.Tensor
    scales: torch.Tensor
    sigma: float
    consistent_columns: int  # columns whose every entry matches the ReLU pattern

    @property
    def perfect(self) -> bool:
        return self.sigma >= 1.0


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
    directions: torch.Tensor, zero_counts: torch.Tensor, b: int, certified: torch.Tensor | None = None
) -> list[int] | None:
    """Stage 1: greedily collect the sparsest candidates that raise the rank (Algorithm 3, l. 2-9),
    certified candidates (samples peeled exactly, :mod:`spear.core.peeling`) first.

    Returns b indices, or None when the candidates span fewer than b dimensions."""
    key = zero_counts.to(torch.float64)
    if certified is not None and key.numel():
        key = key + certified.to(torch.float64) * (float(key.max()) + 1.0)
    order = torch.argsort(key, descending=True, stable=True).tolist()
    basis: list[torch.Tensor] = []
    chosen: list[int] = []
    for i in order:
        v = directions[i]
        for u in basis:
            v = v - (u @ v) * u
        norm = torch.linalg.vector_norm(v)
        if norm > RANK_RTOL:
            basis.append(v / norm)
            chosen.append(i)
            if len(chosen) == b:
                return chosen
    return None


def _score_sets(
    problem: LayerProblem,
    directions: torch.Tensor,
    masks: torch.Tensor,
    sets: torch.Tensor,
    certain_zero: torch.Tensor | None,
    z_rtol: float,
):
    """Score candidate index sets (S, b) in memory-bounded chunks."""
    b, rows = directions.shape[1], masks.shape[1]
    chunk = max(1, SCORE_CHUNK_ELEMENTS // (b * rows))
    out = [
        score(
            problem,
            directions[s].transpose(1, 2),
            masks[s],
            None if certain_zero is None else certain_zero[s],
            z_rtol,
        )
        for s in sets.split(chunk)
    ]
    return tuple(torch.cat(parts) for parts in zip(*out, strict=True))


def greedy_filter(
    problem: LayerProblem,
    directions: torch.Tensor,
    zero_masks: torch.Tensor,
    zero_counts: torch.Tensor,
    max_sweeps: int | None = None,
    certified: torch.Tensor | None = None,
    certain_zero: torch.Tensor | None = None,
    z_rtol: float = 0.0,
) -> Selection | None:
    """Algorithm 3: stage 1, then greedy swaps that maximise sigma. None if rank < b.

    ``certified`` (bool per candidate) marks directions whose samples were recovered and
    checked one by one (:mod:`spear.core.peeling`): they are selected first and never swapped
    out, so the swaps only search the remaining positions. ``certain_zero`` and ``z_rtol``
    make sigma tolerance-aware (see :func:`score`)."""
    b = problem.batch_size
    chosen = sparsest_basis(directions, zero_counts, b, certified)
    if chosen is None:
        return None
    current = torch.tensor(chosen, device=directions.device)
    if certified is not None:
        free = (~certified[current]).nonzero()[:, 0]
    else:
        free = torch.arange(b, device=directions.device)
    sigma, valid, c, consistent = _score_sets(
        problem, directions, zero_masks, current[None], certain_zero, z_rtol
    )
    best_sigma = float(sigma[0])
    n_cand = directions.shape[0]
    sweeps = 0
    while best_sigma < 1.0 and n_cand > b and free.numel() and (max_sweeps is None or sweeps < max_sweeps):
        sweeps += 1
        outside = torch.tensor(sorted(set(range(n_cand)) - set(current.tolist())), device=directions.device)
        # every (free position in the selection, unselected candidate) swap
        pos, new = torch.meshgrid(free, outside, indexing="ij")
        sets = current.expand(pos.numel(), b).clone()
        sets[torch.arange(pos.numel()), pos.reshape(-1)] = new.reshape(-1)
        s_sigma, s_valid, s_c, s_consistent = _score_sets(
            problem, directions, zero_masks, sets, certain_zero, z_rtol
        )
        k = int(torch.argmax(s_sigma))
        if float(s_sigma[k]) <= best_sigma:
            break
        current = sets[k]
        best_sigma, valid, c, consistent = (
            float(s_sigma[k]),
            s_valid[k : k + 1],
            s_c[k : k + 1],
            s_consistent[k : k + 1],
        )
    if not bool(valid[0]):
        return None
    return Selection(
        indices=tuple(current.tolist()),
        Qbar=directions[current].T.contiguous(),
        scales=c[0],
        sigma=best_sigma,
        consistent_columns=int(consistent[0]),
    )
