"""Silent entries: an active neuron whose gradient cancels below the data's zero floor.

A sample's dL/dZ at an active neuron is a sum over the layers above; by chance it can cancel to
below the zero floor (``Tolerances.zero_floor``), and the true batch then contradicts the ReLU
pattern there (z clearly positive, dL/dZ certainly zero): sigma < 1 for the truth itself. Seen
in the realism matrix (trained float32 MLP, m = 1000, b = 32: one entry at 6.8e-8 of its
column's largest, z = 0.99), where the attack searched its whole budget for a selection with
sigma = 1 that no batch has. The model, which predicts every entry of a sample's column,
settles such entries (``spear.core.verdict.model_explains_silent``).

Each test builds a client whose true batch has silent entries by construction: the weights out
of one active neuron of layer 0 go only to neurons of layer 1 that the sample leaves inactive,
so that sample's gradient at the neuron is exactly zero, in any precision.
"""

import pytest
import torch

import spear
import spear.core.reconstruct as reconstruct_module
import spear.core.verdict as verdict_module
from spear.certify import ModelCertifier
from spear.core.consistency import contradictions, pattern_matches
from spear.core.verdict import ModelGate, model_explains_silent
from tests.conftest import match_rows

B, N, WIDTH = 6, 24, 64


def per_sample_dz(model, x, y):
    """(b, m) dL/dZ of layer 0 for the batch mean, and its pre-activations Z (b, m)."""
    z = model[0](x).detach().requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(model[1:](z), y)
    (dz,) = torch.autograd.grad(loss, z)
    return z.detach(), dz


def silence(model, x, sample):
    """Make one clearly active neuron of layer 0 silent for ``sample``: its weights into the
    layer-1 neurons the sample activates are set to zero (those it leaves inactive keep theirs,
    and stay inactive). Returns the neuron."""
    with torch.no_grad():
        z0 = model[0](x[sample])
        h = model[:2](x[sample])
        active1 = model[2](h) > 0
        # clearly active, and feeding some layer-1 neuron the sample leaves inactive
        feeds = (model[2].weight[~active1].abs().sum(dim=0) > 0) & (z0 > 0.3 * z0.max())
        neuron = int(feeds.nonzero()[0, 0])
        model[2].weight[active1, neuron] = 0.0
    return neuron


def silent_client(seed=0, dtype=torch.float64, samples=(0,)):
    """A 3-layer MLP whose true batch has a silent entry for each of ``samples``: an active
    neuron (z well above zero) with a gradient of exactly zero."""
    model = spear.fl.fully_connected(N, WIDTH, 3, 10, seed=seed, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randint(0, 10, (B,), generator=g)
    neurons = [silence(model, x, j) for j in samples]
    z, dz = per_sample_dz(model, x, y)
    for j, neuron in zip(samples, neurons, strict=True):
        assert float(z[j, neuron]) > 0.3 * float(z[j].max())
        assert float(dz[j, neuron]) == 0.0
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return model, x, y, grads, neurons


def exact(rec, x, rtol=1e-6):
    r, c = match_rows(rec.inputs, x)
    return float((rec.inputs[r] - x[c]).abs().max()) <= rtol * float(x.abs().max())


def test_contradictions_split_the_two_kinds():
    z = torch.tensor([[2.0, -2.0, 1.0, -1.0, 1e-12, 3.0]], dtype=torch.float64)
    zero = torch.tensor([[False, False, True, True, True, True]])
    certain = torch.tensor([[False, False, True, True, True, False]])
    refuting, silent = contradictions(z, zero, certain, 1e-9)
    assert refuting.tolist() == [[False, True, False, False, False, False]]
    # the tiny z has no sign; the last entry is in the zero band, not certainly zero: no contradiction
    assert silent.tolist() == [[False, False, True, False, False, False]]
    matches = pattern_matches(z, zero, certain, 1e-9)
    assert matches.tolist() == [[True, False, False, True, True, True]]


@pytest.mark.parametrize(
    ("dtype", "samples"), [(torch.float64, (0,)), (torch.float64, (0, 3)), (torch.float32, (0,))]
)
def test_the_true_batch_of_a_silent_client_is_found_and_verified(dtype, samples, monkeypatch):
    audits = []

    def recording_audit(*args, **kwargs):
        audits.append(True)
        return original_audit(*args, **kwargs)

    original_audit = verdict_module.audit_precision
    monkeypatch.setattr(verdict_module, "audit_precision", recording_audit)
    model, x, y, grads, _ = silent_client(dtype=dtype, samples=samples)
    rec = spear.attack_layer(model, "0", grads, seed=0, max_proposals=20_000)
    assert rec.verified, rec.message
    assert exact(rec, x.double(), 1e-6 if dtype == torch.float64 else 1e-4)
    assert rec.sigma < 1.0  # the truth's own sigma: the silent entries are contradictions
    assert rec.stats.stop_reason == "explained"
    assert any("below the data's zero floor" in note for note in rec.notes), rec.notes
    r, c = match_rows(rec.inputs, x.double())
    assert torch.equal(rec.labels[r], y[c])
    if dtype == torch.float32:  # polished on its clearly zero rows, and audited, as any other batch
        assert audits


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_without_the_model_the_silent_batch_is_not_verified(dtype, monkeypatch):
    """The explanation is what verifies it: the model's word taken away, the same search ends
    unverified (the truth has sigma < 1), and says nothing about an exact batch."""
    monkeypatch.setattr(reconstruct_module, "model_explains_silent", lambda *args, **kwargs: False)
    model, _, _, grads, _ = silent_client(dtype=dtype)
    rec = spear.attack_layer(model, "0", grads, seed=0, max_proposals=20_000)
    assert not rec.verified
    assert not rec.message.startswith("exact")


def test_a_refuting_entry_is_never_explained(monkeypatch):
    """A negative pre-activation with a nonzero gradient refutes a column at any precision: with
    one added to the silent batch's contradictions, nothing is explained."""

    def with_a_refuting_entry(z_t, zero, certain_zero, z_rtol):
        refuting, silent = contradictions(z_t, zero, certain_zero, z_rtol)
        refuting = refuting.clone()
        refuting[0, 0] = True
        return refuting, silent

    monkeypatch.setattr(reconstruct_module, "contradictions", with_a_refuting_entry)
    model, _, _, grads, _ = silent_client()
    rec = spear.attack_layer(model, "0", grads, seed=0, max_proposals=20_000)
    assert not rec.verified


def test_without_a_certificate_nothing_is_explained():
    """``certify=False``: the layer alone cannot tell a silent entry from a mixture's."""
    model, _, _, grads, _ = silent_client()
    rec = spear.attack_layer(model, "0", grads, seed=0, max_proposals=20_000, certify=False)
    assert not rec.verified


def certifier_of(model):
    return ModelCertifier(model[1:], model[0].weight, model[0].bias, 1e-8)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_model_explains_the_silent_entry_and_no_ordinary_one(seed):
    model, x, y, _, (neuron,) = silent_client(seed)
    z, dz = per_sample_dz(model, x, y)
    gate = ModelGate(certifier_of(model))
    silent = torch.zeros(B, WIDTH, dtype=torch.bool)
    silent[0, neuron] = True
    assert model_explains_silent(gate, x, dz.T, silent, 1e-9)
    # an ordinary active entry of another sample, read as silent: the model predicts a gradient
    # there (its certificate passes: the column is the sample's own)
    active = ((z[1] > 0) & (dz[1].abs() > 1e-3 * dz[1].abs().max())).nonzero()[0, 0]
    silent[1, active] = True
    assert not model_explains_silent(gate, x, dz.T, silent, 1e-9)
    # the same through the weighted certificate of DP-SGD's clipping (its predicted columns are
    # the inner certificate's)
    unit = lambda net, xs, ys: torch.ones(len(xs))  # noqa: E731
    weighted = spear.certify.WeightedCertifier(certifier_of(model), model, unit)
    assert torch.equal(weighted.gradients(x, y), certifier_of(model).gradients(x, y))


def test_a_mixture_is_not_explained():
    """A mixture of two samples' columns, zero at one row where both are active (the extra row
    that makes its kernel one-dimensional): the model certifies no label for it (its misfit is
    of order 1), so its silent entry is not explained."""
    model, x, y, _, _ = silent_client()
    z, dz = per_sample_dz(model, x, y)
    both = ((z[2] > 0) & (z[3] > 0) & (dz[2].abs() > 1e-2 * dz[2].abs().max())).nonzero()[:, 0]
    row = int(both[0])
    a, c = float(dz[3, row]), -float(dz[2, row])
    column = a * dz[2] + c * dz[3]  # zero at ``row``
    mixed = (a * x[2] + c * x[3]) / (a + c)
    silent = torch.zeros(1, WIDTH, dtype=torch.bool)
    silent[0, row] = True
    gate = ModelGate(certifier_of(model))
    assert not model_explains_silent(gate, mixed[None], column[:, None], silent, 1e-9)


def test_an_explained_batch_that_does_not_verify_is_judged_once_and_searched_on(monkeypatch):
    """An explained selection the verdict refuses does not end the search (a selection at
    sigma = 1 may yet come), and is not judged again while the pool and peeled samples stand."""
    judged = []

    def refusing_judge(selection, *args, **kwargs):
        verdict = original_judge(selection, *args, **kwargs)
        if selection.explained:
            judged.append(selection.indices)
            verdict.verified_by = None
        return verdict

    original_judge = reconstruct_module.judge
    monkeypatch.setattr(reconstruct_module, "judge", refusing_judge)
    model, _, _, grads, _ = silent_client()
    rec = spear.attack_layer(model, "0", grads, seed=0, max_proposals=5_000)
    assert judged
    assert not rec.verified
    assert rec.stats.stop_reason != "explained"
    assert rec.stats.proposals >= 5_000  # searched to the end of its budget
    assert len(judged) == 1  # the same explained selection, every time the pool grew
