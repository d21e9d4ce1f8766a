"""Re-anchoring (spear.core.anchor): a direction found on an inexact residual problem, moved
onto the exact direction of the whole layer."""

import torch

from spear.core.anchor import drifted_off_zeros, reanchor
from spear.core.deadline import Deadline
from spear.core.filtering import SnapResult, snap_and_filter, zero_mask
from spear.core.proposers import ProposalContext
from spear.core.search import ResidualSearch


def _layer(seed: int, m: int = 400, b: int = 40, zeros: int = 150, small: int = 12):
    """A factor L (m, b) with one true column L q: exact zeros on ``zeros`` rows, ``small``
    active entries of 1e-3 to 1e-2 of its largest (a trained layer's), the rest O(1)."""
    g = torch.Generator().manual_seed(seed)
    L = torch.randn(m, b, generator=g, dtype=torch.float64)
    q = torch.randn(b, generator=g, dtype=torch.float64)
    q = q / q.norm()
    order = torch.randperm(m, generator=g)
    zero_rows, small_rows = order[:zeros], order[zeros : zeros + small]
    L[zero_rows] -= (L[zero_rows] @ q).unsqueeze(1) * q  # L_i q = 0
    size = float((L @ q).abs().max())
    target = size * torch.logspace(-3, -2, small, dtype=torch.float64)
    L[small_rows] += (target - L[small_rows] @ q).unsqueeze(1) * q  # L_i q = target
    return L, q, zero_rows, small_rows


def _drifted(L, zero_rows, small_rows, keep: int = 100, wrong: int = 3):
    """What an inexact residual problem hands back: a direction that vanishes on a few small
    active rows (fitted exactly there, as the residual problem's kernel fits its zero set) and
    nearly on part of the true zeros: the kernel of those rows, the active ones weighted 1e3."""
    weight = torch.zeros(L.shape[0], dtype=torch.float64)
    weight[zero_rows[:keep]] = 1.0
    weight[small_rows[:wrong]] = 1e3
    _, _, Vh = torch.linalg.svd(L * weight.unsqueeze(1), full_matrices=False)
    return Vh[-1]


def test_reanchoring_finds_the_exact_direction_a_drifted_one_approximates():
    for seed in range(4):
        L, q, zero_rows, small_rows = _layer(seed)
        q0 = _drifted(L, zero_rows, small_rows)
        q0 = q0 * torch.sign(q0 @ q)
        assert 1e-9 < 1.0 - float(q0 @ q) < 1e-3  # near, not on it
        moved = reanchor(L, q0[None])[0]
        moved = moved * torch.sign(moved @ q)
        assert 1.0 - float(moved @ q) <= 1e-14, seed
        # the core's exact snapping then gives the true zero set and the direction to rounding
        snapped = snap_and_filter(L, moved[None], None, 100, 1e-9)
        assert snapped.directions.shape[0] == 1
        assert set(snapped.zero_masks[0].nonzero()[:, 0].tolist()) == set(zero_rows.tolist())
        assert 1.0 - float((snapped.directions[0] @ q).abs()) <= 1e-14


def test_reanchoring_leaves_an_exact_direction_where_it_is():
    L, q, _, _ = _layer(5)
    moved = reanchor(L, q[None])[0]
    assert 1.0 - float((moved @ q).abs()) <= 1e-14


def test_reanchoring_without_enough_rows_in_its_band_gives_nan():
    """Fewer than b - 1 rows near zero leave the fit undetermined: NaN, which snapping drops."""
    L, q, _zero_rows, _ = _layer(6, zeros=10, small=0)
    out = reanchor(L, q[None])
    assert bool(torch.isnan(out).all())
    assert snap_and_filter(L, out, None, 30, 1e-9).directions.shape[0] == 0


def test_only_robust_directions_off_their_own_zeros_count_as_drifted():
    L, q, zero_rows, small_rows = _layer(7)
    exact = snap_and_filter(L, q[None], None, 100, 1e-4)
    assert exact.directions.shape[0] == 1 and not bool(drifted_off_zeros(L, exact, 1e-4)[0])
    q0 = _drifted(L, zero_rows, small_rows)[None]  # as lifted: its own zero set, no re-solve
    mask = zero_mask(q0 @ L.T, 1e-4)
    lifted = SnapResult(q0, mask, mask.sum(dim=1), robust=torch.ones(1, dtype=torch.bool))
    assert bool(drifted_off_zeros(L, lifted, 1e-4)[0])
    lifted.robust[0] = False  # a mixture's zero set has essential rows: not re-anchored
    assert not bool(drifted_off_zeros(L, lifted, 1e-4)[0])


def test_zero_mask_of_the_drifted_direction_misses_true_zeros():
    """The premise: the drifted direction's own zero set (float32's 1e-4) is not the sample's."""
    L, _q, zero_rows, small_rows = _layer(8)
    q0 = _drifted(L, zero_rows, small_rows)
    mask = zero_mask((q0 @ L.T)[None], 1e-4)[0]
    true = torch.zeros_like(mask)
    true[zero_rows] = True
    assert bool((mask & ~true).any()) and bool((true & ~mask).any())


def test_reanchoring_stops_at_the_deadline():
    """Past the deadline no chunk is solved: NaN, which snapping drops."""
    L, _q, zero_rows, small_rows = _layer(9)
    q0 = _drifted(L, zero_rows, small_rows)
    assert bool(torch.isnan(reanchor(L, q0[None], deadline=Deadline(0.0))).all())


def test_the_pool_keeps_only_the_reanchored_directions_peeling_certified():
    """``ResidualSearch.settled``: the lifted directions stay whatever peeling said; of the
    re-anchored ones (the snap's trailing ``anchored``), only the certified ones."""
    L, _q, _, _ = _layer(10)
    b = L.shape[1]
    root = ProposalContext(
        L=L,
        batch_size=b,
        threshold_count=50,
        generator=torch.Generator(),
        proposal_dtype=torch.float32,
        found=torch.empty(0, b, dtype=L.dtype),
    )
    search = ResidualSearch(root)
    directions = torch.eye(L.shape[1], dtype=L.dtype)[:5]
    masks = torch.zeros(5, L.shape[0], dtype=torch.bool)
    snapped = SnapResult(directions, masks, masks.sum(dim=1), robust=torch.ones(5, dtype=torch.bool))
    snapped.certified = torch.tensor([False, True, False, True, False])
    search.anchored = 3  # the last three came from re-anchoring
    kept = search.settled(snapped)
    assert torch.equal(kept.directions, directions[[0, 1, 3]])
    assert kept.certified.tolist() == [False, True, True]
    # once only: a probe's directions handed to peeling after the snap (the stall probe) are
    # none of them re-anchored, and all stay (the review's case: a stale count dropped them)
    assert search.anchored == 0
    assert search.settled(snapped).directions.shape[0] == 5


class _Flag:
    """A deadline that passes when told to (no clock)."""

    def __init__(self) -> None:
        self.now = False

    def passed(self) -> bool:
        return self.now


def test_a_residual_snap_past_the_deadline_is_lifted_but_not_reanchored(monkeypatch):
    """Re-anchoring a step's drifted directions (51,600 at once in a float32 trained layer,
    0.6 s) held an attack past its budget; past the deadline nothing snapped is used."""
    import spear.core.search as search_module
    from spear.core.consistency import Tolerances
    from spear.core.proposers import ProposalBatch

    L, _q, zero_rows, small_rows = _layer(11)
    b = L.shape[1]
    q0 = _drifted(L, zero_rows, small_rows)[None]
    mask = zero_mask(q0 @ L.T, 1e-4)
    drifted = SnapResult(q0, mask, mask.sum(dim=1), robust=torch.ones(1, dtype=torch.bool))
    flag = _Flag()

    def snapped_then_late(*args, **kwargs):
        flag.now = True  # the deadline passes while the step's directions are snapped
        return drifted

    outcomes = []
    for late in (False, True):
        root = ProposalContext(
            L=L, batch_size=b, threshold_count=50, generator=torch.Generator(),
            proposal_dtype=torch.float32, found=torch.empty(0, b, dtype=L.dtype), deadline=flag,
        )  # fmt: skip
        search = ResidualSearch(root)
        search.basis = torch.eye(b, dtype=L.dtype)  # a residual problem: the whole one, here
        search.ctx = root
        flag.now = False
        if not late:
            monkeypatch.setattr(search_module, "snap_and_filter", lambda *a, **k: drifted)
        else:
            monkeypatch.setattr(search_module, "snap_and_filter", snapped_then_late)
        tol, known = Tolerances(1e-4, 1e-6, 1e-6, 1e-3), torch.zeros(0, L.shape[0], dtype=torch.bool)
        result = search.snap(ProposalBatch(q0, n_drawn=1), tol, known)
        outcomes.append((search.anchored, result.directions.shape[0]))
    assert outcomes[0][0] == 1  # in time, the drifted direction is re-anchored
    assert outcomes[1] == (0, 1)  # past the deadline, lifted and handed on as it is
