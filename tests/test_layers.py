"""Any layer (issue #12): SPEAR on a later Linear layer, and the exact way back to the data
through the lower layers' own gradients (spear.inversion.GradientInverter)."""

import pytest
import torch

import spear
from spear.experiments import ExperimentSettings, run_experiment
from spear.fl import attackable_layers, fully_connected, layer_inputs, simulate_fedsgd, vgg
from spear.inversion import GradientInverter, invert_to_inputs, layers_below
from tests.conftest import assert_exact

BUDGET = 400_000


@pytest.fixture(scope="module")
def mnist():
    from spear.data import load_dataset

    return load_dataset("mnist")


def _attack(model, layer, view, **options):
    sparsity = attackable_layers(model)[layer]
    return spear.attack_layer(
        view.model, layer, view.gradients, max_proposals=BUDGET, sparsity=sparsity, **options
    )


@pytest.mark.parametrize("layer", ["2", "4", "8"])
def test_hidden_layer_and_the_data_below_it_are_exact(mnist, layer):
    model = fully_connected(784, 300, 6, seed=1)
    view, secret = simulate_fedsgd(model, mnist, 12, seed=2)
    rec = _attack(model, layer, view)
    assert rec.verified and rec.verified_by == "model"
    assert_exact(rec.inputs, layer_inputs(model, layer, secret.inputs), rtol=1e-10)
    inversion = GradientInverter()(view.model, layer, view.gradients, rec)
    assert inversion.method == "gradients" and inversion.verified and inversion.residual < 1e-10
    assert_exact(inversion.inputs, secret.inputs, rtol=1e-10)


def test_output_layer_by_input_sparsity(mnist):
    """The last layer has no ReLU after it: its ReLU-sparse inputs carry the attack (b < classes)."""
    model = fully_connected(784, 200, 3, seed=0)
    assert attackable_layers(model) == {"0": "output", "2": "output", "4": "input"}
    view, secret = simulate_fedsgd(model, mnist, 6, seed=0)
    rec = _attack(model, "4", view)
    assert rec.verified
    inversion = invert_to_inputs(view.model, "4", view.gradients, rec)
    assert inversion.verified
    assert_exact(inversion.inputs, secret.inputs, rtol=1e-9)


def test_float32_updates_descend_exactly(mnist):
    """float32 gradients: recovered ReLU zeros carry rounding of either sign; the inversion must
    settle them (uncertain neurons left out of the solve, then fixed by the solved signs)."""
    model = fully_connected(784, 400, 6, seed=0, dtype=torch.float32)
    view, secret = simulate_fedsgd(model, mnist, 20, seed=1)
    for layer in ("4", "6"):
        rec = _attack(model, layer, view)
        inversion = GradientInverter()(view.model, layer, view.gradients, rec)
        assert inversion.verified, (layer, inversion.residual)
        assert_exact(inversion.inputs, secret.inputs.double(), rtol=1e-4)


def test_inversion_refuses_gradients_of_another_batch(mnist):
    model = fully_connected(784, 300, 4, seed=3)
    view, _ = simulate_fedsgd(model, mnist, 10, seed=4)
    other, _ = simulate_fedsgd(model, mnist, 10, seed=5)
    rec = _attack(model, "4", view)
    assert rec.verified
    forged = dict(view.gradients, **{"0.weight": other.gradients["0.weight"]})
    inversion = GradientInverter()(view.model, "4", forged, rec)
    assert not inversion.verified and inversion.residual > 1e-3
    lower_only = dict(view.gradients, **{"2.bias": 2 * view.gradients["2.bias"]})
    assert not GradientInverter()(view.model, "4", lower_only, rec).verified


def test_inversion_is_never_verified_above_an_unverified_layer(mnist):
    model = fully_connected(784, 300, 4, seed=3)
    view, _ = simulate_fedsgd(model, mnist, 10, seed=4)
    rec = _attack(model, "2", view)
    unproven = type(rec)(**{**rec.__dict__, "verified": False})
    assert not GradientInverter()(view.model, "2", view.gradients, unproven).verified


def test_layers_below_and_applicability():
    model = fully_connected(10, 8, 3)
    assert [name for name, _ in layers_below(model, "4")] == ["0", "1", "2", "3"]
    assert layers_below(model, "0") == []
    cnn = vgg((1, 8, 8), (4, "M"), (6,), 3, pool_to=None)
    head = next(name for name, m in cnn.named_modules() if isinstance(m, torch.nn.Linear))
    assert not GradientInverter().applies(cnn, head) and GradientInverter().applies(model, "4")
    with pytest.raises(spear.InputError, match="feature inversion needs"):
        invert_to_inputs(cnn, head, {}, None)


def test_experiment_record_of_a_hidden_layer():
    record = run_experiment(ExperimentSettings(batch_size=10, width=300, depth=4, layer="2", seed=1)).record
    assert record["layer"] == "2" and record["sparsity"] == "output" and record["verified"]
    features = record["features"]
    assert features["exact_samples"] == 10 and features["metrics"]["feature_cosine"] > 0.999
    assert record["inversion"]["method"] == "gradients" and record["inversion"]["verified"]
    assert record["metrics"]["accuracy"] == 1.0 and record["exact_samples"] == 10
    assert record["data_verified"]


def test_exact_inversion_refuses_what_it_cannot_invert(mnist):
    """A ReLU on the raw input loses its negative entries (review: it used to come back
    'verified' as relu(x)); a lower layer missing from the update cannot be solved."""
    torch.manual_seed(0)
    relu_first = torch.nn.Sequential(
        torch.nn.ReLU(),
        torch.nn.Linear(784, 300),
        torch.nn.ReLU(),
        torch.nn.Linear(300, 300),
        torch.nn.ReLU(),
        torch.nn.Linear(300, 10),
    ).double()
    assert not GradientInverter().applies(relu_first, "3")
    view, _ = simulate_fedsgd(relu_first, mnist, 6, seed=0)
    rec = _attack(relu_first, "3", view)
    with pytest.raises(spear.InputError, match="with a Linear first"):
        GradientInverter()(view.model, "3", view.gradients, rec)
    model = fully_connected(784, 300, 4, seed=3)
    view, _ = simulate_fedsgd(model, mnist, 8, seed=4)
    rec = _attack(model, "2", view)
    partial = {k: v for k, v in view.gradients.items() if k != "0.weight"}
    with pytest.raises(spear.InputError, match=r"no gradient for \['0.weight'\]"):
        GradientInverter()(view.model, "2", partial, rec)


def test_a_training_dropout_hides_the_data():
    """A Dropout in training mode masks and rescales what the next layer sees (the mask is not
    in the server's view): the layer above it is hidden, and nothing recovered there counts as
    the data; in eval mode, or with p = 0, it passes the data through."""
    from spear.api import _check_first_layer
    from spear.inversion import FeatureInverter
    from spear.inversion.base import acting_layers_below

    nn = torch.nn
    model = nn.Sequential(nn.Dropout(0.5), nn.Linear(16, 30), nn.ReLU(), nn.Linear(30, 5)).double()
    assert model.training and acting_layers_below(model, "1") == [("0", model[0])]
    inverter = FeatureInverter((1, 4, 4), lambda images: images.flatten(1))
    assert not GradientInverter().applies(model, "1") and not inverter.applies(model, "1")
    # every route to the data refuses, naming the Dropout and the remedy, before it reads anything
    for attempt in (
        lambda: invert_to_inputs(model, "1", {}, None, image_shape=(1, 4, 4), to_inputs=lambda x: x),
        lambda: inverter(model, "1", {}, None),
        lambda: _check_first_layer(model, "1", "sample_weights"),
        # nor is a second forward pass (other masks) the ground truth the evaluation scores against
        lambda: layer_inputs(model, "1", torch.zeros(2, 16, dtype=torch.float64)),
    ):
        with pytest.raises(spear.InputError, match=r"Dropout \['0'\] .* training mode.*model.eval\(\)"):
            attempt()
    model[0].p = 0.0
    assert not acting_layers_below(model, "1")
    model[0].p = 0.5
    model.eval()
    assert not acting_layers_below(model, "1") and GradientInverter().applies(model, "1")


@pytest.mark.parametrize(
    "kind", ["Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "FeatureAlphaDropout"]
)
def test_every_kind_of_dropout_passes_the_data_only_in_eval_mode(kind):
    """Every dropout is the identity in eval mode (an AlphaDropout model used to be refused as
    if its first Linear saw features), and masks at random in training mode."""
    from spear.inversion.base import acting_layers_below, random_masks_below

    nn = torch.nn
    model = nn.Sequential(getattr(nn, kind)(0.3), nn.Linear(16, 30), nn.ReLU(), nn.Linear(30, 5)).double()
    assert random_masks_below(model, "1") == ["0"] and acting_layers_below(model, "1")
    model.eval()
    x = torch.randn(3, 16, dtype=torch.float64)
    assert torch.equal(model[0](x), x)  # what the rule relies on
    assert not random_masks_below(model, "1") and not acting_layers_below(model, "1")
    # between a ReLU and a Linear: a multiplying mask keeps the ReLU's zeros (input sparsity),
    # an alpha dropout in training mode moves them to a nonzero constant
    head = nn.Sequential(nn.Linear(16, 30), nn.ReLU(), getattr(nn, kind)(0.3), nn.Linear(30, 5)).double()
    alpha = "Alpha" in kind
    assert ("3" in attackable_layers(head)) is not alpha
    head.eval()
    assert attackable_layers(head) == {"0": "output", "3": "input"}


def test_pass_through_modules_leave_the_first_layer_first():
    """Flatten, Dropout and Identity change nothing that reaches a layer: a Flatten-first model's
    first Linear is not hidden (its inputs are the data; nothing to invert), and a Dropout
    between a Linear and its ReLU leaves that Linear output-sparse."""
    from spear.api import _check_first_layer
    from spear.inversion import FeatureInverter
    from spear.inversion.base import acting_layers_below

    nn = torch.nn
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(784, 50), nn.Dropout(0.1), nn.ReLU(), nn.Identity(), nn.Linear(50, 10)
    ).double()
    assert attackable_layers(model) == {"1": "output", "5": "input"}  # in either mode
    model.eval()  # the Dropout passes its inputs through
    inverter = FeatureInverter((1, 28, 28), lambda images: images.flatten(1))
    assert not inverter.applies(model, "1") and inverter.applies(model, "5")
    assert GradientInverter().applies(model, "5")
    assert not acting_layers_below(model, "1") and layers_below(model, "1")
    _check_first_layer(model, "1", "sample_weights")  # the data reaches it through a Flatten
    assert acting_layers_below(model, "5") == [("1", model[1]), ("3", model[3])]  # eval: no Dropout
    with pytest.raises(spear.InputError, match="first layer only; layer '5' sees hidden activations"):
        _check_first_layer(model, "5", "sample_weights")
