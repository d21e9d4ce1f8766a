"""The singleton cascade's samples re-solved together on the rows they explain
(spear.core.singletons.refine_peeled): errors read off one row each, which pile up over a long
cascade, are removed."""

import torch

import spear
import spear.core.singletons as singletons
from spear.core.lowrank import low_rank_split
from spear.core.peeling import PeeledSamples
from spear.core.scale import LayerProblem
from spear.core.singletons import refine_peeled
from spear.data import load_dataset
from spear.fl import fedsgd_gradients, shallow_mlp, simulate_fedsgd
from spear.metrics import match_samples, relative_errors


def _client(b: int, seed: int = 0):
    """photos32 in the LT paper's shallow network: the layer's problem, the true inputs (b, n),
    their columns of dL/dZ (b, m) and pre-activations (b, m)."""
    dataset = load_dataset("photos32")
    model = shallow_mlp(dataset.features, seed=seed)
    view, truth = simulate_fedsgd(model, dataset, b, seed=seed, normalize=False)
    layer = view.model[0]
    x = truth.inputs.reshape(b, -1).to(torch.float64)
    z = (x @ layer.weight.T + layer.bias).detach().requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(view.model[1:](z), truth.labels)
    (dz,) = torch.autograd.grad(loss, z)
    split = low_rank_split(view.gradients["0.weight"])
    problem = LayerProblem(
        layer.weight.detach(), layer.bias.detach(), view.gradients["0.bias"], split.L, split.R, "output"
    )
    return problem, x, dz, z.detach()


def _cascade_order(z: torch.Tensor) -> list[int]:
    """The samples an idealized singleton cascade reaches, in order (ground truth: a neuron
    active for one remaining sample hands it over)."""
    active = z > 0
    found: list[int] = []
    while True:
        rest = active.clone()
        rest[found] = False
        single = rest.sum(dim=0) == 1
        new = [j for j in rest[:, single].any(dim=1).nonzero()[:, 0].tolist() if j not in found]
        if not new:
            return found
        found += new


def _peeled(problem: LayerProblem, x: torch.Tensor, dz: torch.Tensor, index: list[int], noise: float):
    """The samples ``index`` as the cascade peels them, their coefficients ``noise`` off."""
    L, R = problem.L, problem.R
    r = torch.linalg.lstsq(R.T, x[index].T).solution.T  # x_j = R^T r_j
    u = torch.linalg.lstsq(L, dz[index].T).solution.T  # dL/dZ_j = L u_j
    q = u / u.norm(dim=1, keepdim=True)
    g = torch.Generator().manual_seed(0)
    r = r + noise * r.norm(dim=1, keepdim=True) * torch.randn(r.shape, generator=g, dtype=r.dtype)
    r = r / (r @ problem.pinv_grad_bias).unsqueeze(-1)
    u = q / (q * r).sum(dim=1, keepdim=True)
    return PeeledSamples(q, r, r @ R, u)


def _worst(inputs: torch.Tensor, truth: torch.Tensor) -> float:
    return float(relative_errors(inputs, truth).max())


def test_refinement_removes_the_errors_the_cascade_piles_up():
    b = 64
    problem, x, dz, z = _client(b)
    order = _cascade_order(z)
    assert len(order) >= 24
    index = order[:24]
    peeled = _peeled(problem, x, dz, index, noise=1e-9)
    assert _worst(peeled.inputs, x[index]) > 1e-10
    refined = refine_peeled(problem, peeled)
    assert refined is not None
    assert _worst(refined.inputs, x[index]) < 1e-12
    # scale included: each refined sample is its own gradient's share, L u_j = dL/dZ_j
    columns = (problem.L @ refined.duals.T).T
    assert float(((columns - dz[index]).norm(dim=1) / dz[index].norm(dim=1)).max()) < 1e-12
    assert torch.equal(refined.directions, peeled.directions)


def test_refinement_needs_rows_that_determine_every_sample():
    b = 64
    problem, x, dz, z = _client(b)
    order = _cascade_order(z)
    # samples off by far more than a row may be off to count as explained: no rows, no refinement
    assert refine_peeled(problem, _peeled(problem, x, dz, order[:24], noise=1e-3)) is None
    # samples that the rows they explain cannot separate (the last samples the cascade never
    # reaches, alone): nothing to re-solve
    rest = [j for j in range(b) if j not in order[:4]][:4]
    assert refine_peeled(problem, _peeled(problem, x, dz, rest, noise=1e-9)) is None
    assert refine_peeled(problem, PeeledSamples.empty(b, x.shape[1], x.dtype, "cpu")) is None


def test_a_refinement_the_model_does_not_certify_leaves_the_samples_as_they_were(monkeypatch):
    """With every row taken for explained, the re-solve is wrong; the model does not certify
    it, and the cascade's samples stay exact."""
    monkeypatch.setattr(singletons, "EXPLAINED_RTOL", 1.0)
    dataset = load_dataset("photos32")
    model = shallow_mlp(dataset.features, seed=0)
    view, truth = simulate_fedsgd(model, dataset, 32, seed=0, normalize=False)
    rec = spear.attack_layer(view.model, "0", view.gradients, seed=0, max_proposals=1)
    assert rec.stats.certified >= 24
    est, ref = match_samples(rec.certified_inputs, truth.inputs)
    assert float((rec.certified_inputs[est] - truth.inputs[ref]).abs().max()) < 1e-9


def test_the_cascade_refines_its_samples_and_reports_the_refined_ones(monkeypatch):
    import spear.core.reconstruct as reconstruct

    refined: list[PeeledSamples] = []

    def spy(problem, peeled):
        out = refine_peeled(problem, peeled)
        if out is not None:
            refined.append(out)
        return out

    monkeypatch.setattr(reconstruct, "refine_peeled", spy)

    # the cascade's own values (a consistent batch would report its assembled ones instead:
    # tests/test_faint_samples.py)
    def own_values(setup, peeled, verdict, selection, inputs):
        none = torch.zeros(len(peeled), dtype=torch.bool)
        return inputs, none, torch.zeros(len(peeled), dtype=torch.long)

    monkeypatch.setattr(reconstruct, "_as_assembled", own_values)
    dataset = load_dataset("photos32")
    model = shallow_mlp(dataset.features, seed=0)
    view, truth = simulate_fedsgd(model, dataset, 32, seed=0, normalize=False)
    rec = spear.attack_layer(view.model, "0", view.gradients, seed=0, max_proposals=1)
    assert len(refined) >= 3  # after every round that peels
    last = refined[-1].inputs[: rec.stats.certified]  # the certified samples come first
    assert rec.stats.certified >= 24
    assert torch.equal(rec.certified_inputs, last.to(rec.certified_inputs))
    est, ref = match_samples(rec.certified_inputs, truth.inputs)
    assert float((rec.certified_inputs[est] - truth.inputs[ref]).abs().max()) < 1e-9


def test_samples_with_a_sign_only_fit_are_subtracted_without_counting(monkeypatch):
    """photos32, b = 64, seed 3: the cascade alone certifies 51 samples when it stops at
    samples the model fits only by sign and scale, 59 when it subtracts them (uncounted) and
    goes on. What it certifies stays exact, labels included."""
    import spear.core.reconstruct as reconstruct

    attacks = []
    scan = reconstruct._Attack._scan_singletons

    def spy(self):
        attacks.append(self)
        return scan(self)

    monkeypatch.setattr(reconstruct._Attack, "_scan_singletons", spy)
    dataset = load_dataset("photos32")
    model = shallow_mlp(dataset.features, seed=3)
    view, truth = simulate_fedsgd(model, dataset, 64, seed=3, normalize=False)
    rec = spear.attack_layer(view.model, "0", view.gradients, seed=3, max_proposals=1)
    assert rec.stats.certified >= 57
    # the subtracted ones are true samples, and none of them is reported as certified
    held = attacks[0].provisional.inputs
    assert len(held) >= 1
    est, ref = match_samples(held, truth.inputs)
    assert float((held[est] - truth.inputs[ref]).abs().max()) < 1e-9
    distance = torch.cdist(held, rec.certified_inputs, compute_mode="donot_use_mm_for_euclid_dist")
    assert float(distance.min()) > 1e-3
    est, ref = match_samples(rec.certified_inputs, truth.inputs)
    assert float((rec.certified_inputs[est] - truth.inputs[ref]).abs().max()) < 1e-9
    labelled = rec.certified_labels[est] >= 0
    assert torch.equal(rec.certified_labels[est][labelled], truth.labels[ref][labelled])


def test_inputs_whose_zeros_other_samples_share_are_checked_as_dense_ones():
    """Photos with a black letterbox have b - 1 zero pixels, but they share them, so those
    zeros pin none of them (the self-pinning check refuses each). The dense scan takes them
    too, and the model certifies them; before it did, the cascade never saw them again."""
    dataset = load_dataset("photos32")
    b = 32
    model = shallow_mlp(dataset.features, seed=0)
    _, truth = simulate_fedsgd(model, dataset, b, seed=0, normalize=False)
    inputs = truth.inputs.clone()
    boxed = [3, 11, 19, 27]
    inputs.view(b, 3, 32, 32)[boxed, :, :2, :] = 0.0  # two black rows in every channel: 192 zeros, shared
    gradients = fedsgd_gradients(model, inputs, truth.labels)
    rec = spear.attack_layer(model, "0", gradients, seed=0, max_proposals=1)
    est, ref = match_samples(rec.certified_inputs, inputs)
    assert float((rec.certified_inputs[est] - inputs[ref]).abs().max()) < 1e-9
    found = set(ref.tolist())
    assert set(boxed) <= found
    labelled = rec.certified_labels[est] >= 0
    assert torch.equal(rec.certified_labels[est][labelled], truth.labels[ref][labelled])
