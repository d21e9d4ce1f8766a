"""Silent entries: an active neuron whose gradient cancels below the data's zero floor.

A sample's dL/dZ at an active neuron is a sum over the layers above; by chance it can cancel to
below the zero floor (``Tolerances.zero_floor``), and the true batch then contradicts the ReLU
pattern there (z clearly positive, dL/dZ certainly zero): sigma < 1 for the truth itself. Seen
in the realism matrix (trained float32 MLP, m = 1000, b = 32: one entry at 6.8e-8 of its
column's largest, z = 0.99), where the attack searched its whole budget for a selection with
sigma = 1 that no batch has. The model, which predicts every entry of a sample's column,
settles such entries (``spear.core.verdict.model_explains_silent``).

Each test builds a client whose true batch has one such entry by construction: the weights out
of one active neuron are made orthogonal to that sample's gradient one layer up, so the
gradient at the neuron vanishes to float64's rounding.
"""

import pytest
import torch

import spear
import spear.core.reconstruct as reconstruct_module
from spear.certify import ModelCertifier
from spear.core.consistency import contradictions, pattern_matches
from spear.core.verdict import ModelGate, model_explains_silent
from tests.conftest import match_rows

B, N, WIDTH, SAMPLE = 6, 24, 64, 0


def per_sample_dz(model, x, y):
    """(b, m) each sample's dL/dZ of layer 0 (the batch mean's, so b times the per-sample one)."""
    z = model[0](x).detach().requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(model[1:](z), y)
    (dz,) = torch.autograd.grad(loss, z)
    return z.detach(), dz


def silent_client(seed=0):
    """A 3-layer MLP whose true batch has exactly one silent entry: sample ``SAMPLE`` at the
    active neuron ``neuron`` of layer 0 (z well above zero, dL/dZ at float64 rounding)."""
    model = spear.fl.fully_connected(N, WIDTH, 3, 10, seed=seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (B,), generator=g)
    z, dz = per_sample_dz(model, x, y)
    # a clearly active neuron of the sample with a gradient of ordinary size
    ordinary = (z[SAMPLE] > 0.3 * z[SAMPLE].max()) & (dz[SAMPLE].abs() > 0.1 * dz[SAMPLE].abs().max())
    neuron = int(ordinary.nonzero()[0, 0])
    with torch.no_grad():
        for _ in range(50):  # the sample's gradient one layer up moves with the weights: iterate
            h = model[:2](x[SAMPLE : SAMPLE + 1]).detach()
            z1 = (h @ model[2].weight.T + model[2].bias).requires_grad_(True)
            with torch.enable_grad():
                loss = torch.nn.functional.cross_entropy(model[3:](z1), y[SAMPLE : SAMPLE + 1])
                (delta,) = torch.autograd.grad(loss, z1)
            column = model[2].weight[:, neuron]
            column -= (column @ delta[0]) / (delta[0] @ delta[0]) * delta[0]
    z, dz = per_sample_dz(model, x, y)
    assert float(z[SAMPLE, neuron]) > 0.3 * float(z[SAMPLE].max())
    assert float(dz[SAMPLE, neuron].abs()) < 1e-14 * float(dz[SAMPLE].abs().max())
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return model, x, y, grads, neuron


def exact(rec, x, rtol=1e-6):
    r, c = match_rows(rec.inputs, x)
    return float((rec.inputs[r] - x[c]).abs().max()) <= rtol * float(x.abs().max())


def test_contradictions_split_the_two_kinds():
    z = torch.tensor([[2.0, -2.0, 1.0, -1.0, 1e-12]], dtype=torch.float64)
    zero = torch.tensor([[False, False, True, True, True]])
    refuting, silent = contradictions(z, zero, None, 1e-9)
    assert refuting.tolist() == [[False, True, False, False, False]]
    assert silent.tolist() == [[False, False, True, False, False]]  # the tiny z has no sign
    assert pattern_matches(z, zero, None, 1e-9).tolist() == [[True, False, False, True, True]]


def test_the_true_batch_of_a_silent_client_is_found_and_verified():
    model, x, y, grads, _ = silent_client()
    rec = spear.attack_layer(model, "0", grads, seed=0, max_proposals=20_000)
    assert rec.verified, rec.message
    assert exact(rec, x)
    assert rec.sigma < 1.0  # the truth's own sigma: the silent entry is a contradiction
    assert any("below the data's zero floor" in note for note in rec.notes), rec.notes
    assert torch.equal(rec.labels[match_rows(rec.inputs, x)[0]], y[match_rows(rec.inputs, x)[1]])


def test_without_the_model_the_silent_batch_is_not_verified(monkeypatch):
    """The explanation is what verifies it: the model's word taken away, the same search ends
    unverified (the truth has sigma < 1), and says nothing about an exact batch."""
    monkeypatch.setattr(reconstruct_module, "model_explains_silent", lambda *args, **kwargs: False)
    model, _, _, grads, _ = silent_client()
    rec = spear.attack_layer(model, "0", grads, seed=0, max_proposals=20_000)
    assert not rec.verified
    assert not rec.message.startswith("exact")


def certifier_of(model):
    return ModelCertifier(model[1:], model[0].weight, model[0].bias, 1e-8)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_model_explains_the_silent_entry_and_no_ordinary_one(seed):
    model, x, y, _, neuron = silent_client(seed)
    z, dz = per_sample_dz(model, x, y)
    gate = ModelGate(certifier_of(model))
    silent = torch.zeros(B, WIDTH, dtype=torch.bool)
    silent[SAMPLE, neuron] = True
    assert model_explains_silent(gate, x, dz.T, silent, 1e-9)
    # an ordinary active entry of another sample, read as silent: the model predicts a gradient
    other = 1 - SAMPLE
    active = ((z[other] > 0) & (dz[other].abs() > 1e-3 * dz[other].abs().max())).nonzero()[0, 0]
    silent[other, active] = True
    assert not model_explains_silent(gate, x, dz.T, silent, 1e-9)


def test_a_mixture_is_not_explained():
    """A mixture of two samples' columns, zero at one row where both are active (the extra row
    that makes its kernel one-dimensional): the model, at the mixture's input, predicts an
    ordinary gradient there."""
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
