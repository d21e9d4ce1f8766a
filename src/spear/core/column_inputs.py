"""Inputs of found columns: a sample's input read off the columns found so far, pinned by its
own zeros.

Output-side search finds columns ``dL/dZ_j = L q_j`` (exact directions, the pool), and the
inputs follow only from all b at once: ``x_j = r_j R`` with ``r_j`` row j of ``Q^-1``
(Algorithm 1). With k < b columns known, the row of the pseudo-inverse of the k directions
gives ``x_j`` plus a combination of the other samples' inputs, weighted by how far their
columns lie along ``L q_j`` (SPEAR, Theorem 3.1's factorization ``dL/dW = (L Q)(Q^-1 R)``).
Where the columns not found are faint (confident samples, whose gradients are 1e-4 to 1e-5 of
the others': a trained network in float32) or nearly orthogonal to ``L q_j``, that trace lies
far below the input's entries, and its *zeros* read as the sample's own: a ReLU output (a
hidden layer, a CNN's pooled features) is exactly zero on about half its features.

Those zeros pin the input (:mod:`spear.core.input_peeling`, step 1): the kernel of ``R^T`` on
them is one-dimensional, and its vector is the sample's input exactly, the trace gone. Each
such candidate is then completed and checked as any input-side candidate is (its scale from
dL/db, its ReLU pattern pinning its column, and the model's certificate), so a wrong one
costs a check and nothing else. Found on the float32 CNN head trained 200 steps (MNIST,
b = 64, seed 4): the pool never held 64 independent columns, and nothing was certified in
30 s. Its 63 independent columns gave 46 inputs whose zeros pin them, 44 of them within
3.3e-4 of a true sample; the attack now certifies 44 samples in those 30 s (each within
1.4e-4 of the largest feature). The kernel tests must be judged in orthonormal bases for
that (:class:`~spear.core.input_peeling.OrthonormalFactor`).

With b - 1 independent columns found, the trace need not be faint: it is one sample's. The
missing sample's dual is orthogonal to every found direction (``Q^-1 Q = I``), so it spans
the complement of their span and gives that sample's input (up to scale); and each row of
the pseudo-inverse, whose dual is fixed up to that one, reads its sample's input plus a
multiple ``c`` of the missing input. On every feature the sample lacks and the missing one
has, the row reads ``c`` times the missing input: of the ratios row / missing, ``c`` is the
one that leaves the row the most zeros. Found on Fashion-MNIST's float32 CNN head trained 200
steps (b = 64, seed 0): 63 of 64 columns found, the missing one faint (3.5e-4 of the
largest) but its trace 5e-4 to 8e-3 of the inputs, which hid the zeros of 16 strong samples.

Only server-side quantities are used: the found directions, L and R (from dL/dW), and the
peeled samples.
"""

from __future__ import annotations

import torch

from spear.core.consistency import Tolerances
from spear.core.deadline import NEVER, Deadline
from spear.core.filtering import zero_mask
from spear.core.greedy import sparsest_basis
from spear.core.input_peeling import OrthonormalFactor
from spear.core.peeling import PeeledSamples, peel_chunks
from spear.core.singletons import distinct_inputs


def column_input_candidates(
    R: torch.Tensor,
    directions: torch.Tensor,
    zero_counts: torch.Tensor,
    peeled: PeeledSamples,
    inputs: OrthonormalFactor,
    tol: Tolerances,
    rank_rtol: float,
    tried: set[bytes],
    deadline: Deadline = NEVER,
) -> torch.Tensor:
    """Unit coefficient vectors (k', b) of candidate inputs ``x = R^T r`` (module doc): one per
    found direction that raises the rank (stage 1 of Algorithm 3,
    :func:`~spear.core.greedy.sparsest_basis`, however few: a direction within ``rank_rtol``
    of those before it is a copy or a mixture of them) whose estimated input reads at least
    b - 1 zeros among the live features (``zero_rtol`` of its largest entry; a feature no
    sample has, zero in every row of R, tells nothing) and no clearly negative entry
    (``verify_rtol``), each replaced by the kernel of ``R^T`` on those zeros where that
    kernel is one-dimensional (``inputs``: R^T's orthonormal basis). A zero set in ``tried``
    is not solved again (its kernel would not change); the ones solved here join it, and so
    does the basis once every zero set of it is (the same basis gives nothing new). The
    inputs of ``peeled`` samples and repeats are left out
    (:func:`~spear.core.singletons.distinct_inputs`). The kernels are solved in chunks
    (:func:`~spear.core.peeling.peel_chunks`); past ``deadline`` the rest are left unsolved
    (and untried)."""
    b = R.shape[0]
    chosen = sparsest_basis(directions, zero_counts, b, rank_rtol=rank_rtol, partial=True)
    if not chosen:
        return R.new_zeros(0, b)
    q = directions[chosen].to(R.dtype)  # (k, b)
    basis_key = b"basis" + q.cpu().numpy().tobytes()  # every zero set of this basis tried
    if basis_key in tried:
        return R.new_zeros(0, b)
    duals = torch.linalg.pinv(q.T)  # (k, b): r_j . q_i = delta_ij within the k found
    feature = R.abs().amax(dim=0)
    live = feature > tol.zero_floor * feature.max()
    x = duals @ R
    if len(chosen) == b - 1:
        x = _with_the_missing_input(x, q, R, live, tol.zero_rtol, deadline)
    elif 2 <= b - len(chosen) <= TRACES_AT_MOST:
        x = _without_traces(x, _missing_span(q, R), live, tol.zero_rtol, deadline)
    x = x * torch.where(x.sum(dim=1, keepdim=True) < 0, -1.0, 1.0)
    size = x.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)
    zeros = zero_mask(x, tol.zero_rtol) & live
    plausible = (zeros.sum(dim=1) >= b - 1) & (x.amin(dim=1) >= -tol.verify_rtol * size[:, 0])
    keys = {i: zeros[i].cpu().numpy().tobytes() for i in plausible.nonzero()[:, 0].tolist()}
    for i, key in keys.items():
        plausible[i] = key not in tried
    pinned = torch.zeros_like(plausible)
    r = R.new_zeros(x.shape[0], b)
    for part in peel_chunks(plausible.nonzero()[:, 0], int(zeros.sum(dim=1).max()), b):
        if deadline.passed():
            break
        pinned[part], _, r[part], _ = inputs.kernel(zeros[part], tol.verify_rtol)
        tried.update(keys[i] for i in part.tolist())
    if not deadline.passed():
        tried.add(basis_key)
    r = r[pinned]
    r = r * torch.where((r @ R).sum(dim=1, keepdim=True) < 0, -1.0, 1.0)
    return r[distinct_inputs(r, peeled.coefficients)]


def _with_the_missing_input(
    x: torch.Tensor,
    q: torch.Tensor,
    R: torch.Tensor,
    live: torch.Tensor,
    zero_rtol: float,
    deadline: Deadline = NEVER,
) -> torch.Tensor:
    """The estimated inputs x (b - 1, n) of the b - 1 independent found directions ``q``
    without the missing sample's trace (:func:`_without_trace`), then that sample's own input
    (:func:`_missing_input`): (b, n)."""
    missing = _missing_input(q, R)
    return torch.cat([_without_trace(x, missing, live, zero_rtol, deadline), missing[None]])


def _missing_input(q: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """The input (n,) of the one sample whose column is not among the b - 1 independent found
    directions ``q`` (b - 1, b), up to scale: its dual ``r`` satisfies ``r . q_i = 0`` for every
    found ``q_i`` (Theorem 3.1's ``Q^-1 Q = I``), so it spans the orthogonal complement of
    their span, and ``x = r R``."""
    return _missing_span(q, R)[0]


def _missing_span(q: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """(d, n) a basis of the inputs of the d = b - k samples whose columns are not among the k
    independent found directions ``q`` (k, b): their duals span the orthogonal complement of
    the found directions (:func:`_missing_input`), read through R."""
    complement = torch.linalg.svd(q, full_matrices=True).Vh[q.shape[0] :]  # (d, b): q @ it = 0
    return complement @ R


def _without_traces(
    x: torch.Tensor, span: torch.Tensor, live: torch.Tensor, zero_rtol: float, deadline: Deadline = NEVER
) -> torch.Tensor:
    """The estimated inputs x (k, n) with the traces of the d >= 2 missing samples taken out:
    each row is its sample's input plus ``c^T span`` (``span`` (d, n): the missing inputs'
    basis, :func:`_missing_span`), and on any d features the sample lacks (in general
    position) the row reads ``c^T span`` alone, which fixes ``c``. ``TRACE_TRIALS`` random
    d-subsets of the features where the missing inputs reach ``TRACE_SUPPORT`` of their
    largest (a fixed seed: the same rows give the same inputs) each give a ``c``, and each row
    keeps the one that leaves it the most zeros, read against the row's largest entry as read
    (a huge ``c`` then reads none), or stays as read. Past ``deadline`` the trials stop."""
    d = span.shape[0]
    size = torch.where(live, span.abs().amax(dim=0), torch.zeros_like(span[0]))
    support = (size >= TRACE_SUPPORT * size.max()).nonzero()[:, 0]
    if support.numel() < d or not bool(size.max() > 0):
        return x
    band = zero_rtol * x.abs().amax(dim=1, keepdim=True)  # fixed: a huge c reads no zeros

    def zeros(rows: torch.Tensor) -> torch.Tensor:
        return ((rows.abs() <= band) & live).sum(dim=1)

    best, most = x.clone(), zeros(x)
    generator = torch.Generator().manual_seed(0)
    for _ in range(TRACE_TRIALS):
        if deadline.passed():
            break
        features = support[torch.randperm(support.numel(), generator=generator)[:d].to(support.device)]
        c, info = torch.linalg.solve_ex(span[:, features].T, x[:, features].T)  # (d, k)
        if int(info):
            continue
        trial = x - c.T @ span
        count = zeros(trial)
        better = count > most
        best[better], most[better] = trial[better], count[better]
    return best


def _without_trace(
    x: torch.Tensor, missing: torch.Tensor, live: torch.Tensor, zero_rtol: float, deadline: Deadline = NEVER
) -> torch.Tensor:
    """The estimated inputs x (k, n) with the missing sample's trace taken out: each row is the
    sample's input plus ``c`` times ``missing`` (its dual is known up to the missing dual), and
    ``c`` is the one that leaves the row the most zeros among the ``live`` features (module doc).
    On every feature the sample lacks and the missing one has, the row reads ``c`` times the
    missing input, so the candidates are the ratios ``x_f / missing_f`` on the missing input's
    features of at least ``TRACE_SUPPORT`` of its largest (at most ``TRACE_CANDIDATES`` of
    them, spread evenly, and as many as one row's trials fit in ``TRACE_CHUNK``), and 0 (the
    row as read): O(n) each. Past ``deadline`` the rows left keep their trace."""
    size = torch.where(live, missing.abs(), torch.zeros_like(missing))
    if not bool(size.max() > 0):
        return x
    # not on a tiny entry: its ratio's multiple of the missing input outweighs the row
    support = (size >= TRACE_SUPPORT * size.max()).nonzero()[:, 0]
    count = min(TRACE_CANDIDATES, support.numel(), max(1, TRACE_CHUNK // x.shape[1] - 1))
    spread = torch.linspace(0, support.numel() - 1, count)
    features = support[spread.round().long().to(support.device)]
    multiples = torch.cat([x.new_zeros(x.shape[0], 1), x[:, features] / missing[features]], dim=1)
    best = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
    rows_per_chunk = max(1, TRACE_CHUNK // (multiples.shape[1] * x.shape[1]))
    for part in torch.arange(x.shape[0], device=x.device).split(rows_per_chunk):
        if deadline.passed():
            break
        trial = x[part, None, :] - multiples[part, :, None] * missing  # (p, c, n)
        counts = (zero_mask(trial.flatten(0, 1), zero_rtol) & live).sum(dim=1).view(trial.shape[:2])
        best[part] = multiples[part].gather(1, counts.argmax(dim=1, keepdim=True))[:, 0]
    return x - best[:, None] * missing


#: :func:`_without_trace` tries the ratios on the missing input's features of at least this
#: share of its largest (on a smaller one, the ratio's multiple of the missing input outweighs
#: the row, which then reads the missing sample's zeros) ...
TRACE_SUPPORT = 1e-2
#: ... on at most this many of them (the sample's zeros may lie anywhere in that support: on
#: Fashion-MNIST's CNN features, seven samples had none among its 128 largest)
TRACE_CANDIDATES = 512
#: ... holding at most this many entries at once (rows x candidates x features)
TRACE_CHUNK = 2**24
#: with 2 to this many columns missing, :func:`_without_traces` takes out their traces from
#: this many random d-subsets of features: each holds only zeros of a row with probability
#: about (its share of zeros)^d, some 0.1-0.16 for d = 2 and 1-3% for d = 4 on CNN features
TRACES_AT_MOST = 4
TRACE_TRIALS = 256


__all__ = ["column_input_candidates"]
