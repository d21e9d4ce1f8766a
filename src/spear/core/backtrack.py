"""A hidden layer's recovered inputs traced back through the ReLU-linear layer below it.

An attack on a hidden layer recovers what that layer saw, ``h_j = relu(W x_j + bias)``, where
``x_j`` is the input of the linear layer below. The server also holds that layer's gradient
``dL/dW = sum_j dZ_j x_j^T``, whose row space is ``span{x_j}`` when it has rank b (Theorem 3.1
applied to the layer below). So ``x_j = V^T r_j`` with ``V`` the gradient's b right singular
vectors, and on the units sample j activates, ``W V^T r_j = h_j - bias`` is linear in the b
unknowns ``r_j``. With at least b such units in general position the system has one solution,
found by least squares; the units it leaves inactive must have ``W x_j + bias <= 0``.

The trace is exact when the system is determined (its smallest singular value is not lost
in rounding) and both checks hold to ``rtol``. A wrong ``h_j`` (a mixture of samples, a
wrong activation pattern) or an ``x_j`` outside the row space leaves a misfit, so it is not
called exact. The trace needs no ground truth: the weights, the gradient and the recovered
``h_j`` are what the server has.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spear.core.lowrank import numerical_rank

#: the active units' system is determined when its smallest singular value is above this
#: fraction of its largest (else the solution depends on rounding)
DETERMINED_RTOL = 1e-8


@dataclass(frozen=True)
class TracedInputs:
    """Inputs of the layer below, one row per traced sample.

    Attributes:
        inputs: (k, n) the solved ``x_j`` (NaN rows where the system was not determined).
        exact: (k,) determined, and ``relu(W x_j + bias)`` reproduces ``h_j`` to ``rtol``.
        misfit: (k,) the largest violation, relative to ``max |h_j|`` (inf where undetermined).
        active: (k,) how many units sample j activates (the system's equations; the fewest
            over the layers traced).
        layer: the module whose inputs ``inputs`` are (set by :func:`spear.trace_to_inputs`).
        through: the linear layers traced through, top first.
    """

    inputs: torch.Tensor
    exact: torch.Tensor
    misfit: torch.Tensor
    active: torch.Tensor
    layer: str = ""
    through: tuple[str, ...] = ()

    def __len__(self) -> int:
        return int(self.inputs.shape[0])


def gradient_row_space(
    grad_weight: torch.Tensor, source_dtype: torch.dtype, batch_size: int | None = None
) -> torch.Tensor:
    """(b, n) orthonormal rows spanning the inputs of a layer with gradient ``grad_weight``: its
    first b right singular vectors, b its numerical rank (Theorem 3.1) unless ``batch_size``
    is given."""
    g = grad_weight.to(torch.float64)
    _, S, Vh = torch.linalg.svd(g, full_matrices=False)
    rank = numerical_rank(S, (g.shape[0], g.shape[1]), source_dtype) if batch_size is None else batch_size
    return Vh[:rank]


def invert_relu_linear(
    outputs: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    row_space: torch.Tensor,
    rtol: float,
    zero_rtol: float,
) -> TracedInputs:
    """Solve ``x_j`` from ``h_j = relu(W x_j + bias)`` within ``span(row_space)`` (module
    docstring). ``outputs``: (k, m) the recovered ``h_j``; entries within ``zero_rtol`` of a
    sample's largest are inactive units (their equations are left out and checked as
    inequalities), and the result is exact when it reproduces ``h_j`` to ``rtol``."""
    h, W = outputs.to(torch.float64), weight.to(torch.float64)
    bias, V = bias.to(torch.float64), row_space.to(torch.float64)
    k, n = h.shape[0], V.shape[1]
    inputs = torch.full((k, n), torch.nan, dtype=torch.float64)
    misfit = torch.full((k,), torch.inf, dtype=torch.float64)
    scale = h.abs().amax(dim=1).clamp_min(torch.finfo(torch.float64).tiny)
    active = h > zero_rtol * scale[:, None]
    WV = W @ V.T  # (m, b')
    for j in range(k):
        A = WV[active[j]]
        if A.shape[0] < A.shape[1]:
            continue
        S = torch.linalg.svdvals(A)
        if float(S[-1]) <= DETERMINED_RTOL * float(S[0]):
            continue
        r = torch.linalg.lstsq(A, (h[j] - bias)[active[j]].unsqueeze(1)).solution[:, 0]
        x = V.T @ r
        z = W @ x + bias
        on = (z[active[j]] - h[j, active[j]]).abs().amax() if bool(active[j].any()) else z.new_zeros(())
        off = z[~active[j]].clamp_min(0).amax() if bool((~active[j]).any()) else z.new_zeros(())
        inputs[j], misfit[j] = x, torch.maximum(on, off) / scale[j]
    return TracedInputs(inputs, misfit <= rtol, misfit, active.sum(dim=1))
