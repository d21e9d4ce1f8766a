"""A hidden layer's recovered inputs traced back through the ReLU-linear layer below it.

An attack on a hidden layer recovers what that layer saw, ``h_j = relu(W x_j + bias)``, where
``x_j`` is the input of the linear layer below. The server also holds that layer's gradient
``dL/dW = sum_j dZ_j x_j^T``, whose row space is ``span{x_j}`` when it has rank b (Theorem 3.1
applied to the layer below). So ``x_j = V^T r_j`` with ``V`` the gradient's b right singular
vectors, and on the units sample j activates, ``W V^T r_j = h_j - bias`` is linear in the b
unknowns ``r_j``. With at least b such units in general position the system has one solution,
found by least squares; the units it leaves inactive must have ``W x_j + bias <= 0``.

The trace is exact when the system is determined well enough for the data's precision and
both checks hold to ``rtol``. Determined well enough: the solution moves by up to the system's
condition number times the relative error of its data, the larger of the row space's
(``eps * s_1 / s_b`` of the gradient, :class:`RowSpace`) and the outputs' own (the dtype's
eps for a recovered batch, the previous step's for a chain of layers); that product, the
solution's ``precision``, must stay below ``rtol``. A small misfit alone would not do: an
ill-conditioned system fits its equations with a wrong ``x_j`` (float32, measured by the
review). A wrong ``h_j`` (a mixture of samples, a wrong activation pattern) or an ``x_j``
outside the row space leaves a misfit, so it is not called exact either. The trace needs no
ground truth: the weights, the gradient and the recovered ``h_j`` are what the server has.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spear.core.lowrank import numerical_rank


@dataclass(frozen=True)
class TracedInputs:
    """Inputs of the layer below, one row per traced sample.

    Attributes:
        inputs: (k, n) the solved ``x_j`` (NaN rows where the system was not determined).
        exact: (k,) determined for the data's precision, and ``relu(W x_j + bias)`` reproduces
            ``h_j`` to ``rtol``.
        misfit: (k,) the largest violation, relative to ``max |h_j|`` (inf where undetermined).
        precision: (k,) the solution's relative precision: its condition number times its
            data's (inf where undetermined).
        active: (k,) how many units sample j activates (the system's equations).
    """

    inputs: torch.Tensor
    exact: torch.Tensor
    misfit: torch.Tensor
    precision: torch.Tensor
    active: torch.Tensor


@dataclass(frozen=True)
class RowSpace:
    """Orthonormal rows ``basis`` (b, n) spanning a layer's inputs, and the relative precision
    to which the gradient gives them (``eps * s_1 / s_b``: the rounding of the gradient, seen
    through its smallest kept singular value)."""

    basis: torch.Tensor
    precision: float


def gradient_row_space(
    grad_weight: torch.Tensor, source_dtype: torch.dtype, batch_size: int | None = None
) -> RowSpace:
    """The row space of ``grad_weight`` (Theorem 3.1: the span of the layer's b inputs): its
    first b right singular vectors, b its numerical rank unless ``batch_size`` is given."""
    g = grad_weight.to(torch.float64)
    _, S, Vh = torch.linalg.svd(g, full_matrices=False)
    rank = numerical_rank(S, (g.shape[0], g.shape[1]), source_dtype) if batch_size is None else batch_size
    rank = max(1, min(rank, S.numel()))
    eps = torch.finfo(source_dtype).eps
    smallest = float(S[rank - 1])
    precision = eps * float(S[0]) / smallest if smallest > 0 else float("inf")
    return RowSpace(Vh[:rank], precision)


def invert_relu_linear(
    outputs: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    row_space: RowSpace,
    output_precision: torch.Tensor | float,
    rtol: float,
    zero_rtol: float,
) -> TracedInputs:
    """Solve ``x_j`` from ``h_j = relu(W x_j + bias)`` within ``row_space`` (module docstring).
    ``outputs``: (k, m) the recovered ``h_j``, known to ``output_precision`` (relative; a
    number or one per sample); entries within ``zero_rtol`` of a sample's largest are inactive
    units (their equations are left out and checked as inequalities). Exact: the solution's
    precision (condition number times its data's) and its misfit are both within ``rtol``."""
    h, W = outputs.to(torch.float64), weight.to(torch.float64)
    bias, V = bias.to(torch.float64), row_space.basis.to(torch.float64)
    k, n = h.shape[0], V.shape[1]
    data = torch.as_tensor(output_precision, dtype=torch.float64).expand(k).clamp_min(row_space.precision)
    inputs = torch.full((k, n), torch.nan, dtype=torch.float64)
    misfit = torch.full((k,), torch.inf, dtype=torch.float64)
    precision = torch.full((k,), torch.inf, dtype=torch.float64)
    scale = h.abs().amax(dim=1).clamp_min(torch.finfo(torch.float64).tiny)
    active = h > zero_rtol * scale[:, None]
    WV = W @ V.T  # (m, b)
    for j in range(k):
        A = WV[active[j]]
        if A.shape[0] < A.shape[1]:
            continue
        S = torch.linalg.svdvals(A)
        if float(S[-1]) <= 0 or float(S[0]) * float(data[j]) >= rtol * float(S[-1]):
            continue  # condition * precision >= rtol: the data do not determine x_j to rtol
        r = torch.linalg.lstsq(A, (h[j] - bias)[active[j]].unsqueeze(1)).solution[:, 0]
        x = V.T @ r
        z = W @ x + bias
        on = (z[active[j]] - h[j, active[j]]).abs().amax() if bool(active[j].any()) else z.new_zeros(())
        off = z[~active[j]].clamp_min(0).amax() if bool((~active[j]).any()) else z.new_zeros(())
        inputs[j], misfit[j] = x, torch.maximum(on, off) / scale[j]
        precision[j] = S[0] / S[-1] * data[j]
    return TracedInputs(inputs, (misfit <= rtol) & (precision < rtol), misfit, precision, active.sum(dim=1))
