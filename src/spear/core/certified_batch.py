"""The batch of samples certified one by one.

Peeling (:mod:`spear.core.peeling`) recovers and certifies samples one at a time through the
next layer. Once it has certified as many samples as the batch holds (b, the rank of dL/dW),
those samples *are* a candidate batch: inputs solved one by one, and columns
``dL/dZ_j = L u_j`` from their duals. It is judged like any selection
(:func:`spear.core.verdict.judge`): the gradients recomputed through the ReLU must match
(condition 1), the ReLU pattern must match both ways (sigma = 1, condition 2), each sample
keeps the certificate it was counted with, and the precision audit runs. Since the inputs are
not tied to the directions here, each is also checked on its own (:func:`activation_residuals`),
as peeling certified it. The singleton cascade's samples (no next layer) have no such check,
so their batch is not judged this way.

With input sparsity (:mod:`spear.core.input_peeling`) the roles turn: each sample's input is
solved from its own direction, ``x_j = r_j R``, and its column from its own kernel, ``L u_j``.
Input-side peeling counts a sample only with the model's certificate, which the verdict keeps,
so no activation check is needed there; sigma is the fraction of the inputs' entries that are
zero or positive, as :func:`spear.core.greedy.score` reads it. Assembled from all b directions
at once, a faint float32 sample's scale and column come out of the joint solve: MNIST 6 x 500,
layer 2, b = 32, float32, seed 1 certified all 32 samples one by one while the selection of the
same 32 directions had one column with negative entries (sigma 0.9956), and searched its whole
budget for a selection of sigma = 1.

Why not ``Q^-1 R`` of their directions, as for any selection: assembling all b samples at once
spreads the rounding of the faintest columns over every sample. A float32 trained MLP (6 x 1000,
layer 2, b = 128, seed 0 of the realism matrix at m = 1000) certified all 128 samples one by one,
each right to 1e-3 of the input scale, while ``Q^-1 R`` of the same 128 directions put two of
them 0.5 off. Their certificates then did not hold in the assembled batch, and the verdict
rejected a certified sample's direction, which no selection could then replace. The attack
still tries that joint assembly first, with every column polished on its clearly zero rows
(``_Attack._judge_jointly`` in :mod:`spear.core.reconstruct`): where it holds, it is the more
precise, as each sample here carries the rounding of the residual problem it was peeled from.
This batch is judged when the joint one does not verify.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from spear.core.certificate import SampleCertificates
from spear.core.consistency import pattern_matches
from spear.core.greedy import Selection
from spear.core.peeling import PeeledSamples
from spear.core.verify import Verification, verify

if TYPE_CHECKING:
    from spear.core.reconstruct import AttackSetup


#: the note of a result that is the batch of the samples certified one by one
CERTIFIED_BATCH_NOTE = (
    "the batch is the samples certified one by one, as each was solved: assembled from all b "
    "directions at once (Q^-1 R) it did not verify (the rounding of its faintest columns spreads "
    "over every sample)"
)

#: the note of a result that is the certified samples' directions solved again jointly
JOINT_CERTIFIED_NOTE = (
    "the batch is the samples certified one by one, their directions polished and assembled from "
    "all b at once (more precise than each as peeled, from its residual problem)"
)


@dataclass(frozen=True)
class CertifiedBatch:
    """The b certified samples as a selection (see the module doc).

    Attributes:
        selection: their unit directions as ``Qbar`` (b x b, columns), the scales with
            ``dL/dZ_j = L Qbar_j c_j``, and sigma of their own inputs' pattern.
        inputs: (b, n) the samples as certified.
        grad_outputs: (m, b) their columns of dL/dZ, full layer width.
        check: the gradients recomputed from them through the ReLU.
        known: the model certificates they were counted with (``ok`` where a label was fitted).
    """

    selection: Selection
    inputs: torch.Tensor
    grad_outputs: torch.Tensor
    check: Verification
    known: SampleCertificates


def pool_positions(directions: torch.Tensor, pool_directions: torch.Tensor) -> tuple[int, ...]:
    """For each direction (k, b), the pool's most parallel one (up to sign)."""
    if not pool_directions.shape[0]:
        return tuple(-1 for _ in range(directions.shape[0]))
    unit = pool_directions / pool_directions.norm(dim=1, keepdim=True).clamp_min(1e-300)
    mine = directions / directions.norm(dim=1, keepdim=True).clamp_min(1e-300)
    return tuple((mine @ unit.T.to(mine)).abs().argmax(dim=1).tolist())


def activation_residuals(
    setup: AttackSetup, inputs: torch.Tensor, activation_basis: torch.Tensor
) -> torch.Tensor:
    """(k,) for each input (k, n) of the attacked layer, how far its activation ``ReLU(W x + b)``
    lies off the next layer's row space (``activation_basis``: (m, r) orthonormal, peeling's
    ``P``), relative to its size.

    The next layer's weight gradient is ``(dL/dZ') A^T``: its row space is spanned by the
    samples' activations, so a true input's activation lies in it to rounding. A check of each
    sample on its own, whatever its share of the gradient: the batch's gradient residual weighs
    a sample's error by its share, so it can miss an input of a faint sample off by
    ``verify_rtol / share`` (the adversarial review of this path: float64, share 1.7e-3, an
    input 5e-6 off passed it); the activation of such an input leaves the row space by about
    that error."""
    problem = setup.problem
    activation = (inputs @ problem.weight.T + problem.bias).clamp_min(0)
    off = activation - (activation @ activation_basis) @ activation_basis.T
    tiny = torch.finfo(activation.dtype).tiny
    return off.norm(dim=1) / activation.norm(dim=1).clamp_min(tiny)


def certified_batch(
    setup: AttackSetup, peeled: PeeledSamples, pool_directions: torch.Tensor
) -> CertifiedBatch:
    """The batch of the b samples ``peeled`` certified (either sparsity mode); ``pool_directions``
    names the candidates they are in the pool (:attr:`Selection.indices`)."""
    problem, tol = setup.problem, setup.tol
    directions = peeled.directions / peeled.directions.norm(dim=1, keepdim=True)
    inputs = setup.expand_inputs(peeled.inputs)
    grad_outputs = setup.expand(problem.L @ peeled.duals.T)
    layer = setup.layer
    observed = (layer.weight, layer.bias, layer.grad_weight, layer.grad_bias)
    exact = not setup.split.noisy
    check = verify(*observed, inputs, grad_outputs, problem.mode, tol.verify_rtol, tol.z_rtol, exact)
    masks, certain = setup.column_zeros(directions)
    if problem.mode == "output":
        # u_j = q_j / (q_j . r_j): the scale of the unit direction is u_j . q_j
        scales = (peeled.duals * directions).sum(dim=1)
        z_t = peeled.inputs @ problem.weight.T + problem.bias  # (b, live rows)
        matches = pattern_matches(z_t, masks, certain, tol.z_rtol)
    else:
        # x_j = r_j R = c_j R^T p_j for the unit direction p_j: c_j = r_j . p_j. A ReLU's output
        # is zero or positive, to the tolerance input-side peeling checked it at (a faint float32
        # sample's zeros come back at up to its precision, beyond the mask's zero_rtol)
        scales = (peeled.coefficients * directions).sum(dim=1)
        x = peeled.inputs
        matches = masks | (x >= -tol.verify_rtol * x.abs().amax(dim=1, keepdim=True))
    sigma = float(matches.sum()) / matches.numel()
    consistent = int(matches.all(dim=1).sum())
    positions = pool_positions(directions, pool_directions)
    selection = Selection(positions, directions.T, scales, sigma, consistent)
    b = directions.shape[0]
    known = SampleCertificates.none(b, device=peeled.labels.device)
    ok = peeled.labels >= 0
    known.ok[ok] = True
    known.strong[ok] = peeled.strong[ok]
    known.labels[ok] = peeled.labels[ok]
    known.weights[ok] = peeled.weights[ok].to(known.weights)
    known.misfit[ok] = float("nan")  # issued when the sample was peeled
    return CertifiedBatch(selection, inputs, grad_outputs, check, known)
