"""The time budget is a promise (issue #10): every long stage stops at the attack's deadline.

No test here waits on the clock: a deadline in the past has passed, one at None never does.
"""

import time

import torch

import spear
from spear.core.deadline import NEVER, Deadline
from spear.core.filtering import kernel_of_rows, snap_and_filter, zero_mask
from spear.core.greedy import greedy_filter, sparsest_basis, swap_sigmas
from spear.core.proposers import ProposalContext
from spear.core.proposers.next_layer import NextLayerProposer
from tests.conftest import make_client
from tests.test_peeling import _client, _peeler

PASSED = Deadline(0.0)


def test_deadline_semantics():
    assert not NEVER.passed() and not Deadline.after(None).passed()
    assert PASSED.passed()
    assert not Deadline.after(3600.0).passed()
    assert Deadline.after(5.0, start=time.perf_counter() - 10.0).passed()


def test_peeling_stops_at_the_deadline():
    _, problem, _, _, Qt = _client(40, 400)
    masks = zero_mask((problem.L @ Qt).T, 1e-9)
    peeler = _peeler(problem)
    assert bool(peeler.peel(Qt.T, masks).consistent.all())
    late = peeler.peel(Qt.T, masks, PASSED)
    assert not bool(late.consistent.any()) and len(late.samples) == 0


def test_greedy_sweeps_stop_at_the_deadline():
    from tests.test_core_units import layer_problem

    client = make_client(8, width=200, seed=7)
    *_, split, problem, Qt = layer_problem(client)
    impostor = (Qt[:, 0] + Qt[:, 1]) / torch.linalg.norm(Qt[:, 0] + Qt[:, 1])
    directions = torch.cat([impostor[None], Qt.T])
    masks = zero_mask(directions @ split.L.T, 1e-9)
    counts = torch.tensor([10_000] + [int(x) for x in masks[1:].sum(1)])
    assert greedy_filter(problem, directions, masks, counts).sigma == 1.0
    late = greedy_filter(problem, directions, masks, counts, deadline=PASSED)
    # stage 1 only: the impostor stays
    assert late.indices == tuple(sparsest_basis(directions, counts, 8)) and late.sigma < 1.0
    # within a sweep, the ranking of swaps stops between positions (b = 512 with 500 candidates
    # made one sweep minutes long)
    current = torch.tensor(late.indices)
    outside = torch.tensor(sorted(set(range(9)) - set(late.indices)))
    free = torch.arange(8)
    ranked = swap_sigmas(problem, directions, masks, None, 0.0, current, free, outside)
    assert float(ranked.max()) == 1.0
    cut = swap_sigmas(problem, directions, masks, None, 0.0, current, free, outside, PASSED)
    assert bool((cut == -1.0).all())


def _context(problem, deadline: Deadline) -> ProposalContext:
    """A proposal context on the 40-sample client's problem with this deadline."""
    return ProposalContext(
        L=problem.L,
        batch_size=40,
        threshold_count=150,
        generator=torch.Generator().manual_seed(0),
        proposal_dtype=torch.float32,
        found=problem.L.new_empty(0, 40),
        problem=problem,
        deadline=deadline,
    )


def test_next_layer_proposer_stops_at_the_deadline():
    _, problem, *_ = _client(40, 400)
    on_time = NextLayerProposer().propose(_context(problem, NEVER), 10_000)
    assert on_time.n_drawn > 0 and on_time.directions.shape[0] > 0
    late = NextLayerProposer().propose(_context(problem, PASSED), 10_000)
    assert late.n_drawn == 0 and late.directions.shape[0] == 0


def test_irls_proposer_stops_at_the_deadline():
    """One IRLS call refines 64 starts over 80 iterations: 2.4 s at m = 500, b = 64 in input
    mode, which ran an attack 1.6 s past a 30 s budget (realism matrix). Past the deadline the
    call stops between iterations and proposes nothing."""
    from spear.core.proposers.sparse_recovery import SparseRecoveryProposer, irls_sphere

    _, problem, *_ = _client(40, 400)
    proposer = SparseRecoveryProposer(starts_per_call=8, iterations=5)
    on_time = proposer.propose(_context(problem, NEVER), 10_000)
    assert on_time.n_drawn > 0 and on_time.directions.shape[0] > 0
    late = SparseRecoveryProposer(starts_per_call=8, iterations=5).propose(_context(problem, PASSED), 10**4)
    assert late.n_drawn == 0 and late.directions.shape[0] == 0
    U = torch.linalg.qr(problem.L)[0]
    assert irls_sphere(U, U[:3].clone(), 5, deadline=PASSED) is None


def test_the_sparsity_probe_stops_at_the_deadline_and_concludes_nothing():
    """The probe snaps every hint of its two proposer calls (an SVD each): photos32 b = 256 ran
    56 s past a 240 s budget in it. Cut short, it must not read its missing evidence as a dense
    gradient (that raises NoSparsityError) or as columns too sparse for the threshold."""
    from spear.core.diagnosis import probe_sparse_directions

    _, problem, *_ = _client(40, 400)
    on_time = probe_sparse_directions(_context(problem, NEVER), 1e-9, 1e-12, None)
    assert on_time.probed and on_time.snapped.directions.shape[0] > 0
    late = probe_sparse_directions(_context(problem, PASSED), 1e-9, 1e-12, None)
    assert not late.probed and late.snapped.directions.shape[0] == 0
    assert not late.looks_dense(40, problem.L.shape[0])


def test_attack_reports_a_time_budget_stop():
    client = make_client(20, width=200, seed=3)
    rec = spear.reconstruct(*client.layer_args(), time_budget=1e-9, seed=0)
    assert rec.stats.stop_reason == "time budget" and not rec.verified


def test_kernels_of_zero_sets_stop_at_the_deadline():
    """Snapping solves one SVD per zero set (~0.1 s each at m = 1000, b = 512): hundreds of
    hints once held an attack 80 s past a 60 s budget. Past the deadline nothing more is solved."""
    _, problem, _, _, Qt = _client(40, 400)
    masks = zero_mask((problem.L @ Qt).T, 1e-9)
    q, one_dim, _ = kernel_of_rows(problem.L, masks)
    assert bool(one_dim.all())
    q, one_dim, _ = kernel_of_rows(problem.L, masks, PASSED)
    assert not bool(one_dim.any()) and bool(torch.isnan(q).all())
    snapped = snap_and_filter(problem.L, Qt.T, masks, 100, 1e-9, deadline=PASSED)
    assert snapped.directions.shape[0] == 0
    assert snap_and_filter(problem.L, Qt.T, masks, 100, 1e-9).directions.shape[0] == 40
    # the first kernel of hints with more than b - 1 rows (one eigh per hint) stops too
    from spear.core.filtering import _first_kernel

    assert bool(torch.isfinite(_first_kernel(problem.L, masks, 8)).all())
    assert bool(torch.isnan(_first_kernel(problem.L, masks, 8, PASSED)).all())
