"""Peeling: one direction gives its sample exactly through the next layer, and the rest is a
smaller SPEAR problem (spear.core.peeling)."""

import itertools

import pytest
import torch

import spear
from spear.core.filtering import zero_mask
from spear.core.lowrank import low_rank_split
from spear.core.peeling import (
    PeeledSamples,
    SamplePeeler,
    _clashes,
    certified_in_order,
    mutually_consistent,
    residual_problem,
)
from spear.core.scale import LayerProblem
from tests.conftest import TrueColumns, assert_exact

RTOL = 1e-8  # the float64 verification tolerance


def _client(b, width, depth=3, seed=0, init="default"):
    """An MNIST FedSGD client: the first layer's problem, truth (inputs, dL/dZ) and unit Qt."""
    from spear.data import load_dataset
    from spear.fl import fully_connected, simulate_fedsgd

    dataset = load_dataset("mnist")
    model = fully_connected(dataset.features, width, depth, dataset.classes, seed=seed, init=init)
    view, truth = simulate_fedsgd(model, dataset, b, seed=seed)
    g = {k: v.detach() for k, v in view.gradients.items()}
    layer = view.model[0]
    split = low_rank_split(g["0.weight"])
    problem = LayerProblem(
        layer.weight.detach(),
        layer.bias.detach(),
        g["0.bias"],
        split.L,
        split.R,
        "output",
        g["2.weight"],
        view.model[2].weight.detach(),
    )
    Z = layer(truth.inputs)
    loss = torch.nn.functional.cross_entropy(view.model[1:](Z), truth.labels)
    (dZ,) = torch.autograd.grad(loss, Z)  # (b, m)
    Qt = torch.linalg.lstsq(split.L, dZ.T).solution
    return view, problem, truth.inputs.detach(), dZ.detach(), Qt / Qt.norm(dim=0)


def _pattern_sharing_pair(eps):
    """Six random inputs with x1 = x0 + eps noise (one activation pattern for small eps): the
    first layer's problem and the true dL/dZ (m, b)."""
    from spear.fl import fully_connected

    x = torch.randn(6, 784, dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    x[1] = x[0] + eps * torch.randn(784, dtype=torch.float64, generator=torch.Generator().manual_seed(12))
    model = fully_connected(784, 200, 3, seed=11)
    Z = model[0](x)
    Z.retain_grad()
    torch.nn.functional.cross_entropy(model[1:](Z), torch.arange(6)).backward()
    grads = {n: p.grad.detach() for n, p in model.named_parameters()}
    split = low_rank_split(grads["0.weight"])
    problem = LayerProblem(
        model[0].weight.detach(), model[0].bias.detach(), grads["0.bias"], split.L, split.R, "output",
        grads["2.weight"], model[2].weight.detach(),
    )  # fmt: skip
    return problem, Z.grad.detach().T


def _peeler(problem):
    return SamplePeeler(problem, RTOL, 1e-10)


def _peel(peeler, directions, masks):
    """(robustly certified (k,) bool, the samples of the consistent directions)."""
    outcome = peeler.peel(directions, masks)
    assert bool((outcome.robust <= outcome.consistent).all())
    return outcome.robust, outcome.samples


def test_each_true_direction_peels_to_its_exact_sample_and_gradient():
    b = 40
    _, problem, X, dZ, Qt = _client(b, 400)
    peeler = _peeler(problem)
    assert peeler.usable
    masks = zero_mask((problem.L @ Qt).T, 1e-9)
    certified, samples = _peel(peeler, Qt.T, masks)
    assert bool(certified.all())
    # in the order given: sample j from column j alone, without the other b - 1 directions
    assert torch.allclose(samples.inputs, X, rtol=0, atol=1e-10)
    assert torch.allclose(problem.L @ samples.duals.T, dZ.T, rtol=0, atol=1e-12 * float(dZ.abs().max()))
    # the dual relation u_j . r_k = delta_jk behind the scales
    eye = torch.eye(b, dtype=torch.float64)
    assert torch.allclose(samples.duals @ samples.coefficients.T, eye, atol=1e-9)


def test_mixtures_and_wrong_directions_are_not_certified():
    b = 40
    _, problem, _, dZ, Qt = _client(b, 400, seed=1)
    peeler = _peeler(problem)
    L = problem.L
    zeros = dZ.abs() < 1e-14  # (b, m) true zero sets
    wrong = []
    for i in range(0, 12, 2):
        # the kernel of two columns' common zeros plus one row where only column i vanishes:
        # an exact direction of L[S] that is a mixture, not a column (it passes the zero count)
        common = zeros[i] & zeros[i + 1]
        extra = (zeros[i] & ~zeros[i + 1]).nonzero()[:1, 0]
        rows = torch.cat([common.nonzero()[:, 0], extra])
        q = torch.linalg.svd(L[rows])[2][-1]
        wrong.append(q if (Qt.T @ q).abs().max() < 1 - 1e-6 else None)
        # the plain sum of two columns, with its own (intersection) zero set
        wrong.append((Qt[:, i] + Qt[:, i + 1]) / (Qt[:, i] + Qt[:, i + 1]).norm())
    wrong.append(torch.nn.functional.normalize(torch.randn(b, dtype=torch.float64), dim=0))
    wrong = torch.stack([q for q in wrong if q is not None])
    masks = zero_mask(wrong @ L.T, 1e-9)
    certified, samples = _peel(peeler, wrong, masks)
    assert not bool(certified.any()) and len(samples) == 0


def test_residual_problem_is_the_gradient_of_the_unpeeled_samples():
    b = 30
    _, problem, X, dZ, Qt = _client(b, 300, seed=2)
    peeler = _peeler(problem)
    F, rest = torch.arange(0, b, 3), torch.tensor([j for j in range(b) if j % 3])
    masks = zero_mask((problem.L @ Qt[:, F]).T, 1e-9)
    certified, samples = _peel(peeler, Qt[:, F].T, masks)
    assert bool(certified.all())
    residual, basis = residual_problem(problem, samples)
    assert residual.batch_size == rest.numel() and basis.shape == (b, rest.numel())
    truth_w = dZ[rest].T @ X[rest]
    assert torch.allclose(residual.L @ residual.R, truth_w, atol=1e-12 * float(truth_w.abs().max()))
    assert torch.allclose(residual.grad_bias, dZ[rest].sum(dim=0), atol=1e-15)
    # the remaining directions live in span(B): sparse directions of the residual factor
    q_rest = basis.T @ Qt[:, rest]
    assert torch.allclose(basis @ q_rest, Qt[:, rest], atol=1e-12)
    assert torch.allclose((residual.L @ q_rest).abs() < 1e-14, (dZ[rest] != 0).logical_not().T)


def _peeled_twice() -> tuple[PeeledSamples, PeeledSamples]:
    """Samples 0-4 of a b = 20 client peeled, then samples 3-7 (3 and 4 a second time)."""
    b = 20
    _, problem, _, _, Qt = _client(b, 300, seed=3)
    peeler = _peeler(problem)
    masks = zero_mask((problem.L @ Qt).T, 1e-9)
    _, first = _peel(peeler, Qt[:, :5].T, masks[:5])
    _, again = _peel(peeler, Qt[:, 3:8].T, masks[3:8])
    return first, again


def test_a_duplicate_or_inconsistent_certificate_is_rejected():
    first, again = _peeled_twice()
    keep = mutually_consistent(first, again, RTOL)
    assert keep.tolist() == [False, False, True, True, True]
    # a forged certificate: the right direction with another sample's coefficients
    forged = PeeledSamples(again.directions[2:3], first.coefficients[:1], first.inputs[:1], first.duals[:1])
    assert mutually_consistent(first, forged, RTOL).tolist() == [False]


def test_mutual_consistency_allows_the_rounding_each_pairs_data_explain():
    # u_j . r_k = 0 for distinct true samples up to the rounding of u_j's column and r_k's input
    # (float32 CNN heads: true pairs read up to 1.2e-3 at rtol 1e-3, and were kept out); a
    # duplicate reads about 1 whatever the samples' precision
    from spear.core.peeling import CLASH_SLACK

    first, again = _peeled_twice()
    # sample 6's dual leans 2e-3 on sample 0's input: beyond rtol = 1e-3
    again.duals[3] += 2e-3 * again.duals[3].norm() * first.coefficients[0] / first.coefficients[0].norm()
    assert mutually_consistent(first, again, 1e-3).tolist() == [False, False, True, False, True]
    precise = (torch.zeros(10, dtype=torch.float64), torch.zeros(10, dtype=torch.float64))
    assert mutually_consistent(first, again, 1e-3, precise).tolist() == [False, False, True, False, True]
    kept = [False, False, True, True, True]
    rounded = torch.full((10,), 1e-3 / CLASH_SLACK, dtype=torch.float64)
    assert mutually_consistent(first, again, 1e-3, (rounded, rounded)).tolist() == kept
    coarse = torch.full((10,), 0.1 / CLASH_SLACK, dtype=torch.float64)  # still far below a duplicate's
    assert mutually_consistent(first, again, 1e-3, (coarse, coarse)).tolist() == kept


def test_attack_peels_every_sample_of_a_b64_batch():
    # every found direction becomes a certified sample, and the final batch is exact too
    b = 64
    view, _, X, _, _ = _client(b, 400, seed=4)
    rec = spear.attack_layer(view.model, "0", view.gradients, seed=4, max_proposals=50_000)
    assert rec.verified, rec.message
    assert rec.stats.certified == b and rec.summary()["certified_samples"] == b
    assert_exact(rec.inputs, X, 1e-8)
    assert_exact(rec.certified_inputs, X, 1e-8)


def test_partial_result_keeps_the_certified_samples():
    b = 100
    view, _, X, _, _ = _client(b, 500, seed=1)
    rec = spear.attack_layer(view.model, "0", view.gradients, seed=1, max_proposals=300)
    assert not rec.verified and rec.inputs is None
    assert 0 < rec.stats.certified < b and "certified one by one" in rec.message
    # every certified sample is a true one, exactly
    dist = (rec.certified_inputs[:, None, :] - X[None]).abs().amax(dim=-1)
    assert float(dist.min(dim=1).values.max()) < 1e-8


def test_no_peeling_without_a_usable_next_layer():
    # depth 2: the next layer is the 10-class output, rank(dL/dW') <= 10 < b
    b = 16
    view, *_ = _client(b, 200, depth=2, seed=5)
    rec = spear.attack_layer(view.model, "0", view.gradients, seed=5)
    assert rec.verified and rec.stats.certified == 0 and rec.certified_inputs is None
    _, problem, *_ = _client(b, 200, depth=3, seed=5)
    rec = spear.reconstruct(
        problem.weight, problem.bias, problem.L @ problem.R, problem.grad_bias,
        next_grad_weight=problem.next_grad_weight, peel=False,
    )  # fmt: skip
    assert rec.verified and rec.stats.certified == 0


@pytest.mark.parametrize("seed", [6])
def test_peeling_runs_are_deterministic(seed):
    view, *_ = _client(48, 300, seed=seed)
    a = spear.attack_layer(view.model, "0", view.gradients, seed=seed)
    b = spear.attack_layer(view.model, "0", view.gradients, seed=seed)
    assert a.verified and b.verified
    assert a.stats.proposals == b.stats.proposals and a.stats.certified == b.stats.certified
    assert torch.allclose(a.inputs, b.inputs, rtol=0, atol=1e-12)


def test_residual_next_layer_gradient_drops_the_peeled_samples():
    # step 5: with W' known, the next layer's gradient of the unpeeled samples alone
    b = 30
    view, problem, X, _, Qt = _client(b, 300, seed=7)
    model = view.model.double()
    peeler = _peeler(problem)
    F, rest = torch.arange(0, b, 2), torch.arange(1, b, 2)
    masks = zero_mask((problem.L @ Qt[:, F]).T, 1e-9)
    certified, samples = _peel(peeler, Qt[:, F].T, masks)
    assert bool(certified.all()) and samples.next_grad_outputs is not None
    residual, _ = residual_problem(problem, samples)
    # truth: the next layer's per-sample terms dZ'_j a_j^T, summed over the unpeeled samples
    A = torch.relu(model[0](X)).detach()  # (b, m)
    G = problem.next_grad_weight
    dZ2 = torch.linalg.lstsq(A.T, G.T).solution.T  # G = dZ2 A exactly (A has full rank b)
    assert torch.allclose(samples.next_grad_outputs, dZ2[:, F].T, atol=1e-12 * float(dZ2.abs().max()))
    truth = dZ2[:, rest] @ A[rest]
    assert torch.allclose(residual.next_grad_weight, truth, atol=1e-12 * float(G.abs().max()))
    # exact zeros of the residual are the intersections over the unpeeled samples only
    inactive = A[rest] == 0  # (|rest|, m)
    reached = dZ2[:, rest].abs() > 1e-12 * dZ2.abs().max()  # (k, |rest|); lstsq leaves 1e-18s
    expected = torch.stack([inactive[reached[k]].all(dim=0) for k in range(G.shape[0])])
    assert torch.equal(residual.next_grad_weight == 0, expected)


def test_residual_next_layer_gradient_keeps_the_exact_zeros_of_the_whole_one():
    # float32 clients: a peeled sample's dZ'_j comes out of its solve with ~1e-7 of its largest
    # entry on its inactive next neurons; subtracting it must not turn exact zeros of dL/dW'
    # (no sample reaches them) into rounding errors, or the residual has fewer zero sets
    b = 30
    _, problem, _, _, Qt = _client(b, 300, seed=7)
    F = torch.arange(0, b, 2)
    masks = zero_mask((problem.L @ Qt[:, F]).T, 1e-9)
    _, samples = _peel(_peeler(problem), Qt[:, F].T, masks)
    terms = samples.next_grad_outputs
    noise = torch.randn(terms.shape, dtype=terms.dtype, generator=torch.Generator().manual_seed(0))
    samples.next_grad_outputs = terms + 1e-7 * terms.abs().amax(dim=1, keepdim=True) * noise
    residual, _ = residual_problem(problem, samples)
    G = problem.next_grad_weight
    assert int((G == 0).sum()) > 1000
    assert bool((residual.next_grad_weight[G == 0] == 0).all())


def test_the_last_sample_comes_from_the_residual_basis_alone():
    # b - 1 true directions peel to b - 1 samples; the residual problem then has batch size 1,
    # its only direction is the basis vector, and no proposer is asked for it
    b = 24
    view, _, X, dZ, _ = _client(b, 300, seed=8)
    oracle = TrueColumns(dZ.T, range(1, b))
    rec = spear.attack_layer(view.model, "0", view.gradients, proposer=oracle, max_proposals=10_000)
    assert rec.verified and rec.stats.certified == b, rec.message
    assert oracle.calls == 1
    assert_exact(rec.inputs, X, 1e-8)


def test_greedy_selects_certified_directions_first_and_never_swaps_them_out():
    from spear.core.greedy import greedy_filter

    b = 12
    _, problem, _, _, Qt = _client(b, 200, seed=9)
    wrong = torch.nn.functional.normalize(Qt[:, 0] + Qt[:, 1], dim=0)
    directions = torch.cat([Qt.T, wrong[None]])
    masks = zero_mask(directions @ problem.L.T, 1e-9)
    counts = masks.sum(dim=1)
    free = greedy_filter(problem, directions, masks, counts)
    assert free.perfect and b not in free.indices  # the mixture (fewer zeros) is left out
    # marked certified (as if peeled), it is selected first and no swap may drop it, although
    # dropping it would give sigma = 1
    certified = torch.zeros(b + 1, dtype=torch.bool)
    certified[b] = True
    fixed = greedy_filter(problem, directions, masks, counts, certified=certified)
    assert b in fixed.indices and not fixed.perfect


def _with_bias(problem, bias, weight=None):
    return LayerProblem(
        problem.weight if weight is None else weight, bias, problem.grad_bias, problem.L, problem.R,
        "output", problem.next_grad_weight, problem.next_weight,
    )  # fmt: skip


def test_each_peeling_check_is_needed():
    # a layer that differs from the one behind the gradient in one bias entry: on a row where
    # sample 0 is active, only step 2's residual notices; on a row where it is inactive (pushed
    # above zero), only the ReLU-pattern check does
    b = 20
    _, problem, X, _, Qt = _client(b, 300, seed=10)
    masks = zero_mask((problem.L @ Qt[:, :1]).T, 1e-9)
    z = X[0] @ problem.weight.T + problem.bias
    active_row = int(torch.nonzero(~masks[0])[0])
    inactive = torch.nonzero(masks[0])[:, 0]
    inactive_row = int(inactive[z[inactive].argmax()])  # the least negative one
    assert _peel(_peeler(problem), Qt[:, :1].T, masks)[0].tolist() == [True]
    shifted = problem.bias.clone()
    shifted[active_row] += 1e-3 * float(z[active_row])  # the pattern stays, the values do not
    outcome = SamplePeeler(_with_bias(problem, shifted), RTOL, 1e-10).peel(Qt[:, :1].T, masks)
    assert outcome.consistent.tolist() == [False]
    z_shift = z.clone()
    z_shift[active_row] += 1e-3 * float(z[active_row])
    assert bool(((z_shift > 0) == ~masks[0]).all())  # only the residual can see it
    lifted = problem.bias.clone()
    lifted[inactive_row] += 1.0 - float(z[inactive_row])  # pre-activation +1 on a zero row
    outcome = SamplePeeler(_with_bias(problem, lifted), RTOL, 1e-10).peel(Qt[:, :1].T, masks)
    assert outcome.consistent.tolist() == [False]


def test_peeling_residual_check_with_zero_biases():
    # zero biases: step 2 is homogeneous and the scale row r . c = 1 is met exactly, so a layer
    # that differs from the gradient's in one weight row on an active neuron shows only in the
    # residual of step 2
    b = 20
    _, problem, _, _, Qt = _client(b, 300, seed=13, init="kaiming")
    assert float(problem.bias.abs().max()) == 0.0
    masks = zero_mask((problem.L @ Qt[:, :1]).T, 1e-9)
    assert _peel(_peeler(problem), Qt[:, :1].T, masks)[0].tolist() == [True]
    row = int(torch.nonzero(~masks[0])[0])
    weight = problem.weight.clone()
    weight[row] *= 1 + 1e-3
    outcome = SamplePeeler(_with_bias(problem, problem.bias, weight), RTOL, 1e-10).peel(Qt[:, :1].T, masks)
    assert outcome.consistent.tolist() == [False]


def test_peeling_a_mixture_whose_kernel_is_one_dimensional_is_not_certified():
    # two samples sharing their activation pattern: a combination vanishing on their common
    # zeros plus one coincidental row has a one-dimensional kernel there (it passes step 1's
    # dimension check and steps 2-3, as -9.7 x0 + 10.7 x1 once did), but that row is essential
    problem, dZ = _pattern_sharing_pair(1e-3)
    zeros = dZ.abs() < 1e-14  # (m, b)
    common = zeros[:, 0] & zeros[:, 1]
    both = (~zeros[:, 0] & ~zeros[:, 1]).nonzero()[:, 0]  # rows where both samples are active
    assert common.sum() > 50
    consistent = 0
    for extra in both.tolist():
        rows = common.clone()
        rows[extra] = True  # the mixture of the two columns that cancels on this row
        q = torch.linalg.svd(problem.L[rows])[2][-1]
        mask = zero_mask((problem.L @ q)[None], 1e-9)
        outcome = _peeler(problem).peel(q[None], mask)
        assert not bool(outcome.robust[0])
        consistent += bool(outcome.consistent[0])
    assert consistent >= 1  # some pass steps 1-3: robustness is what rejects them


def test_a_failed_direction_is_retried_only_when_its_mask_holds_band_rows(monkeypatch):
    # the retry solves the kernel on the clearly zero rows; without band rows those are the
    # mask itself, whose check just failed: solving it again is wasted work (trained
    # networks: thousands of mixtures per step)
    import spear.core.peeling as peeling

    b = 40
    _, problem, _, _, Qt = _client(b, 400, seed=1)
    peeler = SamplePeeler(problem, RTOL, 1e-10, zero_rtol=1e-9)
    mixture = (Qt[:, 0] + Qt[:, 1]) / (Qt[:, 0] + Qt[:, 1]).norm()
    values = problem.L @ mixture
    exact = zero_mask(values[None], 1e-11)  # only clear zeros (the retry's level)
    calls = []
    original = peeling.kernel_of_rows
    monkeypatch.setattr(peeling, "kernel_of_rows", lambda *a, **k: calls.append(1) or original(*a, **k))
    assert not bool(peeler.peel(mixture[None], exact).consistent[0])
    assert calls == []
    # a mask that also holds a row that is not clearly zero: now the retry runs, without it
    banded = exact.clone()
    banded[0, int((~exact[0]).nonzero()[0, 0])] = True
    assert not bool(peeler.peel(mixture[None], banded).consistent[0])
    assert len(calls) == 1


def test_peeling_refutes_wrong_directions_but_not_true_or_pattern_sharing_ones():
    # refuted: the activation's zero set pins one direction at most and no sample fits. A true
    # column is never refuted; nor is a sample whose pattern another shares (its activation
    # kernel is two-dimensional: not certified here, but not refuted either)
    b = 40
    _, problem, _, _, Qt = _client(b, 400, seed=1)
    peeler = _peeler(problem)
    true = peeler.peel(Qt.T, zero_mask((problem.L @ Qt).T, 1e-9))
    assert bool(true.consistent.all()) and not bool(true.refuted.any())
    # zero sets no sample has (random halves of the rows): no activation vanishes there
    g = torch.Generator().manual_seed(3)
    masks = torch.rand(4, problem.L.shape[0], generator=g) < 0.5
    outcome = peeler.peel(Qt[:, :4].T, masks)
    assert not bool(outcome.consistent.any()) and bool(outcome.refuted.all())
    # past the deadline nothing is checked, so nothing is refuted
    from spear.core.deadline import Deadline

    late = _peeler(problem).peel(Qt[:, :4].T, masks, Deadline(0.0))
    assert not bool(late.refuted.any())

    shared, dZ = _pattern_sharing_pair(1e-6)
    assert torch.equal(dZ[:, 0] == 0, dZ[:, 1] == 0)  # one activation pattern
    q = torch.linalg.lstsq(shared.L, dZ[:, :1]).solution.T
    outcome = SamplePeeler(shared, RTOL, 1e-10).peel(q / q.norm(), zero_mask(dZ[:, :1].T, 1e-12))
    assert not bool(outcome.consistent[0]) and not bool(outcome.refuted[0])


def test_peeling_does_not_check_a_failed_direction_twice(monkeypatch):
    """A direction that failed its checks fails them again with the same mask: the peeler
    remembers it (same verdict, no second check), but not a direction it has not seen on that
    mask, nor one a deadline kept from being checked."""
    from spear.core.deadline import Deadline

    _, problem, _, _, Qt = _client(40, 400, seed=1)
    peeler = _peeler(problem)
    masks = torch.rand(4, problem.L.shape[0], generator=torch.Generator().manual_seed(3)) < 0.5
    calls = []
    certify = SamplePeeler._certify
    monkeypatch.setattr(
        SamplePeeler, "_certify", lambda self, q, *a: calls.append(len(q)) or certify(self, q, *a)
    )
    late = peeler.peel(Qt[:, :4].T, masks, Deadline(0.0))
    assert not calls and not bool(late.refuted.any()) and len(peeler.failed) == 0
    first = peeler.peel(Qt[:, :4].T, masks)
    assert bool(first.refuted.all()) and sum(calls) == 4 and len(peeler.failed) == 4
    again = peeler.peel(-2.0 * Qt[:, :4].T, masks)  # the same directions (sign and scale aside)
    assert sum(calls) == 4 and torch.equal(again.refuted, first.refuted)
    assert not bool(again.consistent.any())
    other = peeler.peel(Qt[:, 4:8].T, masks)  # other directions on the same masks: checked
    assert sum(calls) == 8 and bool(other.refuted.all())
    # a true direction is consistent, and nothing recorded makes it fail
    true = peeler.peel(Qt[:, :1].T, zero_mask((problem.L @ Qt[:, :1]).T, 1e-9))
    assert bool(true.consistent.all())


def _attack_on_client(b):
    """The attack loop's state on the first layer of an MNIST client (before any step), and the
    true dL/dZ (b, m)."""
    from spear.core import reconstruct

    view, _, _, dZ, _ = _client(b, 200)
    g, first = view.gradients, view.model[0]
    layer = reconstruct.LayerTensors(first.weight.detach(), first.bias.detach(), g["0.weight"], g["0.bias"])
    setup = reconstruct.AttackSetup.build(
        layer, reconstruct.AttackOptions(), torch.float64, g["2.weight"], view.model[2].weight.detach()
    )
    return reconstruct._Attack(setup, None), dZ


def test_the_attack_maps_what_peeling_finds_back_to_the_directions_positions(monkeypatch):
    # with the non-robust cap, peeling sees a subset of the snapped directions: what it
    # certifies or refutes must land on those directions' own positions, and nowhere else
    from spear.core import reconstruct
    from spear.core.filtering import SnapResult

    b = 16
    attack, dZ = _attack_on_client(b)
    setup = attack.setup
    L = setup.problem.sparse_factor
    true = torch.linalg.lstsq(L, dZ.T[setup.live]).solution.T[:3]
    gen = torch.Generator().manual_seed(5)
    junk = torch.randn(5, b, dtype=torch.float64, generator=gen)
    # positions 0..7: junk, true, junk, junk, true, junk, true, junk
    at_true, at_junk = [1, 4, 6], [0, 2, 3, 5, 7]
    directions = torch.empty(8, b, dtype=torch.float64)
    directions[at_true], directions[at_junk] = true, junk
    directions /= directions.norm(dim=1, keepdim=True)
    masks = zero_mask(directions @ L.T, 1e-9)
    masks[at_junk] = torch.rand(5, L.shape[0], generator=gen) < 0.5
    counts = masks.sum(dim=1)
    counts[at_junk] = torch.tensor([90, 120, 80, 110, 70])  # the two sparsest: positions 2 and 5
    robust = torch.zeros(8, dtype=torch.bool)
    robust[at_true] = True
    monkeypatch.setattr(reconstruct, "NONROBUST_PEEL_PER_STEP", 2)
    snapped = SnapResult(directions, masks, counts, robust)
    assert reconstruct.worth_peeling(snapped).tolist() == [1, 2, 4, 5, 6]
    samples = attack._peel(snapped)
    assert snapped.certified.nonzero()[:, 0].tolist() == at_true
    assert snapped.refuted.nonzero()[:, 0].tolist() == [2, 5]
    assert len(samples) == 3
    assert torch.allclose(samples.directions.abs(), directions[at_true].abs(), atol=1e-10)


def test_the_stall_probe_keeps_the_threshold_of_an_untrained_float64_layer():
    # an untrained layer's columns are about half zeros, far above Section 4.1's threshold: a
    # stalled search probes, finds them above it, and must not lower it (a lower threshold only
    # lets more mixtures into the pool)
    from spear.core import reconstruct
    from spear.core.filtering import SnapResult

    attack, _ = _attack_on_client(32)
    setup = attack.setup
    absorbed: list[SnapResult] = []
    attack._absorb = absorbed.append
    threshold = setup.threshold
    attack.calls = reconstruct.STALL_CALLS  # no new direction since the start: a stall
    attack._check_stall()
    assert attack.adapted  # the probe ran (once)
    assert setup.threshold == threshold and not attack.notes
    (probed,) = absorbed
    assert probed.zero_counts.numel() and bool((probed.zero_counts >= threshold).all())


@pytest.mark.parametrize("refuted", [True, False])
def test_a_pool_of_refuted_candidates_does_not_hold_off_the_stall_probe(refuted):
    # a trained hidden layer's pool filled with candidates that peeling refuted (Fashion-MNIST,
    # b = 32: 64 of 67), while half the columns lay below the threshold: those are not
    # directions in hand, so a stalled search probes (and may lower the threshold). Candidates
    # not refuted count, as before: b of them hold the probe off
    from spear.core import reconstruct
    from spear.core.filtering import SnapResult

    b = 16
    attack, _ = _attack_on_client(b)
    setup = attack.setup
    L = setup.problem.sparse_factor
    gen = torch.Generator().manual_seed(2)
    junk = torch.nn.functional.normalize(torch.randn(2 * b, b, dtype=torch.float64, generator=gen), dim=1)
    masks = torch.rand(2 * b, L.shape[0], generator=gen) < 0.5
    flags = torch.zeros(2 * b, dtype=torch.bool)
    attack.pool.add(SnapResult(junk, masks, masks.sum(dim=1), flags, refuted=torch.full_like(flags, refuted)))
    assert len(attack.pool) == 2 * b
    attack._absorb = lambda snapped: None
    attack.calls = reconstruct.STALL_CALLS  # no new direction since the start: a stall
    attack._check_stall()
    assert attack.adapted == refuted


@pytest.mark.parametrize(
    ("drops", "probed"),
    [((True, True, True), True), ((True, True), False), ((True, True, False, True), False)],
)
def test_calls_in_a_row_that_drop_sparse_directions_probe_despite_progress(monkeypatch, drops, probed):
    # a trained hidden layer's inputs straddle the threshold (input mode, MNIST 6 x 1000, 200
    # steps, b = 128: 401 zeros per sample, threshold 433): the few columns above it kept coming,
    # one every few calls, and each put the probe off, while every call dropped columns below it
    # (the probe came at call 9, 24 s of a 30 s budget). PROBE_AFTER_CALLS calls in a row that
    # each dropped a ReLU-sparse direction probe now, new directions or not; a call without such
    # a drop starts the count again
    from spear.core import reconstruct
    from spear.core.proposers import ProposalBatch

    b = 16
    attack, _ = _attack_on_client(b)
    rows = attack.setup.problem.sparse_factor.shape[0]
    sparse = rows // 2  # far more zeros than the b - 1 a direction is solved on
    assert reconstruct.relu_sparse(sparse, b, rows)
    calls = iter(drops)

    def propose(proposer, budget):
        return ProposalBatch(torch.empty(0, b), 1, below_threshold=sparse if next(calls) else 0)

    monkeypatch.setattr(attack.search, "propose", propose)
    seen = []
    monkeypatch.setattr(
        reconstruct, "probe_sparse_directions", lambda *args: seen.append(args) or _NotProbed()
    )
    for _ in drops:
        attack.step()
        attack.trusted_seen = -1  # a new trusted direction at every call: the search progresses
        attack._check_stall()
    assert bool(seen) == probed == attack.adapted
    assert reconstruct.PROBE_AFTER_CALLS == 3  # the parametrization's streaks assume it


def test_a_probe_that_lowered_the_threshold_may_be_followed_by_another():
    # the first stall probe always may run; another only STALL_CALLS calls after a lowering that
    # the last probe made (an early probe sees the sparsest columns, a later one on the residual
    # problem the densest); a probe that lowered nothing ends them
    from spear.core import reconstruct

    attack, _ = _attack_on_client(16)
    assert attack._may_probe_again()
    attack.stall_probed_at, attack.lowered_at = 5, 5
    attack.calls = 5 + reconstruct.STALL_CALLS - 1
    assert not attack._may_probe_again()
    attack.calls = 5 + reconstruct.STALL_CALLS
    assert attack._may_probe_again()
    attack.stall_probed_at = 30  # a later probe lowered nothing
    attack.calls = 60
    assert not attack._may_probe_again()
    attack.stall_probed_at, attack.lowered_at = 5, None  # the one probe lowered nothing
    assert not attack._may_probe_again()


def test_a_probe_that_lowered_nothing_is_followed_by_another_while_sparse_drops_go_on():
    # ... unless the search's own calls keep dropping ReLU-sparse directions for the threshold
    # alone: then another probe STALL_CALLS calls later, and twice as long after each further
    # probe that lowers nothing; a lowering starts the count again
    from spear.core import reconstruct

    attack, _ = _attack_on_client(16)
    stall, streak = reconstruct.STALL_CALLS, reconstruct.PROBE_AFTER_CALLS
    attack.stall_probed_at, attack.lowered_at, attack.fruitless_probes = 5, None, 1
    attack.calls, attack.drop_streak = 5 + stall, streak - 1  # no streak: no probe
    assert not attack._may_probe_again()
    attack.drop_streak = streak
    assert attack._may_probe_again()
    attack.calls = 5 + stall - 1
    assert not attack._may_probe_again()
    attack.fruitless_probes = 2  # the second probe in a row that lowered nothing
    attack.calls = 5 + 2 * stall - 1
    assert not attack._may_probe_again()
    attack.calls = 5 + 2 * stall
    assert attack._may_probe_again()
    attack.drop_streak = 0
    assert not attack._may_probe_again()


def test_the_stall_probe_counts_the_probes_that_lowered_nothing(monkeypatch):
    # _check_stall's bookkeeping behind the rule above: a probe that lowers nothing adds one, a
    # probe that lowers the threshold starts the count again
    from spear.core import reconstruct

    attack, _ = _attack_on_client(16)
    monkeypatch.setattr(reconstruct, "probe_sparse_directions", lambda *args: _NotProbed())
    attack.calls = reconstruct.STALL_CALLS  # a stall: the first probe
    attack._check_stall()
    assert (attack.stall_probed_at, attack.fruitless_probes) == (reconstruct.STALL_CALLS, 1)
    attack._adapt_threshold(attack.setup.threshold - 1, attack.setup.threshold - 1, 100)
    assert attack.fruitless_probes == 0


class _NotProbed:
    probed = False


def test_singleton_samples_enter_the_pool_robust_only_where_their_zero_set_pins_them():
    # the singleton cascade certifies a sample through its input or the model; its column's
    # zero set, which the verdict counts as a pin, is judged as any snapped direction's. A
    # direction whose column is a mixture of two samples has a two-dimensional kernel there
    from spear.core.peeling import PeeledSamples

    b = 16
    attack, dZ = _attack_on_client(b)
    setup = attack.setup
    L = setup.problem.sparse_factor
    true = torch.linalg.lstsq(L, dZ.T[setup.live]).solution.T[:4]
    directions = torch.cat([true, true[:2].sum(dim=0, keepdim=True)])
    directions /= directions.norm(dim=1, keepdim=True)
    zeros = torch.zeros_like(directions)
    samples = PeeledSamples(directions, zeros, torch.zeros(5, setup.layer.weight.shape[1]), zeros)
    entries = attack._singleton_entries(samples)
    assert entries.robust.tolist() == [True, True, True, True, False]
    assert bool(entries.certified.all())
    assert torch.equal(entries.zero_counts, entries.zero_masks.sum(dim=1))


def test_swaps_wait_while_peeling_certifies_samples(monkeypatch):
    # a step that certifies samples changes the pool under the search: its selection is stage 1
    # alone (a trained float32 hidden layer spent 40 of its 60 s in such swaps); a step that
    # certifies none runs the full swap search
    from spear.core import reconstruct

    b = 64
    view, _, X, _, _ = _client(b, 400, seed=4)
    sweeps: list[int | None] = []
    steps: list[tuple[bool, list[int | None]]] = []
    greedy, absorb = reconstruct.greedy_filter, reconstruct._Attack._absorb

    def recording_greedy(*args, **kwargs):
        sweeps.append(kwargs.get("max_sweeps"))
        return greedy(*args, **kwargs)

    def recording_absorb(self, snapped):
        before, start = len(self.peeled), len(sweeps)
        absorb(self, snapped)
        steps.append((len(self.peeled) > before, sweeps[start:]))

    monkeypatch.setattr(reconstruct, "greedy_filter", recording_greedy)
    monkeypatch.setattr(reconstruct._Attack, "_absorb", recording_absorb)
    rec = spear.attack_layer(view.model, "0", view.gradients, seed=4, max_proposals=50_000)
    assert rec.verified, rec.message
    assert_exact(rec.inputs, X, 1e-8)
    peeling = [s for certified, made in steps if certified for s in made]
    others = [s for certified, made in steps if not certified for s in made]
    assert peeling and set(peeling) == {0}
    assert set(others) <= {None}
    # the deferred swaps run in the next step that certifies nothing, new candidates or not
    for (peeled, made), (peeled_next, made_next) in itertools.pairwise(steps):
        if peeled and made and not peeled_next:
            assert None in made_next


def test_deferred_swaps_run_in_the_next_quiet_step_or_when_the_run_ends(monkeypatch):
    # a selection that skipped its swaps (peeling certified samples) is made again with them:
    # in the next step that certifies none, even one that adds nothing, or once the run ends
    from spear.core import reconstruct
    from spear.core.filtering import SnapResult

    attack, _ = _attack_on_client(16)
    made: list[int | None] = []
    monkeypatch.setattr(reconstruct._Attack, "_select", lambda self, max_sweeps=None: made.append(max_sweeps))
    monkeypatch.setattr(reconstruct._Attack, "_peel", lambda self, snapped: None)
    b, rows = 16, attack.setup.problem.sparse_factor.shape[0]
    attack.pool.add(
        SnapResult(
            torch.eye(b, dtype=torch.float64),
            torch.zeros(b, rows, dtype=torch.bool),
            torch.zeros(b, dtype=torch.long),
        )
    )
    nothing = SnapResult(
        torch.empty(0, b, dtype=torch.float64),
        torch.empty(0, rows, dtype=torch.bool),
        torch.empty(0, dtype=torch.long),
    )
    attack._absorb(nothing)
    assert made == []  # nothing changed, nothing deferred: no selection
    attack.swaps_deferred = True
    attack._absorb(nothing)
    assert made == [None] and not attack.swaps_deferred
    attack.swaps_deferred = True
    attack._run_deferred_swaps()
    assert made == [None, None] and not attack.swaps_deferred
    attack._run_deferred_swaps()
    assert made == [None, None]


def _band_column(problem, Qt, zero_rtol):
    """A true column whose zero mask at ``zero_rtol`` holds band rows (above the retry's
    threshold) and which peels (consistent), with its mask and retry rows."""
    from spear.core.peeling import BAND_FRACTION

    for j in range(Qt.shape[1]):
        q = Qt[:, j]
        values = (problem.L @ q).abs()
        mask = values <= zero_rtol * values.max()
        tight = values <= BAND_FRACTION * zero_rtol * values.max()
        if torch.equal(mask, tight):
            continue
        if bool(SamplePeeler(problem, 1e-8, zero_rtol=zero_rtol).peel(q[None], mask[None]).consistent[0]):
            return q, mask
    raise AssertionError("no column with band rows")


def test_a_failure_on_other_retry_rows_does_not_hide_a_true_direction():
    # a direction 4e-5 rad from a true column, with the same zero mask (float32's zero_rtol),
    # fails where the true one passes: its retry keeps other rows. The memory keys on those
    # rows too, so the true column is still checked (and certified) after it
    _, problem, _, _, Qt = _client(40, 400, seed=1)
    q, mask = _band_column(problem, Qt, 1e-4)
    _, _, Vh = torch.linalg.svd(problem.L[mask])
    for w in Vh:
        w = w - (w @ q) * q
        near = q + 4e-5 * w / w.norm()
        near = near / near.norm()
        same_mask = torch.equal(zero_mask((problem.L @ near)[None], 1e-4)[0], mask)
        peeler = SamplePeeler(problem, 1e-8, zero_rtol=1e-4)
        if same_mask and not bool(peeler.peel(near[None], mask[None]).consistent[0]):
            break
    else:
        raise AssertionError("no near direction that fails")
    assert 1.0 - abs(float(near @ q)) <= 1e-9 and len(peeler.failed) == 1
    assert bool(peeler.peel(q[None], mask[None]).consistent[0])


def test_a_retry_cut_by_the_deadline_is_not_remembered():
    # the first pass fails on a band row, the deadline passes before the retry: nothing is
    # recorded, and the direction certifies once checked in full
    _, problem, _, _, Qt = _client(40, 400, seed=1)
    q, mask = _band_column(problem, Qt, 1e-4)

    class AfterFirstPass:
        calls = 0

        def passed(self):
            self.calls += 1
            return self.calls > 1

    peeler = SamplePeeler(problem, 1e-8, zero_rtol=1e-4)
    cut = peeler.peel(q[None], mask[None], AfterFirstPass())
    assert not bool(cut.consistent[0]) and not bool(cut.refuted[0]) and len(peeler.failed) == 0
    assert bool(peeler.peel(q[None], mask[None]).consistent[0])


def test_a_selection_with_swaps_starts_where_the_last_one_ended(monkeypatch):
    # the swaps of a selection start from where the last selection's swaps ended (found again
    # in the pool by direction); a selection without swaps (peeling progressed) neither uses
    # nor moves that memory
    from spear.core import reconstruct
    from spear.core.filtering import SnapResult

    attack, _ = _attack_on_client(16)
    b, rows = 16, attack.setup.problem.sparse_factor.shape[0]
    starts: list[tuple[int | None, list[int] | None]] = []
    greedy = reconstruct.greedy_filter

    def recording(*args, **kwargs):
        starts.append((kwargs["max_sweeps"], kwargs["start"]))
        return greedy(*args, **kwargs)

    monkeypatch.setattr(reconstruct, "greedy_filter", recording)
    noise = torch.randn(b + 4, b, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    noise = noise / noise.norm(dim=1, keepdim=True)
    attack.pool.add(
        SnapResult(noise, torch.zeros(b + 4, rows, dtype=torch.bool), torch.zeros(b + 4, dtype=torch.long))
    )
    attack._select()
    first = attack.best.indices
    attack._select(0)
    attack._select()
    assert starts[0] == (None, None) and starts[1] == (0, None)
    assert starts[2][0] is None and sorted(starts[2][1]) == sorted(first)


def test_a_step_past_the_deadline_keeps_its_certified_samples_and_stops_there(monkeypatch):
    # the time budget is a promise: once peeling ran past the deadline, the step records what
    # it certified (the result counts it) but pools and selects nothing
    from spear.core import reconstruct
    from spear.core.deadline import Deadline
    from spear.core.filtering import SnapResult
    from spear.core.peeling import PeeledSamples

    b = 16
    attack, _ = _attack_on_client(b)
    rows, n = attack.setup.problem.sparse_factor.shape[0], attack.setup.problem.R.shape[1]
    one = torch.ones(1, b, dtype=torch.float64)
    fresh = PeeledSamples(one, one, torch.ones(1, n, dtype=torch.float64), one)
    selected: list[int | None] = []
    monkeypatch.setattr(
        reconstruct._Attack, "_select", lambda self, max_sweeps=None: selected.append(max_sweeps)
    )
    monkeypatch.setattr(reconstruct._Attack, "_peel", lambda self, snapped: fresh)
    snapped = SnapResult(
        torch.eye(b, dtype=torch.float64),
        torch.zeros(b, rows, dtype=torch.bool),
        torch.zeros(b, dtype=torch.long),
    )
    monkeypatch.setattr(reconstruct.AttackSetup, "deadline", property(lambda self: Deadline(0.0)))
    attack._absorb(snapped)
    assert len(attack.peeled) == 1 and len(attack.pool) == 0 and selected == []
    monkeypatch.setattr(reconstruct.AttackSetup, "deadline", property(lambda self: Deadline(None)))
    monkeypatch.setattr(reconstruct._Attack, "_peel", lambda self, snapped: None)
    attack._absorb(snapped)  # before the deadline the same step pools and selects
    assert len(attack.pool) == b and selected == [None]


def test_samples_without_step_5_never_pair_next_layer_rows_with_the_wrong_samples():
    from spear.core.peeling import PeeledSamples

    one = torch.ones(1, 4, dtype=torch.float64)
    with_step5 = PeeledSamples(one, one, one, one, torch.ones(1, 3, dtype=torch.float64))
    without = PeeledSamples(one, one, one, one, None)
    both = PeeledSamples.empty(4, 4, torch.float64, "cpu", next_width=3)
    both.extend(with_step5)
    assert both.next_grad_outputs is not None and both.next_grad_outputs.shape == (1, 3)
    both.extend(PeeledSamples.empty(4, 4, torch.float64, "cpu"))  # nothing added: kept
    assert both.next_grad_outputs is not None and both.next_grad_outputs.shape == (1, 3)
    both.extend(without)
    assert len(both) == 2 and both.next_grad_outputs is None  # was (1, 3) beside 2 samples


def _samples(duals, coefficients):
    n = duals.shape[0]
    return PeeledSamples(duals.clone(), coefficients, torch.zeros(n, 3, dtype=duals.dtype), duals)


def _duplicates_and_mixtures(seed, b=12, n=40, mixtures=True):
    """Peeled samples (the first three true ones) and n new ones: copies of true samples (a
    float32 step snaps many directions of one), rounded copies, and mixtures, in random order."""
    g = torch.Generator().manual_seed(seed)
    U = torch.linalg.qr(torch.randn(b, b, generator=g, dtype=torch.float64))[0]  # u_j . r_k = delta
    pick = torch.randint(3, b, (n,), generator=g)
    duals, coefficients = U[pick].clone(), U[pick].clone()
    duals += 1e-12 * torch.randn(n, b, generator=g, dtype=torch.float64)  # copies up to rounding
    mixed = (torch.rand(n, generator=g) < 0.25) & mixtures
    # mixtures of the unpeeled samples: no clash with the peeled ones, a clash with their parts
    weights = torch.randn(int(mixed.sum()), b - 3, generator=g, dtype=torch.float64)
    weights *= torch.rand(weights.shape, generator=g) < 0.3
    duals[mixed] = weights @ U[3:]
    if bool(mixed.any()):
        duals[mixed.nonzero()[0, 0]] = torch.nan  # a failed solve clashes with everything
    return _samples(U[:3], U[:3]), _samples(duals, coefficients), g


def _unblocked(peeled, new, candidate):
    """The candidates that clash with no peeled sample and no earlier such candidate: with
    copies only, the first copy of each distinct sample."""
    f = len(peeled)
    clash = _clashes(peeled, new, RTOL)
    open_ = [i for i in candidate.nonzero()[:, 0].tolist() if not bool(clash[f + i, :f].any())]
    return [i for i in open_ if not any(bool(clash[f + i, f + j]) for j in open_ if j < i)]


@pytest.mark.parametrize("seed", range(8))
def test_certified_in_order_keeps_what_the_eager_rule_keeps(seed):
    # the same samples as certifying every one and then mutually_consistent, with a
    # certificate asked only where it can matter: never twice, never for a sample that clashes
    # with one kept, and the first ask holds one copy of every distinct sample
    peeled, new, g = _duplicates_and_mixtures(seed)
    n = len(new)
    candidate = torch.rand(n, generator=g) < 0.9
    ok = torch.rand(n, generator=g) < 0.7
    passed = (candidate & ok).nonzero()[:, 0]
    eager = torch.zeros(n, dtype=torch.bool)
    eager[passed[mutually_consistent(peeled, new.select(passed), RTOL)]] = True
    asks = []

    def certify(index):
        assert index.numel() and not set(index.tolist()) & {i for a in asks for i in a}, "asked twice"
        asks.append(index.tolist())
        return ok[index]

    lazy = certified_in_order(peeled, new, candidate, certify, RTOL)
    assert lazy.tolist() == eager.tolist()
    # an ask starts at the first undecided sample: every sample kept before it was kept then
    clash = _clashes(peeled, new, RTOL)[len(peeled) :, len(peeled) :]
    for ask in asks:
        before = [j for j in lazy.nonzero()[:, 0].tolist() if j < ask[0]]
        assert not any(bool(clash[i, j]) for i in ask for j in before), "asked a sample already out"
    assert asks[0] == _unblocked(peeled, new, candidate)
    assert eager.any() and sum(map(len, asks)) < int(candidate.sum())  # copies were not certified


def test_certified_in_order_asks_every_distinct_sample_together():
    # a certificate that depends on the samples asked together (the weight quorum): with every
    # certificate passing, one ask holds one copy of each distinct sample, and nothing more
    peeled, new, _ = _duplicates_and_mixtures(0, mixtures=False)
    every = torch.ones(len(new), dtype=torch.bool)
    asks = []

    def quorum(index):
        asks.append(index.tolist())
        return torch.full((index.numel(),), index.numel() >= 3)

    keep = certified_in_order(peeled, new, every, quorum, RTOL)
    assert len(asks) == 1 and asks[0] == _unblocked(peeled, new, every)
    assert keep.tolist() == mutually_consistent(peeled, new, RTOL).tolist()
