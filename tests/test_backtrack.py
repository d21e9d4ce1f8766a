"""Certified hidden samples inverted one by one down to the images (RowSpaceInverter)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import spear
from spear.core.backtrack import RowSpace, gradient_row_space, invert_relu_linear
from spear.fl import fedsgd_gradients, fully_connected, layer_inputs, simulate_fedsgd
from spear.inversion import RowSpaceInverter
from tests.conftest import assert_exact, deep_mlp_round


def _certified(rec, inputs: torch.Tensor):
    """``rec`` as an attack that stopped short of the batch but certified ``inputs``."""
    return dataclasses.replace(rec, verified=False, certified_inputs=inputs)


def test_a_hidden_layers_attack_inverts_to_the_images(mnist):
    view, truth = deep_mlp_round(mnist, 200, 16, 3)
    rec = spear.attack_layer(view.model, "4", view.gradients, seed=0, max_proposals=200_000)
    assert rec.verified
    images = RowSpaceInverter()(view.model, "4", view.gradients, rec)
    assert images.verified and bool(images.exact.all()) and images.residual < 1e-10
    assert_exact(images.inputs, truth.inputs.double(), rtol=1e-9)


def test_certified_samples_alone_invert_without_the_rest_of_the_batch(mnist):
    # the whole-batch inversion needs every sample's output gradient; one by one needs none
    view, truth = deep_mlp_round(mnist, 200, 16, 3)
    rec = spear.attack_layer(view.model, "4", view.gradients, seed=0, max_proposals=200_000)
    some = _certified(rec, layer_inputs(view.model, "4", truth.inputs)[[1, 5, 9]])
    images = RowSpaceInverter()(view.model, "4", view.gradients, some)
    assert images.verified and images.exact.tolist() == [True] * 3
    assert_exact(images.inputs, truth.inputs[[1, 5, 9]].double(), rtol=1e-9)
    as_numpy = {name: g.numpy() for name, g in view.gradients.items()}  # what a server may hold
    assert torch.allclose(
        RowSpaceInverter()(view.model, "4", as_numpy, some).inputs, images.inputs, atol=1e-12
    )


def test_float32_gradients_invert_to_float32_precision(mnist):
    view, truth = deep_mlp_round(mnist, 200, 16, 1, torch.float32)
    rec = spear.attack_layer(view.model, "2", view.gradients, seed=0, max_proposals=200_000)
    some = _certified(rec, layer_inputs(view.model, "2", truth.inputs))
    images = RowSpaceInverter()(view.model, "2", view.gradients, some)
    assert bool(images.exact.all())
    assert_exact(images.inputs, truth.inputs.double(), rtol=1e-4)


def test_wrong_hidden_inputs_are_not_called_exact(mnist):
    # a mixture of two samples, one active unit switched off, a rescaled sample: no input of
    # the row space reproduces them through the ReLU
    view, truth = deep_mlp_round(mnist, 200, 16, 2)
    rec = spear.attack_layer(view.model, "2", view.gradients, seed=0, max_proposals=200_000)
    hidden = layer_inputs(view.model, "2", truth.inputs).double()
    flipped = hidden[2].clone()
    flipped[int(flipped.argmax())] = 0.0
    wrong = torch.stack([(hidden[0] + hidden[1]) / 2, flipped, 1.5 * hidden[3]])
    images = RowSpaceInverter()(
        view.model, "2", view.gradients, _certified(rec, torch.cat([hidden[4:6], wrong]))
    )
    assert images.exact.tolist() == [True, True, False, False, False] and not images.verified


def test_a_layer_below_too_narrow_to_determine_the_inputs_is_reported_not_guessed(mnist):
    # 12 units below, ~6 active per sample, 8 unknowns: where fewer than 8 are active many
    # inputs fit, and none is claimed; where 8 or more are, the one that fits is the truth
    torch.manual_seed(0)
    layers = [torch.nn.Linear(784, 12), torch.nn.ReLU(), torch.nn.Linear(12, 300), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(300, 10)).double()
    view, truth = simulate_fedsgd(model, mnist, 8, seed=0)
    rec = spear.attack_layer(view.model, "2", view.gradients, seed=0, max_proposals=1, peel=False)
    some = _certified(rec, layer_inputs(view.model, "2", truth.inputs))
    images = RowSpaceInverter()(view.model, "2", view.gradients, some)
    active = (layer_inputs(view.model, "2", truth.inputs) > 0).sum(dim=1)
    assert not images.verified and bool((active < 8).any())
    assert not bool(images.exact[active < 8].any()) and bool(torch.isnan(images.inputs[active < 8]).all())
    exact = images.exact
    assert bool(exact.any()) and torch.allclose(images.inputs[exact], truth.inputs[exact].double(), atol=1e-9)


def test_invert_relu_linear_needs_a_determined_system_in_the_right_row_space():
    g = torch.Generator().manual_seed(0)
    W, bias = (
        torch.randn(60, 30, generator=g, dtype=torch.float64),
        torch.randn(60, generator=g, dtype=torch.float64),
    )
    X = torch.randn(5, 30, generator=g, dtype=torch.float64)
    H = torch.relu(X @ W.T + bias)
    grad = torch.randn(40, 5, generator=g, dtype=torch.float64) @ X  # rank 5, rows span the inputs
    good = invert_relu_linear(H, W, bias, gradient_row_space(grad, torch.float64), 0.0, 1e-8, 1e-9)
    assert bool(good.exact.all()) and torch.allclose(good.inputs, X, atol=1e-10)
    other = torch.linalg.qr(torch.randn(30, 5, generator=g, dtype=torch.float64)).Q.T
    assert not bool(invert_relu_linear(H, W, bias, RowSpace(other, 0.0), 0.0, 1e-8, 1e-9).exact.any())
    # weights of rank 3 < 5 unknowns: every active set leaves a family of exact fits
    low = torch.randn(60, 3, generator=g, dtype=torch.float64) @ torch.randn(
        3, 30, generator=g, dtype=torch.float64
    )
    H = torch.relu(X @ low.T + bias)
    flat = invert_relu_linear(H, low, bias, gradient_row_space(grad, torch.float64), 0.0, 1e-8, 1e-9)
    assert not bool(flat.exact.any()) and float(flat.precision.min()) > 1e-3  # x is anything


def test_the_row_space_inversion_names_what_it_cannot_do(mnist):
    view, _ = deep_mlp_round(mnist, 200, 8, 0)
    rec = spear.attack_layer(view.model, "2", view.gradients, max_proposals=1, peel=False)
    assert not rec.verified and rec.certified_inputs is None
    with pytest.raises(spear.InputError, match="only proven inputs"):
        RowSpaceInverter()(view.model, "2", view.gradients, rec)
    grads = {k: v for k, v in view.gradients.items() if k != "0.weight"}
    with pytest.raises(spear.InputError, match=r"lacks the weight gradients of layers \['0'\]"):
        RowSpaceInverter()(view.model, "2", grads, _certified(rec, torch.zeros(1, 200)))
    with pytest.raises(spear.InputError, match="not the attacked"):
        RowSpaceInverter()(view.model, "1", view.gradients, _certified(rec, torch.zeros(1, 200)))
    with pytest.raises(spear.InputError, match=r"takes \(k, 200\)"):
        RowSpaceInverter()(view.model, "2", view.gradients, _certified(rec, torch.zeros(1, 199)))
    first = RowSpaceInverter()(view.model, "0", view.gradients, _certified(rec, torch.ones(2, 784)))
    assert first.method == "identity" and first.exact.tolist() == [True, True]  # the data itself
    cnn = torch.nn.Sequential(
        torch.nn.Conv2d(1, 2, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8, 4)
    )
    assert not RowSpaceInverter().applies(cnn, "3")


def test_an_experiment_counts_the_data_of_certified_hidden_samples(mnist):
    # spear attack on a hidden layer that certified samples but no batch: their images count
    from spear.experiments.evaluation import evaluate

    view, truth = deep_mlp_round(mnist, 200, 16, 3)
    rec = spear.attack_layer(view.model, "4", view.gradients, seed=0, max_proposals=200_000)
    hidden = layer_inputs(view.model, "4", truth.inputs)
    partial = dataclasses.replace(_certified(rec, hidden[[0, 3]]), inputs=None, grad_outputs=None)
    data = RowSpaceInverter()(view.model, "4", view.gradients, partial)
    record = evaluate(mnist, view.model, "4", partial, None, truth, 1e-6, certified_data=data).record
    assert record["exact_samples"] == 2 and record["features"]["exact_samples"] == 2
    assert record["certified_data"]["exact_samples"] == 2
    assert evaluate(mnist, view.model, "4", partial, None, truth, 1e-6).record["exact_samples"] == 0


def test_an_experiment_inverts_certified_samples_only_when_the_batch_is_not_verified(mnist):
    from spear.experiments.run import _certified_data

    view, truth = deep_mlp_round(mnist, 200, 16, 3)
    rec = spear.attack_layer(view.model, "4", view.gradients, seed=0, max_proposals=200_000)
    assert rec.verified and _certified_data(view, "4", rec) is None  # the batch inverts whole
    hidden = layer_inputs(view.model, "4", truth.inputs)
    data = _certified_data(view, "4", _certified(rec, hidden[:3]))
    assert data is not None and data.method == "row space" and data.exact.tolist() == [True] * 3


def test_an_ill_conditioned_system_is_exact_only_where_its_data_are_precise_enough():
    # the active system's condition (~1e6) times float32's row space (~1e-7) exceeds float32's
    # 1e-3: it fits its equations with a wrong x, so it is refused; float64 solves it to ~1e-10
    g = torch.Generator().manual_seed(0)
    X = torch.randn(5, 30, generator=g, dtype=torch.float64)
    span = torch.linalg.qr(X.T).Q.T
    W = torch.randn(60, 30, generator=g, dtype=torch.float64)
    W = W - (1 - 1e-6) * (W @ span[0])[:, None] * span[0][None, :]
    bias = torch.randn(60, generator=g, dtype=torch.float64)
    H = torch.relu(X @ W.T + bias)
    grad = torch.randn(40, 5, generator=g, dtype=torch.float64) @ X
    wide = invert_relu_linear(H, W, bias, gradient_row_space(grad, torch.float64), 0.0, 1e-8, 1e-9)
    assert bool(wide.exact.all()) and torch.allclose(wide.inputs, X, atol=1e-8)
    assert float(wide.precision.max()) > 1e3 * float(torch.finfo(torch.float64).eps)
    space = gradient_row_space(grad.float(), torch.float32)
    narrow = invert_relu_linear(H.float(), W.float(), bias.float(), space, 1.2e-7, 1e-3, 1e-4)
    assert not bool(narrow.exact.any())


def test_a_bias_that_dwarfs_the_layers_input_is_not_mistaken_for_precision(mnist):
    # h = relu(W x + 1e4) in float32 keeps W x to ~1e-3 only: fitting h to 1e-3 of h fits W x
    # to nothing, so the inputs are not determined to float32's tolerance
    model = fully_connected(784, 200, 3, seed=0, dtype=torch.float32)
    with torch.no_grad():
        model[0].bias += 1e4
    view, truth = simulate_fedsgd(model, mnist, 16, seed=0)
    rec = spear.attack_layer(view.model, "2", view.gradients, max_proposals=1, peel=False)
    images = RowSpaceInverter()(
        view.model, "2", view.gradients, _certified(rec, layer_inputs(view.model, "2", truth.inputs))
    )
    error = (images.inputs - truth.inputs.double()).abs().amax(dim=1) / truth.inputs.abs().amax()
    assert not images.verified and not bool((images.exact & ~(error < 1e-3)).any())


def test_a_solved_activation_below_zero_ends_the_chain(mnist):
    # layer 0 built so that two samples activate disjoint halves of its 20 units: y1 - y2 / 2
    # lies in the span of the layer's outputs and reproduces a layer-4 input through layers 2
    # and 0 on its positive units, but as a ReLU output it is impossible (negative entries)
    x = mnist.normalize(mnist.images[:2]).reshape(2, -1).double()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(784, 20),
        torch.nn.ReLU(),
        torch.nn.Linear(20, 30),
        torch.nn.ReLU(),
        torch.nn.Linear(30, 10),
    ).double()
    half = torch.cat([torch.ones(10), -torch.ones(10)]).double()
    target = torch.stack([half, -half], dim=1) - model[0].bias.detach()[:, None]  # (20, 2) pre-activations
    with torch.no_grad():
        model[0].weight.copy_(target @ torch.linalg.solve(x @ x.T, x))
    grads = fedsgd_gradients(model, x, torch.tensor([0, 1]))
    rec = spear.attack_layer(model, "4", grads, max_proposals=1, peel=False)
    y = layer_inputs(model, "2", x)
    wrong = torch.relu(model[2](y[0] - 0.5 * y[1]))
    images = RowSpaceInverter()(
        model, "4", grads, _certified(rec, torch.cat([layer_inputs(model, "4", x), wrong[None]]))
    )
    assert images.exact.tolist() == [True, True, False]


def test_samples_are_traced_in_chunks_that_stop_at_the_deadline_and_reuse_the_svds(mnist, monkeypatch):
    # a review: the cascade's inversion after an attack ignored its deadline (a 5 s cascade ran
    # 5.8 s, 3.5 s of it here); it now traces CHUNK samples at a time, each through every layer
    import spear.inversion.row_space as row_space_module
    from spear.core.deadline import Deadline

    view, truth = deep_mlp_round(mnist, 200, 40, 3)
    rec = spear.attack_layer(view.model, "4", view.gradients, seed=0, max_proposals=200_000)
    assert rec.verified
    whole = RowSpaceInverter()(view.model, "4", view.gradients, rec)
    assert bool(whole.exact.all())
    assert_exact(whole.inputs, truth.inputs.double(), rtol=1e-9)
    looks = []

    class SecondChunk(Deadline):  # passes at its second look: one chunk traced
        def passed(self) -> bool:  # (with no time to wait for, the SVDs run in this thread)
            looks.append(1)
            return len(looks) >= 2

    monkeypatch.setattr(row_space_module, "CHUNK", 16)
    svds: dict = {}
    cut = RowSpaceInverter(svds=svds, deadline=SecondChunk(None))(view.model, "4", view.gradients, rec)
    assert cut.exact.tolist() == [True] * 16 + [False] * 24 and not cut.verified
    assert torch.equal(cut.inputs[:16], whole.inputs[:16]) and bool(cut.inputs[16:].isnan().all())
    assert any("24 sample(s) not traced to the data: the time budget ran out" in n for n in cut.notes)
    assert not any("not determined" in n for n in cut.notes)  # the 16 traced are exact
    assert set(svds) == {"0", "2"}  # the lower layers' SVDs, kept for the next call
    late: dict = {}
    none = RowSpaceInverter(svds=late, deadline=Deadline(0.0))(view.model, "4", view.gradients, rec)
    assert not late and not bool(none.exact.any())  # no SVD started past the deadline
    assert any("40 sample(s) not traced" in n for n in none.notes)
    calls = []
    monkeypatch.setattr(
        torch.linalg, "svd", lambda *a, **k: calls.append(1) or (_ for _ in ()).throw(AssertionError)
    )
    again = RowSpaceInverter(svds=svds)(view.model, "4", view.gradients, rec)
    assert not calls and torch.equal(again.inputs, whole.inputs)
