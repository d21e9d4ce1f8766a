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
from spear.core.linalg import lstsq
from spear.core.peeling import PeeledSamples
from spear.core.scale import LayerProblem

#: two candidates with |cos| above this are the same input (many singleton rows share a sample)
SAME_INPUT_COS = 1.0 - 1e-9
#: at most this many distinct candidates are completed per scan (the sparsest first)
MAX_CANDIDATES = 256
#: the same for the dense scan (every candidate, self-pinning or not): singleton rows are a
#: few percent of the rows, so a scan takes every row it can (each costs an SVD of m x b)
MAX_DENSE_CANDIDATES = 1024
#: a row of the gradient counts as explained by the peeled samples when their part leaves at
#: most this of its norm (measured at photos32, b = 256: explained rows 1e-9 or less before
#: refinement, rows with an unpeeled sample active 4.5e-3 or more)
EXPLAINED_RTOL = 1e-6
#: the explained rows must determine every peeled sample: smallest over largest singular value
#: of their system at least this
REFINE_CONDITION = 1e-8


def singleton_candidates(
    problem: LayerProblem, peeled: PeeledSamples, zero_rtol: float, dense: bool = False
) -> torch.Tensor:
    """Unit coefficient vectors (k, b) of the candidate inputs ``row_i / (dL/db)_i`` of the
    gradient without the peeled samples: nonnegative (up to ``zero_rtol``), with at least b - 1
    zero features (with ``dense``, all of them: inputs such as photos, with hardly a zero pixel,
    cannot pin themselves, and zeros that other samples share do not pin either), deduplicated,
    sparsest first."""
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
    # the dense scan takes every row: an input whose zeros other samples share (a black border)
    # has b - 1 zeros that do not pin it, and only the model can tell it from a mixture
    keep = (x.amin(dim=1, keepdim=True) >= -zero_rtol * size)[:, 0] & (pins_itself | dense)
    r, zeros = r[keep], zeros[keep]
    order = torch.argsort(zeros, descending=True, stable=True)
    unit = r[order] / r[order].norm(dim=1, keepdim=True)
    cap = MAX_DENSE_CANDIDATES if dense else MAX_CANDIDATES
    return unit[distinct_inputs(unit, peeled.coefficients, cap)]


def distinct_inputs(unit: torch.Tensor, known: torch.Tensor, cap: int | None = None) -> list[int]:
    """Indices, in order, of the unit coefficient vectors ``unit`` (k, b) of candidate inputs
    that lie along no ``known`` one (f, b: the peeled samples') and repeat no earlier chosen
    one (``|cos| >= SAME_INPUT_COS``), at most ``cap`` of them."""
    fresh = torch.ones(unit.shape[0], dtype=torch.bool, device=unit.device)
    if known.shape[0]:  # inputs of already peeled samples
        along = known / known.norm(dim=1, keepdim=True)
        fresh = (unit @ along.T.to(unit)).abs().amax(dim=1) < SAME_INPUT_COS
    chosen: list[int] = []
    for i in fresh.nonzero()[:, 0].tolist():
        if chosen and float((unit[chosen] @ unit[i]).abs().max()) >= SAME_INPUT_COS:
            continue
        chosen.append(i)
        if len(chosen) == cap:
            break
    return chosen


def refine_peeled(problem: LayerProblem, peeled: PeeledSamples) -> PeeledSamples | None:
    """The peeled samples re-solved together on every row of the gradient they explain; None
    when those rows do not determine them all, or do not stay explained after the fit.

    The cascade reads each sample off one row of the gradient without the samples peeled
    before it (forward substitution), so their errors pile up: at photos32, b = 256, from 1e-13
    for the first samples to 1e-7 after a hundred, and then true candidates fail the model's
    loss-weight check. The directions ``q_k`` are exact (kernels of the full L), so on a row i
    where only peeled samples are active, ``L_i = sum_k (L q_k)_i y_k`` with
    ``y_k = r_k / (q_k . r_k)``: linear in Y, with many more rows than samples. Then
    ``r_k = y_k / (y_k . L^+ dL/db)`` (Theorem 3.6: ``r_k . s = 1``) and ``u_k = q_k / (q_k . r_k)``.
    Which rows are explained the server sees from the current residual (``EXPLAINED_RTOL``);
    they must still be after the fit. Labels, weights and strength are carried over: the caller
    re-certifies."""
    L = problem.L
    f = len(peeled)
    if not f:
        return None
    tiny = torch.finfo(L.dtype).tiny
    norm = L.norm(dim=1)
    ratio = (L - (L @ peeled.duals.T) @ peeled.coefficients).norm(dim=1) / norm.clamp_min(tiny)
    explained = (ratio <= EXPLAINED_RTOL) & (norm > 0)
    if int(explained.sum()) < f:
        return None
    rows = L[explained] / norm[explained, None]
    system = rows @ peeled.directions.T  # (e, f): the columns L q_k on those rows
    sv = torch.linalg.svdvals(system)
    if not bool(sv[-1] > REFINE_CONDITION * sv[0]):
        return None
    y = lstsq(system, rows)  # (f, b)
    dot = y @ problem.pinv_grad_bias
    r = y / torch.where(dot.abs() > tiny, dot, torch.ones_like(dot)).unsqueeze(-1)
    q = peeled.directions
    qr = (q * r).sum(dim=1)
    u = q / torch.where(qr.abs() > tiny, qr, torch.ones_like(qr)).unsqueeze(-1)
    fitted = (rows - (rows @ u.T) @ r).norm(dim=1)
    if not (torch.isfinite(r).all() and torch.isfinite(u).all()) or bool(fitted.max() > EXPLAINED_RTOL):
        return None  # the rows taken for explained are not all: the samples do not fit them
    return PeeledSamples(
        q, r, r @ problem.R, u, peeled.next_grad_outputs, peeled.labels, peeled.weights, peeled.strong
    )


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


__all__ = [
    "as_input_problem",
    "as_output_samples",
    "distinct_inputs",
    "refine_peeled",
    "singleton_candidates",
]
