"""spear.core.linalg: batched LU solves that survive torch's multi-threaded batched-LU bug."""

import subprocess
import sys

import pytest
import torch

import spear.core.linalg as linalg
from spear.core.linalg import solve_ex


def _shapes(n: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(A, B) shapes covering torch's reading of B: batches of vectors, of matrices, broadcast."""
    return [
        ((3, n, n), (3, n)),  # a batch of vectors
        ((3, n, n), (3, n, 4)),  # a batch of matrices
        ((3, n, n), (n, 2)),  # one matrix, broadcast over the batch
        ((3, n, n), (n,)),  # one vector, broadcast
        ((2, 3, n, n), (3, n, 1)),  # two batch dimensions, broadcast
        ((3, n, n), (2, 3, n, 1)),  # B adds a batch dimension: each matrix solves two systems
        ((1, n, n), (4, n, 2)),  # B broadcasts one matrix over four systems
        ((3, n, n), (3, n, 0)),  # no right-hand sides: the factorizations' info only
        ((3, n, n), (0, 3, n, 2)),  # an empty broadcast batch
        ((0, 3, n, n), (3, n, 2)),  # no matrices
    ]


@pytest.mark.parametrize("case", range(10))
def test_solve_ex_one_at_a_time_matches_torch(monkeypatch, case):
    """The one-matrix-at-a-time path returns torch.linalg.solve_ex's shapes and values, and its
    ``info`` (one per matrix of A, however many systems B makes of it)."""
    monkeypatch.setattr(linalg, "_lu_batch_unsafe", lambda A: True)
    g = torch.Generator().manual_seed(case)
    a_shape, b_shape = _shapes(20)[case]
    A = torch.randn(a_shape, generator=g, dtype=torch.float64)
    B = torch.randn(b_shape, generator=g, dtype=torch.float64)
    X, info = solve_ex(A, B)
    X_ref, info_ref = torch.linalg.solve_ex(A, B)
    assert X.shape == X_ref.shape and info.shape == info_ref.shape
    assert torch.equal(info, info_ref) and not bool(info.any())
    assert torch.allclose(X, X_ref, rtol=1e-10, atol=1e-12)
    if A.numel():
        A.view(-1, 20, 20)[0, 0] = 0.0  # a singular matrix: info > 0 there, like torch's
        assert torch.equal(solve_ex(A, B)[1], torch.linalg.solve_ex(A, B)[1])


#: run in a fresh interpreter: the explicit thread count is what exposes the bug, and it would
#: leak into every later test of this process
MULTI_THREADED = """
import torch
torch.set_num_threads(2)
from spear.core.filtering import _kernel_of_exact_subsets
from spear.core.linalg import solve_ex
from spear.core.scale import LayerProblem

g = torch.Generator().manual_seed(0)
n, m = 160, 400
for size in (150, n):
    A = torch.randn(4, size, size, generator=g, dtype=torch.float64)
    B = torch.randn(4, size, 3, generator=g, dtype=torch.float64)
    X, info = solve_ex(A, B)
    ref = torch.stack([torch.linalg.solve(a, b) for a, b in zip(A, B)])
    assert bool((info == 0).all()), info
    assert torch.allclose(X, ref, rtol=1e-9, atol=1e-12), float((X - ref).abs().max())

L = torch.randn(m, n, generator=g, dtype=torch.float64)
rows = torch.zeros(6, m, dtype=torch.bool)
for i in range(6):
    rows[i, torch.randperm(m, generator=g)[: n - 1]] = True
q = _kernel_of_exact_subsets(L, rows)
residual = max(float((L[r] @ v).abs().max()) for r, v in zip(rows, q))
assert residual < 1e-9 * float(L.abs().max()), residual

problem = LayerProblem(
    torch.randn(m, 300, generator=g, dtype=torch.float64),
    torch.zeros(m, dtype=torch.float64),
    torch.randn(m, generator=g, dtype=torch.float64),
    L,
    torch.randn(n, 300, generator=g, dtype=torch.float64),
)
Qbar = torch.randn(4, n, n, generator=g, dtype=torch.float64)
c, valid = problem.scales(Qbar)
c_ref = torch.stack([torch.linalg.solve(Q, problem.pinv_grad_bias) for Q in Qbar])
assert bool(valid.all()) and torch.allclose(c, c_ref, rtol=1e-9), float((c - c_ref).abs().max())
Z = problem.pre_activations_t(Qbar, c)
Z_ref = torch.stack([torch.linalg.solve(Q, problem.R_Wt) / s[:, None] for Q, s in zip(Qbar, c)])
assert torch.allclose(Z, Z_ref, rtol=1e-9, atol=1e-9), float((Z - Z_ref).abs().max())
from spear.core.proposers import ProposalContext, RandomSubmatrixSampler

bs = 151  # the sampler solves (b - 1) x (b - 1) systems
Ls = torch.randn(3 * bs, bs, generator=g, dtype=torch.float64)
ctx = ProposalContext(
    L=Ls, batch_size=bs, threshold_count=0, generator=torch.Generator().manual_seed(0),
    proposal_dtype=torch.float64, found=torch.empty(0, bs, dtype=torch.float64), problem=None,
)
batch = RandomSubmatrixSampler(chunk_size=4).propose(ctx, 4)
assert batch.directions.shape[0] == 4 and bool(batch.zero_hint.sum(dim=1).eq(bs - 1).all())
for q, hint in zip(batch.directions, batch.zero_hint):
    residual = float((Ls[hint] @ q).abs().max())
    assert residual < 1e-9 * float(q.abs().max()) * float(Ls.abs().max()), residual
print("ok")
"""


def test_batched_solves_survive_an_explicit_thread_count():
    """After ``torch.set_num_threads(2)``, torch 2.13's batched CPU LU of 150 x 150 systems
    never returns, and from 151 it raises or returns solutions off by 1e10
    (pytorch/pytorch#142815); every batched LU in the attack (hint snapping, the sampler,
    scales, pre-activations) must still be right."""
    # at n = 150 torch's batched call never returns: a hang there is a failure, not a stuck suite
    done = subprocess.run([sys.executable, "-c", MULTI_THREADED], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
