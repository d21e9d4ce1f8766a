"""The precision audit of a model-verified batch (:func:`spear.core.verdict.audit_precision`).

float32's verification tolerance (1e-3) is set by its faintest samples. A trace ``c`` of one
sample's column added to another's, with ``c`` times that input taken off the first (dL/dW is
unchanged), passes every check at that tolerance for c = 3e-3 on a float32 MLP (the review of
issue #10). The audit re-checks each sample at the precision the data and the client's
arithmetic give it, and must refuse such batches while passing the true one."""

import itertools

import pytest
import torch

from spear.certify import ModelCertifier, model_tail
from spear.core.certificate import infer_reduction
from spear.core.consistency import Tolerances
from spear.core.greedy import Selection
from spear.core.verdict import ModelGate, Verdict, audit_precision, data_precision, judge
from spear.core.verify import Verification
from spear.data import load_dataset
from spear.fl import fully_connected, pretrain, simulate_fedsgd

B, FLOAT32_RTOL = 32, 1e-3


@pytest.fixture(scope="module")
def client():
    """A float32 MLP 4 x 400 trained 200 steps on MNIST, one FedSGD batch of 32; evaluation side:
    its true inputs and the client's own (float32) columns of dL/dZ."""
    mnist = load_dataset("mnist")
    model = fully_connected(mnist.features, 400, 4, seed=2, dtype=torch.float32)
    pretrain(model, mnist, 200, seed=2)
    view, truth = simulate_fedsgd(model, mnist, B, seed=2)
    x = truth.inputs.reshape(B, -1).to(torch.float32)
    z = view.model[0](x).detach().requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(model_tail(view.model, "0")(z), truth.labels)
    (columns,) = torch.autograd.grad(loss, z)
    g = view.gradients["0.weight"].double()
    U, S, _ = torch.linalg.svd(g, full_matrices=False)
    L = U[:, :B] * S[:B].sqrt()
    return view.model, x.double(), columns.double(), S, L


def certifier_of(model, dtype=torch.float32, loss="cross_entropy"):
    layer = model[0]
    return ModelCertifier(model_tail(model, "0"), layer.weight, layer.bias, FLOAT32_RTOL, loss, 0.0, dtype)


def model_verified(certifier, x, columns) -> Verdict:
    """A verdict as the model level grants it at the dtype's tolerance (asserted)."""
    cert = certifier(x, columns)
    assert bool(cert.ok.all())
    reduction = infer_reduction(cert.weights, torch.full((B,), FLOAT32_RTOL, dtype=torch.float64))
    assert reduction.reduction == "mean" and bool((reduction.multiplicities == 1).all())
    return Verdict(x, columns.T, None, True, None, cert, reduction, "model", [])


def audited(client, x, columns, dtype=torch.float32, loss="cross_entropy") -> Verdict:
    model, _, _, S, L = client
    certifier = certifier_of(model, dtype, loss)
    verdict = model_verified(certifier, x, columns)
    q = torch.linalg.lstsq(L, columns.T).solution
    precision = data_precision(S, q, torch.finfo(dtype).eps)
    audit_precision(
        verdict, ModelGate(certifier), precision, torch.full((B,), FLOAT32_RTOL, dtype=torch.float64)
    )
    return verdict


def judged(client, x, columns) -> Verdict:
    """The verdict of :func:`spear.core.verdict.judge` on a consistent batch with these inputs
    and columns, every column solved on its clearly zero rows (audited)."""
    model, _, _, S, L = client
    q = torch.linalg.lstsq(L, columns.T).solution
    selection = Selection(tuple(range(B)), q, torch.ones(B, dtype=torch.float64), 1.0, B)
    check = Verification(True, 0.0, FLOAT32_RTOL)
    precision = data_precision(S, q, torch.finfo(torch.float32).eps)
    certified = torch.zeros(B, dtype=torch.bool)
    tol = Tolerances.for_dtype(torch.float32)
    gate = ModelGate(certifier_of(model))
    return judge(selection, L, certified, (x, columns.T), check, tol, gate, True, precision=precision)


def test_the_true_batch_passes(client):
    _, x, columns, _, _ = client
    verdict = audited(client, x, columns)
    assert verdict.verified_by == "model", verdict.problems
    assert judged(client, x, columns).verified_by == "model"


def mixed(x, columns, j, k, c):
    """Column j takes c times column k, input k loses c times input j: dL/dW is unchanged."""
    columns, x = columns.clone(), x.clone()
    columns[j] += c * columns[k]
    x[k] -= c * x[j]
    return x, columns


def passes_dtype_checks(certifier, x, columns, j, k, c) -> bool:
    """Whether both changed samples still fit the model at float32's tolerance, weight 1/B."""
    moved, changed = mixed(x, columns, j, k, c)
    cert = certifier(moved[[j, k]], changed[[j, k]])
    return bool(cert.ok.all()) and bool(((cert.weights * B - 1).abs() <= FLOAT32_RTOL).all())


@pytest.fixture(scope="module")
def far_mixtures(client):
    """c -> the ordered pairs (j, k) whose mixture passes float32's checks yet moves sample k by
    more than 100 times the precision the data give it."""
    model, x, columns, S, L = client
    certifier = certifier_of(model)
    explained = data_precision(S, torch.linalg.lstsq(L, columns.T).solution, torch.finfo(torch.float32).eps)
    explained += certifier.rounding(x, certifier(x, columns).labels)
    return {
        c: [
            (j, k)
            for j, k in itertools.permutations(range(B), 2)
            if c * float(x[j].norm() / x[k].norm()) > 100 * float(explained[k])
            and passes_dtype_checks(certifier, x, columns, j, k, c)
        ]
        for c in (3e-3, 1e-3)
    }


@pytest.mark.parametrize("c", [3e-3, 1e-3])
def test_mixtures_that_move_a_precise_sample_are_refused(client, far_mixtures, c):
    """Every mixture that passes float32's checks but moves sample k by more than 100 times
    the precision the data give it is refused; the true batch passes (above). Mixtures into
    the faint samples (known only to ~1e-4) stay: the data do not pin those more closely."""
    _, x, columns, _, _ = client
    assert far_mixtures[c]  # the premise: the dtype's tolerance lets such mixtures through
    messages = []
    for j, k in far_mixtures[c]:
        verdict = audited(client, *mixed(x, columns, j, k, c))
        assert verdict.verified_by is None, (j, k)
        messages.append(verdict.problems[-1])
    assert any("trace of another sample" in text for text in messages)


def test_a_refused_batch_certifies_no_sample_on_its_own(client, far_mixtures):
    """The audit names the column that carries the trace, not the input that lost it: after a
    refusal no column of the batch counts as certified one by one."""
    _, x, columns, _, _ = client
    j, k = far_mixtures[1e-3][0]
    verdict = judged(client, *mixed(x, columns, j, k, 1e-3))
    assert verdict.verified_by is None and verdict.individual is None


def test_a_scaled_precise_sample_is_refused(client):
    """Column j times 1 + d and input j over 1 + d leave dL/dW as it is; at d = 1e-4 the
    fitted loss weight still reads 1/B at float32's tolerance."""
    _, x, columns, S, L = client
    explained = data_precision(S, torch.linalg.lstsq(L, columns.T).solution, torch.finfo(torch.float32).eps)
    for j in explained.argsort()[:4].tolist():
        scaled, shrunk = columns.clone(), x.clone()
        scaled[j] *= 1 + 1e-4
        shrunk[j] /= 1 + 1e-4
        assert audited(client, shrunk, scaled).verified_by is None, j


def test_no_audit_without_a_rounding_model(client, far_mixtures):
    """A custom loss (or a tolerance the user set) has no rounding model: the verdict stands
    where cross-entropy's audit refuses it."""
    _, x, columns, _, _ = client
    moved, changed = mixed(x, columns, *far_mixtures[1e-3][0], 1e-3)
    assert audited(client, moved, changed).verified_by is None

    def loss(logits, labels):
        return torch.nn.functional.cross_entropy(logits, labels, reduction="none")

    assert audited(client, moved, changed, loss=loss).verified_by == "model"


def test_the_audit_never_goes_below_float64s_tolerance(client, monkeypatch):
    """Float64 data explain ~1e-15: 30 times that is far below float64's tolerance of 1e-8,
    which is the floor, so the audit changes nothing there (no certificate is even issued)."""
    model, x, columns, S, L = client
    certifier = certifier_of(model, torch.float64)
    verdict = model_verified(certifier, x, columns)
    calls = []
    monkeypatch.setattr(ModelCertifier, "__call__", lambda *a, **k: calls.append(1))
    q = torch.linalg.lstsq(L, columns.T).solution
    precision = data_precision(S, q, torch.finfo(torch.float64).eps) * 0  # as precise as can be
    audit_precision(verdict, ModelGate(certifier), precision, torch.full((B,), 1e-8, dtype=torch.float64))
    assert verdict.verified_by == "model" and not calls


def test_the_api_turns_the_audit_off_when_asked_or_for_a_tolerance_the_user_sets(monkeypatch):
    import spear.api

    captured = {}

    def stop(*args, **options):
        captured.update(options)
        raise RuntimeError("stopped before the attack")

    monkeypatch.setattr(spear.api, "reconstruct", stop)
    model = fully_connected(20, 30, 2, seed=0, dtype=torch.float32)
    grads = {name: torch.ones_like(p) for name, p in model.named_parameters()}
    cases = (({}, True), ({"verify_rtol": 1e-3}, False), ({"precision_audit": False}, False))
    for extra, models in cases:
        with pytest.raises(RuntimeError, match="stopped"):
            spear.api.attack_layer(model, "0", grads, **extra)
        assert captured["certifier"].models_rounding is models
