"""Unit tests of the core stages against the true dL/dZ of clients built here."""

import pytest
import torch
from tests.conftest import assert_exact, make_client

from spear.core.filtering import CandidatePool, snap_and_filter, zero_mask
from spear.core.greedy import greedy_filter, score, sparsest_basis
from spear.core.lowrank import low_rank_split
from spear.core.proposers import ProposalContext, RandomSubmatrixSampler
from spear.core.proposers.sampling import sample_row_subsets
from spear.core.scale import LayerProblem
from spear.core.verify import verify
from spear.errors import RankError


def true_directions(client, split):
    """Unit columns of the true disaggregation matrix Q = L^+ dL/dZ (evaluation only)."""
    Q = torch.linalg.lstsq(split.L, client.grad_z).solution
    return Q / Q.norm(dim=0), Q


@pytest.mark.parametrize("b", [1, 3, 7, 15])
def test_rank_is_batch_size(b):
    client = make_client(b, width=100, seed=b)
    split = low_rank_split(client.grads["0.weight"])
    assert split.batch_size == b
    assert torch.allclose(split.L @ split.R, client.grads["0.weight"], atol=1e-12)


def test_full_rank_gradient_raises():
    client = make_client(12, n=10, width=50)
    with pytest.raises(RankError, match="batch size < 10"):
        low_rank_split(client.grads["0.weight"])


def test_row_subsets_are_distinct_and_in_range():
    g = torch.Generator().manual_seed(0)
    for rows, k in [(200, 19), (30, 25)]:  # rejection path and top-k path
        idx = sample_row_subsets(rows, k, 500, g)
        assert idx.shape[1] == k and idx.shape[0] > 50
        assert int(idx.min()) >= 0 and int(idx.max()) < rows
        assert all(len(set(r.tolist())) == k for r in idx)


def test_row_subsets_are_uniform():
    g = torch.Generator().manual_seed(1)
    idx = sample_row_subsets(10, 3, 60000, g)
    counts = torch.bincount(idx.reshape(-1), minlength=10).double()
    assert torch.allclose(counts / counts.sum(), torch.full((10,), 0.1, dtype=torch.float64), atol=0.005)


def test_snap_accepts_true_and_rejects_mixture():
    client = make_client(10, width=200, seed=3)
    split = low_rank_split(client.grads["0.weight"])
    Qt, _ = true_directions(client, split)
    mixture = (Qt[:, 0] + Qt[:, 1]) / 2
    noisy_true = Qt[:, 2] + 1e-4 * torch.randn(
        10, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )
    rough = torch.stack([Qt[:, 0], mixture, noisy_true])
    # hint: the exact zeros of the mixture are the rows where both columns vanish
    hint = torch.stack(
        [zero_mask((split.L @ q)[None], 1e-9)[0] for q in rough[:2]] + [client.grad_z[:, 2] == 0]
    )
    assert int(hint[1].sum()) >= 9  # the mixture does vanish on the shared zero rows
    out = snap_and_filter(split.L, rough, hint, threshold_count=70, zero_rtol=1e-9)
    assert out.directions.shape[0] == 2  # the true one and the snapped noisy one; never the mixture
    cos = (out.directions @ Qt).abs()
    assert torch.allclose(cos.max(dim=1).values, torch.ones(2, dtype=torch.float64), atol=1e-12)
    assert set(cos.argmax(dim=1).tolist()) == {0, 2}


def test_mixture_without_hint_is_rejected():
    client = make_client(10, width=200, seed=4)
    split = low_rank_split(client.grads["0.weight"])
    Qt, _ = true_directions(client, split)
    mixture = (0.6 * Qt[:, 3] - 0.8 * Qt[:, 5])[None]
    out = snap_and_filter(split.L, mixture, None, threshold_count=70, zero_rtol=1e-9)
    assert out.directions.shape[0] == 0


def test_pool_deduplicates_up_to_sign():
    pool = CandidatePool(batch_size=3, rows=5)
    d = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    masks = torch.zeros(2, 5, dtype=torch.bool)
    from spear.core.filtering import SnapResult

    assert pool.add(SnapResult(d, masks, torch.tensor([3, 2]))) == 2
    assert pool.add(SnapResult(-d[:1], masks[:1], torch.tensor([3]))) == 0
    assert len(pool) == 2


def test_sigma_is_one_for_truth_and_lower_for_a_wrong_column():
    client = make_client(8, width=200, seed=5)
    W, bias, GW, Gb = client.layer_args()
    split = low_rank_split(GW)
    problem = LayerProblem(W.detach(), bias.detach(), Gb, split.L, split.R)
    Qt, _ = true_directions(client, split)
    masks = zero_mask((split.L @ Qt).T, 1e-9)
    sigma, valid, c, consistent = score(problem, Qt[None], masks[None])
    assert bool(valid[0]) and float(sigma[0]) == 1.0 and int(consistent[0]) == 8
    wrong = Qt.clone()
    wrong[:, 0] = (Qt[:, 0] + Qt[:, 1]) / 2**0.5
    wmasks = zero_mask((split.L @ wrong).T, 1e-9)
    sigma_w, *_ = score(problem, wrong[None], wmasks[None])
    assert float(sigma_w[0]) < 0.99
    # Theorem 3.6: the recovered scales rebuild the true (scaled) inputs
    inputs, grad_out = problem.assemble(Qt, c[0])
    assert_exact(inputs, client.inputs, 1e-8)
    assert_exact(grad_out.T, client.grad_z.T, 1e-8)


def test_verification_rejects_wrong_selection_and_accepts_truth():
    client = make_client(6, width=120, seed=6)
    W, bias, GW, Gb = (t.detach() for t in client.layer_args())
    split = low_rank_split(GW)
    problem = LayerProblem(W, bias, Gb, split.L, split.R)
    Qt, _ = true_directions(client, split)
    ok = verify(W, bias, GW, Gb, client.inputs, client.grad_z, "output", 1e-8)
    assert ok.verified and ok.residual < 1e-12
    wrong = Qt.clone()
    wrong[:, 2] = (Qt[:, 2] - 0.5 * Qt[:, 4]) / torch.linalg.norm(Qt[:, 2] - 0.5 * Qt[:, 4])
    c, _valid = problem.scales(wrong[None])
    inputs, grad_out = problem.assemble(wrong, c[0])
    # the plain gradients are reproduced by any invertible Q ...
    assert torch.allclose(grad_out @ inputs, GW, atol=1e-10)
    # ... but not through the ReLU
    bad = verify(W, bias, GW, Gb, inputs, grad_out, "output", 1e-8)
    assert not bad.verified and bad.residual > 1e-4


def test_greedy_stage_two_fixes_a_wrong_stage_one_choice():
    client = make_client(8, width=200, seed=7)
    W, bias, GW, Gb = (t.detach() for t in client.layer_args())
    split = low_rank_split(GW)
    problem = LayerProblem(W, bias, Gb, split.L, split.R)
    Qt, _ = true_directions(client, split)
    # a very sparse impostor: stage 1 picks it first, stage 2 must swap it out
    impostor = (Qt[:, 0] + Qt[:, 1]) / torch.linalg.norm(Qt[:, 0] + Qt[:, 1])
    directions = torch.cat([impostor[None], Qt.T])
    masks = zero_mask(directions @ split.L.T, 1e-9)
    counts = torch.tensor([10_000] + [int(x) for x in masks[1:].sum(1)])
    assert sparsest_basis(directions, counts, 8)[0] == 0
    sel = greedy_filter(problem, directions, masks, counts)
    assert sel is not None and sel.sigma == 1.0 and 0 not in sel.indices


def test_sampler_hits_true_directions():
    client = make_client(6, width=150, seed=8)
    split = low_rank_split(client.grads["0.weight"])
    Qt, _ = true_directions(client, split)
    ctx = ProposalContext(
        L=split.L,
        batch_size=6,
        threshold_count=50,
        generator=torch.Generator().manual_seed(0),
        proposal_dtype=torch.float32,
        found=torch.empty(0, 6, dtype=torch.float64),
    )
    batch = RandomSubmatrixSampler(chunk_size=2000).propose(ctx, 2000)
    assert 0 < batch.n_drawn <= 2000
    snapped = snap_and_filter(split.L, batch.directions, batch.zero_hint, 50, 1e-9)
    hits = (snapped.directions @ Qt).abs().max(dim=1).values
    assert snapped.directions.shape[0] > 0 and bool((hits > 1 - 1e-10).all())


def test_score_handles_singular_sets():
    client = make_client(5, width=80, seed=9)
    W, bias, GW, Gb = (t.detach() for t in client.layer_args())
    split = low_rank_split(GW)
    problem = LayerProblem(W, bias, Gb, split.L, split.R)
    Qt, _ = true_directions(client, split)
    singular = Qt.clone()
    singular[:, 1] = singular[:, 0]  # a repeated direction
    batch = torch.stack([Qt, singular])
    masks = zero_mask((split.L @ batch).transpose(1, 2), 1e-9)
    sigma, valid, _, _ = score(problem, batch, masks)
    assert valid.tolist() == [True, False]
    assert float(sigma[0]) == 1.0 and float(sigma[1]) == -1.0


def test_pool_bounds_untrusted_candidates_keeping_the_sparsest():
    pool = CandidatePool(batch_size=2, rows=6, untrusted_limit=2)
    from spear.core.filtering import SnapResult

    dirs = torch.stack(
        [
            torch.tensor([1.0, 0.0]),
            torch.tensor([0.6, 0.8]),
            torch.tensor([0.0, 1.0]),
            torch.tensor([0.8, 0.6]),
            torch.tensor([-0.6, 0.8]),
        ]
    ).double()
    counts = torch.tensor([5, 2, 4, 3, 1])
    robust = torch.tensor([True, False, False, False, False])
    pool.add(SnapResult(dirs, torch.zeros(5, 6, dtype=torch.bool), counts, robust))
    assert len(pool) == 3 and pool.trusted.shape[0] == 1
    assert sorted(pool.zero_counts.tolist()) == [3, 4, 5]  # the two sparsest untrusted survive
