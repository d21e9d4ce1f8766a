"""What "consistent" and "determined" mean for one layer: tolerances, ReLU-pattern matching both
ways, and which samples this layer's gradient alone cannot pin down.

**Tolerances.** Every threshold scales with the precision the gradient was computed in
(:class:`Tolerances`). An entry of ``dL/dZ`` (a column ``L q``) is

* *zero* when ``|.| <= zero_rtol * max`` (what the sparsity filter counts),
* *certainly zero* when ``|.| <= zero_floor * max`` (below the rounding noise of the data),
* *certainly nonzero* when ``|.| > zero_rtol * max``;

between ``zero_floor`` and ``zero_rtol`` it is a tiny genuine value or rounding noise, and the
data cannot tell which. A pre-activation ``z`` has a sign only when ``|z| > z_rtol * max|z|``.

**Consistency both ways** (:func:`pattern_matches`). A true sample has ``dL/dZ_ij = 0`` wherever
``z_ij <= 0`` (the ReLU's backward pass: exact) and, generically, ``dL/dZ_ij != 0`` wherever
``z_ij > 0``. An entry contradicts the ReLU when ``z`` is clearly negative and ``dL/dZ`` certainly
nonzero, or ``z`` clearly positive and ``dL/dZ`` certainly zero. Entries inside the tolerance
bands contradict nothing: a float32 gradient's tiny true entries (1e-6 of a column's maximum)
then no longer hold sigma below 1 (Definition 4.1, made tolerance-aware).

**Determined** (:func:`ambiguous_groups`). Any invertible Q reproduces dL/dW, so consistency
alone is not uniqueness. A column is *pinned* when ``L`` restricted to its zero set has a
one-dimensional kernel that survives deleting any single row (no *essential* row): then, for
gradients in general position (no exact cancellations between different samples' nonzero
entries), it is the only vector of ``col(L)`` with that zero set, and no mixture of columns can
be (a mixture of t columns vanishes on the intersection of their zero sets plus t - 1
coincidental rows, each of them essential). A batch whose columns are all pinned is the only
consistent one. Columns that are not pinned form *ambiguous groups*: samples that share (nearly)
the same activation pattern, whose span alone this layer determines, or whose zero set is too
small to pin anything (narrow layers). General position fails when two samples' columns are
proportional on the rows where both are nonzero (e.g. right below an output of width 1 or 2);
such pairs are reported as ambiguous too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from spear.core.deadline import NEVER, Deadline
from spear.core.filtering import DEFAULT_ZERO_RTOL, KERNEL_GAP_RTOL, kernel_of_rows
from spear.core.linalg import gram_ridge, row_products, solve_ex
from spear.core.verify import DEFAULT_VERIFY_RTOL

#: the floor below which an entry is certainly zero, as a fraction of ``zero_rtol``
ZERO_FLOOR_FRACTION = 1e-3
#: the band of undetermined pre-activation signs, as a fraction of ``verify_rtol``
Z_RTOL_FRACTION = 0.1
#: the bound noise / s_b overstates the error of true zeros of L q about five-fold (measured on
#: float32 clients: zeros up to 6.8e-7 of a column's maximum where the bound says 3.3e-6)
RESOLVABLE_SLACK = 10
#: a pin resting on rows that line up inside the zero band by chance more often than this
#: (expected number of such coincidences, see :func:`coincidental_pairs`) is not trusted
SPURIOUS_PIN_RATE = 1e-4
#: pairs of columns whose zero sets differ in more rows than this are not checked for
#: coincidences (the chance of that many coincidental rows is negligible at every precision)
COINCIDENCE_ROWS = 32
#: two columns whose 2 x 2 Gram matrix on their common support has s_2 / s_1 below this are
#: proportional there (general position fails for the pair)
PROPORTIONAL_RTOL = 1e-12


@dataclass(frozen=True)
class Tolerances:
    """Every threshold of one attack, derived from the dtype the gradient was computed in.

    Attributes:
        zero_rtol: entries of a column at most this times its max count as zero.
        zero_floor: entries at most this times the max are certainly zero (rounding noise).
        z_rtol: pre-activations at most this times the column's max |z| have no sign.
        verify_rtol: relative error of the recomputed gradients that still verifies.
    """

    zero_rtol: float
    zero_floor: float
    z_rtol: float
    verify_rtol: float

    @classmethod
    def for_dtype(
        cls, source_dtype: torch.dtype, zero_rtol: float | None = None, verify_rtol: float | None = None
    ) -> Tolerances:
        """Defaults for ``source_dtype``, overridden by the user's ``zero_rtol`` / ``verify_rtol``.

        float64 and float32 have measured defaults (``DEFAULT_ZERO_RTOL``,
        ``DEFAULT_VERIFY_RTOL``); half precisions (float16, bfloat16), whose true zeros of
        ``L q`` reach about 0.3 eps of a column's maximum, count entries up to eps as zero
        and verify to 10 eps.
        """
        eps = torch.finfo(source_dtype).eps
        zero = zero_rtol if zero_rtol is not None else DEFAULT_ZERO_RTOL.get(source_dtype, eps)
        verify = verify_rtol if verify_rtol is not None else DEFAULT_VERIFY_RTOL.get(source_dtype, 10 * eps)
        return cls(zero, zero * ZERO_FLOOR_FRACTION, verify * Z_RTOL_FRACTION, verify)


#: a noisy gradient's zero band is this many times its noise-to-batch ratio s_(b+1) / s_b
#: (the errors of L's columns reach about that ratio, see :func:`resolvable`)
NOISE_ZERO_FACTOR = 3.0


def noisy_tolerances(tol: Tolerances, noise_ratio: float) -> Tolerances:
    """``tol`` with the zero band widened to the gradient's noise (DP-SGD, a gradient sent with
    noise): entries of ``L q`` within ``NOISE_ZERO_FACTOR * s_(b+1) / s_b`` of a column's max
    count as zero. The verification tolerance stays: a noisy gradient is not reproduced to it,
    so nothing recovered from one is called verified."""
    zero = max(tol.zero_rtol, NOISE_ZERO_FACTOR * noise_ratio)
    return Tolerances(zero, zero * ZERO_FLOOR_FRACTION, tol.z_rtol, tol.verify_rtol)


def resolvable(singular_values: torch.Tensor, b: int, zero_rtol: float, eps: float) -> bool:
    """Whether zero sets can be trusted: the errors of L's columns, at most about ``noise / s_b``
    relative (noise: the first singular value beyond the batch, or eps s_max), stay within
    ``RESOLVABLE_SLACK * zero_rtol``. Nearly dependent samples (near-duplicates) make s_b tiny
    and their zero sets unreliable."""
    S = singular_values
    if b < 1 or float(S[0]) == 0.0:
        return False
    return float(S[b - 1]) * RESOLVABLE_SLACK * zero_rtol >= bound_noise(S, b, eps)


def bound_noise(singular_values: torch.Tensor, b: int, eps: float) -> float:
    """The bound on a gradient's rounding: its first singular value beyond the batch, or
    ``eps s_max`` where that is larger."""
    S = singular_values
    return max(float(S[b]) if b < S.numel() else 0.0, eps * float(S[0]))


def rounding_map(
    singular_values: torch.Tensor, b: int, eps: float, noise: float | None = None
) -> torch.Tensor:
    """The rounding map of the split's factor ``L = U_b S_b^1/2`` (b x b, diagonal): for any
    direction q, the computed ``L q`` is off by a vector of norm about ``||map q||`` (its entries
    by about ``||map q|| / sqrt(rows)``, :func:`spear.core.filtering.rounding_floor`).

    The computed factors reproduce dL/dW up to ``E``, ``||E|| ~ noise`` (the first singular
    value beyond the batch, or ``eps s_max``), so to first order ``L`` is off by
    ``E V S^-1/2``: a column whose direction leans on the batch's weakest singular values
    carries errors of ``noise / sqrt(s_i)`` per unit of ``q_i``. Relative to the column, that
    is ``noise / s_b`` for a sample whose gradient is faint (a well-classified sample: ~1e-7 at
    ``s_b / s_1 ~ 1e-9``), far above ``zero_rtol``; such a column's true zeros then fail the
    relative test, and the batch cannot reach sigma = 1 (Fashion-MNIST b = 256 in the LT
    setting: 2 of 256). It is a first-order estimate, not a bound (the review of this map:
    the zero-forcing solve can amplify it for near-duplicate zero sets), so its uses are capped
    (:data:`spear.core.filtering.FLOOR_CAP`, :data:`spear.core.verdict.LOOSEST_SAMPLE_RTOL`),
    and the attack applies it only where the batch is not resolvable and the gradient carries
    no more than rounding (:attr:`spear.core.reconstruct.AttackSetup.rounding`): in effect to
    float64 gradients with faint samples, whose other columns' floors lie far below
    ``zero_rtol * max``. ``noise``: that of :func:`measured_noise` instead (the gradient's own
    rounding as measured, for the per-entry floor of a column's zero set)."""
    S = singular_values.to(torch.float64)
    if noise is None:
        noise = bound_noise(S, b, eps)
    return torch.diag(noise / S[:b].clamp_min(torch.finfo(torch.float64).tiny).sqrt())


def measured_noise(singular_values: torch.Tensor, b: int, shape: tuple[int, int]) -> float | None:
    """The rounding of an m x n gradient (``shape``) as its spectrum shows it, where that lies
    below the bound ``eps s_max`` of :func:`rounding_map`; None where the gradient has no
    singular value beyond the batch.

    A gradient sent in float32 carries each entry's rounding relative to that entry, which is not
    ``eps s_max`` in norm: an m x n matrix of independent errors of size ``e`` has norm about
    ``e (sqrt(m) + sqrt(n))``, against ``e sqrt(mn)`` for its Frobenius norm, the scale of
    ``eps s_max``. Its first singular value beyond the batch is the norm of the part outside
    the batch's row and column spaces, ``(m - b) x (n - b)``; scaled up to the whole, it
    estimates the error's norm (measured: 0.07-0.22 eps s_max on float32 CNN heads trained 200
    steps; over the 5,616 columns of 148 float32 batches that are not resolvable, MLP and CNN
    layers trained 200 and 1000 steps, m = 256-1000, b = 16-64, the columns trusted at the
    floor it gives read their true zeros at most 0.35 of it, README "Tolerances"). It is
    never taken below float64's ``eps s_max``, the attack's own arithmetic: with float64 gradients
    that is the bound itself."""
    S = singular_values.to(torch.float64)
    m, n = shape
    if b >= S.numel() or b >= min(m, n) or float(S[0]) == 0.0:
        return None
    spread = (math.sqrt(m) + math.sqrt(n)) / (math.sqrt(m - b) + math.sqrt(n - b))
    return max(float(S[b]) * spread, torch.finfo(torch.float64).eps * float(S[0]))


#: a column fits the layer above (:func:`fits_the_layer_above`) when its residual is at most this
#: many times its tolerance: the zero tolerance of its norm plus its rounding error (true
#: columns: 1e-7 of their norm in float32; the mixtures it refuses: 0.6 and more)
LAYER_ABOVE_SLACK = 10.0
#: the fit takes the rows at least this many times above a column's zero threshold: a true
#: zero read just above the band (float32 trained heads: 1.5e-4 of the largest against 1e-4)
#: would otherwise ask ``W'^T delta`` to vanish there, and put a true column 2,000 times its
#: tolerance off (the review of this check)
LAYER_ABOVE_SUPPORT = 10.0
#: the check applies below next layers at most this wide, with at least ``2 k + 8`` rows: a
#: classifier head or a narrow layer (the cost is ``k^2`` per row and candidate; the
#: mixtures it refuses come from same-class samples whose ``delta`` agree, a narrow head's)
LAYER_ABOVE_MAX_WIDTH = 32
#: rows beyond k that a fit must rest on to tell (and, twice k plus this, that the layer needs)
LAYER_ABOVE_MARGIN = 8
#: candidates per batched solve
LAYER_ABOVE_CHUNK = 4096


def layer_above_applies(rows: int, width: int) -> bool:
    """Whether :func:`fits_the_layer_above` can tell samples from mixtures below a next layer
    ``width`` wide, on ``rows`` live rows."""
    return width <= LAYER_ABOVE_MAX_WIDTH and rows >= 2 * width + LAYER_ABOVE_MARGIN


def fits_the_layer_above(
    columns: torch.Tensor,
    next_weight: torch.Tensor,
    zero_rtol: float,
    floors: torch.Tensor | None = None,
    errors: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether columns (p, m) of dL/dZ can be samples' columns, given the linear layer ``W'``
    (k x m) that the attacked layer's ReLU feeds; and whether each fit *tells* (p,): it rests
    on more than ``k + 8`` rows, so that a column that is not of the form would not fit.

    The chain rule makes every sample's column ``D_j W'^T delta_j``: its ReLU pattern (0/1)
    applied to a vector of the k-dimensional range of ``W'^T``. So on its clearly nonzero rows
    (``LAYER_ABOVE_SUPPORT`` times above its zero threshold: ``zero_rtol`` of its largest
    entry, or its rounding floor ``floors`` (p,) where higher; rows in between are left out,
    true zeros read above the band and small true entries alike) a sample's column is one
    vector ``W'^T delta``, up to the gradient's rounding (``zero_rtol`` of its norm there, plus
    ``errors`` (p,): the norm of its rounding error,
    :func:`~spear.core.filtering.rounding_error`). A mixture of samples is not where their
    ``delta`` differ. Where two samples' ``delta`` agree to the zero tolerance (same-class
    samples of a float32 trained head), their difference cancels on the rows both activate and
    passes the sparsity filter with more zeros than either sample has, robust (trained digits
    head, b = 11: 50 such candidates with 35 to 56 zeros, against 5 to 24 for the samples); on
    its nonzero rows it is one sample's column on some and minus the other's on others, and its
    residual here is 0.6 to 0.7 of its norm.

    The form holds only where ``W'`` alone takes the layer's output: not for a FedAvg update
    (``W'`` moves between the local steps) nor where the output also feeds another layer; the
    attack applies the check once a telling fit shows it holds (``_Attack._samples_only``)."""
    B = next_weight.T.to(columns.dtype)
    k = B.shape[1]
    fits = torch.zeros(columns.shape[0], dtype=torch.bool, device=columns.device)
    telling = torch.zeros_like(fits)
    BB = row_products(B, B)
    for part in torch.arange(columns.shape[0], device=columns.device).split(LAYER_ABOVE_CHUNK):
        y = columns[part]
        size = y.abs()
        threshold = zero_rtol * size.amax(dim=1)
        if floors is not None:
            threshold = torch.maximum(threshold, floors[part].to(threshold))
        support = size > LAYER_ABOVE_SUPPORT * threshold[:, None]
        w = support.to(B.dtype)
        gram = (w @ BB).reshape(-1, k, k)  # (D B)^T (D B)
        on_support = w * y
        delta = solve_ex(gram + gram_ridge(gram), on_support @ B)[0]
        residual = (on_support - w * (delta @ B.T)).norm(dim=1)
        tolerance = zero_rtol * on_support.norm(dim=1)
        if errors is not None:
            tolerance = tolerance + errors[part].to(tolerance)
        fits[part] = residual <= LAYER_ABOVE_SLACK * tolerance
        telling[part] = support.sum(dim=1) > k + LAYER_ABOVE_MARGIN
    return fits, telling


def pattern_matches(
    z_t: torch.Tensor, zero: torch.Tensor, certain_zero: torch.Tensor | None, z_rtol: float
) -> torch.Tensor:
    """Which entries agree with the ReLU, both ways (see the module doc).

    Args:
        z_t: pre-activations (..., b, rows).
        zero: (..., b, rows) entries of dL/dZ counted as zero (``<= zero_rtol``).
        certain_zero: entries certainly zero (``<= zero_floor``); None: the same as ``zero``.
        z_rtol: |z| at most this times the column's max |z| has no sign.
    """
    refuting, silent = contradictions(z_t, zero, certain_zero, z_rtol)
    return ~(refuting | silent)


def contradictions(
    z_t: torch.Tensor, zero: torch.Tensor, certain_zero: torch.Tensor | None, z_rtol: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two ways an entry contradicts the ReLU (arguments as :func:`pattern_matches`):

    * *refuting*: ``z`` clearly negative and ``dL/dZ`` certainly nonzero. The backward pass of a
      ReLU is exact, so no sample, at any precision, has such an entry.
    * *silent*: ``z`` clearly positive and ``dL/dZ`` certainly zero. Generic, not certain: an
      active neuron's gradient is a sum over the layers above, and it falls below the zero floor
      by cancellation with a probability of about the floor per entry (a trained float32 MLP,
      m = 1000, b = 32: one entry of the true batch at 6.8e-8 of its column's largest, under
      the floor of 1e-7). Only the model can tell such an entry from a mixture's
      (:func:`spear.core.verdict.model_explains_silent`).
    """
    certain_zero = zero if certain_zero is None else certain_zero
    band = z_rtol * z_t.abs().amax(dim=-1, keepdim=True)
    return (z_t < -band) & ~zero, (z_t > band) & certain_zero


@dataclass(frozen=True)
class Determinacy:
    """Which columns of a selection this layer's gradient pins down (see the module doc).

    Attributes:
        pinned: (b,) bool, the column's zero set has a robust one-dimensional kernel.
        groups: ambiguous groups (sorted tuples of column indices); empty when all are pinned.
        reasons: one human-readable reason per group.
    """

    pinned: torch.Tensor
    groups: tuple[tuple[int, ...], ...]
    reasons: tuple[str, ...]

    @property
    def determined(self) -> bool:
        return not self.groups


def _union(groups: list[set[int]]) -> list[set[int]]:
    """Merge overlapping sets."""
    merged: list[set[int]] = []
    for g in groups:
        g = set(g)
        for other in [m for m in merged if m & g]:
            g |= other
            merged.remove(other)
        merged.append(g)
    return merged


def proportional_pairs(grad_outputs: torch.Tensor, zero: torch.Tensor) -> list[tuple[int, int]]:
    """Pairs of columns (m x b) that are proportional on >= 2 rows where both are nonzero: for
    them a mixture vanishes on every common row, and general position fails."""
    D = grad_outputs * (~zero).to(grad_outputs.dtype)
    M = (~zero).to(D.dtype)
    sq = D**2
    own = sq.T @ M  # own[j, k] = sum over rows where k is nonzero of D_j^2
    cross = D.T @ D
    common = M.T @ M
    det = own * own.T - cross**2
    tiny = PROPORTIONAL_RTOL * (own * own.T)
    hits = (det <= tiny) & (common >= 2)
    hits.fill_diagonal_(False)
    return [(int(j), int(k)) for j, k in hits.nonzero().tolist() if j < k]


def coincidental_pairs(values: torch.Tensor, zero: torch.Tensor, zero_rtol: float) -> list[tuple[int, int]]:
    """Pairs ``(j, k)`` where column j's pin against column k could be a coincidence in the band.

    Every mixture ``v_j + t v_k`` vanishes where both columns do; it is told apart from ``v_j``
    only by the rows ``D`` that are zero in ``v_j`` and not in ``v_k``. Inside a zero band of
    relative width ``zero_rtol`` a mixture can meet ``|D|`` such rows by chance: one by its free
    coefficient ``t``, each further row ``r`` with probability about
    ``zero_rtol max|v_j| / (2 w |v_k(r)|)``, where ``w`` (the median ``|v_j / v_k|`` over the rows
    both columns use) measures how the rows' crossing points ``t_r = -v_j(r) / v_k(r)`` spread.
    Over the ``C(N, |D|)`` choices of rows the expected number of such coincidences must stay
    below ``SPURIOUS_PIN_RATE``. In float64 (band 1e-9) two distinguishing rows suffice; in
    float32 (band 1e-4) they do not: two samples 1e-2 apart sharing one pattern yielded a
    mixture vanishing on two extra rows to 1e-7, pinned, that put a sample 3e-2 off.

    Args:
        values: (b, rows) the columns ``L q`` (one per row of this tensor).
        zero: (b, rows) their zero masks (``<= zero_rtol``).
    """
    Z = zero.to(values.dtype)
    shared = Z @ Z.T
    distinguishing = Z.sum(dim=1, keepdim=True) - shared  # [j, k] = |Z_j minus Z_k|
    candidates = (distinguishing <= COINCIDENCE_ROWS).fill_diagonal_(False)
    pairs = []
    for j, k in candidates.nonzero().tolist():
        if _expected_coincidences(values[j], values[k], zero[j], zero[k], zero_rtol) > SPURIOUS_PIN_RATE:
            pairs.append((min(j, k), max(j, k)))
    return sorted(set(pairs))


def _expected_coincidences(
    own: torch.Tensor, other: torch.Tensor, own_zero: torch.Tensor, other_zero: torch.Tensor, zero_rtol: float
) -> float:
    """Expected number of row sets like ``own``'s distinguishing rows that a mixture of the two
    columns meets by chance (see :func:`coincidental_pairs`)."""
    rows = own_zero & ~other_zero
    d = int(rows.sum())
    if d <= 1:
        return math.inf  # the same zero set, or one row the free coefficient meets anyway
    both = ~own_zero & ~other_zero
    if not bool(both.any()):
        return math.inf
    spread = float((own[both] / other[both]).abs().median())
    if spread == 0.0:
        return math.inf
    band = zero_rtol * float(own.abs().max())
    chance = (band / (2.0 * spread * other[rows].abs())).clamp(max=1.0)
    log_chance = torch.log(chance)
    log_rows = float(log_chance.sum() - log_chance.max())  # one row is met by the free coefficient
    n = int((~(own_zero & other_zero)).sum())
    log_choices = math.lgamma(n + 1) - math.lgamma(d + 1) - math.lgamma(n - d + 1)
    return math.exp(min(log_choices + log_rows, 700.0))


def zero_set_pins(L: torch.Tensor, zero: torch.Tensor, deadline: Deadline = NEVER) -> torch.Tensor:
    """(k,) whether each zero set (k x rows) of the factor ``L`` pins its direction: the kernel of
    ``L`` on it is one-dimensional and robust (:func:`spear.core.filtering.kernel_of_rows`)."""
    _, one_dim, robust = kernel_of_rows(L, zero, deadline)
    return one_dim & robust


def ambiguous_groups(
    L: torch.Tensor,
    directions: torch.Tensor,
    zero: torch.Tensor,
    certified: torch.Tensor | None = None,
    pinned: torch.Tensor | None = None,
    zero_rtol: float | None = None,
) -> Determinacy:
    """Pinned columns and ambiguous groups of a selection.

    Args:
        L: the sparse-side factor (rows x b).
        directions: (b, b) unit directions, one per row (the columns of Q up to scale).
        zero: (b, rows) their zero masks (``<= zero_rtol``).
        certified: (b,) bool, columns whose samples were already certified one by one (by
            peeling's two-layer certificate): they are never part of a group.
        pinned: (b,) bool, when already known (the candidate pool's robustness flags come from
            the same computation); else computed here.
        zero_rtol: the zero band the masks were taken with; given, pairs whose pins could be
            coincidences inside it (:func:`coincidental_pairs`) are ambiguous too.
    """
    b = directions.shape[0]
    if pinned is None:
        pinned = zero_set_pins(L, zero)
    sure = torch.zeros(b, dtype=torch.bool, device=L.device) if certified is None else certified.to(L.device)
    groups: list[set[int]] = []
    reasons: list[str] = []
    if b > 1:
        for j in (~pinned & ~sure).nonzero()[:, 0].tolist():
            sharing = _sharing_kernel(L, directions, zero[j], j)
            groups.append({j, *[k for k in sharing if not bool(sure[k])]})
    values = directions @ L.T
    pairs = proportional_pairs(values.T, zero.T)
    if zero_rtol is not None:
        pairs += coincidental_pairs(values, zero, zero_rtol)
    groups += [set(p) for p in pairs if not bool(sure[p[0]] | sure[p[1]])]
    merged = sorted((tuple(sorted(g)) for g in _union(groups)), key=lambda g: g[0])
    for g in merged:
        sizes = [int(zero[j].sum()) for j in g]
        if len(g) == 1:
            reasons.append(
                f"sample {g[0]}: its {sizes[0]} zero rows do not pin its direction (b={b}; a mixture "
                "of it with others fits them as well)"
            )
        else:
            reasons.append(
                f"samples {list(g)} share (nearly) one activation pattern: this layer determines only "
                "their span (their patterns differ in no row, or only in rows a mixture of them "
                "can meet by chance inside the zero band)"
            )
    return Determinacy(pinned, tuple(merged), tuple(reasons))


def _sharing_kernel(L: torch.Tensor, directions: torch.Tensor, rows: torch.Tensor, j: int) -> list[int]:
    """Other selected columns that vanish on the non-essential part of column j's zero set (they
    lie in the kernel that should have pinned j)."""
    sub = L[rows]
    if sub.shape[0] == 0:
        return [k for k in range(directions.shape[0]) if k != j]
    U, S, Vh = torch.linalg.svd(sub, full_matrices=True)
    rank = int((KERNEL_GAP_RTOL * S[0] < S).sum()) if S.numel() else 0
    if rank:
        leverage = (U[:, :rank] ** 2).sum(dim=1)
        keep = leverage < 1.0 - 1e-6
        if bool(keep.any()) and not bool(keep.all()):
            sub = sub[keep]
            _, S, Vh = torch.linalg.svd(sub, full_matrices=True)
            rank = int((KERNEL_GAP_RTOL * S[0] < S).sum()) if S.numel() else 0
    kernel = Vh[rank:]  # (dim, b)
    inside = (directions @ kernel.T).norm(dim=1) >= 1.0 - 1e-6
    return [k for k in inside.nonzero()[:, 0].tolist() if k != j]
