"""End-to-end: exact recovery on networks built here, options, and every error path."""

import itertools

import numpy as np
import pytest
import torch

import spear
from spear.errors import InputError, NoSparsityError, RankError, SpearError
from tests.conftest import assert_exact, make_client

CASES = [
    # (b, width, depth, seed, normalized images)
    (1, 50, 2, 0, True),
    (2, 50, 3, 1, True),
    (4, 100, 2, 2, False),
    (6, 200, 3, 3, True),
    (8, 200, 6, 4, True),
    (10, 300, 4, 5, False),
    (12, 200, 3, 6, True),
    (12, 500, 6, 7, True),
]


@pytest.mark.parametrize("b,width,depth,seed,images", CASES)
def test_exact_recovery(b, width, depth, seed, images):
    client = make_client(b, width=width, depth=depth, seed=seed, normalized_images=images)
    rec = spear.reconstruct(*client.layer_args(), seed=seed)
    assert rec.verified, rec.message
    assert rec.batch_size == b and rec.sigma == 1.0 and rec.consistent_directions == b
    assert rec.residual < 1e-10
    assert_exact(rec.inputs, client.inputs, 1e-6)
    assert_exact(rec.grad_outputs.T, client.grad_z.T, 1e-6)
    assert rec.stats.seed == seed and rec.stats.seconds >= 0


def test_model_level_entry_point_with_dict_and_list():
    client = make_client(7, width=150, depth=4, seed=11)
    rec = spear.attack_layer(client.model, "0", client.grads)
    assert rec.verified
    assert_exact(rec.inputs, client.inputs)
    as_list = [client.grads[name] for name, _ in client.model.named_parameters()]
    rec2 = spear.attack_layer(client.model, "0", as_list)
    assert torch.equal(rec.directions, rec2.directions)
    assert torch.allclose(rec.inputs, rec2.inputs, rtol=0, atol=1e-12)


def test_deeper_layer_output_sparsity():
    # the second linear layer of a ReLU net: its input is the first hidden activation
    client = make_client(6, width=120, depth=4, seed=12)
    hidden = torch.relu(client.model[0](client.inputs)).detach()
    rec = spear.attack_layer(client.model, "2", client.grads)
    assert rec.verified
    assert_exact(rec.inputs, hidden)


def test_input_sparsity_mode():
    # a layer preceded by ReLU and followed by tanh: only its input is sparse (Section 3.2)
    torch.manual_seed(13)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 150),
        torch.nn.ReLU(),
        torch.nn.Linear(150, 40),
        torch.nn.Tanh(),
        torch.nn.Linear(40, 5),
    ).double()
    x = torch.randn(6, 64, dtype=torch.float64)
    torch.nn.functional.cross_entropy(model(x), torch.arange(6) % 5).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    hidden = torch.relu(model[0](x)).detach()
    rec = spear.attack_layer(model, "2", grads, sparsity="input")
    assert rec.verified and rec.sigma == 1.0 and rec.mode == "input"
    assert_exact(rec.inputs, hidden)


def test_numpy_and_float32_inputs():
    client = make_client(5, width=100, seed=14)
    W, b, GW, Gb = (t.detach().numpy() for t in client.layer_args())
    rec = spear.reconstruct(W, b, GW, Gb)
    assert rec.verified
    assert_exact(rec.inputs, client.inputs)
    # a float32 client: exact up to float32 rounding, verified under the float32 tolerance
    c32 = make_client(5, width=100, seed=14, dtype=torch.float32)
    rec32 = spear.reconstruct(*c32.layer_args())
    assert rec32.verified, rec32.message
    assert rec32.inputs.dtype == torch.float64
    assert_exact(rec32.inputs, c32.inputs.double(), 1e-3)


def test_deterministic_given_seed():
    client = make_client(9, width=200, seed=15)
    a = spear.reconstruct(*client.layer_args(), seed=3, chunk_size=256)
    b = spear.reconstruct(*client.layer_args(), seed=3, chunk_size=256)
    # the search is bit-for-bit reproducible; the final BLAS solve is equal to rounding
    assert a.stats.proposals == b.stats.proposals and a.stats.candidates == b.stats.candidates
    assert torch.equal(a.directions, b.directions)
    assert torch.allclose(a.inputs, b.inputs, rtol=0, atol=1e-12)
    c = spear.reconstruct(*client.layer_args(), seed=4, chunk_size=256)
    assert c.stats.proposals != a.stats.proposals


def test_progress_callback_and_interrupt():
    client = make_client(10, width=200, seed=16)
    events = []
    rec = spear.reconstruct(*client.layer_args(), progress=events.append, chunk_size=512)
    assert events and events[-1].consistent_directions == 10 and events[-1].sigma == 1.0
    assert all(e2.proposals > e1.proposals for e1, e2 in itertools.pairwise(events))
    assert rec.verified

    seen = []

    def interrupt(event):
        seen.append(event.proposals)
        if event.proposals >= 1000:
            raise KeyboardInterrupt

    partial = spear.reconstruct(*client.layer_args(), progress=interrupt, chunk_size=512)
    assert partial.stats.stop_reason == "interrupted"
    assert partial.stats.proposals == seen[-1] >= 1000  # the work done so far is kept
    assert not partial.verified and "interrupted" in partial.message


def test_exhausted_budget_returns_honest_unverified_result():
    client = make_client(14, width=200, seed=17)
    rec = spear.reconstruct(*client.layer_args(), max_proposals=3000)
    assert not rec.verified
    assert rec.stats.stop_reason == "budget" and rec.stats.proposals <= 3000
    assert "max_proposals" in rec.message or "unverified" in rec.message


def test_time_budget_stops(monkeypatch):
    # a clock that advances 0.1 s per reading: the test does not depend on the machine's speed
    from types import SimpleNamespace

    import spear.api
    import spear.core.reconstruct as core

    ticks = itertools.count()
    clock = SimpleNamespace(perf_counter=lambda: 0.1 * next(ticks))
    monkeypatch.setattr(core, "time", clock)
    monkeypatch.setattr(spear.api, "time", clock)  # the budget counts from the call
    # the setup runs here, not on a worker waited for on the real clock (tests/test_deadline.py)
    monkeypatch.setattr(core, "finish_by", lambda deadline, work: work())
    client = make_client(22, width=200, seed=18)
    rec = spear.reconstruct(*client.layer_args(), time_budget=0.5, chunk_size=256, proposer="sampling")
    assert rec.stats.stop_reason == "time budget" and not rec.verified
    assert rec.stats.proposals <= 5 * 256  # one step per reading: it stopped at the first check
    assert 0.5 <= rec.stats.seconds <= 1.0


def test_summary_is_json_ready():
    import json

    client = make_client(3, width=60, seed=19)
    summary = spear.reconstruct(*client.layer_args()).summary()
    assert json.loads(json.dumps(summary))["verified"] is True


# --- bad input -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small():
    return make_client(4, width=60, seed=20)


def test_mismatched_shapes(small):
    W, b, GW, Gb = small.layer_args()
    with pytest.raises(InputError, match=r"grad_weight has shape"):
        spear.reconstruct(W, b, GW[:, :-1], Gb)
    with pytest.raises(InputError, match="grad_bias must have shape"):
        spear.reconstruct(W, b, GW, Gb[:-1])
    with pytest.raises(InputError, match=r"weight must be 2-D"):
        spear.reconstruct(W[0], b, GW, Gb)


def test_non_finite_and_wrong_types(small):
    W, b, GW, Gb = small.layer_args()
    bad = GW.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(InputError, match="NaN or Inf"):
        spear.reconstruct(W, b, bad, Gb)
    with pytest.raises(InputError, match=r"torch\.Tensor or numpy"):
        spear.reconstruct(W.tolist(), b, GW, Gb)
    with pytest.raises(InputError, match="floating-point"):
        spear.reconstruct(W, b, GW.to(torch.int64), Gb)


def test_gradients_as_servers_receive_them():
    """Gradients keyed by a wrapper's names (DistributedDataParallel's "module.", Opacus'
    "_module.") are read with the prefix removed; None or a tensor is a clear error, not a
    TypeError from deep inside."""
    from spear.fl import fedsgd_gradients, fully_connected

    model = fully_connected(40, 60, 3, seed=0, dtype=torch.float64)
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    grads = fedsgd_gradients(model, x, torch.arange(6))
    for prefix in ("module.", "_module."):
        rec = spear.attack_layer(model, "0", {prefix + k: v for k, v in grads.items()}, seed=0)
        assert rec.verified
        assert_exact(rec.inputs, x)
    mixed = {("module." + k if k.startswith("0.") else k): v for k, v in grads.items()}
    with pytest.raises(InputError, match=r"gradients lack \['0.weight', '0.bias'\]"):
        spear.attack_layer(model, "0", mixed, seed=0)
    for wrong in (None, grads["0.weight"]):
        with pytest.raises(InputError, match="must be a dict parameter-name -> gradient"):
            spear.attack_layer(model, "0", wrong, seed=0)
    with pytest.raises(InputError, match="keyed by parameter name"):
        spear.attack_layer(model, "0", dict(enumerate(grads.values())), seed=0)


def test_a_frozen_layer_s_none_gradient_is_left_out():
    """Review 26: with the next layer frozen, ``{n: p.grad ...}`` holds None for it, and
    attack_layer failed on an option the user never passed (next_weight without
    next_grad_weight). A None gradient is one the update does not hold."""
    from spear.fl import fedsgd_gradients, fully_connected

    model = fully_connected(40, 60, 3, seed=0, dtype=torch.float64)
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    grads = fedsgd_gradients(model, x, torch.arange(6))
    frozen = {k: (None if k.startswith("2.") else v) for k, v in grads.items()}
    for update in (frozen, list(frozen.values())):
        rec = spear.attack_layer(model, "0", update, seed=0)
        assert rec.verified
        assert_exact(rec.inputs, x)
    with pytest.raises(InputError, match="a None gradient counts as missing"):
        spear.attack_layer(model, "2", frozen, seed=0)


def test_all_zero_gradients(small):
    W, b, GW, Gb = small.layer_args()
    with pytest.raises(InputError, match="all zeros"):
        spear.reconstruct(W, b, torch.zeros_like(GW), Gb)
    with pytest.raises(InputError, match=r"Theorem 3\.6"):
        spear.reconstruct(W, b, GW, torch.zeros_like(Gb))


def test_batch_not_smaller_than_layer():
    narrow = make_client(12, n=784, width=10, seed=21)
    with pytest.raises(RankError, match="batch size < 10"):
        spear.reconstruct(*narrow.layer_args())
    thin_input = make_client(12, n=8, width=100, seed=22)
    with pytest.raises(RankError):
        spear.reconstruct(*thin_input.layer_args())
    # a full-rank gradient may also be a noisy one (DP-SGD): the message names both causes
    W, b, GW, Gb = make_client(8, n=784, width=100, seed=23).layer_args()
    noisy = GW + GW.abs().max() * torch.randn(
        GW.shape, dtype=GW.dtype, generator=torch.Generator().manual_seed(0)
    )
    with pytest.raises(RankError, match="noise added to the gradient"):
        spear.reconstruct(W, b, noisy, Gb)


def test_gradient_without_relu_sparsity():
    dense = make_client(4, width=100, seed=23, activation=torch.nn.Tanh)
    with pytest.raises(NoSparsityError, match="followed"):
        spear.reconstruct(*dense.layer_args())


def test_a_batch_sharing_one_activation_pattern_is_not_blamed_on_a_missing_relu():
    """Unnormalized inputs (one feature ~1e5, as raw UCI Adult's fnlwgt): that feature decides
    every neuron's sign, ~half the neurons are dead for the whole batch and the rest active for
    every sample. The message used to ask whether a ReLU follows the layer; the zero rows show
    one does, and the samples share their pattern."""
    from spear.fl import shallow_mlp
    from spear.fl.client import fedsgd_gradients

    g = torch.Generator().manual_seed(0)
    x = torch.rand(16, 30, generator=g, dtype=torch.float64)
    x[:, 0] = 1e5 * (1 + 0.1 * x[:, 0])
    y = torch.randint(0, 10, (16,), generator=g)
    model = shallow_mlp(30, 200, 10, seed=0).double()
    grads = fedsgd_gradients(model, x, y)
    with pytest.raises(NoSparsityError, match="share one activation pattern") as raised:
        spear.attack_layer(model, "0", grads, max_proposals=20_000, seed=0)
    assert "106 of 200 neurons are zero" in str(raised.value)
    assert "Is the layer followed" not in str(raised.value)


@pytest.mark.parametrize("depth,layer,steps", [(6, "8", 0), (2, "0", 300)])
def test_small_batch_whose_columns_are_sparse_only_on_few_live_rows_is_not_called_dense(depth, layer, steps):
    """b = 5 on raw digits: a deep layer (300 of 700 neurons dead, the rest active for nearly the
    whole batch: ~26 zeros per column among 369 live rows) and a trained two-layer MLP (~100 of
    407). The sampler's patience for b = 5 ran out in two calls, before the probe that lowers
    the threshold ran, and both raised NoSparsityError ("dense") on every seed tried."""
    from spear.data import load_dataset
    from spear.fl import fully_connected, layer_inputs, pretrain, simulate_fedsgd

    digits = load_dataset("digits")
    model = fully_connected(digits.features, 700 if depth == 6 else 500, depth, digits.classes, seed=3)
    if steps:
        pretrain(model, digits, steps, seed=3)
    view, truth = simulate_fedsgd(model, digits, 5, seed=3, normalize=False)
    rec = spear.attack_layer(view.model, layer, view.gradients, seed=3, max_proposals=100_000)
    assert rec.verified, rec.message
    assert_exact(rec.inputs, layer_inputs(view.model, layer, truth.inputs).to(rec.inputs), 1e-6)


def test_bad_options(small):
    args = small.layer_args()
    with pytest.raises(InputError, match="unknown option"):
        spear.reconstruct(*args, max_propsals=10)
    with pytest.raises(InputError, match="p_fr"):
        spear.reconstruct(*args, p_fr=2.0)
    with pytest.raises(InputError, match="sparsity"):
        spear.reconstruct(*args, sparsity="both")
    with pytest.raises(InputError, match="proposer"):
        spear.reconstruct(*args, proposer="magic")
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="CUDA is not available"):
            spear.reconstruct(*args, device="cuda")


def test_a_result_moves_to_a_device_with_every_tensor(small):
    rec = spear.reconstruct(*small.layer_args(), seed=0)
    tensors = {k: v for k, v in vars(rec).items() if isinstance(v, torch.Tensor)}
    assert {"inputs", "grad_outputs", "directions", "scales", "singular_values"} <= set(tensors)
    moved = rec.to("meta")  # a device without data, on any machine
    assert all(getattr(moved, k).device.type == "meta" for k in tensors)
    assert moved.verified == rec.verified and moved.stats == rec.stats and moved.notes == rec.notes
    back = rec.to("cpu")
    assert all(torch.equal(getattr(back, k), v) for k, v in tensors.items())


def test_model_level_errors(small):
    with pytest.raises(InputError, match="no module named"):
        spear.attack_layer(small.model, "fc9", small.grads)
    with pytest.raises(InputError, match=r"not torch\.nn\.Linear"):
        spear.attack_layer(small.model, "1", small.grads)
    with pytest.raises(InputError, match="gradients but the model has"):
        spear.attack_layer(small.model, "0", [small.grads["0.weight"]])


def test_every_error_is_a_spear_error():
    for cls in (InputError, NoSparsityError, RankError):
        assert issubclass(cls, SpearError)
    assert np is not None


def _small_update():
    from spear.fl import fedsgd_gradients, fully_connected

    model = fully_connected(40, 60, 3, seed=0, dtype=torch.float64)
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return model, x, fedsgd_gradients(model, x, torch.arange(6))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda m, g: spear.attack_layer(m, "0", g, loss=3), "loss must be 'cross_entropy' or a callable"),
        (lambda m, g: spear.attack_layer(m, "0", g, loss=lambda logits: logits), "could not be called"),
        (
            lambda m, g: spear.attack_layer(
                m, "0", g, loss=lambda z, y: torch.nn.functional.cross_entropy(z, y)
            ),
            "one loss per row of logits",
        ),
        (lambda m, g: spear.attack_layer(m, "0", g, sample_weights=3), "sample_weights must be a callable"),
        (lambda m, g: spear.attack_layer(m, "0", g, certifier="x"), "certifier must be"),
        (lambda m, g: spear.attack_layer("model", "0", g), "model must be a torch.nn.Module"),
        (
            lambda m, g: spear.attack_layer(m, "0", {**g, "0.weight": g["0.weight"].to_sparse()}),
            "pass a dense one",
        ),
        (lambda m, g: spear.attack_layer(m, "0", {**g, "0.weight": g["0.weight"].to("meta")}), "meta device"),
        (
            lambda m, g: spear.attack_layer(m, "0", {**g, "0.weight": g["0.weight"].numpy().astype(object)}),
            "got numpy dtype object",
        ),
        (lambda m, g: spear.attack_layer(m, "0", g, seed=2**64), "seed must be <="),
        (lambda m, g: spear.attack_layer(m, "0", g, device="meta"), "unknown device 'meta'"),
    ],
)
def test_bad_api_arguments_are_named_not_raised_from_deep_inside(call, match):
    """Review 26: each of these ended in a TypeError, AttributeError or NotImplementedError from
    inside spear or torch."""
    model, _, grads = _small_update()
    with pytest.raises(InputError, match=match):
        call(model, grads)


def test_numpy_gradients_of_any_byte_order_or_strides_are_read():
    model, x, grads = _small_update()
    update = {k: v.numpy().astype(">f8") for k, v in grads.items()}  # a foreign file's byte order
    update["0.weight"] = np.asarray(grads["0.weight"].numpy().T).T  # Fortran order
    rec = spear.attack_layer(model, "0", update, seed=0)
    assert rec.verified
    assert_exact(rec.inputs, x)


def _deep_update(model):
    from spear.fl import fedsgd_gradients

    x = torch.randn(8, 50, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return fedsgd_gradients(model, x, torch.arange(8) % 10)


def test_messages_point_at_the_cause():
    """Review 26: a negated update blamed the loss, a gradient of 1e-200 asked to lower rank_rtol,
    ReLU6 was said to give no zeros, and BatchNorm in training mode asked whether a ReLU follows."""
    from spear.errors import NoSparsityError
    from spear.fl import fully_connected

    model = fully_connected(50, 100, 3, seed=0, dtype=torch.float64)
    grads = _deep_update(model)
    rec = spear.attack_layer(
        model, "0", {k: -0.05 * v for k, v in grads.items()}, seed=0, max_proposals=20_000
    )
    assert not rec.verified and any("negated one" in note for note in rec.notes)
    W, b = model[0].weight.detach(), model[0].bias.detach()
    for scale in (1e-200, 1e300):
        with pytest.raises(InputError, match="rescale the update"):
            spear.reconstruct(W, b, grads["0.weight"] * scale, grads["0.bias"] * scale)
    torch.manual_seed(0)
    for activation, match in (
        (torch.nn.ReLU6(), "a ReLU clipped at 6"),
        (torch.nn.BatchNorm1d(100), "batch statistics"),
    ):
        net = torch.nn.Sequential(
            torch.nn.Linear(50, 100), activation, torch.nn.ReLU(), torch.nn.Linear(100, 10)
        )
        net = net.double().train()
        update = _deep_update(net)
        with pytest.raises(NoSparsityError, match=match):
            spear.attack_layer(net, "0", update, seed=0, max_proposals=20_000)


def test_valid_uses_the_new_checks_keep():
    """Review 26b: a per-sample loss of shape (k, 1) (log_softmax(...).gather(1, y[:, None])) was
    refused, and float32 working dtypes refused gradients of 1e-21 or 1e15 that recover exactly."""
    model, x, grads = _small_update()

    def gathered(logits, labels):
        return -torch.log_softmax(logits, dim=1).gather(1, labels[:, None])

    rec = spear.attack_layer(model, "0", grads, seed=0, loss=gathered)
    assert rec.verified and rec.verified_by == "model"
    W, b = model[0].weight.detach(), model[0].bias.detach()
    for size in (1e-21, 1e15):  # the largest entry
        scale = size / float(grads["0.weight"].abs().max())
        sized = grads["0.weight"] * scale
        rec = spear.reconstruct(W, b, sized, grads["0.bias"] * scale, dtype=torch.float32, seed=0)
        assert rec.verified
        assert_exact(rec.inputs.double(), x, rtol=1e-4)


def test_a_dense_narrow_layer_says_its_candidates_hold_only_forced_zeros():
    """Review 26: a dense gradient on a layer narrower than 4 b (m = 30, b = 10) fills the pool
    with proposals' own b - 1 zeros (the threshold is 4 rows) and runs to its budget with no
    word of density. After Lemma 5.2's expected count it says so; cut short, or on a ReLU
    layer, it does not."""
    from spear import theory

    g = torch.Generator().manual_seed(0)
    m, n, b = 30, 50, 10
    W, bias = (
        torch.randn(m, n, generator=g, dtype=torch.float64),
        torch.randn(m, generator=g, dtype=torch.float64),
    )
    X, dZ = (
        torch.randn(b, n, generator=g, dtype=torch.float64),
        torch.randn(m, b, generator=g, dtype=torch.float64),
    )
    enough = int(theory.expected_proposals(b)) + 1
    rec = spear.reconstruct(W, bias, dZ @ X, dZ.sum(1), seed=0, max_proposals=enough)
    assert not rec.verified and any("no sparsity the search did not force" in note for note in rec.notes)
    short = spear.reconstruct(W, bias, dZ @ X, dZ.sum(1), seed=0, max_proposals=enough // 4)
    assert not any("did not force" in note for note in short.notes)
    relu = dZ * (torch.randn(m, b, generator=g, dtype=torch.float64) > 0)
    rec = spear.reconstruct(W, bias, relu @ X, relu.sum(1), seed=0, max_proposals=enough)
    assert not any("did not force" in note for note in rec.notes)
