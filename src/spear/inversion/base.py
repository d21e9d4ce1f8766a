"""The inversion interface: from a layer's recovered inputs back to the model's inputs."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from spear.core.result import Reconstruction
from spear.errors import InputError

#: every kind of dropout: the identity in eval mode (or with p = 0), a random mask in training
DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
#: modules that leave a Linear layer's (batch, features) output as it is (a dropout as in eval
#: mode; :func:`acting_layers_below` asks :func:`changes_data` for the mode the model is in)
PASS_THROUGH = (nn.Identity, nn.Flatten, *DROPOUTS)


def keeps_zeros(module: nn.Module) -> bool:
    """Whether ``module`` leaves the zeros of what passes through it in place (a ReLU's, for
    the input side of the next Linear): the pass-through modules in either mode but an alpha
    dropout in training mode, which maps a zero to a nonzero constant where it drops it."""
    if isinstance(module, (nn.AlphaDropout, nn.FeatureAlphaDropout)):
        return not changes_data(module)
    return isinstance(module, PASS_THROUGH)


def changes_data(module: nn.Module) -> bool:
    """Whether ``module`` changes what passes through it: anything but the pass-through modules,
    and a dropout in training mode (``p > 0``), whose random mask and 1 / (1 - p) scale (alpha
    dropout: affine) a client training with it applies to what the next layer sees; that layer's
    inputs are then not the data (the mask is not in the server's view), so nothing recovered
    there is the data. Every kind of dropout is the identity in eval mode."""
    if isinstance(module, DROPOUTS):
        return module.training and module.p > 0
    return not isinstance(module, PASS_THROUGH)


@dataclass
class Inversion:
    """Model inputs (b, n_0) behind a recovered hidden batch.

    ``verified`` is True only when they are proven: the unique solution of the server's own
    gradients that reproduces the recovered (and verified) layer inputs. Optimization gives an
    estimate, never verified. ``residual`` is the worst relative misfit of the equations used.
    """

    inputs: torch.Tensor
    method: str  # "identity", "gradients", "row space" or "optimization"
    verified: bool
    residual: float = float("nan")
    notes: list[str] = field(default_factory=list)
    #: (k,) per-sample proof, for inverters that take samples one at a time (else None)
    exact: torch.Tensor | None = None

    def as_dict(self) -> dict:
        out = {
            "method": self.method,
            "verified": self.verified,
            "residual": self.residual,
            "notes": list(self.notes),
        }
        if self.exact is not None:
            out["exact_samples"] = int(self.exact.sum())
        return out


class Inverter(ABC):
    """Recovers the model's inputs from the inputs of its layer ``layer`` (one concept, one
    interface: every inversion method is one subclass)."""

    name: str = "inverter"

    @abstractmethod
    def applies(self, model: nn.Module, layer: str) -> bool:
        """Whether this method can invert the modules below ``layer``."""

    @abstractmethod
    def __call__(
        self,
        model: nn.Module,
        layer: str,
        gradients: Mapping[str, torch.Tensor],
        reconstruction: Reconstruction,
    ) -> Inversion:
        """The model inputs behind ``reconstruction.inputs`` (the server's view only)."""


def recovered_inputs(reconstruction: Reconstruction, needs_gradients: bool = False) -> torch.Tensor:
    """The reconstruction's layer inputs, or a clear error when the attack recovered none."""
    if reconstruction is None or reconstruction.inputs is None:
        raise InputError("the reconstruction holds no recovered batch (inputs is None): nothing to invert")
    if needs_gradients and reconstruction.grad_outputs is None:
        raise InputError("the exact inversion needs the recovered output gradients (grad_outputs)")
    return reconstruction.inputs


def layers_below(model: nn.Module, layer: str) -> list[tuple[str, nn.Module]]:
    """The leaf modules that run before ``layer``, in order, with their names: for (nested)
    ``nn.Sequential`` models the network from the model's input to the layer's input."""
    if layer not in dict(model.named_modules()):
        raise InputError(f"model has no module named {layer!r}")
    below: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if name == layer:
            return below
        if next(module.children(), None) is None:
            below.append((name, module))
    return below


def acting_layers_below(model: nn.Module, layer: str) -> list[tuple[str, nn.Module]]:
    """:func:`layers_below` without the pass-through modules (:func:`changes_data`): the ones
    that change what reaches ``layer``. Empty for a model's first layer, also behind a Flatten
    or an eval-mode Dropout; a Dropout that is training hides the data from every layer above."""
    return [(name, m) for name, m in layers_below(model, layer) if changes_data(m)]


def random_masks_below(model: nn.Module, layer: str) -> list[str]:
    """The Dropouts below ``layer`` that are in training mode (:func:`changes_data`): their
    masks are drawn by the client and are not in the server's view."""
    return [name for name, m in layers_below(model, layer) if isinstance(m, DROPOUTS) and changes_data(m)]


def check_no_random_masks(model: nn.Module, layer: str, what: str) -> None:
    """A clear error when a training-mode Dropout below ``layer`` stands between its inputs and
    the data: ``what`` (an inversion, a first-layer option) cannot undo a mask it never sees."""
    masks = random_masks_below(model, layer)
    if masks:
        raise InputError(
            f"{what}: the Dropout {masks} below layer {layer!r} is in training mode, so what reaches "
            f"{layer!r} was masked at random by the client, and the server never sees the mask. If the "
            "client trains without dropout, put the model in eval mode (model.eval()) first"
        )


def check_takes_the_data(model: nn.Module, layer: str, what: str, remedy: str) -> None:
    """A clear error unless ``layer``'s inputs are the data (only pass-through modules below):
    ``what`` says why that is needed, ``remedy`` what to do instead."""
    check_no_random_masks(model, layer, what)
    below = acting_layers_below(model, layer)
    if below:
        raise InputError(
            f"{what}; layer {layer!r} sees hidden activations (of {below[-1][0]!r}): its inputs are "
            f"features, not the data. {remedy}"
        )
