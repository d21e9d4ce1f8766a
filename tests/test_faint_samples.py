"""Samples whose gradient is faint (a well-classified sample: loss ~1e-8) are known only to
their own precision, about ``noise / s_b`` of their column (``spear.core.consistency.
rounding_map``): their true zeros then sit far above ``zero_rtol``, and their loss weights and
misfits far above the verification tolerance. Each column is judged at its own precision."""

from types import SimpleNamespace

import pytest
import torch

import spear
import spear.core.reconstruct as reconstruct_module
from spear.certify import ModelCertifier, model_tail
from spear.core.certificate import infer_reduction
from spear.core.consistency import rounding_map
from spear.core.filtering import rounding_floor, zero_mask
from spear.core.verdict import LOOSEST_SAMPLE_RTOL, sample_tolerances
from spear.fl import shallow_mlp
from spear.fl.client import fedsgd_gradients
from spear.metrics import match_samples
from tests.conftest import load_fashion_mnist

B, FAINT = 32, 2


@pytest.fixture(scope="module")
def faint_client():
    """The LT setting (raw Fashion-MNIST, F -> 1000 -> 10) with the two best-classified of 5,000
    samples in a batch of 32 (their losses ~3e-8; the others' median is ~10)."""
    dataset = load_fashion_mnist()
    model = shallow_mlp(dataset.features, 1000, seed=0)
    n = 5000
    inputs = dataset.images[:n].reshape(n, -1).double()
    labels = dataset.labels[:n]
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(model(inputs), labels, reduction="none")
    order = loss.argsort()
    others = order[FAINT:][torch.randperm(n - FAINT, generator=torch.Generator().manual_seed(0))[: B - FAINT]]
    pick = torch.cat([order[:FAINT], others])
    assert float(loss[order[FAINT - 1]]) < 1e-6
    x, y = inputs[pick], labels[pick]
    return model, x, y, fedsgd_gradients(model, x, y)


def true_columns(model, x, y) -> torch.Tensor:
    """Evaluation side: the batch's dL/dZ (b x m) of the first layer."""
    z = model[0](x).detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(torch.nn.functional.cross_entropy(model[2](torch.relu(z)), y), z)
    return grad


def test_a_faint_column_keeps_its_zeros_within_its_rounding_floor(faint_client):
    model, x, y, grads = faint_client
    g = grads["0.weight"].double()
    U, S, _ = torch.linalg.svd(g, full_matrices=False)
    L = U[:, :B] * S[:B].sqrt()
    truth = true_columns(model, x, y)
    q = torch.linalg.lstsq(L, truth.T).solution.T  # each true column's direction
    values = q @ L.T
    zeros = truth == 0
    relative = zero_mask(values, 1e-9)
    floor = rounding_floor(q, rounding_map(S, B, torch.finfo(torch.float64).eps), L.shape[0])
    with_floor = zero_mask(values, 1e-9, floor)
    # the faint columns' true zeros fail the relative test ...
    assert not bool((relative[:FAINT] == zeros[:FAINT]).all())
    # ... and pass with the floor, which takes no nonzero entry of any column
    assert torch.equal(with_floor, zeros)
    # the other columns' floors lie far below the relative threshold
    assert float((floor[FAINT:] / values[FAINT:].abs().amax(dim=1)).max()) < 1e-10


def test_faint_samples_keep_the_batch_consistent_and_verified(faint_client, monkeypatch):
    model, x, y, grads = faint_client
    rec = spear.attack_layer(model, "0", grads, seed=0, max_proposals=200_000)
    assert rec.consistent and rec.sigma == 1.0
    est, ref = match_samples(rec.inputs, x)
    assert float((rec.inputs[est] - x[ref]).abs().max()) < 1e-6
    # two samples of the batch are confirmed by a sign only: the layer pins them, and their
    # columns pass on their own the test the batch fails (its faint samples' rounding), so
    # their zero sets count and the batch is verified, the faint samples at their precision
    assert rec.verified and rec.verified_by == "model"
    assert any("sign of their gradient" in note for note in rec.notes)
    error = (rec.inputs[est] - x[ref]).abs().amax(dim=1)
    faint = ref < FAINT
    assert int(faint.sum()) == FAINT
    assert float(error[faint].max()) < 1e-6 and float(error[~faint].max()) < 1e-12
    assert torch.equal(rec.labels[est], y[ref])
    assert any("faint" in note for note in rec.notes)
    # judged at the relative tolerance alone, the faint columns break consistency
    monkeypatch.setattr(reconstruct_module.AttackSetup, "rounding", property(lambda self: None))
    before = spear.attack_layer(model, "0", grads, seed=0, max_proposals=200_000)
    assert not before.consistent and before.stats.certified < B - FAINT


def test_loss_weights_are_read_at_each_samples_precision():
    B_ = 50
    weights = torch.full((5,), 1.0 / B_, dtype=torch.float64)
    weights[0] *= 1 + 3e-6  # a faint sample's weight, known to ~1e-5
    assert infer_reduction(weights, 1e-7).reduction is None
    precise = torch.full((5,), 1e-7, dtype=torch.float64)
    assert infer_reduction(weights, precise).reduction is None
    loose = precise.clone()
    loose[0] = 1e-5
    fit = infer_reduction(weights, loose)
    assert fit.reduction == "mean" and fit.batch_size == B_
    assert fit.multiplicities.tolist() == [1] * 5
    # a looser tolerance on one sample does not let a double weight pass as a single one
    weights[1] *= 2
    assert infer_reduction(weights, loose).multiplicities.tolist() == [1, 2, 1, 1, 1]


def test_a_faint_weight_off_its_estimate_costs_the_others_nothing():
    """A faint sample's weight off by more than its precision estimate (first-order; 2.5e-4
    against 1e-4 measured on MNIST b = 23): the batch fits no reduction, but the samples known
    to the tolerance still fit a mean, and only the faint one has no multiplicity."""
    from spear.core.verdict import reduction_of_tight

    weights = torch.full((6,), 1.0 / 23, dtype=torch.float64)
    weights[2] *= 1 + 2.5e-4
    precision = torch.full((6,), 1e-8, dtype=torch.float64)
    precision[2] = 1e-4
    assert infer_reduction(weights, precision).reduction is None
    fit = reduction_of_tight(weights, precision)
    assert fit is not None and fit.reduction == "mean" and fit.batch_size == 23
    assert fit.multiplicities.tolist() == [1, 1, 0, 1, 1, 1]
    assert reduction_of_tight(weights, torch.full((6,), 1e-8, dtype=torch.float64)) is None
    weights[4] *= 1.01  # a tight sample off too: nothing fits
    assert reduction_of_tight(weights, precision) is None


def test_a_certifier_without_the_opt_in_keeps_its_own_tolerance(faint_client):
    """A user's certifier is called as before (two arguments) and its tolerance stands: the
    faint samples, known only to ~1e-7, are then not certified, and nothing else changes."""
    model, x, _, grads = faint_client
    inner = ModelCertifier(model_tail(model, "0"), model[0].weight, model[0].bias, 1e-8)
    calls = []

    def plain(inputs, grad_outputs):
        calls.append(inputs.shape[0])
        return inner(inputs, grad_outputs)

    rec = spear.attack_layer(model, "0", grads, seed=0, max_proposals=200_000, certifier=plain)
    assert calls and not rec.verified
    est, ref = match_samples(rec.certified_inputs, x)
    assert set(ref.tolist()).isdisjoint(range(FAINT))
    # no consistent batch here (sigma < 1): the samples stand as the singleton cascade read them
    # off rows of the gradient and re-solved them together, ~1e-11 (a consistent batch reports
    # its own, more precise values: the test above)
    assert float((rec.certified_inputs[est] - x[ref]).abs().max()) < 1e-10


def test_sample_tolerances_follow_the_precision_up_to_a_cap():
    L = torch.diag(torch.tensor([1.0, 1e-2, 1e-6], dtype=torch.float64))
    rounding = torch.diag(torch.tensor([1e-16, 1e-10, 1e-8], dtype=torch.float64))
    q = torch.eye(3, dtype=torch.float64)
    rtol = sample_tolerances(q, L, rounding, 1e-8)
    # precision 1e-16, 1e-8 and 1e-2: the first at verify_rtol, the second 10 x its precision,
    # the third far too faint: capped, never a misfit near 1
    assert rtol.tolist() == pytest.approx([1e-8, 1e-7, LOOSEST_SAMPLE_RTOL])
    # where verify_rtol is looser already (float32: 1e-3), nothing changes
    assert sample_tolerances(q, L, rounding, 1e-3).tolist() == pytest.approx([1e-3] * 3)
    assert sample_tolerances(q, L, None, 1e-8).tolist() == pytest.approx([1e-8] * 3)


def test_a_loss_weight_off_by_more_than_the_misfit_tolerance_is_not_verified():
    """A weight ``(1 + delta) / B`` scales the sample's column by ``1 + delta`` and its input by
    about ``1 / (1 + delta)``: measured on one CPU, float32, a trained MLP's sample had misfit
    4.4e-4 (under float32's 1e-3) with weight 1.0077 / 32, and its input was 1.4e-3 off. The
    weights are read at the misfit tolerance itself, not ten times it."""
    from spear.core.certificate import SampleCertificates
    from spear.core.verdict import WEIGHT_PRECISION, _judge_by_model

    def verdict_for(delta: float) -> bool:
        b, rtol = 32, 1e-3  # float32's verification tolerance
        weights = torch.full((b,), 1.0 / b, dtype=torch.float64)
        weights[19] *= 1 + delta
        ok = torch.ones(b, dtype=torch.bool)
        cert = SampleCertificates(ok, torch.zeros(b, dtype=torch.long), weights, torch.full((b,), 4.4e-4))
        verdict = SimpleNamespace(problems=[], notes=[], reject=[], reduction=None, verified_by=None)
        precision = WEIGHT_PRECISION * torch.full((b,), rtol, dtype=torch.float64)
        _judge_by_model(verdict, cert, torch.zeros(b, dtype=torch.bool), precision, gate_trusted=True)
        return verdict.verified_by == "model"

    assert verdict_for(5e-4)  # within the tolerance: one sample's weight
    assert not verdict_for(7.7e-3)  # the measured case


def test_loss_weights_are_read_at_the_datas_rounding():
    from spear.core.verdict import AUDIT_SLACK, weight_tolerances

    sample_rtol = torch.tensor([1e-8, 1e-8, 1e-8, 1e-3], dtype=torch.float64)
    data = torch.tensor([1e-12, 2e-9, 1e-3, 1e-9], dtype=torch.float64)
    # a precise sample keeps its misfit tolerance; an imprecise one is read at what the audit
    # accepts, never looser than LOOSEST_SAMPLE_RTOL; float32's 1e-3 lies above that cap
    expected = torch.tensor([1e-8, AUDIT_SLACK * 2e-9, LOOSEST_SAMPLE_RTOL, 1e-3], dtype=torch.float64)
    assert torch.allclose(weight_tolerances(sample_rtol, data), expected)
    assert torch.equal(weight_tolerances(sample_rtol), sample_rtol)
    # a column not solved on its clearly zero rows (precision inf) keeps its misfit tolerance
    data[1] = torch.inf
    assert float(weight_tolerances(sample_rtol, data)[1]) == 1e-8


def test_loss_weights_are_read_at_the_losss_sensitivity_times_the_misfit_tolerance():
    """A confident sample's weight moves about its sensitivity times its input's error: the
    weight is read at half that many times the misfit tolerance (at least once, at most
    MOST_WEIGHT_SENSITIVITY times), or at the data's rounding where that is coarser."""
    from spear.core.verdict import MOST_WEIGHT_SENSITIVITY, weight_tolerances

    sample_rtol = torch.tensor([1e-3, 1e-3, 1e-3, 1e-8], dtype=torch.float64)
    sensitivity = torch.tensor([0.1, 4.0, 50.0, 3.0], dtype=torch.float64)
    expected = torch.tensor([1e-3, 2e-3, MOST_WEIGHT_SENSITIVITY * 1e-3, 1.5e-8], dtype=torch.float64)
    assert torch.allclose(weight_tolerances(sample_rtol, sensitivity=sensitivity), expected)
    data = torch.tensor([0.0, 0.0, 0.0, 1e-6], dtype=torch.float64)  # the data's rounding: 3e-5
    expected[3] = 3e-5
    assert torch.allclose(weight_tolerances(sample_rtol, data, sensitivity), expected)


def test_zero_sets_are_trusted_column_by_column_where_their_rounding_allows():
    """A batch that is not resolvable (its faint samples) keeps the pins of the columns that
    pass the batch's test on their own and whose zero set as read covers their rounding; in
    float32 the rounding floor never widens the zero band, so a column known to 5e-4 (within
    10 zero_rtol) whose floor exceeds the band is not trusted."""
    from spear.core.consistency import Tolerances

    torch.manual_seed(0)
    rows, b = 400, 4
    factor = torch.randn(rows, b, dtype=torch.float64)
    directions = torch.eye(b, dtype=torch.float64)
    norms = factor.norm(dim=0)
    peaks = factor.abs().amax(dim=0)

    def trusted(dtype, precision, measured=None):  # rounding map giving each column that precision
        setup = SimpleNamespace(
            resolvable=False,
            rounding=torch.diag(precision * norms),
            measured_rounding=torch.diag((precision if measured is None else measured) * norms),
            problem=SimpleNamespace(sparse_factor=factor),
            tol=Tolerances.for_dtype(dtype),
        )
        return reconstruct_module.AttackSetup.trusted_columns(setup, directions)

    precision = torch.tensor([1e-12, 1e-9, 2e-8, 1e-6], dtype=torch.float64)
    assert trusted(torch.float64, precision).tolist() == [True, True, False, False]
    # float32: precision 5e-4 passes the batch's test (1e-3), but its floor, 10 root mean
    # squares of the error (~5e-4 * norm / sqrt(rows) * 10), lies above the band of 1e-4 * max
    precision = torch.tensor([1e-7, 1e-6, 5e-4, 2e-3], dtype=torch.float64)
    floors = 10 * precision * norms / rows**0.5
    assert bool(floors[2] > 1e-4 * peaks[2]) and bool(floors[1] < 1e-4 * peaks[1])
    assert trusted(torch.float32, precision).tolist() == [True, True, False, False]
    # where the gradient's spectrum measures its rounding far below the bound (100 times), the
    # floor of the column known to 5e-4 lies within the band; the last (2e-3) still fails the
    # batch's test, which stays at the bound
    assert trusted(torch.float32, precision, precision / 100).tolist() == [True, True, True, False]
    resolvable = SimpleNamespace(resolvable=True)
    assert bool(reconstruct_module.AttackSetup.trusted_columns(resolvable, directions).all())


def test_the_gradients_rounding_is_measured_by_its_spectrum():
    """A rank-b gradient with independent entry errors: the first singular value beyond the
    batch, scaled to the whole matrix, estimates the errors' norm, far below ``eps s_max``
    (the bound); never below float64's own rounding; none without a singular value beyond b."""
    from spear.core.consistency import measured_noise

    torch.manual_seed(0)
    m, n, b = 300, 200, 20
    clean = torch.randn(m, b, dtype=torch.float64) @ torch.randn(b, n, dtype=torch.float64)
    error = 1e-7 * clean.abs().mean() * torch.randn(m, n, dtype=torch.float64)
    S = torch.linalg.svdvals(clean + error)
    noise = measured_noise(S, b, (m, n))
    truth = float(torch.linalg.matrix_norm(error, ord=2))
    assert 0.8 * truth <= noise <= 1.5 * truth
    assert noise < 0.5 * 1e-7 * float(S[0])  # the bound at that precision (3 times above here)
    exact = torch.linalg.svdvals(clean)
    assert measured_noise(exact, b, (m, n)) >= torch.finfo(torch.float64).eps * float(exact[0])
    assert measured_noise(S[:b], b, (m, n)) is None
    assert measured_noise(S, n, (m, n)) is None


def test_a_column_missing_within_its_rounding_is_kept_not_refuted():
    """A column no label fits within its tolerance, but within what its rounding explains (10
    times its precision, uncapped), is neither certified nor rejected for good; one missing by
    more, or by more than MOST_EXPLAINED_MISFIT, is."""
    from spear.core.certificate import SampleCertificates
    from spear.core.verdict import MOST_EXPLAINED_MISFIT, _judge_by_model, unrefuted

    b = 4
    misfit = torch.tensor([1e-4, 1.2e-3, 2e-3, 5e-2], dtype=torch.float64)
    ok = misfit <= 1e-3
    weights = torch.where(ok, torch.full((b,), 1.0 / b, dtype=torch.float64), torch.nan)
    cert = SampleCertificates(ok, torch.where(ok, 0, -1), weights, misfit)
    rtol = torch.full((b,), 1e-3, dtype=torch.float64)
    explained = torch.tensor([1e-3, 1.4e-3, 1.4e-3, 0.5], dtype=torch.float64)
    spared = unrefuted(cert, rtol, explained)
    assert spared.tolist() == [False, True, False, False]
    assert MOST_EXPLAINED_MISFIT < 5e-2
    assert unrefuted(cert, rtol, None) is None
    verdict = SimpleNamespace(problems=[], notes=[], reject=[], reduction=None, verified_by=None)
    _judge_by_model(verdict, cert, torch.zeros(b, dtype=torch.bool), rtol, True, spared=spared)
    assert verdict.reject == [2, 3] and verdict.verified_by is None
    assert any("kept, not refuted" in p for p in verdict.problems)
    assert any("sample(s) [2, 3]" in p for p in verdict.problems)
