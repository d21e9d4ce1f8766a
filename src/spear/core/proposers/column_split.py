"""Split a feature column of dL/dW into its samples' columns of dL/dZ through a known head.

Feature p's column of dL/dW is ``c = sum_j x_jp dL/dZ_j`` over the samples whose feature p is
nonzero (a few, for raw pixels or ReLU features). Below a known linear layer ``W'`` (k x m,
:mod:`spear.core.proposers.masked_subspace`) every such column is ``D_j B delta_j`` with
``B = W'^T``, so row i of ``c`` is

    c_i = B_i . v_S,   v_S = sum over j in S of v_j,   v_j = x_jp delta_j,

where S is the set of the column's contributors active at neuron i. The rows fall in classes,
one per active set, and each class lies on a hyperplane through the origin of the (k + 1)-
dimensional space of ``(B_i, c_i)``: with the *atoms* ``v_j`` known, each row is a unique subset
sum, and sample j's ReLU pattern on this column's support is the set of rows whose subset holds
j (rows where c vanishes hold none). That pattern is exact, and the layer above pins its column
(:func:`~spear.core.proposers.masked_subspace.pin_columns`), which checks it from scratch.

Finding the class vectors is a robust fit with a few percent of inliers (with four contributors,
a sixteenth of the rows per class). What makes it cheap is the head's saturation: a confident
classifier's ``delta = softmax - onehot`` lies near ``e_pred - e_label``, so on the rows where a
sample is active alone, ``c_i / (B_i . (e_a - e_c))`` nearly repeats one value for the right pair
(a, c). :func:`class_vectors` takes the densest windows of those log-ratios for every one-hot
difference (the *bands*), fits ``v`` exactly through k random rows of a band many times at once
(RANSAC) and keeps a fit that more than ``k + ACCEPT_EXTRA`` rows satisfy to the gradient's
rounding (random rows fit a wrong ``v`` with probability zero). Differences of class vectors
that rows satisfy are class vectors too (a found ``v_1 + v_2`` and ``v_1`` give ``v_2``), and
the atoms are those that are no sum of two others (:func:`atoms_of`). Rows already explained by
the atoms' subset sums leave the next round, which also searches the column minus each of those
subset sums: a row where a new sample is active beside known ones is then a row of the new
sample alone.

On MNIST in the LT-code paper's setting (m = 400, b = 96, the test's batch), columns of 2, 3
and 4 contributors split whole in 27 of 30, 22 of 26 and 9 of 14 cases. At b = 512 (m = 1000,
seed 0), with found samples removed from every column exactly (the ground truth standing in for
an explanation the server cannot yet make), the splits reach all 512 samples; with the
server's explanation, 204-274 of them in 240 s at seeds 0-2 (the README's "Columns split by their head
vectors").
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from spear.core.deadline import NEVER, Deadline
from spear.core.linalg import lstsq

#: width of a band: the log-ratio window (about 10% in ratio) that a sample's solo rows fill
BAND = 0.1
#: densest windows taken per one-hot difference, and the rows a window needs
PEAKS = 2
BAND_ROWS = 12
#: rows of a band the fits draw from, at most
WIDEST = 256
#: random minimal fits per band (one batched solve)
TRIALS = 200
#: a fit is a class vector when this many rows beyond its k defining ones satisfy it
ACCEPT_EXTRA = 6
#: a difference of class vectors is one when this many rows satisfy it
CLASS_ROWS = 6
#: rounds of band searches, each on the rows the atoms leave unexplained
ROUNDS = 5
#: subset sums of known atoms subtracted before a round's band search (the empty one included)
SHIFTS = 16
#: atoms kept per column (their subset sums: 2^10 - 1)
MOST_ATOMS = 10
#: two class vectors are one within this (relative), or within ``SAME_ROUNDING`` times the
#: rows' tolerance relative to the column where that is larger (float32: refits of one class
#: on different rows differ by ~1e-5, and their differences must not pass for classes)
SAME = 1e-6
SAME_ROUNDING = 10.0
#: class vectors kept per column, those that most rows fit first
MOST_CLASSES = 4 * MOST_ATOMS


@dataclass
class ColumnSplit:
    """What :func:`split_column` found in a feature column.

    Attributes:
        atoms: the contributors' vectors ``x_jp delta_j`` (r x k) found.
        patterns: each atom's active rows (r x m): the rows whose subset sum holds it.
        unexplained: rows (m,) that no subset sum of the atoms fits; where there are none, every
            pattern is exact on its own (up to the pin's check).
    """

    atoms: torch.Tensor
    patterns: torch.Tensor
    unexplained: torch.Tensor

    @property
    def complete(self) -> bool:
        return not bool(self.unexplained.any())


def one_hot_differences(k: int, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """Every ``e_a - e_c`` (a < c) of k classes: the deltas a confident classifier nearly has."""
    a, c = torch.triu_indices(k, k, offset=1, device=device)
    rows = torch.arange(a.numel(), device=device)
    differences = torch.zeros(a.numel(), k, dtype=dtype, device=device)
    differences[rows, a] = 1.0
    differences[rows, c] = -1.0
    return differences


def class_vectors(
    column: torch.Tensor,
    rows: torch.Tensor,
    B: torch.Tensor,
    hypotheses: torch.Tensor,
    tol: float,
    generator: torch.Generator,
) -> torch.Tensor:
    """Class vectors (n, k) that many of ``rows`` (indices) of ``column`` satisfy exactly
    (``|B_i . v - c_i| <= tol``), from bands along each hypothesis (module doc)."""
    k = B.shape[1]
    n = rows.numel()
    if n < k + ACCEPT_EXTRA or hypotheses.shape[0] == 0:
        return B.new_zeros(0, k)
    c, Br = column[rows], B[rows]
    along = Br @ hypotheses.T  # (n, h)
    usable = along.abs() > 1e-3 * along.abs().amax(dim=0, keepdim=True)
    ratio = c[:, None] / torch.where(usable, along, torch.ones_like(along))
    # log-ratios, the two signs far apart, unusable rows last
    key = ratio.abs().clamp_min(torch.finfo(c.dtype).tiny).log() + 100.0 * (ratio < 0)
    key = torch.where(usable, key, torch.full_like(key, float("inf")))
    key, order = key.sort(dim=0)
    starts, sizes = _peaks(key.T.contiguous(), usable.sum(dim=0), max(BAND_ROWS, k + 2))
    if starts.numel() == 0:
        return B.new_zeros(0, k)
    # each band's rows (P, width), padded past its size with its last row
    width = int(sizes.max())
    position = torch.arange(width, device=c.device)
    inband = position[None, :] < sizes[:, None]
    spot = starts[:, 1:] + torch.minimum(position[None, :], sizes[:, None] - 1)
    band = order.T[starts[:, 0]].gather(1, spot)
    # k distinct random rows inside each band, TRIALS times: a batched exact solve each
    noise = torch.rand(band.shape[0], TRIALS, width, generator=generator).to(c.device)
    noise = noise + 2.0 * ~inband[:, None, :]
    picks = band.gather(1, noise.topk(k, dim=2, largest=False).indices.reshape(band.shape[0], -1))
    picks = picks.reshape(band.shape[0], TRIALS, k)
    fits, info = torch.linalg.solve_ex(Br[picks], c[picks][..., None])  # (P, T, k, 1)
    # a fit's support among its band's rows; the best of each band is checked on all rows
    fits = fits[..., 0]
    inside = (torch.bmm(fits, Br[band].transpose(1, 2)) - c[band][:, None, :]).abs() <= tol
    support = (inside & inband[:, None, :]).sum(dim=2) * (info == 0)
    best = support.argmax(dim=1)
    candidates = fits[torch.arange(band.shape[0], device=c.device), best]
    candidates = candidates[support.gather(1, best[:, None])[:, 0] >= k + ACCEPT_EXTRA]
    vectors = []
    for v in candidates:  # refit on every row the fit explains
        on = (Br @ v - c).abs() <= tol
        vectors.append(lstsq(Br[on], c[on][:, None])[:, 0])
    return torch.stack(vectors) if vectors else B.new_zeros(0, k)


def _peaks(key: torch.Tensor, valid: torch.Tensor, least: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``PEAKS`` densest windows of width ``BAND`` in each sorted row of ``key`` (h, n; its
    first ``valid`` entries count): (P, 2) of (row, start) and their sizes (P,), at least
    ``least`` each and at most ``WIDEST`` (a window's first rows)."""
    h, n = key.shape
    position = torch.arange(n, device=key.device)
    ends = torch.searchsorted(key, key + BAND)
    counts = torch.where(position[None, :] < valid[:, None], ends - position[None, :], 0)
    found = []
    for _ in range(PEAKS):
        size, start = counts.max(dim=1)
        keep = size >= least
        found.append((torch.stack([torch.arange(h, device=key.device), start], dim=1)[keep], size[keep]))
        # windows overlapping this one are spent
        spent = (position[None, :] > (start - size)[:, None]) & (position[None, :] < (start + size)[:, None])
        counts = torch.where(spent, 0, counts)
    starts = torch.cat([s for s, _ in found])
    return starts, torch.cat([z for _, z in found]).clamp_max(WIDEST)


def atoms_of(vectors: torch.Tensor, same: float = SAME) -> torch.Tensor:
    """The class vectors (r, k) that are no sum of two others (within ``same``, relative)."""
    r = vectors.shape[0]
    if r < 3:
        return vectors
    sums = vectors[:, None, :] + vectors[None, :, :]  # (r, r, k)
    scale = vectors.norm(dim=1)
    close = (vectors[:, None, None, :] - sums[None]).norm(dim=3) <= same * scale[:, None, None]
    eye = torch.eye(r, dtype=torch.bool, device=vectors.device)
    distinct = ~eye[None, :, :] & ~eye[:, :, None] & ~eye[:, None, :]  # i, j, l pairwise distinct
    composite = (close & distinct).flatten(1).any(dim=1)
    return vectors[~composite]


def _distinct(vectors: torch.Tensor, same: float) -> torch.Tensor:
    """``vectors`` (n, k) without near-repeats (within ``same``, relative; the first kept)."""
    if vectors.shape[0] < 2:
        return vectors
    near = torch.cdist(vectors, vectors) <= same * vectors.norm(dim=1)[:, None]
    earlier = torch.ones_like(near).tril(diagonal=-1)
    return vectors[~(near & earlier).any(dim=1)]


def _satisfied(vectors: torch.Tensor, column: torch.Tensor, B: torch.Tensor, tol: float) -> torch.Tensor:
    """(n, m) which rows of ``column`` each vector fits exactly (zero rows excluded)."""
    active = column.abs() > tol
    return (((vectors @ B.T) - column[None, :]).abs() <= tol) & active[None, :]


def _close_under_differences(
    vectors: torch.Tensor, column: torch.Tensor, B: torch.Tensor, tol: float, same: float
) -> torch.Tensor:
    """Add the differences of class vectors that rows satisfy, until none is new; at most
    ``MOST_CLASSES`` are kept, those that most rows fit."""
    vectors = _most_fitted(vectors, column, B, tol)
    for _ in range(3):
        r = vectors.shape[0]
        if r < 2:
            return vectors
        eye = torch.eye(r, dtype=torch.bool, device=vectors.device)
        differences = (vectors[:, None, :] - vectors[None, :, :])[~eye]
        fits = _satisfied(differences, column, B, tol).sum(dim=1) >= CLASS_ROWS
        grown = _most_fitted(_distinct(torch.cat([vectors, differences[fits]]), same), column, B, tol)
        if grown.shape[0] == r and torch.equal(grown, vectors):
            return vectors
        vectors = grown
    return vectors


def _most_fitted(vectors: torch.Tensor, column: torch.Tensor, B: torch.Tensor, tol: float) -> torch.Tensor:
    """The ``MOST_CLASSES`` of ``vectors`` that most rows of ``column`` fit, in their order."""
    if vectors.shape[0] <= MOST_CLASSES:
        return vectors
    count = _satisfied(vectors, column, B, tol).sum(dim=1)
    keep = count.topk(MOST_CLASSES).indices.sort().values
    return vectors[keep]


def _subsets(r: int, device: torch.device) -> torch.Tensor:
    """Every nonempty subset of r atoms (2^r - 1, r) as 0/1 rows, smallest first."""
    members = [s for size in range(1, r + 1) for s in itertools.combinations(range(r), size)]
    table = torch.zeros(len(members), r, dtype=torch.bool, device=device)
    for i, s in enumerate(members):
        table[i, list(s)] = True
    return table


def split_column(
    column: torch.Tensor,
    B: torch.Tensor,
    hypotheses: torch.Tensor,
    tol: float,
    generator: torch.Generator,
    deadline: Deadline = NEVER,
) -> ColumnSplit | None:
    """The contributors' patterns in a feature ``column`` (m,) of dL/dW (module doc), with
    ``B = W'^T`` (m, k), deltas nearly along ``hypotheses`` (h, k) and rows that are exact
    to within ``tol`` (absolute). None when no class vector is found or ``deadline`` passes
    first (a column can take up to ``ROUNDS * SHIFTS`` band searches)."""
    k = B.shape[1]
    active = column.abs() > tol
    rows = active.nonzero()[:, 0]
    scale = float(column.abs().max())
    same = max(SAME, SAME_ROUNDING * tol / scale) if scale > 0 else SAME
    vectors = B.new_zeros(0, k)
    atoms, sums, table = vectors, vectors, _subsets(0, column.device)
    for _ in range(ROUNDS):
        shifts = torch.cat([B.new_zeros(1, k), sums[: SHIFTS - 1]])
        new = []
        for shift in shifts:  # a row of a new atom beside known ones is that atom's alone here
            if deadline.passed():
                return None
            found = class_vectors(column - B @ shift, rows, B, hypotheses, tol, generator)
            new += [found + shift, found]
        candidates = torch.cat(new)
        candidates = candidates[_satisfied(candidates, column, B, tol).sum(dim=1) >= CLASS_ROWS]
        if candidates.shape[0] == 0:
            break
        vectors = _distinct(torch.cat([vectors, candidates]), same)
        vectors = _close_under_differences(vectors, column, B, tol, same)
        atoms = atoms_of(vectors, same)[:MOST_ATOMS]
        table = _subsets(atoms.shape[0], column.device)
        sums = table.to(B.dtype) @ atoms
        explained = _satisfied(sums, column, B, tol).any(dim=0)
        rows = (active & ~explained).nonzero()[:, 0]
        if rows.numel() == 0:
            break
    if atoms.shape[0] == 0:
        return None
    fits = _satisfied(sums, column, B, tol)  # (2^r - 1, m)
    explained = fits.any(dim=0)
    first = fits.to(torch.uint8).argmax(dim=0)  # the smallest subset that fits each row
    patterns = table[first].T & explained[None, :]
    return ColumnSplit(atoms, patterns, active & ~explained)


__all__ = ["ColumnSplit", "atoms_of", "class_vectors", "one_hot_differences", "split_column"]
