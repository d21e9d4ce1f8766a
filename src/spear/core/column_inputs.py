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
    is not solved again (its kernel would not change); the ones solved here join it. The
    inputs of ``peeled`` samples and repeats are left out
    (:func:`~spear.core.singletons.distinct_inputs`). The kernels are solved in chunks
    (:func:`~spear.core.peeling.peel_chunks`); past ``deadline`` the rest are left unsolved
    (and untried)."""
    b = R.shape[0]
    chosen = sparsest_basis(directions, zero_counts, b, rank_rtol=rank_rtol, partial=True)
    if not chosen:
        return R.new_zeros(0, b)
    q = directions[chosen].to(R.dtype)  # (k, b)
    duals = torch.linalg.pinv(q.T)  # (k, b): r_j . q_i = delta_ij within the k found
    x = duals @ R
    x = x * torch.where(x.sum(dim=1, keepdim=True) < 0, -1.0, 1.0)
    size = x.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)
    feature = R.abs().amax(dim=0)
    live = feature > tol.zero_floor * feature.max()
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
    r = r[pinned]
    r = r * torch.where((r @ R).sum(dim=1, keepdim=True) < 0, -1.0, 1.0)
    return r[distinct_inputs(r, peeled.coefficients)]


__all__ = ["column_input_candidates"]
