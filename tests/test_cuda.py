"""The attack on a GPU (``device="cuda"``): exact, verified and reproducible there too.

Skipped where CUDA is not available (CI has no GPU). ``SPEAR_TEST_DEVICE=cpu`` runs the same
tests on the CPU, which checks the tests themselves. Each test builds its network and batch on
the CPU, as a server receives them, and hands the attack ``device``: the model's certificate
then runs on the CPU model while the attack runs on the device. Work is bounded by proposals.
"""

import json
import os

import pytest
import torch
from typer.testing import CliRunner

import spear
from spear.cascade import attack_model
from spear.cli import app
from spear.core.linalg import lstsq
from spear.data import load_dataset
from spear.fl import feature_layer, fully_connected, layer_inputs, shallow_mlp, simulate_fedsgd, small_cnn
from spear.metrics import match_samples
from tests.conftest import assert_exact, deep_mlp_round, make_client

DEVICE = os.environ.get("SPEAR_TEST_DEVICE", "cuda")

pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs CUDA (set SPEAR_TEST_DEVICE=cpu)"
)


@pytest.fixture(scope="module")
def mnist():
    return load_dataset("mnist")


def assert_exact_with_labels(rec, inputs: torch.Tensor, labels: torch.Tensor, rtol: float) -> None:
    assert rec.verified, rec.notes
    found = rec.inputs.cpu().double()
    assert_exact(found, inputs.double(), rtol=rtol)
    est, ref = match_samples(found, inputs.double())
    assert torch.equal(rec.labels.cpu()[est], labels[ref])


def test_lstsq_is_the_minimum_norm_solution_of_rank_deficient_and_wide_systems():
    g = torch.Generator().manual_seed(0)
    deficient = torch.randn(30, 4, generator=g, dtype=torch.float64) @ torch.randn(
        4, 12, generator=g, dtype=torch.float64
    )
    wide = torch.randn(6, 20, generator=g, dtype=torch.float64)
    batched = torch.randn(3, 40, 9, generator=g, dtype=torch.float64)
    for A in (deficient, wide, batched):
        B = torch.randn(*A.shape[:-1], 2, generator=g, dtype=torch.float64)
        on_device = lstsq(A.to(DEVICE), B.to(DEVICE)).cpu()
        reference = torch.linalg.pinv(A) @ B  # the minimum-norm least-squares solution
        assert torch.allclose(on_device, reference, rtol=0, atol=1e-10 * float(reference.abs().max()))


def test_reconstruct_is_exact_and_reproducible():
    client = make_client(b=20, width=200, seed=1)
    runs = [
        spear.reconstruct(*client.layer_args(), device=DEVICE, seed=0, max_proposals=200_000) for _ in "ab"
    ]
    assert runs[0].verified
    assert runs[0].inputs.device.type == torch.device(DEVICE).type
    assert_exact(runs[0].inputs.cpu(), client.inputs)
    assert torch.equal(runs[0].inputs, runs[1].inputs)
    assert runs[0].stats.proposals == runs[1].stats.proposals


def test_attack_layer_is_certified_by_the_model(mnist):
    view, truth = deep_mlp_round(mnist, 500, 64, 0)
    rec = spear.attack_layer(view.model, "0", view.gradients, device=DEVICE, seed=0, max_proposals=500_000)
    assert rec.verified_by == "model"
    assert_exact_with_labels(rec, truth.inputs, truth.labels, rtol=1e-6)


def test_float32_gradients(mnist):
    model = fully_connected(mnist.features, 400, 4, seed=1, dtype=torch.float32)
    view, truth = simulate_fedsgd(model, mnist, 32, seed=1)
    rec = spear.attack_layer(view.model, "0", view.gradients, device=DEVICE, seed=0, max_proposals=500_000)
    assert_exact_with_labels(rec, truth.inputs, truth.labels, rtol=1e-3)


def test_hidden_layer_peels_through_the_next_layer(mnist):
    view, truth = deep_mlp_round(mnist, 500, 64, 1)
    rec = spear.attack_layer(view.model, "2", view.gradients, device=DEVICE, seed=0, max_proposals=500_000)
    assert rec.stats.certified > 0
    assert_exact_with_labels(rec, layer_inputs(view.model, "2", truth.inputs), truth.labels, rtol=1e-6)


def test_cnn_feature_layer(mnist):
    model = small_cnn(mnist.image_shape, hidden=300, seed=3)
    view, truth = simulate_fedsgd(model, mnist, 32, seed=3)
    layer = feature_layer(model)
    rec = spear.attack_layer(view.model, layer, view.gradients, device=DEVICE, seed=0, max_proposals=500_000)
    assert_exact_with_labels(rec, layer_inputs(view.model, layer, truth.inputs), truth.labels, rtol=1e-6)


def test_zero_bias_shallow_network(mnist):
    model = shallow_mlp(mnist.features, 400, seed=1)
    view, truth = simulate_fedsgd(model, mnist, 48, seed=1, normalize=False)
    rec = spear.attack_layer(view.model, "0", view.gradients, device=DEVICE, seed=0, max_proposals=2_000_000)
    assert_exact_with_labels(rec, truth.inputs, truth.labels, rtol=1e-6)


def test_whole_model_cascade(mnist):
    view, truth = deep_mlp_round(mnist, 200, 72, 1)
    result = attack_model(
        view.model, view.gradients, ["2", "0"], max_proposals=200, seed=1, max_rounds=4, device=DEVICE
    )
    assert result.complete
    assert_exact(result.inputs.cpu().double(), truth.inputs.double(), rtol=1e-9)


def test_command_line_attack_and_cascade(tmp_path):
    # the attack runs on the device; the experiment evaluates on the CPU, where the truth is
    runner = CliRunner()
    tiny = ["--batch-size", "8", "--width", "60", "--depth", "4", "--device", DEVICE, "--json"]
    attack = runner.invoke(app, ["attack", *tiny, "--out", str(tmp_path)])
    assert attack.exit_code == 0, attack.output
    payload = json.loads(attack.stdout[attack.stdout.index("{") :])
    assert payload["verified"] is True and payload["metrics"]["accuracy"] == 1.0
    cascade = runner.invoke(app, ["cascade", *tiny])
    assert cascade.exit_code == 0, cascade.output
    payload = json.loads(cascade.stdout[cascade.stdout.index("{") :])
    assert payload["cascade"]["complete"] is True and payload["exact_samples"] == 8


def test_fedavg_update_is_certified_by_replay(mnist):
    # the replay runs inside the attack (its stop rule) on the CPU model, with the attack's tensors
    pytest.importorskip("flwr")  # spear.fl.protocols imports Flower
    from spear.fl import simulate_round
    from spear.fl.protocols import FedAvg

    model = fully_connected(mnist.features, 300, 4, mnist.classes, seed=7)
    protocol = FedAvg(epochs=1, batch_size=4, lr=0.1)
    view, truth = simulate_round(model, mnist, 12, protocol, seed=7)
    options = {"max_proposals": 300_000, **protocol.attack_options(view.model, view.gradients)}
    rec = spear.attack_layer(view.model, "0", view.gradients, device=DEVICE, **options)
    rec = protocol.certify(view.model, view.gradients, rec.to("cpu"))
    assert rec.verified and rec.verified_by == "replay", rec.message
    assert_exact(rec.inputs, truth.inputs)
