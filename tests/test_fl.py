"""The client simulation: models, the FedSGD update, pre-training, what the server sees."""

import dataclasses

import pytest
import torch

from spear.data import load_dataset
from spear.errors import InputError
from spear.fl import ClientBatch, ServerView, fedsgd_gradients, fully_connected, pretrain, simulate_fedsgd


def test_fully_connected_layout_and_inits():
    model = fully_connected(64, width=30, depth=4, classes=5, seed=1)
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(64, 30), (30, 30), (30, 30), (30, 5)]
    assert sum(isinstance(m, torch.nn.ReLU) for m in model) == 3
    assert next(model.parameters()).dtype == torch.float64
    same = fully_connected(64, width=30, depth=4, classes=5, seed=1)
    assert torch.equal(model[0].weight, same[0].weight)
    kaiming = fully_connected(64, width=30, depth=3, init="kaiming", seed=1)
    assert float(kaiming[0].bias.detach().abs().max()) == 0.0
    with pytest.raises(InputError, match="unknown init"):
        fully_connected(64, init="orthogonal")
    with pytest.raises(InputError, match="depth"):
        fully_connected(64, depth=1)


def test_fedsgd_gradient_is_the_mean_cross_entropy_gradient():
    model = fully_connected(64, width=20, depth=3, seed=2)
    x = torch.randn(5, 64, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 3, 4])
    grads = fedsgd_gradients(model, x, y)
    assert all(p.grad is None for p in model.parameters())  # the model is left untouched
    manual = torch.zeros_like(model[0].weight)
    for i in range(5):  # the mean of per-sample gradients
        g = torch.autograd.grad(
            torch.nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]), model[0].weight
        )
        manual += g[0] / 5
    assert torch.allclose(grads["0.weight"], manual, atol=1e-14)


def test_server_view_holds_no_private_data():
    ds = load_dataset("digits")
    model = fully_connected(ds.features, width=40, depth=3, seed=3)
    view, secret = simulate_fedsgd(model, ds, 6, seed=3)
    assert {f.name for f in dataclasses.fields(ServerView)} == {"model", "gradients", "protocol", "metadata"}
    assert set(view.gradients) == {name for name, _ in model.named_parameters()}
    assert view.model is not model and torch.equal(view.model[0].weight, model[0].weight)
    assert isinstance(secret, ClientBatch) and secret.inputs.shape == (6, 64)
    assert torch.allclose(ds.denormalize(secret.inputs), secret.images)
    with pytest.raises(InputError, match="takes 784 features"):
        simulate_fedsgd(fully_connected(784, width=20, depth=2), ds, 4)


def test_single_label_client():
    ds = load_dataset("digits")
    _, secret = simulate_fedsgd(fully_connected(64, width=30, depth=3), ds, 8, seed=4, single_label=True)
    assert len(set(secret.labels.tolist())) == 1


def test_pretraining_lowers_the_loss():
    ds = load_dataset("digits")
    model = fully_connected(64, width=40, depth=3, seed=5)
    x = ds.normalize(ds.images[:300])
    with torch.no_grad():
        before = float(torch.nn.functional.cross_entropy(model(x), ds.labels[:300]))
    pretrain(model, ds, steps=100, batch_size=32, lr=0.1, seed=5)
    with torch.no_grad():
        after = float(torch.nn.functional.cross_entropy(model(x), ds.labels[:300]))
    assert after < 0.7 * before


def _tiny_model():
    return fully_connected(6, width=8, depth=2, classes=3, seed=0)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: fully_connected(6, dtype=torch.int64), "floating-point torch.dtype"),
        (lambda: fully_connected(6, seed=2**64), r"seed must be <= 9223372036854775807"),
        (lambda: load_dataset(None), "takes a data set's name"),
        (lambda: simulate_fedsgd(_tiny_model(), None, 4), "must be a spear.data data set"),
        (
            lambda: simulate_fedsgd(_tiny_model(), load_dataset("digits"), 4.5),
            "batch_size must be an integer",
        ),
        (
            lambda: fedsgd_gradients(
                _tiny_model(), torch.zeros(2, 6, dtype=torch.float64), torch.tensor([0, 3])
            ),
            r"\[0, 3\)",
        ),
        (
            lambda: fedsgd_gradients(_tiny_model(), torch.zeros(2, 6, dtype=torch.float64), torch.zeros(2)),
            "soft labels must have the logits' shape",
        ),
        (
            lambda: fedsgd_gradients(_tiny_model(), torch.zeros(2, 6), torch.zeros(2, dtype=torch.long)),
            "the model computes in torch.float64",
        ),
        (
            lambda: fedsgd_gradients(
                _tiny_model(), torch.zeros(2, 6, dtype=torch.float64), torch.zeros(3, dtype=torch.long)
            ),
            r"shape \(2,\)",
        ),
    ],
)
def test_helpers_name_bad_arguments(call, match):
    """Review 26: each ended in a TypeError, IndexError or RuntimeError from torch or PIL."""
    with pytest.raises(InputError, match=match):
        call()


def test_fedsgd_gradients_take_what_cross_entropy_takes():
    """Review 26b: the first checks refused uint8 and soft labels, integer inputs and models
    whose last-registered Linear is not the classifier; each is the torch loss's gradient."""
    torch.manual_seed(0)
    model = fully_connected(20, 30, 3, 10, seed=0)
    x, y = torch.rand(4, 20, dtype=torch.float64), torch.tensor([1, 5, 9, 0])

    def reference(net, inputs, target):
        loss = torch.nn.functional.cross_entropy(net(inputs), target)
        return torch.autograd.grad(loss, list(net.parameters()))

    soft = torch.softmax(torch.rand(4, 10, dtype=torch.float64), 1)
    for target, expected in ((y.to(torch.uint8), y), (y.to(torch.int32), y), (soft, soft)):
        grads = fedsgd_gradients(model, x, target)
        for got, want in zip(grads.values(), reference(model, x, expected), strict=True):
            assert torch.equal(got, want)

    class Gated(torch.nn.Module):  # the classifier, then a gate Linear(16, 1) registered after it
        def __init__(self):
            super().__init__()
            self.enc, self.fc, self.gate = (
                torch.nn.Linear(20, 16),
                torch.nn.Linear(16, 10),
                torch.nn.Linear(16, 1),
            )

        def forward(self, inputs):
            h = torch.relu(self.enc(inputs))
            return self.fc(h * torch.sigmoid(self.gate(h)))

    class Tokens(torch.nn.Module):  # integer token ids as inputs
        def __init__(self):
            super().__init__()
            self.emb, self.fc = torch.nn.EmbeddingBag(100, 16), torch.nn.Linear(16, 10)

        def forward(self, inputs):
            return self.fc(self.emb(inputs))

    for net, inputs in ((Gated().double(), x), (Tokens(), torch.randint(0, 100, (4, 7)))):
        grads = fedsgd_gradients(net, inputs, y)
        for got, want in zip(grads.values(), reference(net, inputs, y), strict=True):
            assert torch.equal(got, want)


def test_builders_and_rounds_take_numpy_integers():
    import numpy as np

    model = fully_connected(64, 20, 2, seed=np.int64(3))
    assert torch.equal(model[0].weight, fully_connected(64, 20, 2, seed=3)[0].weight)
    _, truth = simulate_fedsgd(model, load_dataset("digits"), np.int64(4), seed=np.int64(2))
    assert truth.inputs.shape[0] == 4


def test_a_frozen_parameter_sends_no_gradient():
    model = fully_connected(20, 30, 3, 10, seed=0)
    model[2].requires_grad_(False)
    grads = fedsgd_gradients(model, torch.rand(4, 20, dtype=torch.float64), torch.tensor([1, 5, 9, 0]))
    assert sorted(grads) == ["0.bias", "0.weight", "4.bias", "4.weight"]


def test_a_model_built_under_inference_mode_is_refused_clearly():
    """Autograd cannot differentiate inference tensors; the client's gradient, training and round
    say so in spear's words instead of torch's "cannot be saved for backward"."""
    with torch.inference_mode():
        model = fully_connected(16, width=10, depth=2, classes=3, seed=0)
    x, y = torch.rand(4, 16, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    with pytest.raises(InputError, match="inference_mode"):
        fedsgd_gradients(model, x, y)
    with pytest.raises(InputError, match="inference_mode"):
        pretrain(model, load_dataset("digits"), steps=1)


def test_the_client_computes_its_gradient_under_a_callers_inference_mode():
    model = fully_connected(16, width=10, depth=2, classes=3, seed=0)
    x, y = torch.rand(4, 16, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    with torch.inference_mode():
        inside = fedsgd_gradients(model, x, y)
    outside = fedsgd_gradients(model, x, y)
    assert all(torch.equal(inside[name], outside[name]) for name in outside)
