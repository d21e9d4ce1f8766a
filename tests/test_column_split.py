"""Feature columns split by the head vectors (``spear.core.proposers.column_split``): a pixel's
column of dL/dW mixes the columns of dL/dZ of the few samples that light it, and each row is a
subset sum of their vectors ``x_jp delta_j`` seen through the known head."""

import torch

from spear.core.proposers import MaskedSubspaceProposer
from spear.core.proposers import column_split as cs
from spear.core.proposers.masked_subspace import _splitter, explain_away
from tests.test_masked_subspace import context, layer_problem, shallow_case, true_columns


def lt_case(b: int = 96, width: int = 400, seed: int = 3):
    """The LT paper's setting (raw MNIST, zero biases, untrained): the server's head in the
    deltas' span, and the ground truth's columns, patterns and inputs."""
    _, view, truth = shallow_case(b, width, seed=seed)
    problem = layer_problem(view.model, view.gradients, b)
    columns = true_columns(view.model, truth.inputs, truth.labels)  # (m, b)
    B, hypotheses = _splitter(view.model[2].weight.detach().T.double(), problem.next_grad_weight, 1e-9)
    inputs = truth.inputs.reshape(b, -1).double()
    return problem, columns, (columns != 0).T, inputs, B, hypotheses


def mixture(columns: torch.Tensor, inputs: torch.Tensor, p: int) -> torch.Tensor:
    """Pixel p's column of dL/dW: sum_j x_jp dL/dZ_j."""
    return columns @ inputs[:, p]


def test_the_splitter_works_in_the_span_of_the_deltas():
    _problem, _, _, _, B, hypotheses = lt_case()
    # softmax cross-entropy: deltas sum to 0, the next layer's gradient has rank k - 1
    assert B.shape == (400, 9) and hypotheses.shape == (45, 9)
    assert torch.allclose(hypotheses.norm(dim=1), torch.ones(45, dtype=torch.float64))
    # a head wider than the one-hot bank: no splitter
    assert _splitter(torch.randn(400, 40, dtype=torch.float64), None, 1e-9) is None


def test_columns_of_two_to_four_samples_split_into_their_exact_patterns():
    _problem, columns, patterns, inputs, B, hypotheses = lt_case()
    lit = inputs > 0
    generator = torch.Generator().manual_seed(0)
    exact = {2: 0, 3: 0, 4: 0}
    tried = {2: 0, 3: 0, 4: 0}
    for p in range(inputs.shape[1]):
        contributors = lit[:, p].nonzero()[:, 0]
        s = contributors.numel()
        if s not in tried:
            continue
        tried[s] += 1
        column = mixture(columns, inputs, p)
        split = cs.split_column(column, B, hypotheses, 1e-9 * float(column.abs().max()), generator)
        if split is None or not split.complete:
            continue
        # every pattern of a complete split is a contributor's, and every contributor is there
        assert split.patterns.shape[0] == s
        for pattern in split.patterns:
            assert bool((pattern[None] == patterns[contributors]).all(dim=1).any())
        exact[s] += 1
    # measured: 27 of 30, 22 of 26 and 9 of 14
    assert tried == {2: 30, 3: 26, 4: 14}
    assert exact[2] >= 24 and exact[3] >= 18 and exact[4] >= 6


def test_a_column_that_is_no_mixture_of_masked_head_vectors_does_not_split():
    problem, columns, _, inputs, B, hypotheses = lt_case()
    generator = torch.Generator().manual_seed(1)
    # a random vector of range(L) with the zero rows of a 2-sample column: no row class fits
    column = mixture(columns, inputs, int(((inputs > 0).sum(0) == 2).nonzero()[0, 0]))
    fake = torch.where(column != 0, problem.L @ torch.randn(problem.L.shape[1], dtype=torch.float64), 0.0)
    split = cs.split_column(fake, B, hypotheses, 1e-9 * float(fake.abs().max()), generator)
    assert split is None or not split.complete


def test_atoms_are_the_class_vectors_that_are_no_sum_of_two_others():
    a, b, c = torch.eye(3, dtype=torch.float64)
    vectors = torch.stack([a, b, a + b, 2.0 * c, a + b + 2.0 * c])
    atoms = cs.atoms_of(vectors)
    assert torch.equal(atoms, torch.stack([a, b, 2.0 * c]))
    assert torch.equal(cs.atoms_of(vectors[:2]), vectors[:2])


def test_one_hot_differences():
    d = cs.one_hot_differences(4, torch.float64)
    assert d.shape == (6, 4) and torch.equal(d.sum(dim=1), torch.zeros(6, dtype=torch.float64))
    assert torch.equal(d[0], torch.tensor([1.0, -1.0, 0.0, 0.0], dtype=torch.float64))


def test_short_runs_explain_away_a_sample_that_is_alone_on_three_rows():
    _problem, columns, _patterns, _inputs, _, _ = lt_case()
    # two samples whose patterns overlap so that one is alone on exactly 3 of the rows
    m = columns.shape[0]
    found, other = columns[:, 0].clone(), columns[:, 1].clone()
    alone = (found != 0) & (other == 0)
    keep = alone.nonzero()[:, 0][3:]
    found_cut = found.clone()
    other_cut = other.clone()
    other_cut[keep] = 1.0 + torch.rand(keep.numel(), dtype=torch.float64)  # the other active there too
    feature = (0.7 * found_cut + 0.4 * other_cut)[None]
    unit = (found_cut / found_cut.abs().max())[None]
    assert int(((found_cut != 0) & (other_cut == 0)).sum()) == 3 and m == 400
    assert torch.equal(explain_away(feature, unit, zero_rtol=1e-9), feature)  # a run of 8: none
    rest = explain_away(feature, unit, zero_rtol=1e-9, min_run=3)[0]
    assert torch.allclose(rest, 0.4 * other_cut, rtol=0, atol=1e-12)


def test_the_proposer_splits_pixel_columns_first_and_pins_only_true_columns(monkeypatch):
    from spear.core.proposers import masked_subspace

    problem, columns, _patterns, _, _, _ = lt_case()
    monkeypatch.setattr(masked_subspace, "SPLIT_ABOVE_BATCH", 95)  # b = 96 here, for a test's time
    ctx = context(problem)
    proposer = MaskedSubspaceProposer()
    batch = proposer.propose(ctx, 10_000)
    assert batch.n_drawn == 16  # a call splits up to 16 columns, a proposal each
    pinned = batch.pinned @ problem.L.T  # the columns L q
    assert pinned.shape[0] >= 8
    unit = columns / columns.norm(dim=0, keepdim=True)
    cosine = (pinned / pinned.norm(dim=1, keepdim=True)) @ unit
    assert bool((cosine.abs().amax(dim=1) > 1 - 1e-9).all())


def test_batches_up_to_256_get_no_splits():
    problem, *_ = lt_case()
    proposer = MaskedSubspaceProposer()
    proposer.propose(context(problem), 10_000)  # b = 96: the pattern search's pass, no splits
    assert proposer.splitter is None and proposer.split_queue.numel() == 0
