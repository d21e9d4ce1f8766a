"""The one interface every direction proposer implements."""

from __future__ import annotations

import itertools
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from spear.core.deadline import NEVER, Deadline
from spear.core.scale import LayerProblem


@dataclass
class ProposalContext:
    """What a proposer may look at: the server-side factor ``L`` and the search state.

    Attributes:
        L: the sparse-side factor (rows x b, float64). ``L q`` is a column of dL/dZ (or of X in
            input-sparsity mode) up to scale when ``q`` is a true direction.
        batch_size: b.
        threshold_count: minimum number of zero entries of ``L q`` (tau * rows, Section 4.1).
        generator: the seeded random generator all randomness must come from.
        proposal_dtype: dtype proposals may be computed in (float32 for speed); the core re-solves
            every survivor in float64.
        found: exact, robust unit directions already accepted (k x b), for proposers that
            deflate or guide (non-robust candidates are left out, see core.filtering).
        problem: the layer (W, b, L, R, dL/db) for proposers that use more than L; all of it is
            what the server sees.
        known: exact directions the attack holds so far, including those of samples already
            peeled off (:mod:`spear.core.peeling`); a progress signal for schedulers, since
            ``found`` restarts when the attack moves on to a residual problem.
        key: unique per context: proposers cache per-problem state under it (a new context,
            e.g. a residual problem, is a new problem).
        zero_rtol: the sparsity filter's zero threshold for the gradient's precision
            (``spear.core.consistency.Tolerances``: 1e-9 in float64, 1e-4 in float32): the
            scale below which a relative singular value or entry of ``L``'s products is
            rounding noise, for proposers that test kernels and zeros themselves.
        deadline: the attack's time budget; a proposer whose call loops over chunks stops
            between them once it has passed (:mod:`spear.core.deadline`).
        noisy: the gradient carries noise (its rank exceeds the batch,
            :attr:`spear.core.lowrank.LowRankSplit.noisy`): exact zeros are blurred to
            ``zero_rtol``, and proposers that need exact kernels give way to the noise-robust one.
        rounding: the rounding map of ``L`` (:func:`spear.core.consistency.rounding_map`, in
            this context's coordinates), or None: entries of ``L q`` within ``||rounding q||``
            count as zero (the columns of faint samples).
        copy_angle: the angle within which two found directions can be copies of one column
            (:func:`spear.core.reconstruct.copy_angle`, at least the greedy selection's rank
            tolerance): proposers that count the found directions' span count such copies once.
    """

    L: torch.Tensor
    batch_size: int
    threshold_count: int
    generator: torch.Generator
    proposal_dtype: torch.dtype
    found: torch.Tensor
    problem: LayerProblem | None = None
    known: int = 0
    key: int = field(default_factory=itertools.count().__next__)
    zero_rtol: float = 1e-9
    deadline: Deadline = NEVER
    noisy: bool = False
    rounding: torch.Tensor | None = None
    copy_angle: float = 0.0

    @property
    def rows(self) -> int:
        return self.L.shape[0]


@dataclass
class ProposalBatch:
    """Rough proposals from one call.

    Attributes:
        directions: (k, b) candidate directions, any scale, any dtype.
        n_drawn: how many proposals the call examined (counts toward the proposal budget), which
            may be far more than ``k`` when the proposer filters internally.
        zero_hint: optional (k, rows) bool, the rows the proposer believes are zero in ``L q``;
            snapping solves for the kernel of exactly these rows.
        exhausted: True when the proposer has nothing more to offer (deterministic proposers).
        confirmed: optional (k,) bool, hints whose pattern the proposer has confirmed by other
            means than its zero count (:mod:`~spear.core.proposers.masked_subspace`: the known
            layer above pins a converged pattern). The sparsity threshold, which guards against
            mixtures passing on chance zeros, then asks only for the b - 1 rows of a kernel: a
            true column sparser than the threshold (Section 4.1 assumes 50% zeros) still counts.
        pinned: optional (p, b) exact directions that no zero set pins but the proposer's other
            evidence does (:mod:`~spear.core.proposers.masked_subspace`: a converged pattern of
            the known layer above with fewer than b - 1 zero rows, whose ``range(D W'^T)`` meets
            ``range(L)`` in one dimension only). Snapping takes them as they are, without a
            kernel step or the sparsity threshold; like any candidate they enter the batch only
            through the model's or the layers' certificates.
        below_threshold: the most zeros (of ``L q``'s rows) of a direction the proposer found
            sparse beyond chance but dropped for the sparsity threshold alone, before snapping
            (0: none). The attack reads it as it reads snapping's ``dropped_sparsest``: evidence
            that the columns are less sparse than the threshold asks, which calls its probe soon.
    """

    directions: torch.Tensor
    n_drawn: int
    zero_hint: torch.Tensor | None = None
    exhausted: bool = False
    confirmed: torch.Tensor | None = None
    pinned: torch.Tensor | None = None
    below_threshold: int = 0


def orthogonal_complement(vectors: torch.Tensor, dim: int, rtol: float = 0.0) -> torch.Tensor:
    """Orthonormal basis (dim x (dim - k)) of the complement of the span of k rows of
    ``vectors``; the identity when there are none. With ``rtol`` > 0 (unit rows), directions
    of that span whose singular value is at most ``rtol`` count as outside it: near-copies of
    one vector (within an angle of about ``rtol``) span one dimension, not two."""
    k = vectors.shape[0]
    if k == 0:
        return torch.eye(dim, dtype=vectors.dtype, device=vectors.device)
    _, S, Vh = torch.linalg.svd(vectors, full_matrices=True)
    if rtol > 0:
        k = int((rtol < S).sum())
    return Vh[k:].T


def rows_to_mask(rows: torch.Tensor, m: int) -> torch.Tensor:
    """(k, m) bool masks with the row indices ``rows`` (k x j) set."""
    mask = torch.zeros(rows.shape[0], m, dtype=torch.bool, device=rows.device)
    return mask.scatter_(1, rows, True)


def pool_subsets(
    order: torch.Tensor, pool: int | torch.Tensor, b: int, m: int, generator: torch.Generator
) -> torch.Tensor:
    """Guided-sampling hints (Section 6.3): for each row of ``order`` (row indices ranked most
    likely zero first), a random (b-1)-subset of its first ``pool`` entries, as an (k, m) mask.
    ``pool`` is one size for all, or one size per row."""
    if isinstance(pool, int):
        noise = torch.rand(order.shape[0], pool, generator=generator).to(order.device)
    else:
        width = order.shape[1]
        noise = torch.rand(order.shape[0], width, generator=generator).to(order.device)
        slots = torch.arange(width, device=order.device)[None, :] < pool[:, None]
        noise = torch.where(slots, noise, 2.0)  # only the first pool slots can be picked
    return rows_to_mask(order.gather(1, noise.argsort(dim=1)[:, : b - 1]), m)


#: a direction counts as ReLU-sparse with more than b - 1 + max(DENSE_SLACK_MIN,
#: DENSE_SLACK_FRACTION * rows) exact zeros (chance zeros of a dense column are far fewer)
DENSE_SLACK_MIN = 4
DENSE_SLACK_FRACTION = 0.02


def relu_sparse(zeros: int, b: int, rows: int) -> bool:
    """Whether a direction with ``zeros`` exact zeros (of ``rows``, batch size b) has more
    than the b - 1 it was solved on and the few a dense column gets by chance."""
    return zeros > b - 1 + max(DENSE_SLACK_MIN, math.ceil(DENSE_SLACK_FRACTION * rows))


def hint_cost(ctx: ProposalContext, hints: int) -> float:
    """Work of snapping ``hints`` (b-1)-row hints: a batched LU solve and a zero count each."""
    b, m = ctx.batch_size, ctx.rows
    return hints * (b**3 / 3 + m * b)


class DirectionProposer(ABC):
    """Proposes candidate directions ``q`` with sparse ``L q``."""

    #: short name used in statistics, the CLI and benchmarks
    name: str = "proposer"

    @abstractmethod
    def propose(self, ctx: ProposalContext, max_proposals: int) -> ProposalBatch:
        """Draw at most ``max_proposals`` proposals and return the promising ones."""

    def cost(self, ctx: ProposalContext) -> float:
        """Estimated floating-point work of one call, including snapping what it returns.

        Schedulers (:class:`AutoProposer`) use it to give stalled proposers equal compute; it
        must be deterministic (no timing), so that runs stay reproducible.
        """
        return hint_cost(ctx, 1)
