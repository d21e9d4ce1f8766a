"""Zero sets from the layer above: exact intersections of the samples' ReLU patterns.

The server also sees the gradient of the next linear layer, ``dL/dW' = (dL/dZ') A^T`` with
``A = ReLU(Z)`` the activations of the attacked layer (m x b). Row k of it is
``sum_j (dL/dZ')_kj a_j``, a combination of the activation vectors of the samples that reach
neuron k of the next layer. Its exact zeros are therefore the neurons of the attacked layer that
are inactive for *all* of those samples: ``S_k = intersection of their zero sets``, and every
such sample's column of dL/dZ vanishes on ``S_k``. So the kernel of ``L[S_k]`` is spanned by the
directions ``q_j`` of those g samples (Theorem 3.3, applied to a set of columns instead of one):

* g = 1: ``S_k`` is (inside) one sample's zero set, and its kernel *is* the direction;
* small g: the g sparse directions of a g-dimensional subspace are found by sampling in it, i.e.
  by adding g-1 random rows outside ``S_k``, which succeeds with probability about
  ``g 2^-(g-1)`` (Lemma 5.2 with b = g) instead of ``b 2^-(b-1)``. A mixture of some of the g
  columns vanishes where they all do (and on the rows solved for), so of the directions found
  only those whose zeros no sparser one contains are proposed.

Every direction goes through the core's exact snapping, so a wrong one is rejected there. With no
exact zeros in the layer above (another activation, noise) the proposer has nothing to offer and
reports itself exhausted.
"""

from __future__ import annotations

import torch

from spear.core.filtering import first_occurrences
from spear.core.proposers.base import DirectionProposer, ProposalBatch, ProposalContext
from spear.errors import InputError

#: an entry of dL/dW' at most this times its row's largest entry is an exact zero
ZERO_RTOL = 1e-12
#: a direction dropped for the sparsity threshold alone is reported (``below_threshold``) when
#: it vanishes on more than this fraction of the rows outside its zero set: between the half a
#: column has where half the neurons are active (Section 4.1) and the quarter of a mixture of two
COLUMN_LIKE_FRACTION = 3 / 8
#: cost-estimate equivalent of the fixed work per zero set and call (see ``cost``)
PER_SET_OVERHEAD = 5e6
#: zero signatures compared at once in :func:`_maximal` (one matrix product per block)
MAXIMAL_BLOCK = 256


class NextLayerProposer(DirectionProposer):
    """Directions from the exact zero sets of the next layer's weight gradient.

    Args:
        max_dimension: largest kernel dimension g searched (cost ~ 2^g solves per zero set).
        tries_per_set: random row choices per zero set and call are ``tries_per_set * 2^(g-1)``.
        sets_per_call: zero sets handled per call.
    """

    name = "next_layer"

    def __init__(self, max_dimension: int = 12, tries_per_set: int = 4, sets_per_call: int = 64) -> None:
        if max_dimension < 1 or tries_per_set < 1 or sets_per_call < 1:
            raise InputError("NextLayerProposer needs max_dimension, tries_per_set, sets_per_call >= 1")
        self.max_dimension = max_dimension
        self.tries_per_set = tries_per_set
        self.sets_per_call = sets_per_call
        self._key: int | None = None
        self._sets: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._cursor = 0

    def _prepare(self, ctx: ProposalContext) -> None:
        if self._key == ctx.key:
            return
        problem = ctx.problem
        if problem is None or problem.mode != "output" or problem.next_grad_weight is None:
            raise InputError(
                "next-layer hints need the gradient of the next linear layer's weight "
                "(reconstruct(..., next_grad_weight=...) or attack_layer on a model that has one)"
            )
        self._key = ctx.key
        G = problem.next_grad_weight.to(ctx.L.dtype).abs()
        zero = ZERO_RTOL * G.amax(dim=1, keepdim=True) >= G
        b = ctx.batch_size
        # distinct zero sets, largest first (the fewest samples behind them)
        # (at least b rows: with fewer, L[S]'s kernel also holds directions that are no column)
        unique = torch.unique(zero[zero.sum(dim=1) >= b], dim=0)
        unique = unique[unique.sum(dim=1).argsort(descending=True, stable=True)]
        self._sets = []
        for mask in unique:
            if ctx.deadline.passed():
                break  # one SVD per set: at m = 4000, b = 200 the sets took 3.4 s past a 3 s budget
            # every set has >= b rows, so the reduced SVD already gives all b right singular vectors
            # (the same ones; in float64 the same bits in every case measured)
            _, sv, Vh = torch.linalg.svd(ctx.L[mask], full_matrices=False)
            rank = int((sv > ctx.zero_rtol * sv[0]).sum()) if sv.numel() else 0
            if 1 <= b - rank <= self.max_dimension:
                self._sets.append((mask, Vh[rank:].T.contiguous()))  # kernel basis K (b x g)
        self._cursor = 0

    @property
    def zero_sets(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The usable zero sets with their kernel bases (b x g), after the first call."""
        return self._sets

    def has_zero_sets(self, ctx: ProposalContext) -> bool:
        """Whether the next layer's gradient has usable zero sets (else nothing to propose)."""
        self._prepare(ctx)
        return bool(self._sets)

    def cost(self, ctx: ProposalContext) -> float:
        # per zero set of the next call: the tries' small SVDs and products, a fixed overhead
        # (a Python-level step per set), and an exact re-solve (m x b^2) of what it returns
        self._prepare(ctx)
        m, b = ctx.rows, ctx.batch_size
        work = 0.0
        for i in range(min(self.sets_per_call, len(self._sets))):
            g = self._sets[(self._cursor + i) % len(self._sets)][1].shape[1]
            tries = self.tries_per_set * 2 ** (g - 1) if g > 1 else 1
            work += tries * (10 * g**3 + m * g) + PER_SET_OVERHEAD + m * b * b
        return work

    def _directions_in(
        self, ctx: ProposalContext, mask: torch.Tensor, K: torch.Tensor
    ) -> tuple[torch.Tensor, int]:
        """Sparse directions of the subspace K: kernels of g-1 random rows outside the zero set,
        kept when L q has zeros beyond the rows chosen (a generic mixture of the g columns has
        none) and as many as the sparsity threshold asks, and only the maximal zero signatures
        among them (:func:`_maximal`); with the most zeros of the column-like ones it dropped for
        the threshold alone (:attr:`ProposalBatch.below_threshold`, see ``COLUMN_LIKE_FRACTION``).
        Rows on which the whole subspace vanishes (:func:`_informative_rows`) are never chosen
        and count as zeros of every direction, as they would inside the zero set."""
        g = K.shape[1]
        none = K.new_empty(0, K.shape[0])
        if g == 1:
            return K.T, 0
        M = ctx.L @ K  # (m, g): L on the subspace
        outside, flat = _informative_rows(M, ~mask, ctx.zero_rtol)
        if outside.numel() < g - 1:
            return none, 0
        tries = self.tries_per_set * 2 ** (g - 1)
        noise = torch.rand(tries, outside.numel(), generator=ctx.generator).to(M.device)
        picks = outside[noise.topk(g - 1, dim=1, largest=False).indices]  # (tries, g-1), distinct
        # kernel of the g-1 chosen rows: the last column of a complete QR of their transpose
        v = torch.linalg.qr(M[picks].transpose(1, 2), mode="complete")[0][:, :, -1]
        values = (M[outside] @ v.T).abs()  # (outside, tries)
        zero = values <= ctx.zero_rtol * values.amax(dim=0, keepdim=True)  # each try's own scale
        zeros = zero.sum(dim=0)
        # more zeros than the chosen rows (a column, not a mixture) and enough of them in all
        sparse, total = zeros > 2 * (g - 1), zeros + int(mask.sum()) + flat
        good = sparse & (total >= ctx.threshold_count)
        # dropped for the threshold alone, and nearer a column's half of the rows outside the set
        # than the quarter a mixture of two of the g columns keeps (their shared zeros)
        column_like = sparse & ~good & (zeros > COLUMN_LIKE_FRACTION * outside.numel())
        below = int(total[column_like].max()) if bool(column_like.any()) else 0
        if not bool(good.any()):
            return none, below
        q = v[good] @ K.T
        signature = zero[:, good]
        first = first_occurrences(signature.T, None)
        return q[first[_maximal(signature.T[first], g - 1)]], below

    def propose(self, ctx: ProposalContext, max_proposals: int) -> ProposalBatch:
        self._prepare(ctx)
        b = ctx.batch_size
        if not self._sets:  # none usable; or the deadline cut the preparation: the time budget stops
            exhausted = not ctx.deadline.passed()
            return ProposalBatch(ctx.L.new_empty(0, b), n_drawn=0, exhausted=exhausted)
        count = min(self.sets_per_call, len(self._sets))
        chunk = [self._sets[(self._cursor + i) % len(self._sets)] for i in range(count)]
        self._cursor = (self._cursor + count) % len(self._sets)
        found, tried, below = [], 0, 0
        for mask, K in chunk:
            if ctx.deadline.passed():
                break
            directions, dropped = self._directions_in(ctx, mask, K)
            found.append(directions)
            below = max(below, dropped)
            tried += self.tries_per_set * 2 ** (K.shape[1] - 1) if K.shape[1] > 1 else 1
        directions = torch.cat(found) if found else ctx.L.new_empty(0, b)
        return ProposalBatch(directions, n_drawn=tried, below_threshold=below)


def _informative_rows(
    M: torch.Tensor, candidates: torch.Tensor, zero_rtol: float
) -> tuple[torch.Tensor, int]:
    """The rows of ``candidates`` where some direction of the subspace is nonzero, and how many
    are not: rows every sample behind the set leaves inactive. They belong in the zero set, but a
    float32 gradient's rounding can keep them out of it; there they vanish for every direction, so
    they would make every mixture look sparse and, picked as rows to solve, leave its kernel free.

    Judged on an orthonormal basis of ``M``'s columns (the span of the g samples' columns, whatever
    their scales), each basis vector against its own largest entry: a faint sample's rows stay."""
    U = torch.linalg.svd(M, full_matrices=False)[0].abs()
    rows = candidates.nonzero()[:, 0]
    flat = (U[rows] <= zero_rtol * U.amax(dim=0)).all(dim=1)
    return rows[~flat], int(flat.sum())


def _maximal(signatures: torch.Tensor, slack: int) -> torch.Tensor:
    """Indices of the zero signatures (k x rows) that no sparser one contains, but for at most
    ``slack`` of their rows; taken sparsest first, each against those kept (block by block:
    thousands of signatures that do not nest cost matrix products, not a loop of them).

    A mixture of some of the g columns vanishes where all of them do, and on the g - 1 rows it
    was solved on (``slack``): but for those, its zeros lie inside each column's. Where the
    samples behind a set are sparse (a trained network), mixtures keep many zeros and pass as
    sparse by the thousand once the search has lowered its threshold; the columns are the
    maximal ones. A sample whose active rows contain all of another's can go with the mixtures
    here; it comes once the other is peeled."""
    S = signatures.to(torch.float32)
    size = S.sum(dim=1)
    order = size.argsort(descending=True, stable=True)
    S, size = S[order], size[order]
    keep = torch.zeros(S.shape[0], dtype=torch.bool, device=S.device)
    for start in range(0, S.shape[0], MAXIMAL_BLOCK):
        block, sizes = S[start : start + MAXIMAL_BLOCK], size[start : start + MAXIMAL_BLOCK]
        need = (sizes - slack)[:, None]
        kept = keep[:start].nonzero()[:, 0]
        # inside a sparser one kept before this block; then inside a sparser one kept in it
        local = ~((block @ S[kept].T >= need) & (size[kept][None, :] > sizes[:, None])).any(dim=1)
        inside = ((block @ block.T >= need) & (sizes[None, :] > sizes[:, None])).cpu()
        local = local.cpu()
        for i in range(1, local.numel()):
            local[i] = local[i] and not bool((inside[i, :i] & local[:i]).any())
        keep[start : start + MAXIMAL_BLOCK] = local.to(keep.device)
    return order[keep].sort().values
