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
