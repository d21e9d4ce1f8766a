"""The known narrow layer above (``spear.core.proposers.masked_subspace``): every column of dL/dZ
is a ReLU-masked vector of range(W'^T), which pins a sample's pattern where ~50% zeros are far
too few for Lemma 5.2's sampling."""

import dataclasses
import math

import pytest
import torch

import spear
from spear.core.deadline import Deadline
from spear.core.proposers import MaskedSubspaceProposer, ProposalContext, masked_subspace
from spear.core.proposers.masked_subspace import (
    ETA,
    HYPOTHESES_PER_GUESS,
    MIN_RUN,
    MOST_CONVERGED,
    RATIO_FLOOR,
    PatternSearch,
    _FlipState,
    _most_repeated,
    applicable,
    delta_hypotheses,
    explain_away,
    remainder_patterns,
)
from spear.core.reconstruct import _Attack
from spear.core.scale import LayerProblem
from spear.data import load_dataset
from spear.errors import InputError
from spear.fl import feature_layer, layer_inputs, shallow_mlp, simulate_fedsgd, small_cnn
from spear.metrics import match_samples
from tests.conftest import assert_exact, make_client, without_singletons

DONE = RATIO_FLOOR  # the search's convergence level for float64 gradients


def shallow_case(b: int, width: int, seed: int, dtype: torch.dtype = torch.float64):
    """The LT paper's setting at test size: model, server view, ground truth (raw MNIST)."""
    dataset = load_dataset("mnist")
    model = shallow_mlp(dataset.features, width, seed=seed, dtype=dtype)
    view, truth = simulate_fedsgd(model, dataset, b, seed=seed, normalize=False)
    return model, view, truth


def layer_problem(model: torch.nn.Sequential, gradients: dict, b: int) -> LayerProblem:
    first, head = model[0], model[2]
    grad = gradients["0.weight"].to(torch.float64)
    U, S, Vh = torch.linalg.svd(grad, full_matrices=False)
    return LayerProblem(
        first.weight.detach().double(),
        first.bias.detach().double(),
        gradients["0.bias"].double(),
        U[:, :b] * S[:b],
        Vh[:b],
        "output",
        gradients["2.weight"].double(),
        head.weight.detach().double(),
    )


def context(problem: LayerProblem, found: torch.Tensor | None = None) -> ProposalContext:
    b = problem.batch_size
    return ProposalContext(
        L=problem.L,
        batch_size=b,
        threshold_count=int(0.4 * problem.L.shape[0]),
        generator=torch.Generator().manual_seed(0),
        proposal_dtype=torch.float64,
        found=torch.empty(0, b, dtype=torch.float64) if found is None else found,
        problem=problem,
    )


def true_columns(model: torch.nn.Sequential, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Evaluation side: the batch's dL/dZ (m x b) of the first layer, from the ground truth."""
    z = model[0](inputs.reshape(inputs.shape[0], -1).double()).detach().requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(model[2](torch.relu(z)), labels)
    (grad,) = torch.autograd.grad(loss, z)
    return grad.T


def flipped(patterns: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    noise = torch.rand(patterns.shape, generator=torch.Generator().manual_seed(seed))
    return patterns ^ (noise < fraction)


@pytest.fixture(scope="module")
def case():
    b, width = 64, 400
    model, view, truth = shallow_case(b, width, seed=1)
    problem = layer_problem(view.model, view.gradients, b)
    columns = true_columns(view.model, truth.inputs, truth.labels)
    patterns = (columns != 0).T  # (b, m): each sample's ReLU pattern
    return model, view, truth, problem, columns, patterns


def test_pattern_search_finds_exact_patterns_from_a_sixth_of_their_rows_wrong(case):
    _, view, _, problem, columns, patterns = case
    U = torch.linalg.qr(problem.L)[0]
    search = PatternSearch(U, view.model[2].weight.detach().T.double(), columns[:, :0])
    start = flipped(patterns, 1 / 6, seed=0)
    assert int((start != patterns).sum(1).min()) > 40  # a sixth of 400 rows, per sample
    masks, ratio, _ = search.descend(start, sweeps=30, flips=400, done=DONE)
    exact = (masks == patterns).all(dim=1)
    assert int(exact.sum()) >= 60 and bool((ratio[exact] < DONE).all())
    # past the attack's deadline no sweep starts: nothing moves, nothing converges
    late, late_ratio, _ = search.descend(start, sweeps=30, flips=400, done=DONE, deadline=Deadline(0.0))
    assert torch.equal(late, start) and not bool((late_ratio < DONE).any())
    # a pattern that is no sample's is never converged: wrong rows cost their values squared
    _, _, wrong = search.fit(flipped(patterns, 0.02, seed=1))
    assert float(wrong.min()) > 1e3 * DONE


def test_deflation_makes_found_patterns_repel_and_keeps_the_others(case):
    _, view, _, problem, columns, patterns = case
    U = torch.linalg.qr(problem.L)[0]
    half = columns.shape[1] // 2
    search = PatternSearch(U, view.model[2].weight.detach().T.double(), columns[:, :half])
    masks, ratio, _ = search.descend(flipped(patterns, 0.1, seed=2), sweeps=30, flips=400, done=DONE)
    converged = ratio < DONE
    back_to_found = (masks[:half] == patterns[:half]).all(dim=1) & converged[:half]
    assert int(back_to_found.sum()) == 0
    reached = (masks[half:] == patterns[half:]).all(dim=1) & converged[half:]
    assert int(reached.sum()) >= half - 3


def true_deltas(model: torch.nn.Sequential, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Evaluation side: each sample's dL/dZ' of the head, ``softmax - onehot`` (b, k), unit rows."""
    logits = model[2](torch.relu(model[0](inputs.reshape(inputs.shape[0], -1).double()))).detach()
    delta = torch.softmax(logits, dim=1) - torch.nn.functional.one_hot(labels, logits.shape[1]).double()
    return delta / delta.norm(dim=1, keepdim=True)


def test_delta_hypotheses_are_the_found_columns_own_deltas_and_the_one_hot_differences(case):
    _, view, truth, _, columns, _ = case
    B = view.model[2].weight.detach().T.double()
    bank = delta_hypotheses(B, columns[:, :5], zero_rtol=1e-12)
    assert bank.shape == (45 + 5, 10)
    assert torch.allclose(bank.norm(dim=1), torch.ones(50, dtype=torch.float64))
    one_hot = bank[:45]
    assert bool(((one_hot > 0).sum(1) == 1).all() and ((one_hot < 0).sum(1) == 1).all())
    assert (
        len({tuple(row.tolist()) for row in one_hot.sign()}) == 45 and float(one_hot.sum(1).abs().max()) == 0
    )
    own = true_deltas(view.model, truth.inputs, truth.labels)[:5]
    assert float(((bank[45:] * own).sum(1).abs() - 1).abs().max()) < 1e-10
    # a wide head gets no one-hot differences, and nothing found means nothing to offer
    assert delta_hypotheses(torch.ones(50, 40, dtype=torch.float64), columns[:50, :0], 1e-12).shape == (0, 40)


def test_relaxation_from_a_near_delta_finds_patterns_far_outside_the_searchs_basin(case):
    """From 40% of rows wrong :meth:`descend` finds nothing; held at each sample's own delta
    the relaxation hands it all of them, and at a delta 10 degrees off nearly all (63-64 measured)."""
    _, view, truth, problem, columns, patterns = case
    U = torch.linalg.qr(problem.L)[0]
    search = PatternSearch(U, view.model[2].weight.detach().T.double(), columns[:, :0])
    start = flipped(patterns, 0.4, seed=3)
    masks, ratio, _ = search.descend(start, sweeps=30, flips=400, done=DONE)
    assert int(((masks == patterns).all(dim=1) & (ratio < DONE)).sum()) == 0
    own = true_deltas(view.model, truth.inputs, truth.labels)
    masks, ratio, _ = search.descend_from(start, own, sweeps=10, flips=150, done=DONE)
    assert bool(((masks == patterns).all(dim=1) & (ratio < DONE)).all())
    tilt = torch.randn(own.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    tilt -= (tilt * own).sum(1, keepdim=True) * own
    near = own + math.tan(math.radians(10)) * tilt / tilt.norm(dim=1, keepdim=True)
    masks, ratio, _ = search.descend_from(start, near, sweeps=10, flips=150, done=DONE)
    assert int(((masks == patterns).all(dim=1) & (ratio < DONE)).sum()) >= 56
    # past the deadline the relaxation takes no step: the guesses come back as they were
    assert torch.equal(search.relax(start, own, deadline=Deadline(0.0)), start)


def test_once_the_plain_passes_run_dry_every_guess_is_searched_from_delta_hypotheses(case, monkeypatch):
    *_, problem, columns, _ = case
    directions = torch.linalg.lstsq(problem.L, columns).solution.T  # true q_j, evaluation side
    ctx = context(problem, found=directions[:8] / directions[:8].norm(dim=1, keepdim=True))
    proposer = MaskedSubspaceProposer(guesses_per_call=4096)  # one call searches every guess
    relaxed = []
    descend_from = PatternSearch.descend_from

    def spy(self, masks, deltas, *args, **kwargs):
        relaxed.append((masks.clone(), deltas.clone()))
        return descend_from(self, masks, deltas, *args, **kwargs)

    monkeypatch.setattr(PatternSearch, "descend_from", spy)
    monkeypatch.setattr(masked_subspace, "_splitter", lambda *args: None)  # no column splits
    proposer.propose(ctx, 10**6)  # the plain pass over every guess
    assert not relaxed and proposer.has_work(ctx)
    proposer.propose(ctx, 10**6)  # it ran dry: the same guesses, each from its nearest hypotheses
    ((masks, deltas),) = relaxed
    guesses = proposer.guesses
    assert masks.shape[0] == HYPOTHESES_PER_GUESS * guesses.shape[0]
    assert torch.equal(masks, guesses.repeat_interleave(HYPOTHESES_PER_GUESS, dim=0))
    bank = delta_hypotheses(proposer.B, (ctx.found @ ctx.L.T).T, ctx.zero_rtol)
    assert bank.shape[0] == 45 + 8
    assert float((deltas[:, None] - bank[None]).abs().amax(dim=2).min(dim=1).values.max()) == 0.0
    # once per growth of the found directions: with nothing new, the proposer is done
    assert not proposer.has_work(ctx) and proposer.propose(ctx, 10**6).exhausted
    assert len(relaxed) == 1


def test_explain_away_removes_exactly_the_found_columns_a_feature_column_holds():
    g = torch.Generator().manual_seed(0)
    m = 300
    masks = torch.rand(3, m, generator=g) < 0.5
    cols = torch.randn(3, m, generator=g, dtype=torch.float64) * masks
    feature = 2.0 * cols[0] + 3.0 * cols[1] + 0.5 * cols[2]
    unit = cols[:2] / cols[:2].abs().amax(dim=1, keepdim=True)
    rest = explain_away(feature[None], unit)[0]
    assert torch.allclose(rest, 0.5 * cols[2], rtol=0, atol=1e-12)
    # a column without a found sample is left as it is
    assert torch.equal(explain_away(cols[2:3], unit), cols[2:3])
    # past the attack's deadline nothing is half-explained: None, and the caller keeps its state
    from spear.core.deadline import Deadline

    assert explain_away(feature[None], unit, deadline=Deadline(0.0)) is None


def _objective(search: PatternSearch, masks: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The deflated objective of each pattern, recomputed from scratch (the reference)."""
    y = masks.double() * h
    return ((y @ search.P) ** 2 + ETA * y**2).sum(1) / ((y @ search.Pi) ** 2).sum(1)


def test_flip_state_gains_and_updates_equal_the_objective_recomputed_from_scratch():
    g = torch.Generator().manual_seed(3)
    m, b, k, S = 40, 6, 3, 5
    U = torch.linalg.qr(torch.randn(m, b, generator=g, dtype=torch.float64))[0]
    search = PatternSearch(U, torch.randn(m, k, generator=g, dtype=torch.float64), U[:, :2].clone())
    masks = torch.rand(S, m, generator=g) < 0.5
    h = torch.randn(S, m, generator=g, dtype=torch.float64)
    state = _FlipState(search, masks, h)
    for _ in range(3):  # gains, a block of flips, and the running state after it
        gain, improving, count = state.gains()
        now = _objective(search, state.masks, h)
        for i in range(m):
            flipped = state.masks.clone()
            flipped[:, i] ^= True
            expected = now - _objective(search, flipped, h)
            assert torch.allclose(gain[:, i], expected, rtol=1e-9, atol=1e-12 * float(now.max()))
        assert torch.equal(count, improving.sum(1)) and torch.equal(improving, gain > 1e-12 * now[:, None])
        rows = gain.topk(4, dim=1).indices
        take = torch.rand(S, 4, generator=g) < 0.7
        expected_masks = state.masks.clone()
        expected_masks.scatter_(1, rows, expected_masks.gather(1, rows) ^ take)
        state.apply(rows, take)
        assert torch.equal(state.masks, expected_masks)
        y = expected_masks.double() * h
        assert torch.allclose(state.rt, torch.cat([y @ search.P, y @ search.Pi], 1), atol=1e-12)
        assert torch.equal(state.y, y)
    state.keep(torch.tensor([4, 1]))  # the patterns left keep their own state
    assert torch.equal(state.live, torch.tensor([4, 1])) and torch.equal(state.masks, expected_masks[[4, 1]])
    flipped = state.masks.clone()
    flipped[:, 7] ^= True
    expected = _objective(search, state.masks, h[[4, 1]]) - _objective(search, flipped, h[[4, 1]])
    assert torch.allclose(state.gains()[0][:, 7], expected, rtol=1e-9, atol=1e-12)


def _longest_run_reference(row: list[float], rtol: float) -> float:
    """Mean of the first longest run of neighbours equal within rtol (NaNs last), or 0."""
    best, best_mean, i, n = 0, 0.0, 0, len(row)
    while i < n and row[i] == row[i]:
        j = i
        while j + 1 < n and row[j + 1] == row[j + 1] and abs(row[j + 1] - row[j]) <= rtol * abs(row[j + 1]):
            j += 1
        if j - i + 1 > best:
            best, best_mean = j - i + 1, sum(row[i : j + 1]) / (j - i + 1)
        i = j + 1
    return best_mean if best >= MIN_RUN else 0.0


def test_most_repeated_takes_the_first_longest_run_as_a_reference_scan_does():
    g = torch.Generator().manual_seed(5)
    rows = []
    for case in range(40):
        values = torch.randn(60, generator=g, dtype=torch.float64)
        for _ in range(case % 4):  # planted runs, some of equal length (the first wins)
            at = int(torch.randint(0, 50, (1,), generator=g))
            length = int(torch.randint(MIN_RUN - 2, MIN_RUN + 4, (1,), generator=g))
            jitter = 1e-12 * torch.randn(min(length, 60 - at), generator=g)
            values[at : at + length] = values[at] * (1 + jitter)
        values[torch.rand(60, generator=g) < 0.2] = float("nan")
        rows.append(values.sort().values)
    ordered = torch.stack(rows)
    got = _most_repeated(ordered, 1e-9)
    expected = torch.tensor([_longest_run_reference(r.tolist(), 1e-9) for r in ordered], dtype=torch.float64)
    assert torch.allclose(got, expected, rtol=1e-12, atol=0) and int((expected != 0).sum()) >= 10


def test_explain_away_leaves_zero_where_a_column_is_explained_whole():
    g = torch.Generator().manual_seed(4)
    m = 300
    masks = torch.rand(3, m, generator=g) < 0.5
    cols = torch.randn(3, m, generator=g, dtype=torch.float64) * masks
    noisy = cols + 1e-17 * torch.randn(3, m, generator=g, dtype=torch.float64) * ~masks  # rounding off
    unit = noisy / noisy.abs().amax(dim=1, keepdim=True)
    zero = torch.zeros(m, dtype=torch.float64)
    features = torch.stack([2.0 * cols[0] + 3.0 * cols[1], 0.5 * cols[2], zero])
    rest = explain_away(features, unit, zero_rtol=1e-9)
    assert torch.equal(rest, torch.zeros_like(rest))  # no rounding left to pass for a guess
    # a column with a faint sample left keeps what is left, its rounding included
    partial = explain_away((2.0 * cols[0] + 1e-3 * cols[1])[None], unit[:1], zero_rtol=1e-9)[0]
    assert torch.allclose(partial, 1e-3 * cols[1], rtol=0, atol=1e-14)
    assert bool((partial[~masks[1]] != 0).any())  # rounding where sample 1 is zero: not cleared
    # at float32's tolerances (the proposer passes zero_rtol 1e-4 and ratios equal to 1e-6)
    rough = cols * (1 + 1e-7 * torch.randn(3, m, generator=g, dtype=torch.float64))
    rough_unit = rough / rough.abs().amax(dim=1, keepdim=True)
    both = torch.stack([2.0 * cols[0] + 3.0 * cols[1], 2.0 * cols[0] + 1e-3 * cols[2]])
    rest = explain_away(both, rough_unit[:2], rtol=1e-6, zero_rtol=1e-4)
    assert torch.equal(rest[0], torch.zeros(m, dtype=torch.float64))
    assert torch.allclose(rest[1], 1e-3 * cols[2], rtol=0, atol=1e-5 * float(both[1].abs().max()))
    # without the zero tolerance, the same columns keep their rounding
    assert float(explain_away(features, unit).abs().max()) > 0
    # columns all explained already (digits' 64 pixels at b = 13 did it) stay as they are
    assert torch.equal(
        explain_away(torch.zeros(4, m, dtype=torch.float64), unit), torch.zeros(4, m, dtype=torch.float64)
    )


def test_the_last_samples_inputs_give_their_exact_patterns(case):
    _, _, _, problem, columns, patterns = case
    directions = torch.linalg.lstsq(problem.L, columns).solution.T  # true q_j, evaluation side
    directions = directions / directions.norm(dim=1, keepdim=True)
    left = 3
    ctx = context(problem, found=directions[left:])
    guessed = remainder_patterns(ctx, count=512)
    for j in range(left):
        assert bool((guessed == patterns[j]).all(dim=1).any())


def test_applies_only_below_a_narrow_known_layer(case):
    _, _, _, problem, _, _ = case
    assert applicable(context(problem))
    client = make_client(20, width=200, depth=3, seed=0)  # the next layer is 200 wide
    weight, bias, grad_w, grad_b = client.layer_args()
    U, S, Vh = torch.linalg.svd(grad_w.double(), full_matrices=False)
    split = (U[:, :20] * S[:20], Vh[:20])
    wide = LayerProblem(weight, bias, grad_b, *split, "output", None, torch.zeros(200, 200))
    assert not applicable(context(wide))
    with pytest.raises(InputError, match="guesses_per_call"):
        MaskedSubspaceProposer(guesses_per_call=0)


def test_shallow_network_beyond_sampling_reach_is_recovered_exactly():
    """m/b ~ 2.9 on raw MNIST: each column has ~50% zeros, so Lemma 5.2's sampling needs ~1e38
    proposals; the pattern search finds all b columns within a bounded number of guesses."""
    b, width = 104, 300
    _, view, truth = shallow_case(b, width, seed=4)
    proposer = MaskedSubspaceProposer()
    rec = spear.attack_layer(view.model, "0", view.gradients, seed=0, proposer=proposer, max_proposals=20_000)
    assert rec.verified and rec.verified_by == "model"
    assert_exact(rec.inputs, truth.inputs)
    est, ref = match_samples(rec.inputs, truth.inputs)
    assert torch.equal(rec.labels[est], truth.labels[ref])


def test_columns_the_model_certifies_alone_count_when_the_batch_is_not_verified():
    from spear.core.certificate import BatchReduction, SampleCertificates
    from spear.core.verdict import individually_certified

    ok = torch.tensor([True, True, True, True, False, True])
    cert = SampleCertificates(
        ok=ok,
        labels=torch.tensor([1, 2, 3, 4, -1, 5]),
        weights=torch.full((6,), 1 / 6, dtype=torch.float64),
        misfit=torch.zeros(6, dtype=torch.float64),
        strong=torch.tensor([True, True, False, True, False, True]),  # 2: sign only
        saturated=torch.tensor([False, False, False, False, False, True]),
    )
    reduction = BatchReduction("mean", torch.tensor([1, 2, 1, 1, 1, 1]), 7, 0)  # 1 stands for two
    peeled = torch.tensor([False, False, False, True, False, False])  # 3 counted already
    assert individually_certified(cert, reduction, peeled).tolist() == [
        True,
        False,
        False,
        False,
        False,
        False,
    ]
    none_fits = BatchReduction(None, None, None, None)
    assert not bool(individually_certified(cert, none_fits, peeled).any())


def test_explain_away_at_float32_precision_and_clear_errors_when_not_applicable(case):
    g = torch.Generator().manual_seed(1)
    m = 300
    cols = torch.randn(2, m, generator=g, dtype=torch.float64) * (torch.rand(2, m, generator=g) < 0.5)
    feature = 2.0 * cols[0] + 3.0 * cols[1]
    noisy = feature * (1 + 1e-7 * torch.randn(m, generator=g, dtype=torch.float64))  # float32 rounding
    unit = cols[:1] / cols[:1].abs().amax()
    assert torch.equal(explain_away(noisy[None], unit)[0], noisy)  # float64's tolerance: no run
    rest = explain_away(noisy[None], unit, rtol=1e-6)[0]
    assert float((rest - 3.0 * cols[1]).abs().max()) < 1e-5
    # alone, the proposer names what it needs instead of failing deep inside
    _, _, _, problem, _, _ = case
    without = LayerProblem(problem.weight, problem.bias, problem.grad_bias, problem.L, problem.R)
    with pytest.raises(InputError, match="next linear layer"):
        MaskedSubspaceProposer().propose(context(without), 100)


def test_auto_does_not_stop_when_one_of_its_proposers_runs_dry(case):
    from spear.core.proposers import AutoProposer, ProposalBatch

    *_, problem, _, _ = case
    auto = AutoProposer()
    auto.subspace.propose = lambda ctx, n: ProposalBatch(
        ctx.L.new_zeros(0, ctx.batch_size), 1, exhausted=True
    )
    assert not auto.propose(context(problem), 100).exhausted


def test_confirmed_patterns_count_below_the_sparsity_threshold(monkeypatch):
    """A float32 CNN feature layer (untrained, b = 64): some samples' columns have fewer zeros
    than Section 4.1's threshold of 184 for ~460 live rows (3 to 13 of them, 174-183 zeros,
    depending on the CPU's float32 arithmetic). The subspace proposer's converged patterns are
    pinned by the known head, so they need only a kernel's b - 1 rows.

    Both runs switch off the two other routes to such columns: a stalled search lowering the
    threshold, and the singleton cascade (which needs no zero count)."""
    dataset = load_dataset("mnist")
    model = small_cnn(dataset.image_shape, hidden=500, classes=dataset.classes, seed=0, dtype=torch.float32)
    view, truth = simulate_fedsgd(model, dataset, 64, seed=0)
    layer = feature_layer(model)
    features = layer_inputs(view.model, layer, truth.inputs)
    monkeypatch.setattr(_Attack, "_adapt_threshold", lambda self, *args: None)
    without_singletons(monkeypatch)
    rec = spear.attack_layer(view.model, layer, view.gradients, seed=0, max_proposals=20_000)
    assert rec.verified
    assert_exact(rec.inputs.double(), features.double(), rtol=1e-3)
    # the premise: some columns have fewer zeros than the threshold
    dz = rec.grad_outputs.double()
    live = dz.abs().amax(dim=1) > 0
    zeros = (dz[live].abs() <= 1e-4 * dz[live].abs().amax(dim=0)).sum(dim=0)
    assert int((zeros < rec.stats.threshold_count).sum()) >= 1
    # the same hints held to the threshold leave such samples out
    propose = MaskedSubspaceProposer.propose

    def unconfirmed(self, ctx, max_proposals):
        return dataclasses.replace(propose(self, ctx, max_proposals), confirmed=None)

    monkeypatch.setattr(MaskedSubspaceProposer, "propose", unconfirmed)
    # and without the column splits, whose columns are pinned by the head, not by their zeros
    monkeypatch.setattr(masked_subspace, "_splitter", lambda *args: None)
    held = spear.attack_layer(view.model, layer, view.gradients, seed=0, max_proposals=20_000)
    assert not held.verified and held.stats.candidates < 64


def _small_batch_runs(monkeypatch, view, layer: str, seed: int, max_proposals: int):
    """The attack as it is, and with the pattern search out of the small-batch schedule."""
    with_search = spear.attack_layer(
        view.model, layer, view.gradients, seed=seed, max_proposals=max_proposals
    )
    monkeypatch.setattr(MaskedSubspaceProposer, "has_work", lambda self, ctx: False)
    without = spear.attack_layer(view.model, layer, view.gradients, seed=seed, max_proposals=max_proposals)
    return with_search, without


def test_small_batches_below_a_narrow_head_get_its_pattern_search(monkeypatch):
    """b = 13 (the paper's sampler alone below 14) on a two-layer MLP trained 300 steps, raw
    digits, float32: the last columns are dense for sampling, and the head's pattern search
    pins them (8,320 proposals). Sampling alone gets there too (40,704) since candidates that
    cannot be columns under the head are rejected (``fits_the_layer_above``); before, 1M
    proposals found no batch among those mixtures. The singleton cascade solves this batch
    on its own since it counts samples with silent entries (4,096 proposals, with or without
    the pattern search: ``tests/test_shallow.py``), so it is off here: this test is the
    search's."""
    from spear.core import reconstruct
    from spear.fl import fully_connected, pretrain

    dataset = load_dataset("digits")
    model = fully_connected(dataset.features, 300, 2, dataset.classes, seed=7267, dtype=torch.float32)
    pretrain(model, dataset, 300, seed=7267)
    view, truth = simulate_fedsgd(model, dataset, 13, seed=7267, normalize=False)
    monkeypatch.setattr(reconstruct._Attack, "_scan_singletons", lambda self: None)
    rec, without = _small_batch_runs(monkeypatch, view, "0", seed=7267, max_proposals=100_000)
    assert rec.verified and rec.stats.proposals < 100_000
    assert_exact(rec.inputs.double(), truth.inputs.double(), rtol=1e-5)
    assert without.stats.proposals > 3 * rec.stats.proposals


def _head_columns(m=60, k=4, b=6, seed=0, flat_row=None):
    """Columns ``D_j B g_j`` of b samples below a k-wide known layer (patterns 80% active), and
    an orthonormal basis of their span (what range(L) is). ``flat_row``: make ``B g_0`` vanish
    there."""
    g = torch.Generator().manual_seed(seed)
    B = torch.randn(m, k, generator=g, dtype=torch.float64)
    masks = torch.rand(b, m, generator=g) < 0.8
    deltas = torch.randn(b, k, generator=g, dtype=torch.float64)
    if flat_row is not None:
        d = deltas[0]
        B[flat_row] -= (B[flat_row] @ d) / (d @ d) * d
    columns = masks * (deltas @ B.T)
    return B, masks, columns, torch.linalg.qr(columns.T)[0]


def test_candidates_that_no_pattern_of_the_layer_above_explains_are_not_samples():
    """fits_the_layer_above: every sample's column is ``D_j W'^T delta_j`` on its nonzero rows
    (to float32 rounding too); the difference of two samples whose deltas agree (same-class
    samples of a trained head) vanishes wherever both are active, so it has more zeros than
    either, but it is one column on some rows and minus the other on others: refused, and so
    is a generic mixture. Its rounding error lets a faint column through."""
    from spear.core.consistency import fits_the_layer_above
    from spear.core.filtering import ROUNDING_ENTRY

    B, masks, columns, _ = _head_columns(m=80, k=4, b=6, seed=3)
    shared = B @ torch.linalg.lstsq(B[masks[0]], columns[0, masks[0], None]).solution[:, 0]
    difference = columns[0] - masks[1] * shared  # sample 0, and sample 1's pattern with its delta
    mixture = columns[2] + 0.7 * columns[3]
    rounded = columns + 1e-7 * columns.abs().amax(dim=1, keepdim=True) * torch.randn(
        columns.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    candidates = torch.cat([columns, rounded, difference[None], mixture[None]])
    zero = candidates.abs() <= 1e-4 * candidates.abs().amax(dim=1, keepdim=True)
    assert int(zero[-2].sum()) > int(zero[:2].sum(dim=1).max())  # the difference is sparser
    fits, telling = fits_the_layer_above(candidates, B.T, 1e-4)
    assert fits.tolist() == [True] * 12 + [False, False] and bool(telling.all())
    # at float64's zero tolerance the rounded columns need their rounding floor and error
    assert not bool(fits_the_layer_above(rounded, B.T, 1e-9)[0].any())
    errors = (rounded - columns).norm(dim=1)
    floors = ROUNDING_ENTRY * errors / math.sqrt(columns.shape[1])  # as filtering.rounding_floor
    assert bool(fits_the_layer_above(rounded, B.T, 1e-9, floors, errors)[0].all())
    # a true zero read above the band (here 5 times it) is left out of the fit, not fitted
    lifted = columns.clone()
    row = int((~masks[0]).nonzero()[0])
    lifted[0, row] = 5e-4 * lifted[0].abs().max()
    assert bool(fits_the_layer_above(lifted, B.T, 1e-4)[0][0])
    # a column with too few nonzero rows fits any delta: it passes, and tells nothing
    few = columns[:1] * (torch.arange(80) < 6)
    fits, telling = fits_the_layer_above(few, B.T, 1e-4)
    assert bool(fits[0]) and not bool(telling[0])


def test_a_pattern_pins_its_column_and_nothing_else_passes():
    """pin_columns: a sample's pattern gives its column exactly; a pattern with one row wrong,
    a pattern two samples share (two-dimensional kernel) and a mixture's pattern do not pin."""
    from spear.core.proposers.masked_subspace import pin_columns

    B, masks, columns, U = _head_columns()
    pinned, ok = pin_columns(U, B, masks, 1e-9)
    assert bool(ok.all())
    cos = torch.nn.functional.cosine_similarity(pinned, columns, dim=1).abs()
    assert float((1 - cos).max()) < 1e-13
    wrong = masks[0].clone()
    wrong[masks[0].nonzero()[5, 0]] = False  # an active row called inactive
    mixed = masks[1] | masks[2]  # the pattern of a mixture of samples 1 and 2
    _, bad = pin_columns(U, B, torch.stack([wrong, mixed]), 1e-9)
    assert bad.tolist() == [False, False]
    twins = columns.clone()
    other = torch.randn(B.shape[1], generator=torch.Generator().manual_seed(1), dtype=B.dtype)
    twins[5] = masks[4] * (other @ B.T)  # samples 4 and 5 share a pattern
    U_twins = torch.linalg.qr(twins.T)[0]
    _, shared = pin_columns(U_twins, B, torch.stack([masks[4], masks[3]]), 1e-9)
    assert shared.tolist() == [False, True]
    # the twins' mixture that vanishes on a row they share is (D minus that row) W'^T delta:
    # refused, the row being essential to its kernel (found by review: 7 wrong columns pinned
    # on a digits MLP where two samples of one class share their pattern)
    row = masks[4].nonzero()[3, 0]
    less = masks[4].clone()
    less[row] = False
    for zero_rtol in (1e-9, 1e-4):
        _, pinned = pin_columns(U_twins, B, less[None], zero_rtol)
        assert not bool(pinned[0])


def test_a_near_duplicate_active_on_one_more_row_leaves_the_column_pinned():
    """Sample 1's pattern is sample 0's with one more row on: that row is essential to sample
    0's kernel (dropping it lets sample 1's column in), but on the larger pattern only sample
    1's column fits, so sample 0's column is no mixture and stays pinned."""
    from spear.core.proposers.masked_subspace import pin_columns

    B, masks, columns, _ = _head_columns(seed=3)
    row = (~masks[0]).nonzero()[0, 0]
    masks[1] = masks[0]
    masks[1, row] = True
    other = torch.randn(B.shape[1], generator=torch.Generator().manual_seed(4), dtype=B.dtype)
    columns[1] = masks[1] * (other @ B.T)
    pinned, ok = pin_columns(torch.linalg.qr(columns.T)[0], B, masks[:2], 1e-9)
    assert ok.tolist() == [True, True]
    cos = torch.nn.functional.cosine_similarity(pinned, columns[:2], dim=1).abs()
    assert float((1 - cos).max()) < 1e-12


def test_an_active_row_that_vanishes_is_solved_again_as_inactive():
    """A row the search calls active where ``W'^T delta`` vanishes (the ratio cannot tell): the
    column is zero there, and the pattern with that row inactive pins it."""
    from spear.core.proposers.masked_subspace import pin_columns

    row = int((~_head_columns(seed=2)[1][0]).nonzero()[0, 0])  # inactive for sample 0
    B, masks, columns, U = _head_columns(seed=2, flat_row=row)
    called_active = masks[0].clone()
    called_active[row] = True
    pinned, ok = pin_columns(U, B, called_active[None], 1e-9)
    assert bool(ok[0])
    cos = torch.nn.functional.cosine_similarity(pinned[0], columns[0], dim=0).abs()
    assert float(1 - cos) < 1e-13


def test_columns_with_fewer_zeros_than_a_kernel_needs_are_pinned_by_their_pattern(monkeypatch):
    """The last hidden layer of a 4 x 128 MLP trained 300 steps on raw digits, float32, b = 11:
    seven of the eleven columns have 5-9 zeros among 91 live neurons, fewer than the b - 1 = 10
    any zero set needs, so no zero-set method can return them. The head's converged patterns
    pin them (pin_columns); without that the budget runs out."""
    from spear.core.proposers import masked_subspace
    from spear.fl import fully_connected, pretrain

    dataset = load_dataset("digits")
    model = fully_connected(dataset.features, 128, 4, dataset.classes, seed=7260, dtype=torch.float32)
    pretrain(model, dataset, 300, seed=7260)
    view, truth = simulate_fedsgd(model, dataset, 11, seed=7260, normalize=False)
    inputs = layer_inputs(view.model, "4", truth.inputs)
    rec = spear.attack_layer(view.model, "4", view.gradients, seed=7260, max_proposals=50_000)
    assert rec.verified and rec.stats.proposals < 50_000
    assert_exact(rec.inputs.double(), inputs.double(), rtol=1e-4)
    pin = masked_subspace.pin_columns
    monkeypatch.setattr(masked_subspace, "pin_columns", lambda *a: (pin(*a)[0], torch.zeros_like(pin(*a)[1])))
    without = spear.attack_layer(view.model, "4", view.gradients, seed=7260, max_proposals=50_000)
    assert not without.verified and without.stats.proposals == 50_000


def test_near_copies_of_a_found_direction_count_once():
    """Two near-copies of one column (1e-3 apart, as a faint float32 column is found through two
    zero sets) among the found directions leave one more sample unfound than their number says:
    the remainder's guesses must still run for it."""
    from spear.core.proposers.base import orthogonal_complement
    from spear.core.proposers.masked_subspace import unfound

    b = 4
    e = torch.eye(b, dtype=torch.float64)
    copy = e[0] + 1e-3 * e[1]
    found = torch.stack([e[0], copy / copy.norm(), e[2]])
    assert orthogonal_complement(found, b).shape[1] == 1  # exact rank: 3 of 4
    assert orthogonal_complement(found, b, 1e-2).shape[1] == 2  # the copies span one dimension
    ctx = ProposalContext(
        L=torch.eye(b, dtype=torch.float64),
        batch_size=b,
        threshold_count=1,
        generator=torch.Generator().manual_seed(0),
        proposal_dtype=torch.float64,
        found=found,
        copy_angle=1e-2,
    )
    assert unfound(ctx) == 2
    assert unfound(dataclasses.replace(ctx, copy_angle=0.0)) == 1


def test_a_faint_columns_pattern_converges_within_its_own_rounding():
    """With a rounding map (faint columns), a pattern has converged where its plain ratio is
    within its column's squared relative rounding (a faint column lies that far outside the
    computed range(L)), between ``done`` and ``MOST_CONVERGED``; without a map, at ``done``."""
    g = torch.Generator().manual_seed(0)
    m, b, k, done = 40, 5, 3, 1e-6
    U = torch.linalg.qr(torch.randn(m, b, generator=g, dtype=torch.float64))[0]
    B = torch.randn(m, k, generator=g, dtype=torch.float64)
    masks = torch.rand(8, m, generator=g) < 0.5
    delta = torch.randn(8, k, generator=g, dtype=torch.float64)
    at_done = PatternSearch(U, B, U[:, :0]).thresholds(masks, delta, done)
    assert torch.equal(at_done, torch.full((8,), done, dtype=torch.float64))
    inside = (masks.double() * (delta @ B.T)) @ U  # reference: the columns' coordinates in U
    for weakest in (3e-3, 1.0):  # squared precisions about 1e-6 to 1e-5; above the cap
        rounding = torch.diag(torch.tensor([1e-7, 1e-6, 1e-5, 1e-4, weakest], dtype=torch.float64))
        precision = (inside @ rounding.T).norm(dim=1) / inside.norm(dim=1)
        expected = precision.square().clamp(done, MOST_CONVERGED)
        got = PatternSearch(U, B, U[:, :0], rounding).thresholds(masks, delta, done)
        torch.testing.assert_close(got, expected)
        between = (got > done) & (got < MOST_CONVERGED)
        assert bool(between.any()) if weakest < 1 else bool((got == MOST_CONVERGED).all())
