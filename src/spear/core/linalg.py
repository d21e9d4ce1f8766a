"""Linear algebra the attack needs bit-reproducible (the same seed, the same result).

``torch.linalg.lstsq``'s default CPU driver, LAPACK's gelsy (QR with column pivoting), rounds
differently depending on where its inputs sit in memory: two identical calls in one process can
differ by an ulp, and peeling's decisions on an ill-conditioned batch amplified that into
different reconstructions. gelsd (SVD-based, minimum-norm like gelsy for rank-deficient systems)
does not; CUDA offers only gels.
"""

from __future__ import annotations

import torch


def lstsq(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """The least-squares (minimum-norm) solution X of ``A X = B``, batched like
    ``torch.linalg.lstsq``, reproducible bit for bit on the CPU."""
    driver = "gelsd" if A.device.type == "cpu" else None
    return torch.linalg.lstsq(A, B, driver=driver).solution


#: batched LU factorizations of matrices this large are run one matrix at a time on the CPU
#: (:func:`solve_ex`); MKL's getrf goes wrong from n = 150 (measured on two machines, with 2 to 16
#: threads; below 150 never)
LU_BATCH_SAFE_N = 128


def _lu_batch_unsafe(A: torch.Tensor) -> bool:
    """Whether torch's batched CPU LU could factor several of these matrices concurrently with
    a parallel MKL getrf (:func:`solve_ex`)."""
    batched = A.dim() > 2 and A[..., 0, 0].numel() > 1
    large = A.shape[-1] >= LU_BATCH_SAFE_N
    return batched and large and A.device.type == "cpu" and torch.get_num_threads() > 1


def solve_ex(A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.linalg.solve_ex(A, B)`` (LU with partial pivoting), safe for batches on the CPU.

    torch's batched CPU LU factors the matrices of a batch on several threads at once. Once the
    thread count has been set (``torch.set_num_threads(k)``, k > 1), MKL's getrf then corrupts
    its pivots for matrices from n = 150 on (pytorch/pytorch#142815, #141358; measured with
    torch 2.13.0 on batches of two or more): at n = 150 the call never returns (its threads
    spin), from 151 it raises ("Pivots given to lu_solve must all be greater or equal to 1") or,
    silently, returns solutions off by 1e10 to 1e28. Such batches are factored here one matrix
    at a time (each call may use every thread inside; where ``B`` broadcasts one matrix over
    several systems, it is factored once and the batched ``lu_solve``, not affected, solves
    them all); smaller matrices and a single thread keep the batched call. Shapes are torch's:
    ``B`` is a batch of vectors when its shape is ``A``'s without the last dimension (or it is
    one vector), else a batch of matrices; batch dimensions broadcast, and ``info`` has ``A``'s
    batch shape (each matrix is factored once)."""
    if A.numel() == 0 or not _lu_batch_unsafe(A):
        return torch.linalg.solve_ex(A, B)
    vector = B.dim() == 1 or B.shape == A.shape[:-1]
    rhs = B.unsqueeze(-1) if vector else B
    if torch.broadcast_shapes(A.shape[:-2], rhs.shape[:-2]) == A.shape[:-2]:
        X, info = _solve_each(A, rhs)  # one right-hand side per matrix: the attack's case
    else:
        X, info = _factor_each(A, rhs)
    return (X.squeeze(-1) if vector else X), info


def _solve_each(A: torch.Tensor, rhs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One ``solve_ex`` per matrix of ``A`` (the fastest way, measured), for right-hand sides
    ``rhs`` (..., n, k) whose batch broadcasts to ``A``'s."""
    n, k = A.shape[-1], rhs.shape[-1]
    systems = A.reshape(-1, n, n)
    sides = rhs.expand(*A.shape[:-1], k).reshape(len(systems), n, k)
    parts = [torch.linalg.solve_ex(a, s) for a, s in zip(systems, sides, strict=True)]
    X = torch.stack([x for x, _ in parts]).reshape(*A.shape[:-1], k)
    return X, torch.stack([i for _, i in parts]).reshape(A.shape[:-2])


def _factor_each(A: torch.Tensor, rhs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each matrix of ``A`` factored once, one at a time, and every system of the broadcast
    batch solved by one batched ``lu_solve``."""
    n = A.shape[-1]
    factors = [torch.linalg.lu_factor_ex(a) for a in A.reshape(-1, n, n)]
    LU = torch.stack([f.LU for f in factors]).reshape(A.shape)
    pivots = torch.stack([f.pivots for f in factors]).reshape(A.shape[:-1])
    info = torch.stack([f.info for f in factors]).reshape(A.shape[:-2])
    return torch.linalg.lu_solve(LU, pivots, rhs), info
