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
    ]


@pytest.mark.parametrize("case", range(5))
def test_solve_ex_one_at_a_time_matches_torch(monkeypatch, case):
    """The one-matrix-at-a-time path returns torch.linalg.solve_ex's shapes and values."""
    monkeypatch.setattr(linalg, "_lu_batch_unsafe", lambda A: True)
    g = torch.Generator().manual_seed(case)
    a_shape, b_shape = _shapes(20)[case]
    A = torch.randn(a_shape, generator=g, dtype=torch.float64)
    B = torch.randn(b_shape, generator=g, dtype=torch.float64)
    A[0, ..., 0, :] = 0.0  # a singular system: info > 0, like torch's
    X, info = solve_ex(A, B)
    X_ref, info_ref = torch.linalg.solve_ex(A, B)
    assert X.shape == X_ref.shape and info.shape == info_ref.shape
    assert torch.equal(info, info_ref)
    regular = info_ref == 0
    assert torch.allclose(X[regular], X_ref[regular], rtol=1e-10, atol=1e-12)


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
A = torch.randn(4, n, n, generator=g, dtype=torch.float64)
B = torch.randn(4, n, 3, generator=g, dtype=torch.float64)
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
print("ok")
"""


def test_batched_solves_survive_an_explicit_thread_count():
    """After ``torch.set_num_threads(2)``, torch 2.13's batched CPU LU of 160 x 160 systems raises
    or returns solutions off by 1e10 (pytorch/pytorch#142815); every batched LU in the attack
    (hint snapping, scales, pre-activations) must still be right."""
    done = subprocess.run([sys.executable, "-c", MULTI_THREADED], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
