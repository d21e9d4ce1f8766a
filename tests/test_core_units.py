"""Unit tests of the core stages against the true dL/dZ of clients built here."""

import math

import pytest
import torch

from spear.core import greedy
from spear.core.filtering import CandidatePool, snap_and_filter, zero_mask
from spear.core.greedy import greedy_filter, score, sparsest_basis, swap_sigmas
from spear.core.lowrank import low_rank_split
from spear.core.proposers import ProposalContext, RandomSubmatrixSampler
from spear.core.proposers.sampling import sample_row_subsets
from spear.core.scale import LayerProblem
from spear.core.verify import verify
from spear.errors import RankError
from tests.conftest import assert_exact, make_client


def true_directions(client, split):
    """Unit columns of the true disaggregation matrix Q = L^+ dL/dZ (evaluation only)."""
    Q = torch.linalg.lstsq(split.L, client.grad_z).solution
    return Q / Q.norm(dim=0), Q


def layer_problem(client):
    """The first layer's tensors, split, problem and unit true directions (evaluation only)."""
    W, bias, GW, Gb = (t.detach() for t in client.layer_args())
    split = low_rank_split(GW)
    problem = LayerProblem(W, bias, Gb, split.L, split.R)
    Qt, _ = true_directions(client, split)
    return W, bias, GW, Gb, split, problem, Qt


@pytest.mark.parametrize("b", [1, 3, 7, 15])
def test_rank_is_batch_size(b):
    client = make_client(b, width=100, seed=b)
    split = low_rank_split(client.grads["0.weight"])
    assert split.batch_size == b
    assert torch.allclose(split.L @ split.R, client.grads["0.weight"], atol=1e-12)


def test_full_rank_gradient_raises():
    client = make_client(12, n=10, width=50)
    with pytest.raises(RankError, match="batch size < 10"):
        low_rank_split(client.grads["0.weight"])


def test_row_subsets_are_distinct_and_in_range():
    g = torch.Generator().manual_seed(0)
    for rows, k in [(200, 19), (30, 25)]:  # rejection path and top-k path
        idx = sample_row_subsets(rows, k, 500, g)
        assert idx.shape[1] == k and idx.shape[0] > 50
        assert int(idx.min()) >= 0 and int(idx.max()) < rows
        assert all(len(set(r.tolist())) == k for r in idx)


def test_row_subsets_are_uniform():
    g = torch.Generator().manual_seed(1)
    idx = sample_row_subsets(10, 3, 60000, g)
    counts = torch.bincount(idx.reshape(-1), minlength=10).double()
    assert torch.allclose(counts / counts.sum(), torch.full((10,), 0.1, dtype=torch.float64), atol=0.005)


def test_snap_accepts_true_and_rejects_mixture():
    client = make_client(10, width=200, seed=3)
    split = low_rank_split(client.grads["0.weight"])
    Qt, _ = true_directions(client, split)
    mixture = (Qt[:, 0] + Qt[:, 1]) / 2
    noisy_true = Qt[:, 2] + 1e-4 * torch.randn(
        10, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )
    rough = torch.stack([Qt[:, 0], mixture, noisy_true])
    # hint: the exact zeros of the mixture are the rows where both columns vanish
    hint = torch.stack(
        [zero_mask((split.L @ q)[None], 1e-9)[0] for q in rough[:2]] + [client.grad_z[:, 2] == 0]
    )
    assert int(hint[1].sum()) >= 9  # the mixture does vanish on the shared zero rows
    out = snap_and_filter(split.L, rough, hint, threshold_count=70, zero_rtol=1e-9)
    assert out.directions.shape[0] == 2  # the true one and the snapped noisy one; never the mixture
    cos = (out.directions @ Qt).abs()
    assert torch.allclose(cos.max(dim=1).values, torch.ones(2, dtype=torch.float64), atol=1e-12)
    assert set(cos.argmax(dim=1).tolist()) == {0, 2}


def test_mixture_without_hint_is_rejected():
    client = make_client(10, width=200, seed=4)
    split = low_rank_split(client.grads["0.weight"])
    Qt, _ = true_directions(client, split)
    mixture = (0.6 * Qt[:, 3] - 0.8 * Qt[:, 5])[None]
    out = snap_and_filter(split.L, mixture, None, threshold_count=70, zero_rtol=1e-9)
    assert out.directions.shape[0] == 0


def test_snapping_reports_the_sparsest_direction_the_threshold_alone_dropped():
    # true columns below the threshold (a trained network's) are dropped, and the result says
    # how sparse the sparsest of them was: the attack's evidence to probe soon
    client = make_client(10, width=200, seed=4)
    split = low_rank_split(client.grads["0.weight"])
    Qt, _ = true_directions(client, split)
    zeros = (client.grad_z == 0).sum(dim=0)
    above = snap_and_filter(split.L, Qt.T, None, threshold_count=int(zeros.min()), zero_rtol=1e-9)
    assert above.directions.shape[0] == 10 and above.dropped_sparsest == 0
    # a threshold between the columns' zero counts: the dropped ones' most zeros is reported
    cut = int(zeros.median()) + 1
    out = snap_and_filter(split.L, Qt.T, None, threshold_count=cut, zero_rtol=1e-9)
    assert out.directions.shape[0] == int((zeros >= cut).sum())
    assert out.dropped_sparsest == int(zeros[zeros < cut].max())
    # nothing kept at all still reports it; lifting and selecting keep it
    none = snap_and_filter(split.L, Qt.T, None, threshold_count=int(zeros.max()) + 1, zero_rtol=1e-9)
    assert none.directions.shape[0] == 0 and none.dropped_sparsest == int(zeros.max())
    assert out.select(torch.tensor([0])).dropped_sparsest == out.dropped_sparsest


def test_pool_adds_a_batch_in_order_and_passes_certified_flags_to_the_kept_copy():
    from spear.core.filtering import SnapResult

    pool = CandidatePool(batch_size=3, rows=4)
    e = torch.eye(3, dtype=torch.float64)
    pool.add(SnapResult(e[:1], torch.zeros(1, 4, dtype=torch.bool), torch.tensor([2])))
    # a copy of the pool's one (certified), a new one, its copy up to sign (certified), another
    d = torch.stack([e[0], e[1], -e[1], e[2]])
    masks = torch.tensor([[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]], dtype=torch.bool)
    certified = torch.tensor([True, False, True, False])
    snapped = SnapResult(d, masks, masks.sum(dim=1), torch.ones(4, dtype=torch.bool), certified)
    assert pool.add(snapped) == 2
    assert torch.equal(pool.directions, e)
    assert pool.certified.tolist() == [True, True, False]
    assert torch.equal(pool.zero_masks[1:], masks[[1, 3]])  # the first of each kept


def _first_new_reference(pool_directions, directions, threshold):
    """The pool's duplicate rule one direction at a time: the most parallel of the pool and the
    new ones kept so far (ties: the pool's, then the earliest) is its match if parallel enough."""
    kept, match, before = [], [], pool_directions.shape[0]
    for i, d in enumerate(directions):
        best, where = -1.0, -1
        if before:
            cos = (pool_directions @ d).abs()
            best, where = float(cos.max()), int(cos.argmax())
        for rank, k in enumerate(kept):
            c = float((directions[k] @ d).abs())
            if c > best:
                best, where = c, before + rank
        if best >= threshold:
            match.append(where)
        else:
            kept.append(i)
            match.append(-1)
    return kept, match


def _nudged_copies(seed, distinct, dim, n, sizes):
    """``distinct`` random unit directions, and n copies of them (either sign), each nudged by
    one of ``sizes`` (per coordinate, drawn uniformly) and normalized."""
    g = torch.Generator().manual_seed(seed)
    base = torch.nn.functional.normalize(torch.randn(distinct, dim, dtype=torch.float64, generator=g), dim=1)
    picks = base[torch.randint(0, distinct, (n,), generator=g)]
    signs = torch.where(torch.rand(n, 1, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    sizes = torch.tensor(sizes, dtype=torch.float64)
    size = sizes[torch.randint(0, len(sizes), (n, 1), generator=g)]
    nudge = size * torch.randn(n, dim, dtype=torch.float64, generator=g)
    return base, torch.nn.functional.normalize(picks * signs + nudge, dim=1)


def test_pool_deduplication_across_blocks_matches_the_one_by_one_rule():
    from spear.core.filtering import DEDUP_BLOCK

    n = 2 * DEDUP_BLOCK + 37  # copies fall in other blocks than their first
    base, directions = _nudged_copies(3, 120, 6, n, [0.0, 0.0, 0.0, 0.0, 1e-7])
    for threshold in (1.0 - 1e-9, 1.0 - 1e-12):
        pool = CandidatePool(batch_size=6, rows=4, duplicate_cos=threshold)
        pool.directions = base[:30]
        kept, match = pool._first_new(directions)
        ref_kept, ref_match = _first_new_reference(base[:30], directions, threshold)
        assert kept.tolist() == ref_kept and match.tolist() == ref_match
        assert 0 < len(ref_kept) < n and sum(m >= 30 for m in ref_match) > 0  # both kinds of copy


@pytest.mark.parametrize("screened", [True, False])
@pytest.mark.parametrize("threshold", [1.0 - 1e-9, 1.0 - 1e-4])
def test_pool_deduplication_of_near_copies_matches_the_one_by_one_rule(monkeypatch, threshold, screened):
    """Copies nudged by several sizes around the threshold (a noisy gradient's 1 - 1e-4 too),
    either sign, across blocks: the projection screen (or, past its pair limit, every pair)
    finds exactly the reference's matches. A screen radius too small misses the nudged copies."""
    import spear.core.filtering as filtering

    if not screened:
        monkeypatch.setattr(filtering, "NEAR_PAIR_LIMIT", 0)
    dim, n = 8, 2 * filtering.DEDUP_BLOCK + 91
    # around each threshold's |u - v| (4.5e-5 and 1.4e-2, over sqrt(dim) per coordinate)
    sizes = [0.0, 1e-7, 1e-5, 2e-5, 1e-3, 3e-3, 4e-3, 6e-3, 1e-2]
    base, directions = _nudged_copies(11, 150, dim, n, sizes)
    pool = CandidatePool(batch_size=dim, rows=4, duplicate_cos=threshold)
    pool.directions = base[:40]
    kept, match = pool._first_new(directions)
    ref_kept, ref_match = _first_new_reference(base[:40], directions, threshold)
    assert kept.tolist() == ref_kept and match.tolist() == ref_match
    assert sum(m >= 40 for m in ref_match) > 20 and sum(0 <= m < 40 for m in ref_match) > 20
    assert len(ref_kept) > 150  # the larger nudges make new directions


def test_pool_deduplication_ties_and_float32_rounding():
    """Ties go to the pool, then to the earliest kept direction; and a float32 pair whose
    computed cosine rounds to 1 is a duplicate however far apart the screen's keys put it."""
    threshold = 1.0 - 1e-4
    theta = math.acos(1.0 - 0.6e-4)  # each side within the threshold, the two sides not
    a = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    side = torch.tensor([[math.cos(theta), math.sin(theta), 0.0], [math.cos(theta), -math.sin(theta), 0.0]])
    side = side.to(torch.float64)
    new = torch.stack([side[0], side[1], a])
    pool = CandidatePool(batch_size=3, rows=1, duplicate_cos=threshold)
    pool.directions = torch.empty(0, 3, dtype=torch.float64)
    kept, match = pool._first_new(new)
    assert kept.tolist() == [0, 1] and match.tolist() == [-1, -1, 0]  # the earlier of two equal
    assert (kept.tolist(), match.tolist()) == _first_new_reference(pool.directions, new, threshold)
    pool.directions = side[1:]  # one side in the pool, the other new: the pool's wins the tie
    kept, match = pool._first_new(torch.stack([side[0], a]))
    assert kept.tolist() == [0] and match.tolist() == [-1, 0]
    pool32 = CandidatePool(batch_size=2, rows=1, dtype=torch.float32)
    pool32.directions = torch.tensor([[1.0, 0.0]])
    kept, match = pool32._first_new(torch.tensor([[1.0, 2e-4]]))  # the computed cos is 1.0
    assert kept.tolist() == [] and match.tolist() == [0]


def test_pool_deduplicates_up_to_sign():
    pool = CandidatePool(batch_size=3, rows=5)
    d = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    masks = torch.zeros(2, 5, dtype=torch.bool)
    from spear.core.filtering import SnapResult

    assert pool.add(SnapResult(d, masks, torch.tensor([3, 2]))) == 2
    assert pool.add(SnapResult(-d[:1], masks[:1], torch.tensor([3]))) == 0
    assert len(pool) == 2


def test_sigma_is_one_for_truth_and_lower_for_a_wrong_column():
    client = make_client(8, width=200, seed=5)
    W, bias, GW, Gb = client.layer_args()
    split = low_rank_split(GW)
    problem = LayerProblem(W.detach(), bias.detach(), Gb, split.L, split.R)
    Qt, _ = true_directions(client, split)
    masks = zero_mask((split.L @ Qt).T, 1e-9)
    sigma, valid, c, consistent = score(problem, Qt[None], masks[None])
    assert bool(valid[0]) and float(sigma[0]) == 1.0 and int(consistent[0]) == 8
    wrong = Qt.clone()
    wrong[:, 0] = (Qt[:, 0] + Qt[:, 1]) / 2**0.5
    wmasks = zero_mask((split.L @ wrong).T, 1e-9)
    sigma_w, *_ = score(problem, wrong[None], wmasks[None])
    assert float(sigma_w[0]) < 0.99
    # Theorem 3.6: the recovered scales rebuild the true (scaled) inputs
    inputs, grad_out = problem.assemble(Qt, c[0])
    assert_exact(inputs, client.inputs, 1e-8)
    assert_exact(grad_out.T, client.grad_z.T, 1e-8)


def test_verification_rejects_wrong_selection_and_accepts_truth():
    client = make_client(6, width=120, seed=6)
    W, bias, GW, Gb, _, problem, Qt = layer_problem(client)
    ok = verify(W, bias, GW, Gb, client.inputs, client.grad_z, "output", 1e-8)
    assert ok.verified and ok.residual < 1e-12
    wrong = Qt.clone()
    wrong[:, 2] = (Qt[:, 2] - 0.5 * Qt[:, 4]) / torch.linalg.norm(Qt[:, 2] - 0.5 * Qt[:, 4])
    c, _valid = problem.scales(wrong[None])
    inputs, grad_out = problem.assemble(wrong, c[0])
    # the plain gradients are reproduced by any invertible Q ...
    assert torch.allclose(grad_out @ inputs, GW, atol=1e-10)
    # ... but not through the ReLU
    bad = verify(W, bias, GW, Gb, inputs, grad_out, "output", 1e-8)
    assert not bad.verified and bad.residual > 1e-4


def test_greedy_stage_two_fixes_a_wrong_stage_one_choice():
    client = make_client(8, width=200, seed=7)
    *_, split, problem, Qt = layer_problem(client)
    # a very sparse impostor: stage 1 picks it first, stage 2 must swap it out
    impostor = (Qt[:, 0] + Qt[:, 1]) / torch.linalg.norm(Qt[:, 0] + Qt[:, 1])
    directions = torch.cat([impostor[None], Qt.T])
    masks = zero_mask(directions @ split.L.T, 1e-9)
    counts = torch.tensor([10_000] + [int(x) for x in masks[1:].sum(1)])
    assert sparsest_basis(directions, counts, 8)[0] == 0
    sel = greedy_filter(problem, directions, masks, counts)
    assert sel is not None and sel.sigma == 1.0 and 0 not in sel.indices


def test_a_swap_never_takes_a_copy_or_mixture_of_the_directions_that_stay():
    """The swaps keep stage 1's rank test: a candidate within ``rank_rtol`` of the span of the
    directions that would stay is refused there (checked against an explicit projection). A
    float32 CNN head (b = 64) swapped a copy of one column carrying a 1.7e-3 trace of a faint
    one in for that faint column, and held two copies of one sample."""
    g = torch.Generator().manual_seed(3)
    b, rtol = 6, 1e-2
    basis = torch.linalg.qr(torch.randn(b, b, generator=g, dtype=torch.float64))[0].T
    copy = basis[0] + 1e-3 * basis[1]
    mixture = basis[2] + basis[3]
    other = torch.randn(b, generator=g, dtype=torch.float64)
    directions = torch.cat([basis, torch.stack([copy, mixture, other])])
    current, free, outside = torch.arange(b), torch.arange(b), torch.arange(b, b + 3)
    fresh = greedy._swaps_outside_the_rest(directions, current, free, outside, rtol)
    for p in range(b):
        rest = directions[[i for i in range(b) if i != p]].T
        for j, v in enumerate(directions[outside]):
            residual = v - rest @ torch.linalg.lstsq(rest, v[:, None]).solution[:, 0]
            assert bool(fresh[p, j]) == bool(residual.norm() > rtol * v.norm()), (p, j)
            trial = current.clone()
            trial[p] = outside[j]
            assert greedy._outside_the_rest(directions, trial, p, rtol) == bool(fresh[p, j])
    assert not bool(fresh[1, 0]) and bool(fresh[0, 0])  # the copy of 0 may stand for 0 only
    assert not bool(fresh[:2, 1].any()) and bool(fresh[2:4, 1].all())  # the mixture: for 2 or 3


def test_sampler_hits_true_directions():
    client = make_client(6, width=150, seed=8)
    split = low_rank_split(client.grads["0.weight"])
    Qt, _ = true_directions(client, split)
    ctx = ProposalContext(
        L=split.L,
        batch_size=6,
        threshold_count=50,
        generator=torch.Generator().manual_seed(0),
        proposal_dtype=torch.float32,
        found=torch.empty(0, 6, dtype=torch.float64),
    )
    batch = RandomSubmatrixSampler(chunk_size=2000).propose(ctx, 2000)
    assert 0 < batch.n_drawn <= 2000
    snapped = snap_and_filter(split.L, batch.directions, batch.zero_hint, 50, 1e-9)
    hits = (snapped.directions @ Qt).abs().max(dim=1).values
    assert snapped.directions.shape[0] > 0 and bool((hits > 1 - 1e-10).all())


def test_score_handles_singular_sets():
    client = make_client(5, width=80, seed=9)
    *_, split, problem, Qt = layer_problem(client)
    singular = Qt.clone()
    singular[:, 1] = singular[:, 0]  # a repeated direction
    batch = torch.stack([Qt, singular])
    masks = zero_mask((split.L @ batch).transpose(1, 2), 1e-9)
    sigma, valid, _, _ = score(problem, batch, masks)
    assert valid.tolist() == [True, False]
    assert float(sigma[0]) == 1.0 and float(sigma[1]) == -1.0


def test_pool_bounds_untrusted_candidates_keeping_the_sparsest():
    pool = CandidatePool(batch_size=2, rows=6, untrusted_limit=2)
    from spear.core.filtering import SnapResult

    dirs = torch.stack(
        [
            torch.tensor([1.0, 0.0]),
            torch.tensor([0.6, 0.8]),
            torch.tensor([0.0, 1.0]),
            torch.tensor([0.8, 0.6]),
            torch.tensor([-0.6, 0.8]),
        ]
    ).double()
    counts = torch.tensor([5, 2, 4, 3, 1])
    robust = torch.tensor([True, False, False, False, False])
    pool.add(SnapResult(dirs, torch.zeros(5, 6, dtype=torch.bool), counts, robust))
    assert len(pool) == 3 and pool.trusted.shape[0] == 1
    assert sorted(pool.zero_counts.tolist()) == [3, 4, 5]  # the two sparsest untrusted survive


# --- tests that fail for the real bugs (mutants of verify, filtering, greedy, lowrank) -------------


def test_verification_needs_the_bias_gradient_too():
    # zero bias: X / 2 with 2 dL/dZ keeps every ReLU pattern and dL/dW, only dL/db doubles
    client = make_client(6, width=120, seed=30)
    W = client.first.weight.detach()
    zero = torch.zeros(W.shape[0], dtype=W.dtype)
    X = client.inputs
    active = (X @ W.T > 0).T.to(X.dtype)  # (m, b)
    dZ = torch.randn(W.shape[0], 6, dtype=X.dtype, generator=torch.Generator().manual_seed(0)) * active
    GW, Gb = dZ @ X, dZ.sum(dim=1)
    assert verify(W, zero, GW, Gb, X, dZ, "output", 1e-8).verified
    halved = verify(W, zero, GW, Gb, X / 2, 2 * dZ, "output", 1e-8)
    assert not halved.verified and halved.residual == pytest.approx(1.0, rel=1e-6)


def test_verification_tolerance_is_tight():
    client = make_client(6, width=120, seed=31)
    W, bias, GW, Gb = (t.detach() for t in client.layer_args())
    off = client.inputs * (1 + 1e-6)  # a reconstruction wrong in the 6th digit
    check = verify(W, bias, GW, Gb, off, client.grad_z, "output", 1e-8)
    assert not check.verified and 1e-7 < check.residual < 1e-5


def test_the_attack_is_invariant_to_the_gradient_scale():
    # relative tolerances: a gradient 1e-12 (or 1e12) times smaller is the same problem
    import spear

    client = make_client(8, width=200, seed=32)
    W, bias, GW, Gb = client.layer_args()
    for factor in (1e-12, 1e12):
        rec = spear.reconstruct(W, bias, GW * factor, Gb * factor, max_proposals=200_000)
        assert rec.verified, rec.message
        assert_exact(rec.inputs, client.inputs, 1e-8)


def test_zero_count_threshold_is_inclusive():
    client = make_client(8, width=200, seed=33)
    split = low_rank_split(client.grads["0.weight"])
    Qt, _ = true_directions(client, split)
    q = Qt[:, 0][None]
    mask = zero_mask(q @ split.L.T, 1e-9)
    zeros = int(mask.sum())
    assert snap_and_filter(split.L, q, mask, zeros, 1e-9).directions.shape[0] == 1
    assert snap_and_filter(split.L, q, mask, zeros + 1, 1e-9).directions.shape[0] == 0


def test_greedy_takes_the_best_swap_of_a_sweep(monkeypatch):
    import itertools

    from spear.core import greedy

    client = make_client(8, width=200, seed=34)
    *_, split, problem, Qt = layer_problem(client)
    # two impostors that stage 1 takes first, then the true columns: the first swap that helps
    # is not the best one
    wrong = [Qt[:, 0] + 0.7 * Qt[:, 1], Qt[:, 2] - 0.4 * Qt[:, 3], Qt[:, 0] + 0.2 * Qt[:, 5]]
    directions = torch.cat([torch.stack([w / w.norm() for w in wrong]), Qt.T])
    masks = zero_mask(directions @ split.L.T, 1e-9)
    counts = torch.tensor([10_000, 9_999, 9_998] + [100] * 8)
    start = sparsest_basis(directions, counts, 8)
    more = greedy_filter(problem, directions, masks, counts, max_sweeps=1)
    monkeypatch.setattr(greedy, "MORE_SWAPS", 0)  # the sweep's best swap alone
    one = greedy_filter(problem, directions, masks, counts, max_sweeps=1)
    best = -1.0
    for pos, new in itertools.product(range(8), range(directions.shape[0])):
        if new in start:
            continue
        trial = list(start)
        trial[pos] = new
        s, *_ = score(problem, directions[trial].T[None], masks[trial][None])
        best = max(best, float(s[0]))
    assert one.sigma == pytest.approx(best, abs=1e-12)
    # the sweep goes on with the next-ranked swaps that still help: all three impostors go
    assert best < 1.0 and more.sigma == 1.0 and not {0, 1, 2} & set(more.indices)
    # ... but not past the deadline
    from spear.core.deadline import Deadline

    monkeypatch.setattr(greedy, "MORE_SWAPS", 64)
    calls = []  # the sweep's ranking runs; only the extra swaps see a passed deadline
    more_swaps = greedy._more_swaps
    monkeypatch.setattr(
        greedy,
        "_more_swaps",
        lambda *a: calls.append(1) or more_swaps(*a[:-1], Deadline(0.0)),
    )
    cut = greedy_filter(problem, directions, masks, counts, max_sweeps=1)
    assert calls and cut.sigma == pytest.approx(best, abs=1e-12)


def test_greedy_resumes_its_swaps_where_the_last_selection_ended(monkeypatch):
    """``start``: stage 1 with those candidates preferred (after certified ones) is a second
    starting point, taken when it scores at least as high; from the end of the last climb, one
    sweep (finding nothing) suffices, where stage 1 climbs again. A start worse than stage 1
    is not taken, and a start never keeps a certified candidate out."""
    from spear.core import greedy
    from spear.core.reconstruct import SweptSelection

    client = make_client(8, width=200, seed=34)
    *_, split, problem, Qt = layer_problem(client)
    wrong = [Qt[:, 0] + 0.7 * Qt[:, 1], Qt[:, 2] - 0.4 * Qt[:, 3], Qt[:, 0] + 0.2 * Qt[:, 5]]
    directions = torch.cat([torch.stack([w / w.norm() for w in wrong]), Qt.T])
    masks = zero_mask(directions @ split.L.T, 1e-9)
    counts = torch.tensor([10_000, 9_999, 9_998] + [100] * 8)
    sweeps = []
    best_swap = greedy._best_swap
    monkeypatch.setattr(greedy, "_best_swap", lambda *a, **k: sweeps.append(1) or best_swap(*a, **k))
    cold = greedy_filter(problem, directions, masks, counts)
    assert cold.sigma == 1.0 and len(sweeps) >= 1 and not {0, 1, 2} & set(cold.indices)
    sweeps.clear()
    warm = greedy_filter(problem, directions, masks, counts, start=list(cold.indices))
    assert sorted(warm.indices) == sorted(cold.indices) and len(sweeps) == 0  # sigma = 1: no sweep
    # a start that scores lower than stage 1's basis is not taken; one that scores higher is
    plain = greedy_filter(problem, directions, masks, counts, max_sweeps=0)
    better = greedy_filter(problem, directions, masks, counts, max_sweeps=0, start=list(cold.indices))
    assert plain.sigma < 1.0 and better.sigma == 1.0
    sparse_truth = torch.tensor([50, 50, 50] + [100] * 8)  # stage 1 takes the true columns
    plain = greedy_filter(problem, directions, masks, sparse_truth, max_sweeps=0)
    worse = greedy_filter(problem, directions, masks, sparse_truth, max_sweeps=0, start=[0, 1, 2])
    assert plain.sigma == 1.0 and worse.indices == plain.indices
    # a certified candidate stays in whatever the start says, even a sparse impostor
    certified = torch.zeros(directions.shape[0], dtype=torch.bool)
    certified[0] = True
    truth = list(range(3, 11))
    kept = greedy_filter(problem, directions, masks, sparse_truth, 0, certified, start=truth)
    assert 0 in kept.indices

    # the attack remembers the directions, and finds them again in a pool that has changed
    class Pool:
        def __init__(self, d):
            self.directions = d

        def __len__(self):
            return self.directions.shape[0]

    memory = SweptSelection()
    memory.remember(Pool(directions), cold)
    shuffled = Pool(directions.flip(0) * -1.0)
    n = directions.shape[0]
    assert sorted(memory.find(shuffled)) == sorted(n - 1 - i for i in cold.indices)
    assert memory.find(Pool(directions[:3])) is None


@pytest.mark.parametrize("overlap", [False, True])
def test_rank_one_swap_scores_equal_scoring_each_swap_afresh(monkeypatch, overlap):
    # the greedy's swap ranking (Sherman-Morrison updates of Qbar^-1) against score() per swap,
    # with impostors, near-singular swaps and the tolerance-aware masks; chunks of a few
    # candidates (the split into chunks changes nothing). ``overlap``: entries both nonzero and
    # surely zero (masks no caller builds), which the sweep's one-comparison test cannot take
    client = make_client(10, width=150, seed=35)
    *_, split, problem, Qt = layer_problem(client)
    g = torch.Generator().manual_seed(0)
    mixtures = Qt @ torch.randn(10, 6, generator=g, dtype=Qt.dtype)
    twin = Qt[:, 3] + 1e-12 * Qt[:, 4]
    directions = torch.cat([mixtures.T, Qt.T, twin[None]])
    directions = directions / directions.norm(dim=1, keepdim=True)
    values = directions @ split.L.T
    masks, certain = zero_mask(values, 1e-9), zero_mask(values, 1e-12)
    if overlap:
        certain[:, ::7] = True
    current = torch.tensor([0, 1, 2, 9, 10, 11, 12, 13, 14, 15])
    free = torch.tensor([0, 1, 2, 3, 5])
    outside = torch.tensor([3, 4, 5, 6, 7, 8, 16])
    fast = swap_sigmas(problem, directions, masks, certain, 1e-9, current, free, outside)
    monkeypatch.setattr(greedy, "SWAP_CHUNK_ELEMENTS", 3 * 10 * problem.R_Wt.shape[1])  # 3 a chunk
    assert torch.equal(swap_sigmas(problem, directions, masks, certain, 1e-9, current, free, outside), fast)
    for i, pos in enumerate(free.tolist()):
        for j, new in enumerate(outside.tolist()):
            trial = current.clone()
            trial[pos] = new
            Qbar = directions[trial].T[None]
            s, valid, *_ = score(problem, Qbar, masks[trial][None], certain[trial][None], 1e-9)
            if bool(valid[0]) and float(fast[i, j]) >= 0:
                assert float(fast[i, j]) == pytest.approx(float(s[0]), abs=1e-12), (pos, new)
            else:
                # the twin of true column 3 beside it is singular either way
                assert not bool(valid[0]) and float(fast[i, j]) == -1.0, (pos, new)
                assert new == 16 and pos != 3
    assert int((fast[:, -1] == -1).sum()) == 4  # only the twin in column 3's place is valid


def test_rank_threshold_is_numpys_rule_exactly():
    m, n = 60, 40
    rtol = max(m, n) * torch.finfo(torch.float64).eps
    g = torch.Generator().manual_seed(35)
    U = torch.linalg.qr(torch.randn(m, n, dtype=torch.float64, generator=g))[0]
    V = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=g))[0]
    S = torch.zeros(n, dtype=torch.float64)
    S[:4] = torch.tensor([1.0, 0.5, 3 * rtol, 0.3 * rtol])
    split = low_rank_split((U * S) @ V.T)
    assert split.batch_size == 3  # 3 rtol counts, 0.3 rtol does not (x10 or /10 would differ)
    assert split.rank_rtol == pytest.approx(rtol)


def test_sigma_counts_both_directions_of_the_relu():
    from spear.core.consistency import pattern_matches

    z = torch.tensor([[[2.0, -1.0, 0.5, -0.5]]], dtype=torch.float64)
    zero = torch.tensor([[[False, True, True, False]]])
    # z > 0 with dL/dZ = 0 contradicts the ReLU (generically), as z < 0 with dL/dZ != 0 does
    assert pattern_matches(z, zero, None, 0.0).tolist() == [[[True, True, False, False]]]
    # inside the tolerance bands nothing contradicts: a tiny nonzero that is not certainly zero,
    # and pre-activations without a clear sign
    certain = torch.tensor([[[False, True, False, False]]])
    assert pattern_matches(z, zero, certain, 0.0).tolist() == [[[True, True, True, False]]]
    assert pattern_matches(z, zero, None, 0.3).tolist() == [[[True, True, True, True]]]  # |z| <= 0.6
    assert pattern_matches(z, zero, None, 0.2).tolist() == [[[True, True, False, False]]]  # |z| > 0.4


def test_score_rejects_a_column_that_vanishes_where_its_sample_is_active():
    client = make_client(8, width=200, seed=36)
    *_, split, problem, Qt = layer_problem(client)
    masks = zero_mask((split.L @ Qt).T, 1e-9)
    assert float(score(problem, Qt[None], masks[None])[0][0]) == 1.0
    claimed = masks.clone()
    claimed[0, (~masks[0]).nonzero()[0, 0]] = True  # a zero where sample 0 is active
    sigma, *_ = score(problem, Qt[None], claimed[None])
    assert float(sigma[0]) < 1.0


def test_gap_rank_finds_the_drop_to_the_noise_floor():
    from spear.core.lowrank import gap_rank

    def S(*values):
        return torch.tensor(values, dtype=torch.float64)

    # signal 1 .. 0.02, noise ~1e-4: the largest drop with the next value under the floor
    assert gap_rank(S(1.0, 0.3, 0.02, 1e-4, 8e-5, 5e-5), floor_rtol=1e-2) == 3
    # a larger drop inside the signal does not count while its next value is above the floor
    assert gap_rank(S(1.0, 0.05, 0.03, 1e-4, 9e-5), floor_rtol=1e-2) == 3
    # nothing under the floor: full rank; a floor above everything: the largest drop anywhere
    assert gap_rank(S(1.0, 0.5, 0.2), floor_rtol=1e-3) == 3
    assert gap_rank(S(1.0, 0.5, 0.01, 0.005), floor_rtol=1.0) == 2
    assert gap_rank(S(2.0), floor_rtol=1e-2) == 1 and gap_rank(S(0.0, 0.0), floor_rtol=1e-2) == 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_leading_svd_equals_the_full_svd_of_a_low_rank_gradient(dtype):
    from spear.core.lowrank import leading_svd, numerical_rank

    g = torch.Generator().manual_seed(3)
    m, n, b = 600, 500, 40
    scales = torch.logspace(0, -4, b, dtype=torch.float64)  # a trained net's spread of samples
    left = torch.randn(m, b, generator=g, dtype=torch.float64) * scales
    exact = left @ torch.randn(b, n, generator=g, dtype=torch.float64)
    G = exact.to(dtype).double()  # rounded as the client sent it
    U, S, Vh = torch.linalg.svd(G, full_matrices=False)
    U2, S2, Vh2 = leading_svd(G, b)
    assert S2.numel() == b + 10 < S.numel()
    rank = numerical_rank(S, (m, n), dtype)
    assert rank == b == numerical_rank(S2, (m, n), dtype)
    assert torch.allclose(S2[:b], S[:b], rtol=1e-8, atol=0)
    # the row and column spaces are as close to the noise-free ones as the full SVD's
    U0, _, Vh0 = torch.linalg.svd(exact, full_matrices=False)

    def distance(A, B):
        return 1.0 - float(torch.linalg.svdvals(A @ B).min())

    assert distance(Vh0[:b], Vh2[:b].T) <= 2 * distance(Vh0[:b], Vh[:b].T) + 1e-14
    assert distance(U0[:, :b].T, U2[:, :b]) <= 2 * distance(U0[:, :b].T, U[:, :b]) + 1e-14


def test_every_robust_direction_is_peeled_and_only_the_sparsest_others():
    from spear.core.filtering import SnapResult
    from spear.core.reconstruct import NONROBUST_PEEL_PER_STEP, worth_peeling

    k, b, m = 3 * NONROBUST_PEEL_PER_STEP, 4, 10
    counts = torch.randperm(k, generator=torch.Generator().manual_seed(0)) + b
    robust = torch.zeros(k, dtype=torch.bool)
    robust[:5] = True
    snapped = SnapResult(torch.zeros(k, b), torch.zeros(k, m, dtype=torch.bool), counts, robust)
    chosen = worth_peeling(snapped)
    assert chosen.tolist() == sorted(chosen.tolist())
    assert set(range(5)) <= set(chosen.tolist())
    others = [i for i in chosen.tolist() if i >= 5]
    assert len(others) == NONROBUST_PEEL_PER_STEP
    cutoff = min(int(counts[i]) for i in others)
    assert all(int(counts[i]) <= cutoff for i in range(5, k) if i not in others)
    # robustness unknown: everything is peeled
    unknown = SnapResult(snapped.directions, snapped.zero_masks, counts)
    assert worth_peeling(unknown).tolist() == list(range(k))


def test_a_robust_candidate_that_peeling_refuted_is_not_trusted():
    # float32 zero bands make some mixtures robust; peeling's checks are what refutes them,
    # and proposers must not deflate against them. Pins (robust) stay as they are.
    from spear.core.filtering import CandidatePool, SnapResult

    b, m = 3, 8
    pool = CandidatePool(b, m)
    directions = torch.eye(b, dtype=torch.float64)
    masks = torch.zeros(b, m, dtype=torch.bool)
    counts = torch.full((b,), 4)
    robust = torch.tensor([True, True, False])
    refuted = torch.tensor([False, True, False])
    pool.add(SnapResult(directions, masks, counts, robust, torch.zeros(b, dtype=torch.bool), None, refuted))
    assert pool.trusted_mask.tolist() == [True, False, False]
    assert pool.robust.tolist() == [True, True, False]
    # a certified sample is trusted whatever else was said of it
    pool.certified[1] = True
    assert pool.trusted_mask.tolist() == [True, True, False]


def test_unrecovered_message_says_why_enough_candidates_gave_no_basis():
    """40 candidates and b = 9 is not "fewer than needed": they span fewer than 9 (copies)."""
    from spear.core.reconstruct import _short_of_a_basis

    assert "fewer than the b=9" in _short_of_a_basis(3, 9)
    reason = _short_of_a_basis(40, 9)
    assert "fewer than" not in reason and "no b=9 of them form an independent" in reason


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.complex64])
def test_all_finite_finds_any_nan_or_inf_by_one_reduction(dtype):
    from spear.checks import all_finite, largest_magnitude

    t = torch.randn(50, 40).to(dtype)
    assert all_finite(t) and all_finite(t[:0]) and all_finite(torch.arange(5))
    for bad in (math.nan, math.inf, -math.inf):
        for place in ((0, 0), (17, 23), (49, 39)):
            u = t.clone()
            u[place] = bad
            assert not all_finite(u)
            assert not all_finite(u.T)  # a view, not contiguous
    if dtype.is_complex:  # review 47b: a conjugated view crashed view_as_real
        assert all_finite(t.conj()) and not all_finite(torch.full_like(t, complex(0, math.nan)).conj())
    if not dtype.is_complex:
        assert largest_magnitude(t) == float(t.abs().max())
        assert largest_magnitude(-t.abs() - 1) == float(t.abs().max() + 1)


def test_all_finite_reads_float8():
    from spear.checks import all_finite

    t = torch.tensor([1.0, -2.0, math.inf]).to(torch.float8_e5m2)
    assert not all_finite(t) and all_finite(t[:2])
