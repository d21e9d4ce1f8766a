"""Re-anchoring: a direction found on a residual problem, moved onto the exact direction of the
whole layer that it approximates.

Peeling's residual problem (:func:`spear.core.peeling.residual_problem`, step 4) searches the
complement of the peeled samples' coefficient vectors ``r_k``; the unpeeled samples'
directions lie in it exactly only when the ``r_k`` are exact. On a float32 gradient they carry
rounding of ~1e-3 (step 2's least squares on a float32 next layer), and after 52 of 64 samples
of a trained layer the unpeeled directions were 2e-4 to 1.3e-3 off the residual span (MNIST
6 x 500, 200 steps, layer 2, seed 1). A residual direction is then only near its sample's: on
the whole layer its ``L q`` misses the sample's zeros by ~1e-3 of the column, its zero set (at
float32's 1e-4) loses half the true zeros and takes in active rows that happen to cancel, and
peeling rightly refutes it. The search found these four samples' directions again and again,
each time 1e-4 off, and the batch stayed at 60 of 64.

The exact direction is the one whose ``L q`` vanishes on its zero set. Near it, the rows where
``|L q|`` is within ``ANCHOR_BAND`` of its largest hold all of that zero set and a few small
active entries. The minimum of ``sum_i |L_i q|`` over them (L1, with ``q . q0 = 1``) puts exact
zeros on the many rows that can all vanish and lets the few that cannot keep their value: the
robust fit of a linear system with a few gross outliers. It is solved by iteratively
reweighted least squares (IRLS, weights ``1 / max(|L_i q|, eps)``, eps a tenth each step),
batched; the core then snaps the result exactly (:func:`spear.core.filtering.snap_and_filter`)
and peeling checks it as any other direction, so a wrong anchor costs work, never a wrong
sample.
"""

from __future__ import annotations

import torch

from spear.core.deadline import NEVER, Deadline
from spear.core.filtering import KERNEL_CHUNK_ELEMENTS, SnapResult, kernel_chunk
from spear.core.linalg import solve_ex

#: rows with ``|L q|`` at most this times its largest take part in the fit (a drifted float32
#: direction misses its zeros by ~1e-3 of the column: well inside)
ANCHOR_BAND = 1e-2
#: IRLS steps (eps then falls from 1e-2 to 1e-14 of the band's largest |L q|: the measured
#: float32 case lands 5e-14 (1 - cos) from the sample's direction, on its 187 zeros)
ANCHOR_STEPS = 12
#: eps of the first IRLS step, relative to the largest ``|L q|`` in the band, and its decay per
#: step (the fit's zeros are exact to about the last eps)
ANCHOR_EPS = 1e-2
ANCHOR_EPS_DECAY = 10.0
#: a direction whose ``|L q|`` on its own zero set reaches this fraction of ``zero_rtol`` (of
#: its largest) has drifted: an exact one is at its gradient's rounding there (float32 trained
#: layer 2, seed 1: drifted ones 1.1e-5 to 1e-4 of the largest, at ``zero_rtol`` 1e-4)
DRIFT_FRACTION = 0.1


def drifted_off_zeros(L: torch.Tensor, snapped: SnapResult, zero_rtol: float) -> torch.Tensor:
    """(k,) which snapped directions are robust (no essential zero row, as a sample's column)
    but not at rounding on their own zero set (see ``DRIFT_FRACTION``): the ones worth
    :func:`reanchor`. A mixture's zero set has essential rows; leaving the non-robust ones
    out saved three quarters of the work on the measured float32 layer."""
    values = (snapped.directions.to(L.dtype) @ L.T).abs()
    on_zeros = (values * snapped.zero_masks).amax(dim=1)
    drifted = on_zeros > DRIFT_FRACTION * zero_rtol * values.amax(dim=1)
    return drifted if snapped.robust is None else drifted & snapped.robust


def reanchor(
    L: torch.Tensor,
    directions: torch.Tensor,
    band: float = ANCHOR_BAND,
    steps: int = ANCHOR_STEPS,
    deadline: Deadline = NEVER,
) -> torch.Tensor:
    """The L1 fits (k, b) near ``directions`` (k, b): for each q0, the q minimizing
    ``sum |L_i q|`` over the rows with ``|L_i q0| <= band * max |L q0|``, subject to
    ``q . q0 = 1`` (see the module doc), normalized. Non-finite where the band's rows do not
    determine it (fewer than b - 1 of them); past ``deadline`` the chunks left stay NaN."""
    k, b = directions.shape
    out = torch.full_like(directions, torch.nan, dtype=L.dtype)
    # a chunk's steps together do the work of one kernel chunk (the deadline is checked between)
    chunk = max(1, kernel_chunk(L.shape[0], b, KERNEL_CHUNK_ELEMENTS) // steps)
    for part in torch.arange(k, device=L.device).split(chunk):
        if deadline.passed():
            break
        out[part] = _irls(L, directions[part].to(L.dtype), band, steps)
    return out


def _irls(L: torch.Tensor, q0: torch.Tensor, band: float, steps: int) -> torch.Tensor:
    """:func:`reanchor` for one chunk (c, b)."""
    q0 = q0 / q0.norm(dim=1, keepdim=True)
    values = (q0 @ L.T).abs()  # (c, m)
    inside = values <= band * values.amax(dim=1, keepdim=True)
    scale = (values * inside).amax(dim=1, keepdim=True).clamp_min(torch.finfo(L.dtype).tiny)
    eps = ANCHOR_EPS * scale
    q, failed = q0, inside.sum(dim=1) < L.shape[1] - 1
    for _ in range(steps):
        weight = inside / torch.maximum((q @ L.T).abs(), eps)  # (c, m); 0 outside the band
        gram = (L.unsqueeze(0) * weight.unsqueeze(-1)).mT @ L  # (c, b, b)
        y, info = solve_ex(gram, q0)
        failed |= info != 0
        q = y / (y * q0).sum(dim=1, keepdim=True)
        q = torch.where(failed.unsqueeze(1), q0, q)  # a singular system keeps its start (dropped)
        eps = torch.maximum(eps / ANCHOR_EPS_DECAY, 1e-14 * scale)
    q = q / q.norm(dim=1, keepdim=True)
    return torch.where(failed.unsqueeze(1) | ~torch.isfinite(q), torch.nan, q)
