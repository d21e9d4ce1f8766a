"""Issue: large batches. Each proposer behind the one interface; mixtures never get accepted."""

import pytest
import torch

import spear
from spear.core.filtering import snap_and_filter, zero_mask
from spear.core.lowrank import low_rank_split
from spear.core.proposers import (
    AutoProposer,
    DirectionProposer,
    GuidedSampler,
    NeuronGuidedSampler,
    NextLayerProposer,
    ProposalBatch,
    ProposalContext,
    RandomSubmatrixSampler,
    SparseRecoveryProposer,
)
from spear.core.proposers.sparse_recovery import irls_sphere
from spear.core.scale import LayerProblem
from spear.theory import sparsity_threshold_count
from tests.conftest import assert_exact, make_client


def fresh_context(problem, seed):
    """A proposal context with nothing found yet (p_fr = 1e-5)."""
    b = problem.batch_size
    return ProposalContext(
        L=problem.L,
        batch_size=b,
        threshold_count=sparsity_threshold_count(problem.L.shape[0], 1e-5),
        generator=torch.Generator().manual_seed(seed),
        proposal_dtype=torch.float32,
        found=torch.empty(0, b, dtype=torch.float64),
        problem=problem,
    )


def setup(b, width, seed, depth=3):
    client = make_client(b, width=width, depth=depth, seed=seed)
    W, bias, GW, Gb = (t.detach() for t in client.layer_args())
    split = low_rank_split(GW)
    problem = LayerProblem(W, bias, Gb, split.L, split.R)
    Qt = torch.linalg.lstsq(split.L, client.grad_z).solution
    Qt = Qt / Qt.norm(dim=0)
    ctx = fresh_context(problem, seed)
    return client, split, Qt, ctx


def accepted_are_true(snapped, Qt):
    """Every candidate trusted for guidance (robust) is a true direction; a wrong one may only
    enter the pool flagged non-robust, for the greedy selection to reject."""
    trusted = snapped.directions[snapped.robust]
    if trusted.shape[0] == 0:
        return True
    return bool(((trusted @ Qt).abs().amax(dim=1) > 1 - 1e-9).all())


def test_polynomial_proposers_recover_b48_exactly():
    # IRLS + complement-guided sampling only (random sampling switched off): polynomial time
    client = make_client(48, width=400, depth=3, seed=0)
    polynomial = AutoProposer(sampling_every=10**9)
    # bounded by proposals, never by wall-clock (it needs ~55k here)
    rec = spear.reconstruct(*client.layer_args(), proposer=polynomial, max_proposals=300_000)
    assert rec.verified, rec.message
    assert rec.batch_size == 48 and rec.sigma == 1.0
    assert_exact(rec.inputs, client.inputs, 1e-6)


def test_auto_is_default_and_recovers_b24():
    client = make_client(24, width=240, depth=3, seed=1)
    rec = spear.reconstruct(*client.layer_args(), max_proposals=100_000)
    assert rec.verified and rec.stats.proposer == "auto"
    assert_exact(rec.inputs, client.inputs, 1e-6)


def test_proposers_selectable_by_name():
    client = make_client(6, width=100, seed=2)
    for name in ("sampling", "irls", "auto"):
        rec = spear.reconstruct(*client.layer_args(), proposer=name, max_proposals=100_000)
        assert rec.verified and rec.stats.proposer == name
        assert_exact(rec.inputs, client.inputs)


def test_essential_row_flags_a_mixture_that_passes_the_count():
    _, split, Qt, _ = setup(12, 200, 3)
    L = split.L
    mixture = Qt[:, 0] + Qt[:, 1]
    common = zero_mask((L @ mixture)[None], 1e-9)[0]  # rows where both columns vanish
    extra = int((~common).nonzero()[0])  # one more row makes the kernel one-dimensional
    hint = common.clone()
    hint[extra] = True
    low_threshold = int(common.sum()) // 2  # so that the zero count alone would accept it
    out = snap_and_filter(L, mixture[None], hint[None], low_threshold, 1e-9)
    assert out.directions.shape[0] == 1 and not bool(out.robust[0])  # exact kernel, never trusted
    assert float((out.directions[0] @ Qt).abs().max()) < 0.999
    truth = snap_and_filter(L, Qt[:, 0][None], zero_mask((L @ Qt[:, 0])[None], 1e-9), low_threshold, 1e-9)
    assert truth.directions.shape[0] == 1 and bool(truth.robust[0]) and accepted_are_true(truth, Qt)
    # the pool keeps both, but only the true one is trusted for deflation and guidance
    from spear.core.filtering import CandidatePool

    pool = CandidatePool(12, 200)
    pool.add(out)
    pool.add(truth)
    assert len(pool) == 2 and pool.trusted.shape[0] == 1
    assert float((pool.trusted[0] @ Qt[:, 0]).abs()) > 1 - 1e-12


def test_sampler_fed_mixture_rows_is_rejected():
    b = 10
    _, split, Qt, ctx = setup(b, 200, 4)
    zero_cols = zero_mask((split.L @ Qt).T, 1e-9)  # (b, m)
    common = (zero_cols[0] & zero_cols[1]).nonzero()[:, 0]
    others = (~zero_cols[0] & ~zero_cols[1]).nonzero()[:, 0]
    assert common.numel() >= b - 2
    # (b-1)-row sets whose kernel is a mixture of columns 0 and 1
    rows = torch.stack(
        [torch.cat([common[torch.randperm(common.numel())[: b - 2]], others[i : i + 1]]) for i in range(20)]
    )
    hint = torch.zeros(20, 200, dtype=torch.bool)
    hint.scatter_(1, rows, True)
    out = snap_and_filter(split.L, torch.zeros(20, b, dtype=torch.float64), hint, ctx.threshold_count, 1e-9)
    assert accepted_are_true(out, Qt)  # no mixture is trusted (most are rejected by the count)
    # and the sampler's own proposals only ever yield true directions
    batch = RandomSubmatrixSampler(4096).propose(ctx, 4096)
    snapped = snap_and_filter(split.L, batch.directions, batch.zero_hint, ctx.threshold_count, 1e-9)
    assert snapped.directions.shape[0] > 0 and accepted_are_true(snapped, Qt)


def test_irls_started_from_a_mixture_yields_only_true_directions():
    b = 16
    _, split, Qt, ctx = setup(b, 200, 5)
    proposer = SparseRecoveryProposer(starts_per_call=8, ica_restarts=0)
    proposer._prepare(ctx)
    U, T = proposer.U, proposer.T
    mixture = (T @ (Qt[:, 2] + 0.7 * Qt[:, 3]))[None]
    proposer._queue = [mixture.repeat(8, 1) + 0.01 * torch.randn(8, b, dtype=torch.float64)]
    batch = proposer.propose(ctx, 10_000)
    snapped = snap_and_filter(split.L, batch.directions, batch.zero_hint, ctx.threshold_count, 1e-9)
    assert accepted_are_true(snapped, Qt)
    # IRLS itself moves a rough start onto a true direction
    start = T @ (Qt[:, 4] + 0.3 * Qt[:, 5])
    p = irls_sphere(U, start[None], 80)
    q = torch.linalg.solve_triangular(T, p.T, upper=True).T
    assert float((q / q.norm() @ Qt).abs().max()) > 0.999999


def test_guided_with_a_mixed_approximate_input_yields_only_true_directions():
    b = 16
    client, split, Qt, ctx = setup(b, 200, 6)
    blend = (client.inputs[0] + client.inputs[1]) / 2
    guided = GuidedSampler(
        approximate_inputs=torch.stack([blend, client.inputs[2] + 0.05]), guesses_per_call=64
    )
    batch = guided.propose(ctx, 10_000)
    snapped = snap_and_filter(split.L, batch.directions, batch.zero_hint, ctx.threshold_count, 1e-9)
    assert accepted_are_true(snapped, Qt)
    assert snapped.directions.shape[0] > 0  # the near-copy of input 2 guides to its column


def test_complement_guided_finds_the_missing_columns():
    b = 20
    _, split, Qt, ctx = setup(b, 200, 7)
    missing = [3, 11, 17]
    keep = [i for i in range(b) if i not in missing]
    ctx.found = Qt[:, keep].T.contiguous()
    hits = set()
    guided = GuidedSampler()
    for _ in range(10):
        batch = guided.propose(ctx, 10_000)
        snapped = snap_and_filter(split.L, batch.directions, batch.zero_hint, ctx.threshold_count, 1e-9)
        assert accepted_are_true(snapped, Qt)
        if snapped.directions.shape[0]:
            hits |= set((snapped.directions @ Qt).abs().argmax(dim=1).tolist())
        if set(missing) <= hits:
            break
    assert set(missing) <= hits


def test_guided_needs_output_problem():
    *_, ctx = setup(6, 80, 8)
    ctx.problem = None
    with pytest.raises(spear.InputError, match="guided sampling"):
        GuidedSampler().propose(ctx, 100)


def test_neuron_virtual_samples_are_affine_combinations_of_the_batch():
    # Section 6.3 guidance from the gradient itself: (dL/dW)_i / (dL/db)_i is the combination of
    # the inputs that activate neuron i, with weights (dL/dZ)_ij / (dL/db)_i
    b = 12
    client, _, _, ctx = setup(b, 200, 9)
    W, bias = ctx.problem.weight, ctx.problem.bias
    Z_true = client.inputs @ W.T + bias  # (b, m)
    dZ = client.grad_z  # (m, b)
    live = dZ.sum(dim=1).abs() > 1e-6 * dZ.sum(dim=1).abs().max()
    neurons = live.nonzero()[:, 0][:40]
    virtual = NeuronGuidedSampler().virtual_preactivations(ctx, neurons, 1.0)
    weights = dZ[neurons] / dZ[neurons].sum(dim=1, keepdim=True)
    torch.testing.assert_close(virtual, weights @ Z_true, rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("repeated", [False, True])
def test_neuron_deflation_isolates_the_missing_sample(repeated):
    # with all directions but one known, every deflated virtual sample IS the missing input;
    # also when found directions repeat (float32 copies can both be trusted; one negated),
    # which made the deflation's Gram matrix singular and torch raise from the proposer
    # (Fashion-MNIST CNN head, float32, trained)
    b = 12
    client, split, Qt, ctx = setup(b, 200, 10)
    missing = 5
    found = Qt[:, [i for i in range(b) if i != missing]].T
    if repeated:
        found = torch.cat([found, found[:1], -found[3:4]])
    ctx.found = found.contiguous()
    # the complement of b-1 found directions is the line through p_missing, and p . s = 1 fixes
    # the point on it: every neuron's deflated virtual sample is exactly the missing input
    neurons = torch.arange(60)
    virtual = NeuronGuidedSampler().virtual_preactivations(ctx, neurons, 1.0)
    assert virtual.shape[0] > 50
    Z_missing = client.inputs[missing] @ ctx.problem.weight.T + ctx.problem.bias
    torch.testing.assert_close(virtual, Z_missing.expand_as(virtual), rtol=1e-6, atol=1e-6)
    batch = NeuronGuidedSampler(neurons_per_call=30).propose(ctx, 10_000)
    snapped = snap_and_filter(split.L, batch.directions, batch.zero_hint, ctx.threshold_count, 1e-9)
    assert accepted_are_true(snapped, Qt)
    assert float((snapped.directions @ Qt[:, missing]).abs().max()) > 1 - 1e-9


def test_neuron_guided_with_a_wrong_found_direction_yields_only_true_directions():
    b = 16
    _, split, Qt, ctx = setup(b, 200, 11)
    mixture = Qt[:, 0] + Qt[:, 1]
    ctx.found = torch.stack([mixture / mixture.norm(), Qt[:, 2], Qt[:, 3]])  # deflation is misled
    proposer = NeuronGuidedSampler()
    for _ in range(2):
        batch = proposer.propose(ctx, 10_000)
        snapped = snap_and_filter(split.L, batch.directions, batch.zero_hint, ctx.threshold_count, 1e-9)
        assert accepted_are_true(snapped, Qt)


def test_neuron_guided_alone_recovers_b64_of_mnist_exactly():
    # real images: many neurons fire for few samples, so the virtual samples are informative
    # (on i.i.d. synthetic inputs they are not, and auto falls back to IRLS: the b=48 test above)
    from spear.data import load_dataset
    from spear.fl import fully_connected, simulate_fedsgd

    dataset = load_dataset("mnist")
    model = fully_connected(dataset.features, 640, 3, dataset.classes, seed=0)
    view, truth = simulate_fedsgd(model, dataset, 64, seed=0)
    rec = spear.attack_layer(
        view.model, "0", view.gradients, proposer="neurons", max_proposals=50_000, peel=False
    )  # the proposer alone, without peeling's residual problems
    assert rec.verified and rec.stats.proposer == "neurons", rec.message
    assert_exact(rec.inputs, truth.inputs, 1e-6)


def test_neuron_guided_needs_output_problem():
    *_, ctx = setup(6, 80, 8)
    ctx.problem = None
    with pytest.raises(spear.InputError, match="neuron-guided"):
        NeuronGuidedSampler().propose(ctx, 100)


def _mnist_problem(b, width, seed):
    """A depth-3 MNIST client's first layer, with the next layer's weight gradient."""
    from spear.data import load_dataset
    from spear.fl import fully_connected, simulate_fedsgd

    dataset = load_dataset("mnist")
    model = fully_connected(dataset.features, width, 3, dataset.classes, seed=seed)
    view, truth = simulate_fedsgd(model, dataset, b, seed=seed)
    g = view.gradients
    split = low_rank_split(g["0.weight"])
    layer = view.model[0]
    problem = LayerProblem(
        layer.weight.detach(), layer.bias.detach(), g["0.bias"], split.L, split.R, "output", g["2.weight"]
    )
    Z = layer(truth.inputs)
    loss = torch.nn.functional.cross_entropy(view.model[1:](Z), truth.labels)
    (dZ,) = torch.autograd.grad(loss, Z)
    Qt = torch.linalg.lstsq(split.L, dZ.T).solution
    Z = Z.detach()
    ctx = fresh_context(problem, seed)
    return view, truth, split, Z, ctx, Qt / Qt.norm(dim=0)


def test_next_layer_zero_sets_are_intersections_of_inactive_sets():
    # a zero of (dL/dW')_k at r means: every sample reaching neuron k leaves neuron r inactive
    b = 32
    *_, Z, ctx, _ = _mnist_problem(b, 320, 13)
    proposer = NextLayerProposer()
    proposer.propose(ctx, 10_000)
    assert len(proposer.zero_sets) > 5
    inactive = Z <= 0  # (b, m), ground truth
    for mask, K in proposer.zero_sets:
        samples = inactive[:, mask].all(dim=1)  # the samples whose columns vanish on the set
        assert int(samples.sum()) == K.shape[1]  # the kernel is exactly their span


def test_next_layer_directions_are_exact_columns():
    b = 48
    _, _, split, _, ctx, Qt = _mnist_problem(b, 480, 14)
    batch = NextLayerProposer().propose(ctx, 10_000)
    cos = (batch.directions @ Qt).abs().amax(dim=1)
    # nearly all proposals are already exact columns (solved in the small subspaces)
    assert int((cos > 1 - 1e-9).sum()) >= 0.85 * batch.directions.shape[0] > 0
    snapped = snap_and_filter(split.L, batch.directions, batch.zero_hint, ctx.threshold_count, 1e-9)
    assert accepted_are_true(snapped, Qt)
    hits = set((snapped.directions @ Qt).abs().argmax(dim=1).tolist())
    assert len(hits) >= 10  # distinct columns from one call


def test_next_layer_with_a_mixture_subspace_yields_only_true_directions():
    # feed it a wrong "zero set": the common zeros of two columns minus a few rows, whose kernel
    # holds mixtures; only exact columns may come out
    b = 16
    _, split, Qt, ctx = setup(b, 200, 15)
    zeros = zero_mask((split.L @ Qt).T, 1e-9)
    common = zeros[0] & zeros[1]
    proposer = NextLayerProposer()
    proposer._key = ctx.key
    _, sv, Vh = torch.linalg.svd(split.L[common], full_matrices=True)
    rank = int((sv > 1e-9 * sv[0]).sum())
    proposer._sets = [(common, Vh[rank:].T.contiguous())]
    batch = proposer.propose(ctx, 10_000)
    snapped = snap_and_filter(split.L, batch.directions, batch.zero_hint, ctx.threshold_count, 1e-9)
    assert accepted_are_true(snapped, Qt)


def test_next_layer_proposes_columns_not_their_mixtures_when_the_threshold_is_low():
    # after the search lowers its threshold (a trained layer's sparse columns), the threshold no
    # longer keeps a mixture of a subspace's columns out; its zeros are those its columns share
    # plus the g - 1 rows solved for, so the columns' zero sets, which contain them, are maximal
    *_, ctx, Qt = _mnist_problem(48, 480, 14)
    ctx.threshold_count = 0
    batch = NextLayerProposer().propose(ctx, 10_000)
    overlap = (batch.directions @ Qt).abs()
    exact = overlap.amax(dim=1) > 1 - 1e-9
    assert len(set(overlap[exact].argmax(dim=1).tolist())) >= 40  # the columns all still come out
    assert int((~exact).sum()) <= 0.2 * batch.directions.shape[0]  # without mixtures: 486 of 584 were


def test_maximal_zero_signatures_drop_mixtures_with_the_rows_solved_for():
    from spear.core.proposers.next_layer import _maximal

    column_a = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0, 0, 0], dtype=torch.bool)
    column_b = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 0, 0], dtype=torch.bool)
    mixture = column_a & column_b  # row 3: both inactive
    mixture[9] = True  # and the one row solved for (g = 2), where neither is zero
    beyond = torch.zeros(10, dtype=torch.bool)
    beyond[[1, 8, 9]] = True  # two rows outside a's zeros: more than g - 1
    signatures = torch.stack([mixture, column_a, column_b, beyond])
    assert _maximal(signatures, slack=1).tolist() == [1, 2, 3]
    assert _maximal(signatures, slack=2).tolist() == [1, 2]  # within a's zeros up to the slack


def test_maximal_zero_signatures_match_the_one_by_one_reference_across_blocks():
    # the blocks of MAXIMAL_BLOCK signatures must decide as taking them one by one, sparsest
    # first, each against those kept: mixtures (shared zeros of 1-2 of 10 columns, plus a few
    # rows solved for) over three blocks
    from spear.core.proposers.next_layer import MAXIMAL_BLOCK, _maximal

    def reference(signatures, slack):
        sizes = signatures.sum(dim=1)
        kept = []
        for i in sizes.argsort(descending=True, stable=True).tolist():
            shared = [int((signatures[j] & signatures[i]).sum()) for j in kept]
            pairs = zip(shared, kept, strict=True)
            sparser = [n >= sizes[i] - slack and sizes[j] > sizes[i] for n, j in pairs]
            if not any(sparser):
                kept.append(i)
        return sorted(kept)

    g = torch.Generator().manual_seed(3)
    columns = torch.rand(10, 60, generator=g) < 0.6
    pairs = torch.randint(0, 10, (2 * MAXIMAL_BLOCK + 100, 2), generator=g)
    single = torch.rand(pairs.shape[0], 1, generator=g) < 0.3
    signatures = columns[pairs[:, 0]] & (columns[pairs[:, 1]] | single)
    signatures |= torch.rand(signatures.shape, generator=g) < 0.04
    for slack in (0, 2, 5):
        assert _maximal(signatures, slack).tolist() == reference(signatures, slack)


def test_informative_rows_skip_rows_every_column_leaves_at_zero_whatever_the_columns_scales():
    # a float32 residual gradient misses zeros of the next layer: rows where every sample
    # behind a set is inactive stay outside the set; they vanish for every direction of the
    # subspace. A faint sample's rows are small beside a loud one's but must stay
    from spear.core.proposers.next_layer import _informative_rows

    g = torch.Generator().manual_seed(0)
    C = torch.randn(60, 3, generator=g, dtype=torch.float64)
    C[:20, 0] = 0  # rows 0-19: only samples 1, 2 active
    C[20:40, 1:] = 0  # rows 20-39: only sample 0, the faint one
    C[40:50] = 0  # rows 40-49: nobody active (flat)
    C[:, 0] *= 1e-6
    noise = 1e-12 * torch.randn(60, 3, generator=g, dtype=torch.float64)
    M = (C + noise) @ torch.randn(3, 3, generator=g, dtype=torch.float64)  # any basis of the span
    candidates = torch.ones(60, dtype=torch.bool)
    candidates[50:] = False  # the zero set
    rows, flat = _informative_rows(M, candidates, 1e-4)
    assert flat == 10
    assert rows.tolist() == list(range(40))


def test_attack_layer_passes_the_next_layer_gradient():
    view, *_ = _mnist_problem(24, 240, 16)
    rec = spear.attack_layer(view.model, "0", view.gradients, proposer="next_layer", max_proposals=1)
    assert rec.stats.proposer == "next_layer"  # no error: the gradient of layer "2" was found
    with pytest.raises(spear.InputError, match="next linear layer"):
        spear.reconstruct(
            view.model[0].weight, view.model[0].bias, view.gradients["0.weight"],
            view.gradients["0.bias"], proposer="next_layer", max_proposals=10,
        )  # fmt: skip
    with pytest.raises(spear.InputError, match="next_grad_weight must be"):
        spear.reconstruct(
            view.model[0].weight, view.model[0].bias, view.gradients["0.weight"],
            view.gradients["0.bias"], next_grad_weight=view.gradients["0.weight"],
        )  # fmt: skip


def test_next_layer_gradient_only_through_relu():
    from spear.api import _next_linear

    relu = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    grads = {"2.weight": torch.ones(3, 6)}
    layer, grad = _next_linear(relu, "0", relu[0], grads)
    assert layer is relu[2] and grad is grads["2.weight"]
    sigmoid = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Sigmoid(), torch.nn.Linear(6, 3))
    assert _next_linear(sigmoid, "0", sigmoid[0], grads) is None
    assert _next_linear(relu, "2", relu[2], grads) is None  # the last layer has none


class _Stub(DirectionProposer):
    """A proposer with a fixed cost that records its calls and may 'find' directions."""

    def __init__(self, name, work, finds=0):
        self.name, self.work, self.finds, self.calls = name, work, finds, 0

    def cost(self, ctx):
        return self.work

    def propose(self, ctx, max_proposals):
        self.calls += 1
        if self.finds:
            self.finds -= 1
            ctx.found = torch.cat([ctx.found, torch.zeros(1, ctx.batch_size, dtype=ctx.found.dtype)])
        return ProposalBatch(torch.empty(0, ctx.batch_size), n_drawn=1)


def test_auto_shares_compute_among_stalled_proposers_and_keeps_a_finder(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr("spear.core.proposers.auto.CALL_OVERHEAD", 0.0)  # the stubs' costs only

    b = 64  # random sampling hopeless: no sampler turns
    ctx = ProposalContext(
        L=torch.zeros(640, b, dtype=torch.float64),
        batch_size=b,
        threshold_count=300,
        generator=torch.Generator().manual_seed(0),
        proposal_dtype=torch.float32,
        found=torch.empty(0, b, dtype=torch.float64),
        problem=SimpleNamespace(mode="output", next_grad_weight=None),
    )
    auto = AutoProposer()
    auto.neurons, auto.guided, auto.recovery = _Stub("n", 1.0, finds=5), _Stub("g", 10.0), _Stub("r", 100.0)
    for _ in range(5 + 100 + 10 + 1):
        auto.propose(ctx, 10**6)
    # the finder kept the turn for its 5 finds, then each stalled proposer spent ~100 units
    assert auto.neurons.calls == 5 + 100 and auto.guided.calls == 10 and auto.recovery.calls == 1
    for _ in range(100 + 10 + 1):
        auto.propose(ctx, 10**6)
    assert auto.neurons.calls == 205 and auto.guided.calls == 20 and auto.recovery.calls == 2


def test_auto_uses_complement_guided_sampling_for_small_batches():
    # below 15 samples auto samples at random, and every 4th call, once a direction is known,
    # complement-guided sampling finds the least sparse columns
    client = make_client(12, width=200, depth=3, seed=21)
    auto = AutoProposer()
    calls = []
    original = auto.guided.propose

    def counted(ctx, max_proposals):
        calls.append(max_proposals)
        return original(ctx, max_proposals)

    auto.guided.propose = counted
    spear.reconstruct(*client.layer_args(), proposer=auto, early_stop=False, max_proposals=60_000)
    assert len(calls) >= 2


def test_next_layer_reports_the_columns_it_drops_for_the_threshold_alone():
    # the proposer filters its own directions by the sparsity threshold before snapping sees
    # them; what it dropped for the threshold alone (true columns, sparser than chance) must
    # reach the attack, or its probe never learns that the columns are below the threshold
    b = 48
    _, _, split, _, ctx, Qt = _mnist_problem(b, 480, 14)
    zeros = zero_mask((split.L @ Qt).T, 1e-9).sum(dim=1)  # the true columns' zero counts
    usual = NextLayerProposer().propose(ctx, 10_000)
    assert usual.below_threshold == 0  # untrained: every column it finds is above the threshold
    ctx.threshold_count = int(zeros.max()) + 1  # above every true column
    strict = NextLayerProposer().propose(ctx, 10_000)
    assert strict.below_threshold in set(zeros.tolist())  # a true column's count, no mixture's
    assert strict.directions.shape[0] < usual.directions.shape[0]


def test_columns_below_the_threshold_that_the_next_layer_drops_call_the_probe():
    # a threshold near m/2 (p_fr = 0.45): most columns of a wide layer fall below it, as a
    # trained m = 4000 layer's do at the default p_fr (54% active: 1729-1939 zeros of 3980,
    # threshold 1856; 3 to 6 of 32 samples after 60 s before the proposer reported its drops)
    from spear.data import load_dataset
    from spear.fl import fully_connected, simulate_fedsgd

    dataset = load_dataset("mnist")
    model = fully_connected(dataset.features, 2000, 6, dataset.classes, seed=0)
    view, truth = simulate_fedsgd(model, dataset, 32, seed=0)
    rec = spear.attack_layer(view.model, "0", view.gradients, seed=0, p_fr=0.45, max_proposals=30_000)
    assert rec.verified, rec.message  # 10,449 proposals; 59,825 without the report
    assert any("threshold was lowered" in note for note in rec.notes)
    assert_exact(rec.inputs, truth.inputs, 1e-6)
