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
#: (:func:`solve_ex`); MKL's getrf goes wrong from n ~ 150 (151 and 152 measured on two machines)
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
    its pivots for matrices from n ~ 150 on (pytorch/pytorch#142815, #141358): a RuntimeError
    ("Pivots given to lu_solve must all be greater or equal to 1") or, silently, solutions off
    by 1e10 (measured, torch 2.13.0: every batch of two or more 152 x 152 systems). Such batches
    are solved one matrix at a time here, each a single call that MKL may parallelize inside;
    smaller matrices and a single thread keep the batched call. ``B`` is read as torch reads
    it: a batch of vectors when its shape is ``A``'s without the last dimension (or it is one
    vector), else a batch of matrices; batch dimensions broadcast."""
    if not _lu_batch_unsafe(A):
        return torch.linalg.solve_ex(A, B)
    vector = B.dim() == 1 or B.shape == A.shape[:-1]
    rhs = B.unsqueeze(-1) if vector else B
    batch = torch.broadcast_shapes(A.shape[:-2], rhs.shape[:-2])
    n, k = A.shape[-1], rhs.shape[-1]
    systems = A.expand(*batch, n, n).reshape(-1, n, n)
    sides = rhs.expand(*batch, n, k).reshape(-1, n, k)
    parts = [torch.linalg.solve_ex(a, s) for a, s in zip(systems, sides, strict=True)]
    X = torch.stack([x for x, _ in parts]).reshape(*batch, n, k)
    info = torch.stack([i for _, i in parts]).reshape(batch)
    return (X.squeeze(-1) if vector else X), info
