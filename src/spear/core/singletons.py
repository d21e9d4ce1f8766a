"""Singleton neurons: a neuron that one sample alone activates hands over that sample.

Row i of ``dL/dW`` is ``sum_j (dL/dZ)_ij x_j`` over the samples that activate neuron i, and
``(dL/db)_i`` the same sum without the inputs. When one sample j alone activates neuron i,
their ratio is ``x_j`` exactly (the observation behind the LT-code peeling attack, Shariati &
Meybodi 2026). Which rows are singletons the server cannot tell, so every row's ratio is a
candidate input, completed and checked by :class:`spear.core.input_peeling.InputSidePeeler`
(its own zeros pin it, its ReLU pattern pins a column of dL/dZ) and then by the model
certificate; a wrong candidate (a row shared by several samples) fails them.

Once samples are peeled, the same holds for the gradient of the others,
``dL/dW - sum_peeled (L u_j) x_j^T``: neurons shared only with peeled samples become singletons,
which is the LT cascade. In the coordinates of ``R`` (``x = R^T r``), the candidate of row i is
row i of ``L - (L U) C`` divided by ``(dL/db - L U 1)_i``, with U, C the peeled samples' duals and
coefficients.

Only server-side quantities are used: dL/dW, dL/db (through L, R), W and the bias.
"""

from __future__ import annotations

import torch

from spear.core.filtering import canonical_sign, zero_mask
from spear.core.peeling import PeeledSamples
from spear.core.scale import LayerProblem

#: two candidates with |cos| above this are the same input (many singleton rows share a sample)
SAME_INPUT_COS = 1.0 - 1e-9
#: at most this many distinct candidates are completed per scan (the sparsest first)
MAX_CANDIDATES = 256
#: the same for dense inputs (no b - 1 zero features to rank by): singleton rows are a few
#: percent of the rows, so a scan takes every row it can (each costs an SVD of m x b)
MAX_DENSE_CANDIDATES = 1024


def singleton_candidates(
    problem: LayerProblem, peeled: PeeledSamples, zero_rtol: float, dense: bool = False
) -> torch.Tensor:
    """Unit coefficient vectors (k, b) of the candidate inputs ``row_i / (dL/db)_i`` of the
    gradient without the peeled samples: nonnegative (up to ``zero_rtol``), with at least b - 1
    zero features (with ``dense``, the others: inputs such as photos, with hardly a zero pixel,
    cannot pin themselves), deduplicated, sparsest first."""
    L, R = problem.L, problem.R
    b = L.shape[1]
    rows, grad_bias = L, problem.grad_bias
    if len(peeled):
        LU = L @ peeled.duals.T  # (m, f): the peeled samples' columns of dL/dZ
        rows = L - LU @ peeled.coefficients
        grad_bias = grad_bias - LU.sum(dim=1)
    scale = grad_bias.abs().amax().clamp_min(torch.finfo(L.dtype).tiny)
    usable = grad_bias.abs() > zero_rtol * scale
    r = rows[usable] / grad_bias[usable].unsqueeze(-1)
    x = r @ R
    size = x.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(L.dtype).tiny)
    zeros = zero_mask(x, zero_rtol).sum(dim=1)
    pins_itself = zeros >= b - 1
    keep = (x.amin(dim=1, keepdim=True) >= -zero_rtol * size)[:, 0] & (~pins_itself if dense else pins_itself)
    r, zeros = r[keep], zeros[keep]
    if len(peeled):  # rows of already peeled samples
        known = peeled.coefficients / peeled.coefficients.norm(dim=1, keepdim=True)
        unit = r / r.norm(dim=1, keepdim=True)
        fresh = (unit @ known.T).abs().amax(dim=1) < SAME_INPUT_COS
        r, zeros = r[fresh], zeros[fresh]
    order = torch.argsort(zeros, descending=True, stable=True)
    unit = r[order] / r[order].norm(dim=1, keepdim=True)
    cap = MAX_DENSE_CANDIDATES if dense else MAX_CANDIDATES
    chosen: list[int] = []
    for i in range(unit.shape[0]):
        if chosen and float((unit[chosen] @ unit[i]).abs().max()) >= SAME_INPUT_COS:
            continue
        chosen.append(i)
        if len(chosen) == cap:
            break
    return unit[chosen]


def as_input_problem(problem: LayerProblem) -> LayerProblem:
    """The same layer seen from its input side (for :class:`InputSidePeeler`)."""
    return LayerProblem(problem.weight, problem.bias, problem.grad_bias, problem.L, problem.R, "input")


def as_output_samples(samples: PeeledSamples) -> PeeledSamples:
    """Samples completed on the input side, as output-side peeled samples: their direction is
    that of their dL/dZ column (``u_j``), the search side of an output-sparsity attack."""
    q = canonical_sign(samples.duals / samples.duals.norm(dim=1, keepdim=True))
    return PeeledSamples(
        q,
        samples.coefficients,
        samples.inputs,
        samples.duals,
        None,
        samples.labels,
        samples.weights,
        samples.strong,
    )


__all__ = ["as_input_problem", "as_output_samples", "singleton_candidates"]
