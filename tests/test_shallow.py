"""The LT-code paper's passive setting: a two-layer MLP with zero biases on raw [0, 1] inputs
(``spear.fl.shallow_mlp``; benchmarks/bench_passive.py measures it at scale)."""

import pytest
import torch

import spear
from spear.data import load_dataset
from spear.errors import InputError
from spear.fl import shallow_mlp, simulate_fedsgd
from spear.metrics import match_samples
from tests.conftest import assert_exact, load_fashion_mnist, without_dense_singletons


def test_shallow_mlp_is_the_papers_setting():
    model = shallow_mlp(784, seed=3)
    first, second = model[0].requires_grad_(False), model[2].requires_grad_(False)
    assert (first.in_features, first.out_features, second.out_features) == (784, 1000, 10)
    assert bool((first.bias == 0).all()) and bool((second.bias == 0).all())
    assert abs(float(first.weight.std()) - 0.5) < 0.01
    bound = (6 / (1000 + 10)) ** 0.5
    assert float(second.weight.abs().max()) <= bound
    with pytest.raises(InputError, match="first_std"):
        shallow_mlp(10, first_std=0.0)


@pytest.mark.parametrize(("width", "b", "seed"), [(400, 48, 1), (1000, 64, 0)])
def test_zero_bias_shallow_network_on_raw_images_is_recovered_exactly(width, b, seed):
    dataset = load_dataset("mnist")
    model = shallow_mlp(dataset.features, width, seed=seed)
    view, truth = simulate_fedsgd(model, dataset, b, seed=seed, normalize=False)
    assert float(truth.inputs.min()) >= 0.0  # raw pixels, not standardized
    rec = spear.attack_layer(view.model, "0", view.gradients, seed=0, max_proposals=2_000_000)
    assert rec.verified and rec.verified_by == "model"
    assert_exact(rec.inputs, truth.inputs)
    est, ref = match_samples(rec.inputs, truth.inputs)
    assert torch.equal(rec.labels[est], truth.labels[ref])


def test_singleton_neurons_peel_samples_before_any_search():
    """The LT cascade (spear.core.singletons): on Fashion-MNIST a neuron that one sample alone
    activates hands over that sample, the model certifies it, and its gradient is subtracted so
    that more singletons appear; all of it before the first proposal."""
    dataset = load_fashion_mnist()
    b = 32
    model = shallow_mlp(dataset.features, seed=2)
    view, truth = simulate_fedsgd(model, dataset, b, seed=2, normalize=False)
    rec = spear.attack_layer(view.model, "0", view.gradients, seed=0, max_proposals=1)
    assert rec.stats.certified >= b // 2
    est, ref = match_samples(rec.certified_inputs, truth.inputs)
    assert float((rec.certified_inputs[est] - truth.inputs[ref]).abs().max()) < 1e-9
    labelled = rec.certified_labels[est] >= 0
    assert torch.equal(rec.certified_labels[est][labelled], truth.labels[ref][labelled])
    # without the model nothing counts: the layer's checks alone do not certify these samples
    layer = view.model[0]
    g = view.gradients
    alone = spear.reconstruct(layer.weight, layer.bias, g["0.weight"], g["0.bias"], max_proposals=1)
    assert alone.stats.certified == 0


def test_dense_inputs_peel_through_the_layers_relu_and_a_discriminative_certificate(monkeypatch):
    # photos have hardly a zero pixel, so no candidate input pins itself by its zeros. A neuron
    # that one sample alone activates still hands over that sample exactly; its ReLU pattern
    # pins its column, and the model certifies it (discriminatively: such samples are never
    # robust). The cascade then runs as on MNIST
    dataset = load_dataset("photos32")
    model = shallow_mlp(dataset.features, seed=0)
    view, truth = simulate_fedsgd(model, dataset, 32, seed=0, normalize=False)
    assert float((truth.inputs == 0).double().mean()) < 0.1
    rec = spear.attack_layer(view.model, "0", view.gradients, seed=0, max_proposals=1)  # the scan
    assert rec.stats.certified >= 24
    found = rec.certified_inputs
    est, ref = match_samples(found, truth.inputs)
    assert float((found[est] - truth.inputs[ref]).abs().max()) < 1e-6
    assert torch.equal(rec.certified_labels[est], truth.labels[ref])
    # the sparse candidates alone (the few darkest images) certify a third as many
    without_dense_singletons(monkeypatch)
    alone = spear.attack_layer(view.model, "0", view.gradients, seed=0, max_proposals=1)
    assert alone.stats.certified <= 12


def test_singleton_samples_with_silent_entries_count_through_the_model():
    """A two-layer MLP trained 300 steps on raw digits, float32, b = 13: some samples have an
    active neuron whose gradient lies within float32's zero band (a silent entry). The cascade's
    layer check refused them (11 of 13 certified, then the search); now they complete, never
    robustly, and the model certifies them: the whole batch before the first proposal."""
    from spear.fl import fully_connected, pretrain

    dataset = load_dataset("digits")
    model = fully_connected(dataset.features, 300, 2, dataset.classes, seed=7267, dtype=torch.float32)
    pretrain(model, dataset, 300, seed=7267)
    view, truth = simulate_fedsgd(model, dataset, 13, seed=7267, normalize=False)
    rec = spear.attack_layer(view.model, "0", view.gradients, seed=7267, max_proposals=1)
    assert rec.verified and rec.stats.certified == 13
    assert_exact(rec.inputs.double(), truth.inputs.double(), rtol=1e-5)
