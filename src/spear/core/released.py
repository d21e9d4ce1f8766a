"""Released zeros: the direction of a sample whose zero set, as read, holds one of its own
small values.

A zero band (float32: 1e-4 of a column's largest) takes in a sample's small true values too. A
direction solved to vanish on such a row is not the sample's: it is the sample with a trace of
another one mixed in, just enough to cancel the small value there. Let ``x_0`` hold ``3e-5``
of its largest at row ``f`` and ``x_1`` hold ``5e-2`` there: ``x_0 - 6e-4 x_1`` vanishes at
``f``, and wherever ``x_1`` is zero on ``x_0``'s zeros it vanishes on the rest of them too; on
a row ``g`` where ``x_1`` holds ``3e-3`` it reads ``-1.8e-6``, far inside the band. Both
directions read the same zero set, and the mixture is even *sparser* below the band (it
vanishes at ``f``), so no count of zeros can prefer the sample. The mixture passes every check
of float32's verification tolerance (1e-3: a synthetic float32 MLP, input sparsity, b = 8,
was verified with that sample 1.6e-3 off); it fails only the precision audit, which checks each
sample at the precision its data have (:func:`spear.core.verdict.audit_precision`).

The zero set as read is then *inconsistent*: no one direction vanishes on all of it to
rounding (the least-squares kernel of its rows leaves ``f`` and ``g`` at ~1e-6), and dropping
a single row makes it consistent again: the kernel without ``g`` is the mixture, the one
without ``f`` the sample. :func:`released_kernels` finds those rows (of leverage near 1 among
the zero rows: each alone holds one dimension of the inconsistency) and keeps the kernels
whose released row holds a value no zero's rounding can (above the certainly-zero floor,
:data:`spear.core.consistency.ZERO_FLOOR_FRACTION` of the band). Which of them is the sample
(the kernel without ``g``, the mixture, holds ``-1.8e-6`` there and is kept too) is the
model's to say: each is judged again, with its audit
(:meth:`spear.core.reconstruct._Attack._released`).
"""

from __future__ import annotations

import torch

from spear.core.consistency import ZERO_FLOOR_FRACTION
from spear.core.deadline import NEVER, Deadline
from spear.core.filtering import kernel_of_rows, largest_on, zero_mask
from spear.core.linalg import masked_kernels

#: a row is released when the zero set without it fits its kernel with at most this fraction of
#: the residual of the whole zero set (least singular values): that row alone holds the zero
#: set's inconsistency
RELEASE_SHRINK = 0.1
#: at most this many released kernels per direction (the rows whose release fits best)
MOST_RELEASED = 4


def released_kernels(
    L: torch.Tensor,
    q: torch.Tensor,
    zero_rtol: float,
    most: int = MOST_RELEASED,
    deadline: Deadline = NEVER,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernels (k, b, unit norm, the sign of ``q``) of the zero rows of the column ``L q``
    (``L`` rows x b, ``q`` (b,)) with one row released, and the rows released (k,), best fit
    first: only rows whose release shrinks the least singular value of the zero rows by
    ``RELEASE_SHRINK`` and whose kernel holds a value above the certainly-zero floor there
    (``ZERO_FLOOR_FRACTION * zero_rtol`` of its largest: not a zero's rounding); at most
    ``most``."""
    b = L.shape[1]
    none = L.new_zeros(0, b), torch.zeros(0, dtype=torch.long, device=L.device)
    q = q.to(L.dtype) / q.norm().clamp_min(torch.finfo(L.dtype).tiny)
    zero = zero_mask((L @ q)[None], zero_rtol)[0]
    rows = zero.nonzero()[:, 0]
    if b < 2 or rows.numel() < b or deadline.passed():
        return none
    candidates = _shrinking_rows(L[rows].to(torch.float64), most)
    if not candidates.numel():
        return none
    released = rows[candidates]
    masks = zero[None].repeat(released.numel(), 1)
    masks[torch.arange(released.numel(), device=L.device), released] = False
    kernel, one_dim, _ = kernel_of_rows(L, masks, deadline)
    kernel = kernel * torch.where(kernel @ q < 0, -1.0, 1.0).to(kernel)[:, None]
    values = kernel @ L.T
    freed = values[torch.arange(released.numel(), device=L.device), released].abs()
    holds_value = freed > ZERO_FLOOR_FRACTION * zero_rtol * values.abs().amax(dim=1)
    keep = one_dim & holds_value & torch.isfinite(kernel).all(dim=1)
    return kernel[keep], released[keep]


def inconsistent_columns(L: torch.Tensor, Q: torch.Tensor, zero_rtol: float, most: int) -> torch.Tensor:
    """Columns of ``Q`` (b x k directions) whose zero set as read (of ``L q``) no direction
    vanishes on to rounding: the least singular value of ``L`` on those rows above the
    certainly-zero floor (``ZERO_FLOOR_FRACTION * zero_rtol``) of the column's largest entry;
    at most ``most``, most inconsistent first. Only columns that do not vanish on their own zero
    set to that floor are solved (a consistent zero set holds its direction's zeros)."""
    q = (Q / Q.norm(dim=0, keepdim=True).clamp_min(torch.finfo(Q.dtype).tiny)).T.to(L.dtype)
    values = q @ L.T
    peak = values.abs().amax(dim=1)
    floor = ZERO_FLOOR_FRACTION * zero_rtol
    zero = zero_mask(values, zero_rtol)
    unsure = (largest_on(values, zero) > floor) & (zero.sum(dim=1) >= L.shape[1])
    columns = unsure.nonzero()[:, 0]
    if not columns.numel():
        return columns
    least = masked_kernels(L, zero[columns]).singular_values[:, -1]
    inconsistency = least / peak[columns]
    over = inconsistency > floor
    columns, inconsistency = columns[over], inconsistency[over]
    return columns[inconsistency.argsort(descending=True)[:most]]


def _shrinking_rows(A: torch.Tensor, most: int) -> torch.Tensor:
    """Positions (at most ``most``, best first) of the rows of ``A`` (rows x b) without which
    its least singular value falls to ``RELEASE_SHRINK`` of its own or below: those of leverage
    at least ``1 - RELEASE_SHRINK**2`` in all b left singular vectors (deleting row r scales the
    product of the squared singular values by ``1 - h_r``: where the others stay, the least
    falls by ``sqrt(1 - h_r)``; a row that carries a large singular value instead comes as an
    extra candidate, which the judging refuses)."""
    U = torch.linalg.svd(A, full_matrices=False).U
    leverage = (U**2).sum(dim=1)
    shrinking = (leverage >= 1.0 - RELEASE_SHRINK**2).nonzero()[:, 0]
    order = leverage[shrinking].argsort(descending=True)
    return shrinking[order[:most]]


__all__ = ["MOST_RELEASED", "RELEASE_SHRINK", "inconsistent_columns", "released_kernels"]
