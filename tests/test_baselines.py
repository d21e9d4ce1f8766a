"""The baseline attacks behind one interface: each lowers its objective and beats its start on a
tiny case; CPA separates ICA-separable mixtures; SPEAR (and SPEAR + prior) stay exact."""

import pytest
import torch
from torch import nn

from spear.baselines import (
    ATTACKS,
    AttackTarget,
    CocktailPartyAttack,
    DataDomain,
    DLGAttack,
    GeipingAttack,
    SpearAttack,
    SpearWithPrior,
    cosine_distance,
    l2_distance,
    make_attack,
    parameter_gradients,
    recover_labels,
)
from spear.baselines.cpa import CPAConfig, WhitenedMixture, scaled_sources, unmix
from spear.baselines.labels import class_counts
from spear.errors import InputError
from spear.fl import fedsgd_gradients
from spear.metrics import match_samples

SHAPE = (1, 4, 4)  # 16 "pixels"


def tiny_mlp(seed=0, width=40, classes=5):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, classes)
    ).double()


def tiny_target(b=2, seed=0, labels_given=False, width=40):
    model = tiny_mlp(seed, width)
    g = torch.Generator().manual_seed(seed + 1)
    inputs = torch.rand(b, 16, generator=g, dtype=torch.float64)
    labels = torch.randperm(5, generator=g)[:b]
    grads = fedsgd_gradients(model, inputs, labels)
    domain = DataDomain(SHAPE, lambda x: x.flatten(1), 0.0, 1.0, True)
    target = AttackTarget(model, grads, b, domain, labels=labels if labels_given else None, seed=seed)
    return target, inputs, labels


def matched_error(estimate, truth):
    est, ref = match_samples(estimate, truth)
    return float((estimate[est] - truth[ref]).abs().max())


def test_matching_losses_vanish_at_the_truth_only():
    target, inputs, labels = tiny_target()
    truth = parameter_gradients(target.model, inputs, labels, create_graph=False)
    other = parameter_gradients(target.model, inputs.flip(0), labels, create_graph=False)
    assert float(l2_distance(truth, truth)) == 0
    assert abs(float(cosine_distance(truth, truth))) < 1e-12
    assert float(l2_distance(other, truth)) > 1e-8 and float(cosine_distance(other, truth)) > 1e-8


def test_labels_single_sample_idlg_and_counts():
    target, _, labels = tiny_target(b=1)
    assert recover_labels(target).tolist() == labels.tolist()
    # counts: b * (p - g) with p known exactly gives the true counts
    counts = class_counts(torch.tensor([-0.3, 0.1, -0.2, 0.2, 0.2]), torch.full((5,), 0.2), 10)
    assert counts.tolist() == [5, 1, 4, 0, 0] and int(counts.sum()) == 10
    # every class with a negative gradient entry is present, counts still sum to b
    forced = class_counts(torch.tensor([-0.01, -0.01, -0.01, 0.02, 0.01]), torch.zeros(5), 2)
    assert int(forced.sum()) == 2 and (forced >= 0).all()


def test_labels_of_a_batch_from_the_bias_gradient():
    target, _, labels = tiny_target(b=3)
    assert sorted(recover_labels(target).tolist()) == sorted(labels.tolist())


@pytest.mark.parametrize("attack", [GeipingAttack(iterations=150, lr=0.05), DLGAttack(iterations=15)])
def test_optimization_baselines_lower_their_objective_and_beat_their_start(attack):
    target, inputs, _ = tiny_target(b=2, labels_given=True)
    out = attack(target)
    assert out.method == attack.name and out.seconds > 0 and not out.verified
    assert out.objective["end"] < 0.1 * out.objective["start"]
    start = torch.randn(2, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert matched_error(out.inputs, inputs) < 0.5 * matched_error(start, inputs)


def test_geiping_keeps_the_box_and_recovers_labels_itself():
    target, _, labels = tiny_target(b=2)
    out = GeipingAttack(iterations=60)(target)
    assert out.inputs.min() >= 0 and out.inputs.max() <= 1
    assert sorted(out.labels.tolist()) == sorted(labels.tolist())


def test_dlg_at_one_sample_uses_idlg_label():
    target, inputs, labels = tiny_target(b=1)
    out = DLGAttack(iterations=20)(target)
    assert out.labels.tolist() == labels.tolist() and "iDLG" in out.notes[0]
    assert matched_error(out.inputs, inputs) < 1e-3


def laplace_mixture(b=4, n=4000, m=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(b, n, generator=g, dtype=torch.float64) - 0.5
    sources = -torch.sign(u) * torch.log1p(-2 * u.abs()) + 0.3  # Laplace, independent, non-zero mean
    mixing = torch.randn(m, b, generator=g, dtype=torch.float64)
    return sources, mixing @ sources, mixing @ torch.ones(b, dtype=torch.float64)


def test_cpa_separates_ica_separable_mixtures_with_their_scales():
    sources, gradient, bias_gradient = laplace_mixture()
    mixture = WhitenedMixture.of(gradient, 4)
    U = unmix(mixture, CPAConfig(), None, seed=0)
    recovered = scaled_sources(gradient, bias_gradient, U @ mixture.whitening @ mixture.basis)
    est, ref = match_samples(recovered, sources)
    cos = nn.functional.cosine_similarity(recovered[est], sources[ref], dim=1)
    assert cos.min() > 0.999  # finite-sample ICA: separated to within sampling error
    relative = (recovered[est] - sources[ref]).norm(dim=1) / sources[ref].norm(dim=1)
    assert relative.max() < 0.1  # sign and scale from the bias gradient


def test_cpa_scales_are_exact_for_exact_directions():
    sources, gradient, bias_gradient = laplace_mixture(b=3, n=50, m=10)
    directions = torch.diag(torch.tensor([2.0, -0.5, 3.0], dtype=torch.float64)) @ sources
    assert torch.allclose(scaled_sources(gradient, bias_gradient, directions), sources, atol=1e-9)


def test_cpa_attack_runs_on_a_model_and_refuses_b_too_large():
    target, _, _ = tiny_target(b=2)
    out = CocktailPartyAttack()(target)
    assert out.inputs.shape == (2, 16) and out.verified is False
    big, _, _ = tiny_target(b=2)
    big.batch_size = 16
    with pytest.raises(InputError, match="ICA needs b"):
        CocktailPartyAttack()(big)


def test_cpa_on_a_flatten_first_model_separates_the_data_itself():
    """A Flatten before the first Linear hides nothing: CPA's sources are the images (its
    image-prior unmixing), with no feature inversion through the Flatten."""
    target, _, _ = tiny_target(b=2)
    target.model = nn.Sequential(nn.Flatten(), *target.model).double()
    target.gradients = {f"{int(k[0]) + 1}{k[1:]}": v for k, v in target.gradients.items()}
    out = CocktailPartyAttack(inversion_steps=3)(target)
    assert out.details["layer"] == "1" and out.inputs.shape == (2, 16)
    assert not any("feature inversion" in note for note in out.notes)


def test_spear_behind_the_interface_is_exact_and_verified():
    target, inputs, labels = tiny_target(b=3, width=60)
    out = SpearAttack(max_proposals=200_000)(target)
    assert out.verified and matched_error(out.inputs, inputs) < 1e-9
    assert sorted(out.labels.tolist()) == sorted(labels.tolist())
    assert out.reconstruction is not None and out.details["layer"] == "0"


def test_spear_with_prior_is_exact_and_records_the_prior():
    target, inputs, _ = tiny_target(b=3, width=60)
    out = SpearWithPrior(prior=GeipingAttack(iterations=20), max_proposals=200_000)(target)
    assert out.verified and matched_error(out.inputs, inputs) < 1e-9
    assert out.details["prior"]["method"] == "geiping" and "guided by geiping" in out.notes[0]


def test_registry_and_clear_errors():
    assert set(ATTACKS) == {"spear", "spear+prior", "geiping", "dlg", "cpa"}
    with pytest.raises(InputError, match="unknown attack"):
        make_attack("nope")
    with pytest.raises(InputError, match="invalid options for geiping"):
        make_attack("geiping", not_an_option=1)
    with pytest.raises(InputError, match="invalid Geiping settings"):
        GeipingAttack(restarts=0)
    target, _, _ = tiny_target()
    with pytest.raises(InputError, match="lacks gradients"):
        AttackTarget(target.model, {}, 2, target.domain)


def test_prior_guided_sampling_finds_what_the_default_schedule_cannot_in_budget():
    """Paper Table 5: a rough prior (the truth + 5% noise, as an optimization attack gives) makes
    m/b = 2.5 exact within a budget in which the default schedule finds no direction."""
    import spear
    from spear.core.proposers import PriorGuidedProposer
    from tests.conftest import assert_exact, make_client

    client = make_client(40, n=200, width=100, depth=2, seed=0)
    noise = torch.randn(client.inputs.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    options = {"max_proposals": 5_000, "seed": 0}
    plain = spear.reconstruct(*client.layer_args(), **options)
    assert not plain.verified and plain.consistent_directions < 40
    guided = spear.reconstruct(
        *client.layer_args(), proposer=PriorGuidedProposer(client.inputs + 0.05 * noise), **options
    )
    assert guided.verified
    assert_exact(guided.inputs, client.inputs)


def test_cpa_on_cnn_features_separates_then_inverts_to_images():
    """CPA's second stage: separated conv features go back to images by feature inversion."""
    from spear.fl import feature_layer, small_cnn

    model = small_cnn((1, 16, 16), hidden=64, classes=5, seed=0)
    g = torch.Generator().manual_seed(0)
    images = torch.rand(3, 1, 16, 16, generator=g, dtype=torch.float64)
    inputs = images.flatten(1)
    grads = fedsgd_gradients(model, inputs, torch.tensor([0, 1, 2]))
    domain = DataDomain((1, 16, 16), lambda x: x.flatten(1), 0.0, 1.0, True)
    out = CocktailPartyAttack(inversion_steps=3)(AttackTarget(model, grads, 3, domain))
    assert out.inputs.shape == (3, 256) and out.details["layer"] == feature_layer(model)
    assert "feature inversion" in out.notes[-1] and not out.verified
    assert out.inputs.min() >= 0 and out.inputs.max() <= 1  # images from the box


class _NoisyTruth(GeipingAttack):
    """A stand-in prior for the test: the truth plus 5% noise (what a good optimization attack
    gives), so the test checks SpearWithPrior's wiring, not Geiping's quality."""

    name = "noisy-truth"

    def __init__(self, truth):
        super().__init__(iterations=0)
        self.truth = truth

    def run(self, target):
        from spear.baselines import AttackOutput

        noise = torch.randn(self.truth.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        return AttackOutput(self.name, self.truth + 0.05 * noise)


def test_spear_with_prior_uses_the_prior_where_spear_alone_cannot():
    """m/b = 2.5: SPEAR alone finds no batch in 1,500 proposals (3,000 neither; 5,000 do since
    the head's pattern search tries delta hypotheses); with the prior the batch is exact, and
    verified, in the same budget."""
    from tests.conftest import make_client

    client = make_client(40, n=200, width=100, depth=2, seed=0)
    domain = DataDomain((200,), lambda x: x.flatten(1), None, None, False)
    target = AttackTarget(client.model, client.grads, 40, domain, seed=0)
    options = {"max_proposals": 1_500}
    alone = SpearAttack(**options)(target)
    assert alone.inputs is None or not alone.verified
    guided = SpearWithPrior(prior=_NoisyTruth(client.inputs), **options)(target)
    assert guided.verified and guided.details["prior"]["method"] == "noisy-truth"
    assert matched_error(guided.inputs, client.inputs) < 1e-6


def test_class_counts_never_negative_and_domain_holds_no_data():
    counts = class_counts(torch.tensor([-0.85, 0.3, 0.55]), torch.tensor([0.9, 0.05, 0.05]), 2)
    assert counts.tolist() == [2, 0, 0]
    many = class_counts(torch.tensor([-0.1, -0.1, -0.1, 0.3]), torch.zeros(4), 2)  # 3 present, b = 2
    assert int(many.sum()) == 2 and (many >= 0).all()
    from spear.data import load_dataset

    domain = DataDomain.of(load_dataset("digits"))
    assert not hasattr(domain.to_inputs, "__self__")  # a plain normalization, not the data set's method
    images = torch.rand(2, *domain.shape, dtype=torch.float64)
    assert torch.equal(domain.to_inputs(images), load_dataset("digits").normalize(images))


def test_baselines_run_the_same_under_a_callers_inference_mode():
    """Optimization baselines differentiate the model; a caller's torch.inference_mode used to
    end them in autograd."""
    target, _, _ = tiny_target(b=2, labels_given=True)
    outside = DLGAttack(iterations=5)(target)
    with torch.inference_mode():
        inside = DLGAttack(iterations=5)(target)
    assert torch.equal(inside.inputs, outside.inputs)
