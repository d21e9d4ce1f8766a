"""Clients computing in mixed precision (``torch.autocast``): the precision read off the
gradient's entries (spear.api.stored_precision) or told (``client_dtype``), and saturation
counted only where another sample can hide in a column (spear.core.verdict.
saturation_ambiguous), which lets float16 and bfloat16 batches verify."""

import pytest
import torch

import spear
import spear.api
import spear.cascade
import spear.certify
from spear.core.certificate import SampleCertificates
from spear.core.verdict import saturation_ambiguous
from spear.fl.protocols import FedSGD


def test_stored_precision_reads_the_significands():
    g = torch.randn(100, 100)
    assert spear.api.stored_precision(g) == torch.float32
    assert spear.api.stored_precision(g.half().float()) == torch.float16
    # loss scaling and unscaling multiply by powers of 2: the significands stay float16's
    assert spear.api.stored_precision(g.half().float() * 2.0**-16) == torch.float16
    assert spear.api.stored_precision(g.bfloat16().float()) == torch.bfloat16
    assert spear.api.stored_precision(g.double()) == torch.float32  # a float32 update upcast
    assert spear.api.stored_precision(g.half()) == torch.float16
    few = torch.zeros(100, 100)
    few[0, :63] = g[0, :63].half().float()  # too few nonzero entries to tell: the container's
    assert spear.api.stored_precision(few) == torch.float32
    few[1, :1] = 1.0
    assert spear.api.stored_precision(few) == torch.float16  # 64 entries: enough
    assert spear.api.source_precision(g, g.half().float()) == torch.float16  # the least precise


def test_fedsgd_autocast_takes_the_half_dtypes_only():
    with pytest.raises(spear.InputError, match=r"autocast must be torch\.float16, torch\.bfloat16"):
        FedSGD(autocast=torch.float64)
    assert FedSGD(autocast=torch.bfloat16).settings() == {"protocol": "fedsgd", "autocast": "bfloat16"}
    # review 45: a float64 model's client computed in float64 under a record saying float16
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2)).double()
    x, y = torch.rand(2, 4, dtype=torch.float64), torch.tensor([0, 1])
    with pytest.raises(spear.InputError, match="autocast leaves float64 alone"):
        FedSGD(autocast=torch.float16).client_update(model, x, y)


def _network():
    """A 3-layer ReLU MLP on 100 features (PyTorch's init, float32)."""
    return torch.nn.Sequential(
        torch.nn.Linear(100, 300),
        torch.nn.ReLU(),
        torch.nn.Linear(300, 300),
        torch.nn.ReLU(),
        torch.nn.Linear(300, 10),
    )


def _batch(b, seed):
    """b sparse inputs in [0, 1] and labels; then the global generator draws the network."""
    torch.manual_seed(seed)
    X = torch.rand(b, 100) * (torch.rand(b, 100) > 0.3)
    return X, torch.randint(0, 10, (b,))


def _autocast_client(dtype, b, seed):
    X, y = _batch(b, seed)
    model = _network()
    grads = FedSGD(autocast=dtype).client_update(model, X, y)
    assert all(g.dtype == torch.float32 for g in grads.values())  # AMP keeps the parameters' dtype
    return model, grads, X.double()


def _errors(rec, X):
    D = torch.cdist(rec.inputs.double(), X)
    return D.amin(dim=1) / X[D.argmin(dim=1)].norm(dim=1)


@pytest.mark.parametrize(("dtype", "b", "seed"), [(torch.float16, 32, 0), (torch.bfloat16, 8, 0)])
def test_an_autocast_client_is_verified_to_its_arithmetic(dtype, b, seed, monkeypatch):
    """A client under autocast sends float32 gradients computed in float16 (bfloat16): read as
    float32 they were not recovered (float16, b = 32: "not recovered", 9 samples certified one
    by one; bfloat16, b = 8: unverified, 0 consistent directions). Read at their arithmetic's
    precision, every sample reads saturated (1e3 eps is about 1 there), which blocked the
    model certificate; no two share a pattern and a label, so the batch verifies."""
    model, grads, X = _autocast_client(dtype, b, seed)
    rec = spear.attack_layer(model, "0", grads, seed=0, max_proposals=20_000)
    assert rec.verified, rec.message
    error = _errors(rec, X)
    assert bool((error < 10 * torch.finfo(dtype).eps).all()), error.max()  # the verification tolerance
    assert bool((error <= rec.input_precision.double()).all())  # within each stated precision
    assert any("compare client_batch_size" in note for note in rec.notes)  # what it cannot see
    monkeypatch.setattr(spear.api, "FEWEST_TELLING_ENTRIES", 10**12)  # the container's dtype
    assert not spear.attack_layer(model, "0", grads, seed=0, max_proposals=20_000).verified


def test_saturated_samples_block_the_batch_with_a_twin_or_scaled_copies():
    b = 4
    cert = SampleCertificates(
        ok=torch.ones(b, dtype=torch.bool),
        labels=torch.tensor([3, 3, 5, 3]),
        weights=torch.full((b,), 0.25, dtype=torch.float64),
        misfit=torch.zeros(b, dtype=torch.float64),
        strong=torch.zeros(b, dtype=torch.bool),
        saturated=torch.tensor([True, True, True, False]),
    )
    biased = torch.zeros(b, dtype=torch.bool)  # every sample's copies change its pattern
    assert saturation_ambiguous(cert, (), biased).tolist() == [False] * 4  # every pattern its own
    assert saturation_ambiguous(cert, ((0, 1),), biased).tolist() == [True, True, False, False]
    assert saturation_ambiguous(cert, ((0, 2),), biased).tolist() == [False] * 4  # other labels
    # sample 3 is not saturated: sample 0 may still hide a mixture with it
    assert saturation_ambiguous(cert, ((0, 2, 3),), biased).tolist() == [True, False, False, False]
    copies = torch.tensor([False, False, True, True])  # 2 keeps its pattern when scaled
    assert saturation_ambiguous(cert, (), copies).tolist() == [False, False, True, False]
    assert saturation_ambiguous(cert, (), None).tolist() == [True, True, True, False]  # not known


def test_scaled_copies_keep_the_pattern_of_a_zero_bias_or_ungated_layer_only():
    torch.manual_seed(0)
    tail = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(50, 10)).double()
    layer = torch.nn.Linear(20, 50).double()
    x = torch.randn(6, 20, dtype=torch.float64)
    certifier = spear.certify.ModelCertifier(tail, layer.weight, layer.bias, rtol=1e-8)
    assert not bool(certifier.scale_invariant(x).any())
    zero_bias = spear.certify.ModelCertifier(
        tail, layer.weight, torch.zeros(50, dtype=torch.float64), rtol=1e-8
    )
    assert bool(zero_bias.scale_invariant(x).all())
    ungated = spear.certify.ModelCertifier(tail[1:], layer.weight, layer.bias, rtol=1e-8)
    assert bool(ungated.scale_invariant(x).all())  # no ReLU after the layer: no pattern to change


def test_float16_twins_are_not_verified():
    """Sample 1 is sample 0 plus 10% noise on its support, with its label: the two share their
    pattern, and their saturated losses (float16) cannot tell them from mixtures of them. The
    batch stays unverified and neither is certified on its own; the other 14 are."""
    torch.manual_seed(0)
    X = torch.rand(16, 100) * (torch.rand(16, 100) > 0.3)
    X[1] = X[0] + 0.1 * torch.rand(100) * (X[0] > 0)
    y = torch.randint(0, 10, (16,))
    y[1] = y[0]
    model = _network()
    grads = FedSGD(autocast=torch.float16).client_update(model, X, y)
    rec = spear.attack_layer(model, "0", grads, seed=0, max_proposals=20_000)
    assert not rec.verified and "samples sharing such a pattern and label (a twin" in rec.message
    # the other 14 are certified one by one (a discriminative fit, no twin), the pair is not
    D = torch.cdist(rec.certified_inputs.double(), X.double())
    assert sorted(D.argmin(dim=1).tolist()) == list(range(2, 16))
    assert bool((D.amin(dim=1) / X.double()[D.argmin(dim=1)].norm(dim=1) <= rec.certified_precision).all())


def test_client_dtype_tells_what_the_entries_no_longer_show(monkeypatch):
    """A residual (certified samples subtracted) of an autocast client's update reads float32;
    ``client_dtype`` gives the attack float16's tolerances back, and ``attack_model`` sets it
    from the update as the client sent it."""
    model, grads, X = _autocast_client(torch.float16, 32, 0)
    blurred = {name: g + (g != 0) * g.abs().amax() * 1e-9 * torch.rand(g.shape) for name, g in grads.items()}
    assert spear.api.stored_precision(blurred["0.weight"]) == torch.float32
    assert not spear.attack_layer(model, "0", blurred, seed=0, max_proposals=20_000).verified
    rec = spear.attack_layer(model, "0", blurred, seed=0, max_proposals=20_000, client_dtype=torch.float16)
    assert rec.verified, rec.message
    assert bool((_errors(rec, X) <= rec.input_precision.double()).all())
    with pytest.raises(spear.InputError, match="client_dtype must be one of"):
        spear.attack_layer(model, "0", grads, client_dtype=torch.int8)
    told = []
    real = spear.cascade.attack_layer

    def spy(*args, **options):
        told.append(options.get("client_dtype"))
        return real(*args, **options)

    monkeypatch.setattr(spear.cascade, "attack_layer", spy)
    model, grads, _ = _autocast_client(torch.float16, 8, 1)
    spear.attack_model(model, grads, seed=0, max_proposals=20_000, max_rounds=1)
    assert told and set(told) == {torch.float16}


def test_the_certificate_tolerance_grows_with_a_half_precision_tail():
    tail = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    assert spear.api.certificate_rtol(tail, torch.float32) == pytest.approx(1e-3)
    assert spear.api.certificate_rtol(tail, torch.float16) == pytest.approx(
        2 * 10 * torch.finfo(torch.float16).eps
    )
    assert spear.api.certificate_rtol(torch.nn.Sequential(torch.nn.ReLU()), torch.bfloat16) == pytest.approx(
        10 * torch.finfo(torch.bfloat16).eps
    )


@pytest.mark.parametrize(("dtype", "b", "seed"), [(torch.float64, 8, 0), (torch.float32, 16, 4)])
def test_saturated_twins_merged_alike_stay_unverified_in_full_precision(dtype, b, seed):
    """A review's batch: a confidently wrong network (last layer x 5000), every sample with a
    twin (plus 1e-3 noise, its label, its pattern). Each pair merges into one column at its
    midpoint, all weights alike: read as b/2 samples. In float32 and float64 saturation stays a
    bar to the batch (the relaxation is for half precision, where it reads on every sample):
    unverified, as before."""
    model = spear.fl.fully_connected(50, 200, 3, 10, seed=seed, dtype=dtype)
    with torch.no_grad():
        model[4].weight.mul_(5000)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 50, generator=g, dtype=torch.float64).to(dtype)
    x[1::2] = x[0::2] + 1e-3 * torch.randn(b // 2, 50, generator=g, dtype=torch.float64).to(dtype)
    with torch.no_grad():
        y = (model(x).argmax(1) + 1) % 10
    y[1::2] = y[0::2]
    loss = torch.nn.functional.cross_entropy(model(x), y)
    names = [n for n, _ in model.named_parameters()]
    grads = dict(zip(names, torch.autograd.grad(loss, list(model.parameters())), strict=True))
    rec = spear.attack_layer(model, "0", grads, seed=0, max_proposals=20_000)
    assert not rec.verified and "saturated" in rec.message


def test_the_cascade_judges_a_mixed_precision_update_in_the_clients_arithmetic(monkeypatch):
    """A float16 client's whole batch, found exactly, leaves 31 to 33 eps of its update in
    float64 (ReLUs within float16's rounding of zero switched), over float16's 10 eps: the
    cascade never called it complete and attacked the rank-1 residual to its last round. In
    the client's arithmetic (autocast) it leaves under 1 eps. A doubled update stays
    incomplete: half the batch, weighted 2/16, leaves half of it."""
    model, grads, X = _autocast_client(torch.float16, 16, 0)
    eps = torch.finfo(torch.float16).eps
    found = spear.attack_model(model, grads, seed=0, max_proposals=20_000, max_rounds=3)
    assert found.complete and found.stop_reason == "complete" and len(found.steps) == 1
    assert found.residual < eps and found.inputs.shape[0] == 16
    D = torch.cdist(found.inputs, X)
    assert bool((D.amin(dim=1) <= 1e-2 * X[D.argmin(dim=1)].norm(dim=1)).all())
    assert sorted(D.argmin(dim=1).tolist()) == list(range(16))
    doubled = spear.attack_model(model, {k: 2 * g for k, g in grads.items()}, seed=0, max_proposals=20_000)
    assert not doubled.complete and doubled.residual > 0.4
    # the counterfactual: judged in float64 only, the same batch is not complete
    monkeypatch.setattr(spear.cascade._Cascade, "_left_in_client_arithmetic", lambda self: float("inf"))
    before = spear.attack_model(model, grads, seed=0, max_proposals=20_000, max_rounds=3)
    assert not before.complete and before.inputs.shape[0] == 16 and before.residual > 30 * eps


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_per_sample_gradients_in_the_clients_arithmetic_reproduce_its_update(dtype):
    """``per_sample_gradients(..., autocast=dtype)`` is the client's own computation (the
    samples in another order, each weighted 1/B): within 0.1 eps of what it sent, where
    float64 is 31 eps off (float16, a ReLU switched)."""
    model, grads, X = _autocast_client(dtype, 16, 0)
    _, y = _batch(16, 0)
    order = torch.randperm(16, generator=torch.Generator().manual_seed(3))
    weights = torch.full((16,), 1 / 16, dtype=torch.float64)
    ours = spear.cascade.per_sample_gradients(model, X[order], y[order], weights, autocast=dtype)
    eps = torch.finfo(dtype).eps
    for name, sent in grads.items():
        assert ours[name].dtype == torch.float32
        assert float((ours[name] - sent).norm() / sent.norm()) < 0.1 * eps, name
    if dtype == torch.float16:
        exact = spear.cascade.per_sample_gradients(model, X, y, weights)
        assert float((exact["0.weight"] - grads["0.weight"]).norm() / grads["0.weight"].norm()) > 30 * eps


def test_a_recomputation_that_overflows_explains_nothing():
    """A review's case: a doubled float32 update of inputs x 1e5, read as float16 (told), half of
    its samples found (weights 2/16 read 1/8: a batch of 8). Their float16 recomputation
    overflows to NaN, which ``max`` skipped: the update read as explained and the half batch as
    complete."""
    from spear.cascade import _Cascade, _Plan, per_sample_gradients

    X, y = _batch(16, 0)
    model, X = _network(), X * 1e5
    doubled = {k: 2 * g for k, g in FedSGD().client_update(model, X, y).items()}
    weights = torch.full((8,), 1 / 8, dtype=torch.float64)
    plan = _Plan(["2", "0"], None, None, 1, "cross_entropy", None, {"client_dtype": torch.float16})
    cascade = _Cascade(model, doubled, plan)
    cascade.found.add(X[:8].double(), y[:8], weights, "0")
    for name, taken in per_sample_gradients(model, X[:8], y[:8], weights).items():
        cascade.residual[name] = cascade.residual[name].double() - taken
    assert cascade._left_in_client_arithmetic() == float("inf")
    count = cascade._count()
    assert count.missing == 0 and not count.explained and not count.complete
    assert cascade._unexplained() > 0.5
    with pytest.raises(spear.InputError, match="autocast must be"):
        per_sample_gradients(model, X[:1], y[:1], weights[:1], autocast=torch.float32)


def test_the_cascade_inverts_at_the_clients_precision_whatever_the_container():
    """The same float16 update in float64 tensors: layer 2's attack verifies its 16 hidden
    inputs, and the row-space inversion to the data read float64's tolerances off the
    containers and took none of them (15 of 16 found, by the first layer, incomplete). It takes
    the client's precision as the cascade read it."""
    model, grads, X = _autocast_client(torch.float16, 16, 0)
    wide = {k: g.double() for k, g in grads.items()}
    found = spear.attack_model(model, wide, ["2", "0"], seed=0, max_proposals=20_000, max_rounds=1)
    assert found.complete and found.inputs.shape[0] == 16 and found.steps[0].added == 16
    D = torch.cdist(found.inputs, X)
    assert sorted(D.argmin(dim=1).tolist()) == list(range(16))
    assert bool((D.amin(dim=1) <= 1e-2 * X[D.argmin(dim=1)].norm(dim=1)).all())
