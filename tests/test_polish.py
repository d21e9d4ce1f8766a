"""Polishing a selection's directions on their clearly zero rows (spear.core.polish)."""

import torch

from spear.core.filtering import kernel_of_rows
from spear.core.polish import POLISH_FRACTION, polish_directions, repair_rows

ZERO_RTOL = 1e-4  # float32's zero band


def columns_with_small_active_rows(zeros: int | None = None, m: int = 300, b: int = 8, small: int = 12):
    """b columns of dL/dZ, each zero on about half the rows; column 0 also has ``small`` active
    rows of 5e-5 of its largest entry (inside the zero band, above the polished one), and
    keeps only ``zeros`` of its zero rows when given (the others become such small rows)."""
    g = torch.Generator().manual_seed(0)
    D = torch.randn(m, b, generator=g, dtype=torch.float64) * (torch.rand(m, b, generator=g) < 0.5)
    peak = D[:, 0].abs().max()
    active = D[:, 0].nonzero()[:small, 0]
    D[active, 0] = 5e-5 * peak * torch.sign(D[active, 0])
    if zeros is not None:
        D[(D[:, 0] == 0).nonzero()[zeros:, 0], 0] = 5e-5 * peak
    X = torch.randn(b, 40, generator=g, dtype=torch.float64)
    U, S, _ = torch.linalg.svd(D @ X, full_matrices=False)
    L = U[:, :b] * S[:b].sqrt()
    truth = torch.linalg.lstsq(L, D).solution  # (b, b): each column's true direction
    return L, D, truth / truth.norm(dim=0)


def kernel_on(L, rows):
    return torch.linalg.svd(L[rows], full_matrices=False).Vh[-1]


def test_a_column_snapped_on_its_band_is_sharpened():
    L, D, truth = columns_with_small_active_rows()
    snapped = kernel_on(L, D[:, 0].abs() <= ZERO_RTOL * D[:, 0].abs().max())
    snapped *= torch.sign(snapped @ truth[:, 0])
    Qbar = truth.clone()
    Qbar[:, 0] = snapped
    before = float((snapped - truth[:, 0]).norm())
    assert before > 1e-6  # the band's active rows bias the snapped kernel
    result = polish_directions(L, Qbar, ZERO_RTOL)
    assert bool(result.solved[0]) and bool(result.keeps_pin[0])
    polished = result.Qbar / result.Qbar.norm(dim=0)
    assert float((polished[:, 0] - truth[:, 0]).norm()) < 1e-3 * before
    # the exact columns stay (a rare entry of theirs inside the band may be dropped: same kernel)
    assert float((polished[:, 1:] - truth[:, 1:]).norm(dim=0).max()) < 1e-9


def test_too_few_clearly_zero_rows_leave_the_direction_alone():
    """Fewer than b rows below the polished band: no kernel to trust, the snapped one stays."""
    L, D, truth = columns_with_small_active_rows(zeros=5)
    column = D[:, 0].abs()
    snapped = kernel_on(L, column <= ZERO_RTOL * column.max())
    Qbar = truth.clone()
    Qbar[:, 0] = snapped * torch.sign(snapped @ truth[:, 0])
    values = (Qbar[:, 0] @ L.T).abs()
    assert int((values <= POLISH_FRACTION * ZERO_RTOL * values.max()).sum()) < 8  # the premise
    result = polish_directions(L, Qbar, ZERO_RTOL)
    assert not bool(result.solved[0]) and torch.equal(result.Qbar[:, 0], Qbar[:, 0])


def test_everywhere_solves_the_clean_columns_too():
    """``everywhere`` solves the columns without band rows as well (the precision audit trusts
    only columns computed on exactly their clearly zero rows): the same kernels."""
    L, _, truth = columns_with_small_active_rows()
    result = polish_directions(L, truth.clone(), ZERO_RTOL, everywhere=True)
    assert bool(result.solved[1:].all())
    solved = result.Qbar / result.Qbar.norm(dim=0)
    assert float((solved - truth).norm(dim=0).max()) < 1e-9


def test_an_input_column_off_by_a_trace_is_solved_again_on_its_zero_and_negative_rows():
    """Input mode: a direction carrying -1e-4 of another sample's column reads that column's
    rows below zero where its own sample's are zero, which no ReLU output is. Its clearly zero
    rows and its negative ones are exactly its sample's zeros, and their kernel is the
    sample's direction (the selection is then scored again with it)."""
    g = torch.Generator().manual_seed(0)
    b, n = 6, 120
    X = (0.1 + torch.rand(b, n, generator=g, dtype=torch.float64)) * (torch.rand(b, n, generator=g) < 0.5)
    M = torch.randn(b, b, generator=g, dtype=torch.float64)
    L = X.T @ M  # L q_j = X_j for q_j = M^-1 e_j
    q = torch.linalg.inv(M)
    off = q[:, 0] - 1e-4 * q[:, 1]
    values = L @ off
    assert bool((values < -POLISH_FRACTION * 1e-4 * values.abs().max()).any())
    rows = repair_rows(values[None], 1e-4)
    assert torch.equal(rows[0], X[0] == 0)
    kernel, one_dim, _ = kernel_of_rows(L, rows)
    assert bool(one_dim[0])
    cos = torch.nn.functional.cosine_similarity(kernel[0], q[:, 0], dim=0).abs()
    assert float(1 - cos) < 1e-12
