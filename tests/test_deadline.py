"""The time budget is a promise (issue #10): every long stage stops at the attack's deadline.

No test here waits on the clock: a deadline in the past has passed, one at None never does.
"""

import time
import warnings

import pytest
import torch

import spear
from spear.core.deadline import NEVER, Deadline
from spear.core.filtering import kernel_of_rows, snap_and_filter, zero_mask
from spear.core.greedy import greedy_filter, sparsest_basis, swap_sigmas
from spear.core.proposers import ProposalContext
from spear.core.proposers.next_layer import NextLayerProposer
from tests.conftest import deep_mlp_round, make_client
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


def test_peel_steps_are_bounded_by_work_and_do_not_change_the_samples(monkeypatch):
    """Peeling checks its directions in steps bounded by work (an SVD and a least-squares
    solve of m x (b + 1) per direction), not 32 at a time whatever their size (seconds idle at
    m = 1000, b = 320). The step size follows from the shapes alone (the same every run, at any
    load); the samples agree at any step size to rounding (a matrix product's blocking depends
    on how many rows it has, so not bit for bit)."""
    import spear.core.filtering as filtering
    import spear.core.peeling as peeling

    _, problem, _, _, Qt = _client(40, 400)
    masks = zero_mask((problem.L @ Qt).T, 1e-9)
    whole = _peeler(problem).peel(Qt.T, masks)
    rows, b = problem.L.shape
    assert len(peeling.peel_chunks(torch.arange(40), 1000, 321)) == 40  # one direction a step
    assert len(peeling.peel_chunks(torch.arange(40), rows, b + 1)) == 2  # 32 at most
    per = rows * (b + 1) ** 2 + filtering.KERNEL_MASK_OVERHEAD
    monkeypatch.setattr(filtering, "KERNEL_CHUNK_WORK", 3 * per)
    assert len(peeling.peel_chunks(torch.arange(40), rows, b + 1)) == 14
    stepped = _peeler(problem).peel(Qt.T, masks)
    late = _peeler(problem).peel(Qt.T, masks, _PassesAfter(2))  # two steps, then the deadline
    assert int(late.consistent.sum()) == 6 and bool(late.consistent[:6].all())
    assert torch.equal(stepped.consistent, whole.consistent) and torch.equal(stepped.robust, whole.robust)
    for name in ("inputs", "coefficients", "duals", "next_grad_outputs"):
        ours, theirs = getattr(stepped.samples, name), getattr(whole.samples, name)
        assert torch.allclose(ours, theirs, rtol=1e-10, atol=1e-12 * float(theirs.abs().max())), name
    again = _peeler(problem).peel(Qt.T, masks)
    assert torch.equal(again.samples.inputs, stepped.samples.inputs)  # same steps, same bits


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


def test_swaps_ranked_afresh_stop_at_the_deadline(monkeypatch):
    """Where the rank-one updates cannot rank (input mode, or a singular selection), every
    swap is scored outright; that ranking stops at the deadline too (photos32 b = 256 ran 38 s
    past a 240 s budget in it)."""
    from spear.core import greedy
    from tests.test_core_units import layer_problem

    client = make_client(8, width=200, seed=7)
    *_, split, problem, Qt = layer_problem(client)
    directions = torch.cat([Qt.T[:1], Qt.T])  # candidate 0 duplicates candidate 1
    masks = zero_mask(directions @ split.L.T, 1e-9)
    current = torch.arange(8)  # holds both copies: singular, so swap_sigmas gives way
    free, outside = torch.arange(8), torch.tensor([8])
    assert swap_sigmas(problem, directions, masks, None, 0.0, current, free, outside) is None
    scored = []
    score = greedy.score
    monkeypatch.setattr(greedy, "score", lambda *a, **k: scored.append(1) or score(*a, **k))
    swap = greedy._best_swap(problem, directions, masks, None, 0.0, current, free, outside, 0.0)
    assert swap is not None and float(swap[1][0][0]) == 1.0 and scored
    scored.clear()
    late = greedy._best_swap(problem, directions, masks, None, 0.0, current, free, outside, 0.0, PASSED)
    assert late is None and not scored


def test_pattern_flips_stop_at_the_deadline():
    """The known-head search checks the deadline between its flip steps, not only between
    sweeps (one call of 128 guesses ran 2 s past a 30 s budget on a loaded machine)."""
    from spear.core.proposers.masked_subspace import PatternSearch

    g = torch.Generator().manual_seed(3)
    m, b, k, S = 60, 8, 3, 4
    U = torch.linalg.qr(torch.randn(m, b, generator=g, dtype=torch.float64))[0]
    search = PatternSearch(U, torch.randn(m, k, generator=g, dtype=torch.float64), U[:, :0])
    masks = torch.rand(S, m, generator=g) < 0.5
    h = torch.randn(S, m, generator=g, dtype=torch.float64)
    free = masks.clone()
    assert bool(search._flip(free, h, 400).all())  # every pattern improves at first
    late = masks.clone()
    assert not bool(search._flip(late, h, 400, PASSED).any()) and torch.equal(late, masks)
    one_step = masks.clone()
    search._flip(one_step, h, 400, _PassesAfter(1))  # one step, then the deadline
    changed = int((one_step != masks).sum())
    assert 0 < changed < int((free != masks).sum())


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


def test_next_layer_zero_sets_are_not_prepared_past_the_deadline():
    """One SVD per distinct zero set of the next layer: at m = 4000, b = 200 they took 3.4 s and
    ran a 3 s budget to 7.1 s before the first proposal."""
    _, problem, *_ = _client(40, 400)
    assert NextLayerProposer().has_zero_sets(_context(problem, NEVER))
    late = NextLayerProposer()
    assert not late.has_zero_sets(_context(problem, PASSED)) and late.zero_sets == []
    # cut short, it has not run dry: the run stops for its time budget, not as "exhausted"
    assert not NextLayerProposer().propose(_context(problem, PASSED), 10_000).exhausted


def test_the_time_budget_counts_from_the_call(monkeypatch):
    """Checking the inputs and building the model's certificate come before the attack's own
    setup (0.9 s and 0.6 s at m = 4000): the budget counts them. A fake clock jumps 100 s while
    the certifier is built and stands still otherwise (no test waits on the real clock): a 50 s
    budget is then spent before the first proposal, a 500 s one never."""
    import spear.api
    from spear.fl import fedsgd_gradients, fully_connected

    model = fully_connected(40, 60, 3, seed=0, dtype=torch.float64)
    x = torch.randn(8, 40, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    grads = fedsgd_gradients(model, x, torch.arange(8))
    clock = {"offset": 0.0}
    frozen, real_certifier = time.perf_counter(), spear.api.ModelCertifier

    def slow_certifier(*args, **kwargs):
        clock["offset"] += 100.0
        return real_certifier(*args, **kwargs)

    monkeypatch.setattr(time, "perf_counter", lambda: frozen + clock["offset"])
    monkeypatch.setattr(spear.api, "ModelCertifier", slow_certifier)
    late = spear.attack_layer(model, "0", grads, time_budget=50.0, seed=0)
    assert late.stats.stop_reason == "time budget" and late.stats.proposals == 0 and not late.verified
    on_time = spear.attack_layer(model, "0", grads, time_budget=500.0, seed=0)
    assert on_time.verified and on_time.stats.stop_reason != "time budget"
    started = frozen + clock["offset"] - 1000.0  # reconstruct takes the start it is given
    rec = spear.reconstruct(*[model[0].weight, model[0].bias, grads["0.weight"], grads["0.bias"]],
                            time_budget=50.0, _clock_start=started, seed=0)  # fmt: skip
    assert rec.stats.stop_reason == "time budget" and rec.stats.proposals == 0


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


def test_the_sparsity_probe_snaps_a_bounded_number_of_hints_at_large_batches(monkeypatch):
    """A neuron-guided call gives 1,536 hints, each snapped by an SVD of about b^3: at b = 512
    the probe took a whole 240 s budget (MNIST, LT setting, seed 1), and as long without one.
    Up to b = 256 it snaps them all, as before; beyond, fewer, by work, not by time."""
    from spear.core import diagnosis
    from spear.core.proposers import ProposalBatch
    from spear.core.proposers.neurons import NeuronGuidedSampler

    assert diagnosis.probe_hints(256) >= 1536 and diagnosis.probe_hints(64) >= 1536
    assert diagnosis.probe_hints(512) == 192 and diagnosis.probe_hints(4096) == 1
    asked = []
    propose = NeuronGuidedSampler.propose
    monkeypatch.setattr(
        NeuronGuidedSampler, "propose", lambda self, ctx, n: asked.append(n) or propose(self, ctx, n)
    )
    monkeypatch.setattr(diagnosis, "PROBE_SNAP_WORK", 100 * 40**3)
    _, problem, *_ = _client(40, 400)
    probed = diagnosis.probe_sparse_directions(_context(problem, NEVER), 1e-9, 1e-12, None)
    assert asked == [100] and probed.probed  # sparse directions found: evidence enough
    assert probed.snapped.directions.shape[0] > 0
    # finding nothing in a cut call proves no dense layer (it would raise NoSparsityError)
    monkeypatch.setattr(NeuronGuidedSampler, "propose", lambda self, ctx, n: ProposalBatch(ctx.L[:0], 1))
    assert not diagnosis.probe_sparse_directions(_context(problem, NEVER), 1e-9, 1e-12, None).probed
    monkeypatch.setattr(diagnosis, "PROBE_SNAP_WORK", diagnosis.PROBE_FULL_CALL * 40**3)
    assert diagnosis.probe_sparse_directions(_context(problem, NEVER), 1e-9, 1e-12, None).probed


def test_attack_reports_a_time_budget_stop():
    client = make_client(20, width=200, seed=3)
    rec = spear.reconstruct(*client.layer_args(), time_budget=1e-9, seed=0)
    assert rec.stats.stop_reason == "time budget" and not rec.verified


def test_a_setup_past_the_budget_builds_no_peeler(monkeypatch):
    """Under load one SVD of the setup can outlast the budget; the peeler's own SVD would only
    add to the overrun of an attack that can no longer search."""
    from spear.core.reconstruct import AttackSetup
    from spear.fl import fedsgd_gradients, fully_connected

    model = fully_connected(40, 60, 3, seed=0, dtype=torch.float64)
    x = torch.randn(8, 40, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    y = torch.arange(8)
    grads = fedsgd_gradients(model, x, y)
    built = []
    make_peeler = AttackSetup.make_peeler
    monkeypatch.setattr(AttackSetup, "make_peeler", lambda self: built.append(1) or make_peeler(self))
    assert spear.attack_layer(model, "0", grads, seed=0).verified and built == [1]
    late = spear.attack_layer(model, "0", grads, time_budget=1e-9, seed=0)
    assert late.stats.stop_reason == "time budget" and not late.verified and built == [1]


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


def test_a_snap_whose_deadline_passes_while_its_kernels_are_solved_returns_nothing(monkeypatch):
    """Past the deadline no snapped direction is used (peeling and pooling stop there), so the
    zero sets and exact re-solves left are not computed: 51,600 directions of one float32 step
    held an attack up to 1.2 s past a 30 s budget."""
    import spear.core.filtering as filtering

    _, problem, _, _, Qt = _client(40, 400)
    masks = zero_mask((problem.L @ Qt).T, 1e-9)
    late = _PassesAfter(10**9)
    solve = filtering.kernel_of_rows

    def solved_then_late(L, rows, deadline=NEVER):
        out = solve(L, rows, deadline)
        late.left = 0  # the deadline passes while the last kernels are solved
        return out

    monkeypatch.setattr(filtering, "kernel_of_rows", solved_then_late)
    assert snap_and_filter(problem.L, Qt.T, masks, 100, 1e-9).directions.shape[0] == 40
    late.left = 10**9  # in time until the kernels are solved
    assert snap_and_filter(problem.L, Qt.T, masks, 100, 1e-9, deadline=late).directions.shape[0] == 0


class _PassesAfter:
    """A deadline that passes after ``checks`` looks at it (a clock that needs no clock)."""

    def __init__(self, checks: int) -> None:
        self.left = checks

    def passed(self) -> bool:
        self.left -= 1
        return self.left < 0


def test_kernel_steps_are_bounded_by_work_and_do_not_change_the_kernels(monkeypatch):
    """The deadline is checked after every batched kernel step, and a step holds a bounded
    amount of work (rows x b^2 per mask), not a memory-sized batch: on a loaded machine one
    memory-sized step of 225 SVDs took 73 s. The steps are counted in work, so the kernels are
    the same bits whatever the step size (and whatever the machine's load)."""
    import spear.core.filtering as filtering

    _, problem, _, _, Qt = _client(40, 400)
    rows, b = problem.L.shape
    masks = zero_mask((problem.L @ Qt).T, 1e-9)
    whole, one_dim, robust = kernel_of_rows(problem.L, masks)
    assert filtering.kernel_chunk(1000, 512, filtering.KERNEL_CHUNK_ELEMENTS) == 1
    per_mask = rows * b * b + filtering.KERNEL_MASK_OVERHEAD
    assert filtering.kernel_chunk(rows, b, 2**40) == filtering.KERNEL_CHUNK_WORK // per_mask
    assert filtering.kernel_chunk(200, 2, 2**40) <= 2**11  # tiny factors: the call's cost counts
    monkeypatch.setattr(filtering, "KERNEL_CHUNK_WORK", 3 * per_mask)
    assert filtering.kernel_chunk(rows, b, filtering.KERNEL_CHUNK_ELEMENTS) == 3
    q, one, rob = kernel_of_rows(problem.L, masks, _PassesAfter(2))  # two steps, then the deadline
    assert int(one.sum()) == 6 and bool(torch.isnan(q[6:]).all())
    assert torch.equal(q[:6], whole[:6]) and torch.equal(rob[:6], robust[:6])
    q, one, rob = kernel_of_rows(problem.L, masks)
    assert torch.equal(q, whole) and torch.equal(one, one_dim) and torch.equal(rob, robust)


def test_a_time_budget_on_an_oversubscribed_machine_warns_once(monkeypatch):
    import os

    import spear.api as api

    client = make_client(20, width=200, seed=3)
    monkeypatch.setattr(api, "_warned_oversubscribed", False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0.5, 0.5), raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)  # 2 cores
    with warnings.catch_warnings():
        warnings.simplefilter("error", spear.OversubscribedWarning)
        spear.reconstruct(*client.layer_args(), time_budget=1e-9, seed=0)  # idle: no warning
        monkeypatch.setattr(os, "getloadavg", lambda: (64.0, 64.0, 64.0), raising=False)
        spear.reconstruct(*client.layer_args(), max_proposals=10, seed=0)  # no time budget
        monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
        spear.reconstruct(*client.layer_args(), time_budget=1e-9, seed=0)  # threads sleep
    monkeypatch.delenv("OMP_WAIT_POLICY")

    def unreadable():
        raise OSError("no /proc/loadavg")

    monkeypatch.setattr(os, "getloadavg", unreadable, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", spear.OversubscribedWarning)
        spear.reconstruct(*client.layer_args(), time_budget=1e-9, seed=0)  # no figures: no warning
    monkeypatch.setattr(os, "getloadavg", lambda: (64.0, 64.0, 64.0), raising=False)
    with pytest.warns(spear.OversubscribedWarning, match="OMP_WAIT_POLICY=PASSIVE") as record:
        spear.reconstruct(*client.layer_args(), time_budget=1e-9, seed=0)
    assert [w.filename for w in record if w.category is spear.OversubscribedWarning] == [__file__]
    with warnings.catch_warnings():
        warnings.simplefilter("error", spear.OversubscribedWarning)
        spear.reconstruct(*client.layer_args(), time_budget=1e-9, seed=0)  # once per process


def test_model_certificate_checks_samples_in_groups_and_stops_at_the_deadline(monkeypatch):
    # a 62-sample certificate through a 4000-wide tail ran 22 s past a 60 s budget: with a
    # deadline the gate checks samples in groups sized by the tail's work and stops between them
    import spear.core.verdict
    from spear.core.certificate import SampleCertificates
    from spear.core.verdict import ModelGate

    monkeypatch.setattr(spear.core.verdict, "GATE_GROUP_WORK", 1200)  # a small tail's work

    class Certifier:
        classes = 4

        def __init__(self, params: int):
            self.tail = torch.nn.Linear(params, 1, bias=False)
            self.calls: list[int] = []

        def __call__(self, inputs, grad_outputs):
            self.calls.append(inputs.shape[0])
            k = inputs.shape[0]
            return SampleCertificates(
                torch.ones(k, dtype=torch.bool),
                torch.zeros(k, dtype=torch.long),
                torch.ones(k, dtype=torch.float64),
                torch.zeros(k, dtype=torch.float64),
            )

    big = Certifier(1200 // (4 * 3))  # three samples per group
    gate = ModelGate(big)
    x, d, pinned = torch.zeros(8, 2), torch.zeros(8, 3), torch.zeros(8, dtype=torch.bool)
    whole = gate.check(x, d, pinned, deadline=Deadline.after(3600.0))
    assert big.calls == [3, 3, 2] and bool(whole.ok.all())
    big.calls.clear()
    late = gate.check(x, d, pinned, deadline=PASSED)
    assert big.calls == [] and not bool(late.ok.any()) and bool((late.labels == -1).all())
    # samples the deadline left unchecked are no evidence against the model (its note)
    assert gate.failed_pinned == 0 and gate.check(x, d, ~pinned, deadline=PASSED) is not None
    assert gate.failed_pinned == 0
    assert gate.check(x, d, pinned).ok.all() and big.calls == [8]  # no deadline: all at once
    small = Certifier(10)
    ModelGate(small).check(x, d, pinned, deadline=Deadline.after(3600.0))
    assert small.calls == [8]


def test_seconds_left_reads_the_one_clock():
    # no wall-clock bound: a deadline an hour away has time left, one in the past has none
    assert NEVER.seconds_left() is None
    assert Deadline.after(3600.0).seconds_left() > 0
    assert Deadline(at=0.0).seconds_left() < 0


def test_an_attack_with_a_time_budget_runs_on_one_thread_while_the_machine_is_oversubscribed(
    monkeypatch, mnist
):
    # spin-waiting OpenMP threads on an oversubscribed machine made one step 70x slower and a
    # 10 s budget end at 16.4 s; on one thread the budgets held (api.budget_threads)
    import os

    import spear.api as api
    import spear.cascade as cascade_module

    threads = {"now": 2}
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads["now"])
    monkeypatch.setattr(torch, "set_num_threads", lambda k: threads.update(now=k))
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)  # 2 cores
    monkeypatch.setattr(api, "_warned_oversubscribed", True)  # the warning has its own test
    seen = []
    run_attack = api.run_attack

    def recording(*args, **kwargs):
        seen.append(threads["now"])
        return run_attack(*args, **kwargs)

    monkeypatch.setattr(api, "run_attack", recording)
    client = make_client(20, width=200, seed=3)
    for load, options, inside in [
        (64.0, {"time_budget": 1e-9}, 1),
        (64.0, {"max_proposals": 10}, 2),  # a work budget: the same bits under any load
        (0.5, {"time_budget": 1e-9}, 2),  # idle
    ]:
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load,) * 3, raising=False)
        spear.reconstruct(*client.layer_args(), seed=0, **options)
        assert seen.pop() == inside and threads["now"] == 2
    monkeypatch.setattr(os, "getloadavg", lambda: (64.0,) * 3, raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")  # threads that sleep keep their count
    spear.reconstruct(*client.layer_args(), seed=0, time_budget=1e-9)
    assert seen.pop() == 2
    monkeypatch.delenv("OMP_WAIT_POLICY")

    def failing(*args, **kwargs):
        seen.append(threads["now"])
        raise KeyboardInterrupt

    monkeypatch.setattr(api, "run_attack", failing)
    with pytest.raises(KeyboardInterrupt):
        spear.reconstruct(*client.layer_args(), seed=0, time_budget=5.0)
    assert seen.pop() == 1 and threads["now"] == 2  # set back however the attack ends
    monkeypatch.setattr(api, "run_attack", recording)
    view, _ = deep_mlp_round(mnist, 100, 8, 0)
    cascade_module.attack_model(
        view.model, view.gradients, ["0"], seed=0, time_budget=3600.0, max_proposals=500, max_rounds=1
    )
    assert seen and set(seen) == {1} and threads["now"] == 2


def _join_late_workers() -> None:
    import threading

    for worker in threading.enumerate():
        if worker.name == "spear-uncut-work":
            worker.join()


def test_finish_by_runs_uncut_work_until_the_deadline_only():
    """A unit that cannot be cut (one SVD) is waited for until the deadline, not past it: the
    late work is blocked on an event, so the outcome does not depend on the machine's speed."""
    import threading

    from spear.core.deadline import LateError, finish_by

    here = threading.get_ident()
    assert finish_by(NEVER, threading.get_ident) == here  # no deadline: run in this thread
    far = Deadline.after(3600.0)
    assert finish_by(far, lambda: 7) == 7
    with pytest.raises(ZeroDivisionError):
        finish_by(far, lambda: 1 / 0)
    with pytest.raises(LateError):
        finish_by(PASSED, lambda: pytest.fail("started past the deadline"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # the worker computes as the caller would: its thread count and grad mode
        with torch.no_grad():
            seen = finish_by(far, lambda: (torch.get_num_threads(), torch.is_grad_enabled()))
    finally:
        torch.set_num_threads(threads)
    assert seen == (1, False)
    release, results = threading.Event(), []

    def late() -> str:
        release.wait(30)  # released below (on a clock only if finish_by never returns)
        results.append("late")
        return "late"

    with pytest.raises(LateError):
        finish_by(Deadline.after(0.05), late)
    release.set()
    _join_late_workers()
    assert results == ["late"]  # it ran to its end, and its value went nowhere


def test_an_attack_whose_setup_outlasts_the_budget_ends_at_the_budget(monkeypatch):
    """The gradient's SVD cannot be cut (review 45: a 0.5 s budget on a 1000 x 3072 first layer
    ran 1.6 s; 0.2 s ran 2.2 s here). The attack now waits for its setup until the deadline and
    reports the budget, with the batch size not read; the setup here waits on an event."""
    import threading

    import spear.core.reconstruct as reconstruct

    client = make_client(8, width=60, seed=3)
    release, build = threading.Event(), reconstruct.AttackSetup.build

    def slow(*args, **kwargs):
        release.wait(30)  # released by the test (on a clock only if the attack never returns)
        return build(*args, **kwargs)

    monkeypatch.setattr(reconstruct.AttackSetup, "build", slow)
    try:
        rec = spear.attack_layer(client.model, "0", client.grads, time_budget=0.05, seed=0)
    finally:
        release.set()
        _join_late_workers()
    assert rec.stats.stop_reason == "time budget" and rec.batch_size is None and not rec.verified
    assert rec.inputs is None and rec.singular_values.numel() == 0 and rec.stats.proposals == 0
    assert "ran out in the attack's setup" in rec.message and "60 x 784 gradient" in rec.message
    assert rec.summary()["batch_size"] is None
    monkeypatch.setattr(reconstruct.AttackSetup, "build", build)
    whole = spear.attack_layer(client.model, "0", client.grads, time_budget=3600.0, seed=0)
    assert whole.verified and whole.batch_size == 8


def test_the_inverters_late_svd_is_dropped_not_cached(mnist, monkeypatch):
    """A lower layer's SVD that outlasts the cascade's deadline ends the wait for it; when it
    ends later, its result must not land in the cache (the cascade clears it on a subtraction,
    and a stale SVD would then describe the wrong gradient)."""
    import threading

    from spear.core.backtrack import GradientSVD
    from spear.inversion.row_space import RowSpaceInverter

    view, _ = deep_mlp_round(mnist, 200, 12, 3)
    rec = spear.attack_layer(view.model, "4", view.gradients, seed=0, max_proposals=50_000)
    assert rec.verified
    release, of = threading.Event(), GradientSVD.of
    monkeypatch.setattr(GradientSVD, "of", lambda grad: release.wait(30) and of(grad))
    svds: dict = {}
    try:
        cut = RowSpaceInverter(svds=svds, deadline=Deadline.after(0.05))(view.model, "4", view.gradients, rec)
    finally:
        release.set()
        _join_late_workers()
    assert not bool(cut.exact.any()) and not svds
    assert any("12 sample(s) not traced to the data" in n for n in cut.notes)


def test_late_work_still_running_is_waited_for_before_new_work_starts():
    """Review 46b: an SVD cut by one attack's budget ran on beside the next attacks, which then
    ran out of time in their own setup. Later uncut work waits for it, within its own deadline."""
    import threading

    from spear.core.deadline import LateError, finish_by

    release, started = threading.Event(), []
    with pytest.raises(LateError):
        finish_by(Deadline.after(0.05), lambda: release.wait(30))
    try:
        with pytest.raises(LateError):  # the first still runs: this one is not even started
            finish_by(Deadline.after(0.05), lambda: started.append(1))
        assert not started
    finally:
        release.set()
    assert finish_by(Deadline.after(3600.0), lambda: started.append(2) or "done") == "done"
    assert started == [2]
    _join_late_workers()


def test_ctrl_c_while_waiting_for_uncut_work_does_not_abort_the_interpreter(tmp_path):
    """Review 46b: Ctrl-C during ``Thread.join`` marked the worker (inside an SVD) finished, so
    Python's exit did not wait for it and aborted (SIGABRT, "terminate called without an active
    exception") in 4 of 6 runs. The wait is on an event now; the exit waits for the worker."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "interrupted.py"
    script.write_text(
        textwrap.dedent(
            """
            import signal, threading, time, torch
            from spear.core.deadline import Deadline, finish_by
            torch.set_num_threads(1)
            a = torch.randn(300, 300, dtype=torch.float64)
            stop = threading.Event()  # SVDs until the interrupt is handled, however fast the machine

            def work():
                for _ in range(100_000):
                    if stop.is_set():
                        return
                    torch.linalg.svd(a)

            # whatever the parent left (an ignored or blocked SIGINT is inherited): Python's own
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            main = threading.main_thread().ident  # the signal to the waiting thread itself: one sent
            # to the process may land on the worker, and the main thread's wait would not wake
            threading.Timer(0.3, lambda: signal.pthread_kill(main, signal.SIGINT)).start()
            try:
                finish_by(Deadline.after(3600.0), work)
            except KeyboardInterrupt:
                print("interrupted", flush=True)
                stop.set()
            """
        )
    )
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.returncode, run.stderr[-500:])
    assert "interrupted" in run.stdout and "terminate called" not in run.stderr


def test_a_peeler_that_would_outlast_the_budget_is_not_built(monkeypatch):
    """The peeler's SVD of the next layer's gradient cannot be cut either (review 46b: 3.75 s on a
    loaded machine, a 3 s budget ran 7.5 s): past the deadline the attack goes on without it."""
    import spear.core.reconstruct as reconstruct
    from spear.core.deadline import LateError

    asked = []

    def peeler_late(deadline, work):
        if getattr(work, "__name__", "") == "make_peeler":
            asked.append(1)
            raise LateError
        return work()

    client = make_client(12, width=80, seed=3)
    monkeypatch.setattr(reconstruct, "finish_by", peeler_late)
    rec = spear.attack_layer(client.model, "0", client.grads, seed=0, max_proposals=512, time_budget=3600.0)
    assert asked == [1] and rec.batch_size == 12 and rec.stats.proposals <= 512
    assert rec.stats.stop_reason in ("budget", "sigma=1", "explained", "exhausted")
