"""A hidden layer's recovered inputs traced back through the ReLU-linear layer below it.

An attack on a hidden layer recovers what that layer saw, ``h_j = relu(W x_j + bias)``, where
``x_j`` is the input of the linear layer below. The server also holds that layer's gradient
``dL/dW = sum_j dZ_j x_j^T``, whose row space is ``span{x_j}`` when it has rank b (Theorem 3.1
applied to the layer below). So ``x_j = V^T r_j`` with ``V`` the gradient's b right singular
vectors, and on the units sample j activates, ``W V^T r_j = h_j - bias`` is linear in the b
unknowns ``r_j``. With at least b such units in general position the system has one solution,
found by least squares; the units it leaves inactive must have ``W x_j + bias <= 0``.

The trace is exact when the data determine ``x_j`` to ``rtol`` and both checks hold to it.
Determine: the solution can be off by an equation's noise over the system's smallest singular
value. The noise is read off the residual of the redundant equations (about m/2 - b of them),
which shows the data's actual rounding (the row space's and the outputs', including what the
layers above passed down); with few redundant equations the row space's precision
(``s_(b+1) / s_b`` of the gradient, :class:`RowSpace`) stands in. A small misfit alone would
not do: an ill-conditioned system fits its equations with a wrong ``x_j`` (float32, found by
the review). A wrong ``h_j`` (a mixture of samples, a
wrong activation pattern) or an ``x_j``
outside the row space normally leaves a misfit and is refused, but not always: with a zero
bias a rescaled sample ``c h_j`` fits ``c x_j``, and a sample with exactly b active units
fits any values there. The trace proves ``x_j`` *given* ``h_j``: start it from proven outputs
(a verified batch, certified samples). The trace needs no
ground truth: the weights, the gradient and the recovered ``h_j`` are what the server has.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spear.core.linalg import lstsq
from spear.core.lowrank import numerical_rank


@dataclass(frozen=True)
class TracedInputs:
    """Inputs of the layer below, one row per traced sample.

    Attributes:
        inputs: (k, n) the solved ``x_j`` (NaN rows where the system was not determined).
        exact: (k,) determined for the data's precision, and ``relu(W x_j + bias)`` reproduces
            ``h_j`` to ``rtol``.
        misfit: (k,) the largest violation, relative to ``max |h_j - bias|`` on the active units
            (inf where undetermined).
        precision: (k,) the solution's estimated relative error: an equation's noise over
            the system's smallest singular value (inf where undetermined).
    """

    inputs: torch.Tensor
    exact: torch.Tensor
    misfit: torch.Tensor
    precision: torch.Tensor


@dataclass(frozen=True)
class RowSpace:
    """Orthonormal rows ``basis`` (b, n) spanning a layer's inputs, and the relative precision
    to which the gradient gives them (``s_(b+1) / s_b``: the gradient's rounding, measured past
    its rank, over its smallest kept singular value; Wedin's bound)."""

    basis: torch.Tensor
    precision: float


def gradient_row_space(
    grad_weight: torch.Tensor, source_dtype: torch.dtype, batch_size: int | None = None
) -> RowSpace:
    """The row space of ``grad_weight`` (Theorem 3.1: the span of the layer's b inputs): its
    first b right singular vectors, b its numerical rank (at most ``batch_size``)."""
    return GradientSVD.of(grad_weight).row_space(source_dtype, batch_size)


@dataclass(frozen=True)
class GradientSVD:
    """A weight gradient's singular values and right singular vectors (float64), kept so that
    its row space can be read again at another batch size without a second SVD (the cascade
    reuses them until it changes the gradient)."""

    S: torch.Tensor
    Vh: torch.Tensor
    shape: tuple[int, int]
    dtype: torch.dtype  # the gradient's own, as given

    @classmethod
    def of(cls, grad_weight: torch.Tensor) -> GradientSVD:
        g = grad_weight.to(torch.float64)
        _, S, Vh = torch.linalg.svd(g, full_matrices=False)
        return cls(S, Vh, (g.shape[0], g.shape[1]), grad_weight.dtype)

    def row_space(self, source_dtype: torch.dtype, batch_size: int | None = None) -> RowSpace:
        """The :class:`RowSpace` of :func:`gradient_row_space`."""
        S = self.S
        rank = numerical_rank(S, self.shape, source_dtype)
        # duplicates in the batch: fewer distinct inputs than samples, and their span is smaller
        rank = max(1, min(rank, S.numel(), batch_size or rank))
        # the gradient's own rounding, seen past its rank (Wedin: the subspace moves by about
        # that over s_b); eps * s_1 where nothing lies past the rank
        beyond = float(S[rank]) if rank < S.numel() else torch.finfo(source_dtype).eps * float(S[0])
        floor = torch.finfo(torch.float64).eps * float(S[0])
        smallest = float(S[rank - 1])
        precision = max(beyond, floor) / smallest if smallest > 0 else float("inf")
        return RowSpace(self.Vh[:rank], precision)


def invert_relu_linear(
    outputs: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    row_space: RowSpace,
    output_precision: torch.Tensor | float,
    rtol: float,
    zero_rtol: float,
    projected: torch.Tensor | None = None,
) -> TracedInputs:
    """Solve ``x_j`` from ``h_j = relu(W x_j + bias)`` within ``row_space`` (module docstring).
    ``outputs``: (k, m) the recovered ``h_j``, known to ``output_precision`` (relative; a
    number or one per sample); entries within ``zero_rtol`` of a sample's largest are inactive
    units (their equations are left out and checked as inequalities). Exact: the solution's
    estimated error (:func:`_solution_error`, relative to its largest entry) and its misfit are
    both within ``rtol``. ``projected``: ``W V^T`` (m, b) in float64 where the caller keeps it
    for several calls (samples traced in chunks); computed here otherwise."""
    h, W = outputs.to(torch.float64), weight.to(torch.float64)
    bias, V = bias.to(torch.float64), row_space.basis.to(torch.float64)
    k, n = h.shape[0], V.shape[1]
    tiny = torch.finfo(torch.float64).tiny
    scale = h.abs().amax(dim=1).clamp_min(tiny)
    active = h > zero_rtol * scale[:, None]
    # the outputs' own rounding, absolute: a floor under the noise the residual shows
    given = torch.as_tensor(output_precision, dtype=torch.float64).expand(k) * scale
    linear = ((h - bias).abs() * active).amax(dim=1).clamp_min(tiny)
    inputs = torch.full((k, n), torch.nan, dtype=torch.float64)
    misfit = torch.full((k,), torch.inf, dtype=torch.float64)
    precision = torch.full((k,), torch.inf, dtype=torch.float64)
    WV = W @ V.T if projected is None else projected.to(torch.float64)  # (m, b)
    for j in range(k):
        A, rhs = WV[active[j]], (h[j] - bias)[active[j]]
        if A.shape[0] < A.shape[1]:
            continue
        S = torch.linalg.svdvals(A)
        if float(S[-1]) <= 0:
            continue
        r = lstsq(A, rhs.unsqueeze(1))[:, 0]
        x = V.T @ r
        z = W @ x + bias
        on = (z[active[j]] - h[j, active[j]]).abs().amax() if bool(active[j].any()) else z.new_zeros(())
        off = z[~active[j]].clamp_min(0).amax() if bool((~active[j]).any()) else z.new_zeros(())
        inputs[j], misfit[j] = x, torch.maximum(on, off) / linear[j]
        precision[j] = _solution_error(A, rhs, r, S, float(given[j]), row_space.precision) / x.abs().amax()
    # x_j's part off the row space is not in the residual: the row space's own precision bounds it
    determined = precision.clamp_min(row_space.precision) < rtol
    return TracedInputs(inputs, (misfit <= rtol) & determined, misfit, precision)


def _solution_error(
    A: torch.Tensor, rhs: torch.Tensor, r: torch.Tensor, S: torch.Tensor, floor: float, subspace: float
) -> float:
    """How far the least-squares solution ``r`` of ``A r = rhs`` can be from the truth: the noise
    of one equation over the system's smallest singular value. With at least as many redundant
    equations as unknowns the noise is read off the residual (the data's actual rounding, the
    row space's included); with fewer, the row space's precision times ``|rhs|`` stands in for
    it. Never below the outputs' own rounding ``floor``."""
    extra = A.shape[0] - A.shape[1]
    bound = subspace * float(rhs.abs().amax())
    noise = float((A @ r - rhs).norm()) / extra**0.5 if extra >= A.shape[1] else bound
    return max(noise, floor) / float(S[-1])
