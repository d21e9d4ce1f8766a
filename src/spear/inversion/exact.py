"""Exact inversion of the layers below an attacked layer through their own weight gradients.

For a linear layer ``Z = H W^T + c`` below the attacked one, the server received
``dL/dW = D^T H`` with ``D`` the per-sample gradients at ``Z`` (b x m). Once the attacked layer's
inputs and their output gradients are recovered (SPEAR, Theorem 3.6), ``D`` follows by the chain
rule through the known weights and the ReLU masks (a ReLU's output is positive exactly where its
input is), and ``H`` is the unique solution of ``D^T H = dL/dW`` whenever ``D`` has rank b
(``m >= b``, the same condition SPEAR needs). Layer by layer this reaches the model's input: the
data behind a hidden-layer attack, exactly, with no optimization. The paper inverts deeper layers
only by optimization (Sec. 6); this uses that the server holds every layer's gradient.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from spear.core.linalg import lstsq
from spear.core.result import Reconstruction
from spear.errors import InputError
from spear.inversion.base import (
    Inversion,
    Inverter,
    acting_layers_below,
    layers_below,
    recovered_inputs,
)

#: D must have a smallest singular value above this fraction of its largest (rank b): below,
#: the inputs of that layer are not determined by its gradient
RANK_RTOL = 1e-9
#: a recovered ReLU output below this fraction of its sample's largest is a zero (about the
#: ten thousand and ten eps: float64 recovery rounds zeros to ~1e-16, float32 to ~1e-8)
ZERO_RTOL = {True: 1e-12, False: 1e-6}
#: recovered activations up to this many times the zero cut may be rounded zeros or small
#: activations: their neurons are left out of the solve
UNCERTAIN_BAND = 8.0


class GradientInverter(Inverter):
    """Exact inversion through Linear and ReLU layers (see the module doc).

    ``rtol``: the largest relative misfit of ``D^T H = dL/dW``, of the bias gradient and of the
    forward pass through the recovered inputs at which the result is still verified (the
    gradient's rounding scale: 1e-6 for float64, 1e-3 for float32 updates).
    """

    name = "gradients"

    def __init__(self, rtol: float | None = None) -> None:
        self.rtol = rtol

    def applies(self, model: nn.Module, layer: str) -> bool:
        """Only Linear, ReLU and pass-through modules below ``layer``, and a Linear first (a ReLU
        applied to the raw input would lose its negative entries: not invertible)."""
        below = [m for _, m in acting_layers_below(model, layer)]
        if not below:
            return True
        return isinstance(below[0], nn.Linear) and all(isinstance(m, (nn.Linear, nn.ReLU)) for m in below)

    def __call__(
        self,
        model: nn.Module,
        layer: str,
        gradients: Mapping[str, torch.Tensor],
        reconstruction: Reconstruction,
    ) -> Inversion:
        if not self.applies(model, layer):
            raise InputError(
                f"the exact inversion needs only Linear and ReLU layers below {layer!r}, with a Linear "
                "first; use feature inversion (spear.inversion.FeatureInverter) for this model"
            )
        below = layers_below(model, layer)
        _check_gradients(below, gradients)
        modules = dict(model.named_modules())
        hidden = recovered_inputs(reconstruction, needs_gradients=True).to(torch.float64)
        if not below:
            return Inversion(hidden, "identity", reconstruction.verified, 0.0)
        rtol = self.rtol or _rtol(gradients)
        zero_rtol = ZERO_RTOL[_precise(gradients)]
        attacked = modules[layer]
        grad_out = reconstruction.grad_outputs.T.to(torch.float64)  # (b, m): dL/dZ per sample
        grad_h = grad_out @ attacked.weight.detach().to(torch.float64)
        worst, notes, determined = 0.0, [], True
        relu: _ReluCall | None = None  # the ReLU above the current layer, as read off its outputs
        for name, module in reversed(below):
            if isinstance(module, nn.ReLU):
                relu = _ReluCall(grad_h, *_relu_pattern(hidden, zero_rtol))
                grad_h = relu.grad_above * relu.active  # the gradient at the ReLU's input
            elif isinstance(module, nn.Linear):
                step = _solve_linear(name, module, gradients, grad_h, relu)
                worst = max(worst, step.residual)
                if not step.determined:
                    determined = False
                    notes.append(f"layer {name!r}: its gradient does not determine its inputs (rank < b)")
                hidden, relu = step.inputs, None
                grad_h = step.grad_z @ module.weight.detach().to(torch.float64)
        forward = _forward(below, hidden, reconstruction.inputs)
        worst = max(worst, forward)
        verified = bool(reconstruction.verified and determined and worst <= rtol)
        if reconstruction.verified and not verified and determined:
            notes.append(f"the lower layers' gradients do not fit the recovered batch (misfit {worst:.1e})")
        return Inversion(hidden, self.name, verified, worst, notes)


@dataclass
class _ReluCall:
    grad_above: torch.Tensor  # the gradient at the ReLU's output (b x m)
    active: torch.Tensor  # where its output is read as positive
    certain: torch.Tensor  # where that reading is sure


@dataclass
class _Step:
    inputs: torch.Tensor  # the layer's inputs H (b x n)
    grad_z: torch.Tensor  # the gradient at its outputs, with the ReLU pattern settled (b x m)
    residual: float
    determined: bool


def _solve_linear(
    name: str,
    module: nn.Linear,
    gradients: Mapping[str, torch.Tensor],
    grad_z: torch.Tensor,
    relu: _ReluCall | None,
) -> _Step:
    """The inputs H of one linear layer from ``dL/dW = D^T H`` with ``D = grad_z`` (b x m):
    least squares over the neurons whose ReLU pattern is certain for every sample (a wrong
    mask entry corrupts only its neuron's row), unique when those rows of D have rank b. The
    uncertain entries are then settled by the signs of the solved pre-activations ``H W^T + c``,
    so the gradient passed further down is exact too."""
    prefix = f"{name}." if name else ""
    rows = torch.ones(grad_z.shape[1], dtype=torch.bool) if relu is None else relu.certain.all(dim=0)
    grad_w = gradients[prefix + "weight"].to(torch.float64)[rows]
    used = grad_z[:, rows]
    inputs = lstsq(used.T, grad_w)
    singular = torch.linalg.svdvals(used)
    determined = used.shape[0] <= used.shape[1] and bool(singular[-1] > RANK_RTOL * singular[0])
    residual = _relative(used.T @ inputs, grad_w)
    if module.bias is not None and prefix + "bias" in gradients:
        bias_grad = gradients[prefix + "bias"].to(torch.float64)[rows]
        residual = max(residual, _relative(used.sum(0), bias_grad))
    if relu is not None and not bool(relu.certain.all()):
        pre = inputs @ module.weight.detach().to(torch.float64).T
        if module.bias is not None:
            pre = pre + module.bias.detach().to(torch.float64)
        active = torch.where(relu.certain, relu.active, pre > 0)
        grad_z = relu.grad_above * active
    return _Step(inputs, grad_z, residual, determined)


def _check_gradients(below: list[tuple[str, nn.Module]], gradients: Mapping[str, torch.Tensor]) -> None:
    """A clear error when the update lacks a lower linear layer's weight gradient."""
    linear = [name for name, m in below if isinstance(m, nn.Linear)]
    missing = [f"{name}.weight" for name in linear if f"{name}.weight" not in gradients]
    if missing:
        raise InputError(
            f"the update has no gradient for {missing}: the exact inversion solves each lower layer's "
            "weight gradient (a frozen or omitted layer cannot be inverted this way)"
        )


def _forward(below: list[tuple[str, nn.Module]], inputs: torch.Tensor, hidden: torch.Tensor) -> float:
    """Relative misfit between the recovered hidden batch and the recovered inputs run forward."""
    dtype = next((p.dtype for _, m in below for p in m.parameters()), torch.float64)
    with torch.no_grad():
        out = nn.Sequential(*(m for _, m in below))(inputs.to(dtype)).to(torch.float64)
    return _relative(out, hidden.to(torch.float64))


def _relative(estimate: torch.Tensor, reference: torch.Tensor) -> float:
    scale = float(reference.norm())
    return float((estimate - reference).norm()) / scale if scale > 0 else float((estimate - reference).norm())


def _relu_pattern(hidden: torch.Tensor, zero_rtol: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a ReLU's recovered output is positive, and which of those calls are certain.

    A recovered zero carries the recovery's rounding, of either sign: the most negative entry
    shows its size (a ReLU output is never negative), and the cut is twice that, or ``zero_rtol``
    of the sample's largest activation. Entries between half and ``UNCERTAIN_BAND`` times the
    cut may be either a rounded zero or a small activation: they are uncertain, and the neurons
    where they occur are left out of the solve below (see :func:`_solve_linear`)."""
    noise = 2 * float((-hidden).clamp(min=0).amax()) if hidden.numel() else 0.0
    cut = (zero_rtol * hidden.abs().amax(dim=1, keepdim=True)).clamp(min=noise)
    uncertain = (hidden > cut / 2) & (hidden < UNCERTAIN_BAND * cut)
    return hidden > cut, ~uncertain


def _precise(gradients: Mapping[str, torch.Tensor]) -> bool:
    """Whether every gradient is float64."""
    return all(g.dtype == torch.float64 for g in gradients.values())


def _rtol(gradients: Mapping[str, torch.Tensor]) -> float:
    """The misfit scale of the gradients' precision."""
    return 1e-6 if _precise(gradients) else 1e-3
