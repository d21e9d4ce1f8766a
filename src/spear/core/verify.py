"""Verification: recompute the layer's gradients from a reconstruction.

Any invertible ``Q`` reproduces ``dL/dW = L Q Q^-1 R`` and, with Theorem 3.6's scales, dL/db, so
reproducing the gradients alone proves nothing. We therefore recompute them *through the ReLU*:
in output mode the reconstructed dL/dZ is masked by the reconstructed pre-activations,
``dZ' = dL/dZ * 1[W X' + b > 0]`` (what the ReLU's backward pass would let through), and in input
mode the reconstructed inputs are passed through ReLU. A wrong direction breaks the pattern and
the gradients no longer match; the true batch matches them to rounding error.

A pre-activation within ``z_rtol`` of its sample's largest ``|z|`` on the live neurons (those
with a nonzero row of dL/dW: the band sigma uses, :func:`spear.core.consistency.pattern_matches`)
has no sign the data can tell: the client's own rounding may have put it on either side of
zero. The mask lets the reconstructed dL/dZ through there, so the data decide: a float32 first
layer of width 4000 (b = 32) had one pre-activation at -3e-8 of a sample's, where the client's
was positive. Masking it dropped an entry at 0.45 of its column's largest and put the
recomputed gradient 3.6e-3 off, with every input right to 8e-8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spear.core.scale import SparsityMode

#: default relative tolerance of the verification, by the dtype the gradient was computed in
DEFAULT_VERIFY_RTOL = {torch.float64: 1e-8, torch.float32: 1e-3}
#: a neuron whose row of dL/dW is at most this times the largest row's is dead for the whole
#: batch (its dL/dZ row is exactly zero: a ReLU inactive for every sample)
DEAD_ROW_RTOL = 1e-12


def live_rows(grad_weight: torch.Tensor) -> torch.Tensor:
    """(m,) the neurons active for some sample: a row of dL/dW above ``DEAD_ROW_RTOL``."""
    rows = grad_weight.norm(dim=1)
    return rows > DEAD_ROW_RTOL * rows.max()


@dataclass(frozen=True)
class Verification:
    verified: bool
    residual: float  # max of the relative Frobenius errors of dL/dW and dL/db
    rtol: float
    #: live neurons (a nonzero row of dL/dW) that no sample of the batch activates (see
    #: :func:`uncovered_rows`); the batch is then not verified, whatever its residual
    uncovered: int = 0


def relu_gates(z: torch.Tensor, z_rtol: float, live: torch.Tensor | None = None) -> torch.Tensor:
    """(b, m) where the ReLU lets pre-activations ``z`` (b, m) through: positive ones, and those
    within ``z_rtol`` of their sample's largest on the ``live`` rows (all by default), which have
    no sign (see the module doc); an exact zero's gate is closed."""
    active = z > 0
    if z_rtol > 0 and (live is None or bool(live.any())):
        scale = (z if live is None else z[:, live]).abs().amax(dim=1, keepdim=True)
        active |= (z.abs() <= z_rtol * scale) & (z != 0)
    return active


def uncovered_rows(
    grad_weight: torch.Tensor, active: torch.Tensor, live: torch.Tensor | None = None
) -> torch.Tensor:
    """(m,) the neurons whose row of dL/dW is nonzero (:func:`live_rows`) while every sample of
    the batch has it clearly inactive (``active`` (b, m): the batch's gates,
    :func:`relu_gates`; a pre-activation below ``-z_rtol`` of the sample's largest on the live
    rows, or exactly zero, is closed).

    ReLU's backward pass is exact: a neuron inactive for every sample of a batch has an exactly
    zero row of dL/dW, in any precision. A live row that the batch leaves inactive throughout
    proves that the gradient holds a sample the batch lacks, however small its share: samples
    whose gradients lie below the rounding of the others' (a float32 head, 15 confident samples
    at loss ~1e-5 beside one misclassified at 3.5) leave the gradient's rank at 1, and that one
    sample reproduces it to 9e-5 of its norm, within verify_rtol. Only for exact gradients:
    noise makes every row live. ``live``: :func:`live_rows` of ``grad_weight`` where known."""
    live = live_rows(grad_weight) if live is None else live
    return live & ~active.any(dim=0)


def recompute_gradients(
    weight: torch.Tensor,
    bias: torch.Tensor,
    inputs: torch.Tensor,
    grad_outputs: torch.Tensor,
    mode: SparsityMode = "output",
    z_rtol: float = 0.0,
    live: torch.Tensor | None = None,
    active: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dL/dW and dL/db of ``Z = W X + b`` for inputs (b x n) and dL/dZ (m x b), through the ReLU;
    pre-activations within ``z_rtol`` of their sample's largest on the ``live`` rows (all by
    default) have no sign (see the module doc). ``active`` (b, m): the ReLU's gates
    (:func:`relu_gates`) where the caller computed them already (output mode)."""
    if mode == "output":
        if active is None:
            active = relu_gates(inputs @ weight.T + bias, z_rtol, live)  # (b, m)
        grad_z = grad_outputs * active.T.to(grad_outputs.dtype)
        return grad_z @ inputs, grad_z.sum(dim=1)
    relu_inputs = inputs.clamp_min(0)
    return grad_outputs @ relu_inputs, grad_outputs.sum(dim=1)


def verify(
    weight: torch.Tensor,
    bias: torch.Tensor,
    grad_weight: torch.Tensor,
    grad_bias: torch.Tensor,
    inputs: torch.Tensor,
    grad_outputs: torch.Tensor,
    mode: SparsityMode,
    rtol: float,
    z_rtol: float = 0.0,
    exact: bool = False,
    row_noise: torch.Tensor | None = None,
) -> Verification:
    """Compare the recomputed gradients with the observed ones (relative Frobenius error);
    ``z_rtol``: the band of sign-less pre-activations (:func:`recompute_gradients`), relative to
    each sample's largest on the neurons the observed gradient shows alive. ``exact``: the
    gradient carries no noise beyond rounding, so (output mode) a live row that no sample
    activates fails the check (:func:`uncovered_rows`), where its norm is above ``row_noise``
    ((m,), a residual's subtraction noise: see :class:`~spear.core.result.AttackOptions`)."""
    covered = exact and mode == "output"
    live = live_rows(grad_weight) if z_rtol > 0 or covered else None
    # output mode: the gates once, for the recomputed gradients and the uncovered rows
    active = relu_gates(inputs @ weight.T + bias, z_rtol, live) if mode == "output" else None
    gw, gb = recompute_gradients(weight, bias, inputs, grad_outputs, mode, z_rtol, live, active)
    err_w = torch.linalg.norm(gw - grad_weight) / torch.linalg.norm(grad_weight)
    err_b = torch.linalg.norm(gb - grad_bias) / torch.linalg.norm(grad_bias).clamp_min(1e-300)
    residual = float(torch.maximum(err_w, err_b))
    ok = residual <= rtol and bool(torch.isfinite(inputs).all())
    uncovered = 0
    if covered:
        telling = live if row_noise is None else live & (grad_weight.norm(dim=1) > row_noise.to(grad_weight))
        uncovered = int(uncovered_rows(grad_weight, active, telling).sum())
    return Verification(verified=ok and not uncovered, residual=residual, rtol=rtol, uncovered=uncovered)
