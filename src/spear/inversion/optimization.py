"""Feature inversion by optimization: images whose features through the known layers below the
attacked one match the recovered features (the Cocktail Party Attack's second stage, Kariyappa
et al. 2023, and the SPEAR paper's Table 6).

    minimise  ||f(x) - h||^2 / ||h||^2  +  tv * TV(x)   over images x in [0, 1],

with ``f`` the modules below the attacked layer (convolutions, ReLUs, pools: the server has
them), Adam steps and a projection back into the box after each step. The result is an
estimate, never verified: several images can share the features, the prior picks one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from spear.core.result import Reconstruction
from spear.errors import InputError
from spear.inversion.base import (
    Inversion,
    Inverter,
    acting_layers_below,
    check_no_random_masks,
    layers_below,
    random_masks_below,
    recovered_inputs,
)


@dataclass(frozen=True)
class InversionSettings:
    """Adam on the box-constrained images; the defaults are tuned on inversion from the *true*
    features of the small VGG on MNIST (the ceiling the README reports), not on the attack."""

    steps: int = 1000
    lr: float = 0.05
    tv: float = 1e-3
    seed: int = 0


def total_variation(images: torch.Tensor) -> torch.Tensor:
    """Anisotropic total variation per image, mean absolute difference of neighbouring pixels."""
    dx = (images[..., :, 1:] - images[..., :, :-1]).abs().flatten(1).mean(1)
    dy = (images[..., 1:, :] - images[..., :-1, :]).abs().flatten(1).mean(1)
    return dx + dy


def invert_features(
    below: nn.Module,
    features: torch.Tensor,
    image_shape: tuple[int, int, int],
    to_inputs: Callable[[torch.Tensor], torch.Tensor],
    settings: InversionSettings = InversionSettings(),
) -> torch.Tensor:
    """Images (b, C, H, W) in [0, 1] whose features ``below(to_inputs(x))`` match ``features``.

    ``to_inputs`` maps images to the model's inputs (the data set's normalization)."""
    if settings.steps < 0:
        raise InputError(f"steps must be >= 0, got {settings.steps}")
    dtype = next((p.dtype for p in below.parameters()), torch.float64)
    target = features.detach().to(dtype)
    generator = torch.Generator().manual_seed(settings.seed)
    images = 0.5 + 0.01 * torch.randn(target.shape[0], *image_shape, generator=generator, dtype=dtype)
    images.requires_grad_(True)
    optimizer = torch.optim.Adam([images], lr=settings.lr)
    scale = target.pow(2).sum(1).clamp(min=1e-30)
    for _ in range(settings.steps):
        optimizer.zero_grad()
        misfit = (below(to_inputs(images)) - target).pow(2).sum(1) / scale
        loss = (misfit + settings.tv * total_variation(images)).sum()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            images.clamp_(0, 1)
    return images.detach()


class FeatureInverter(Inverter):
    """:func:`invert_features` as an :class:`Inverter`: any stack of known modules below the
    attacked layer. ``to_inputs`` and ``image_shape`` describe the data (normalization, shape)."""

    name = "optimization"

    def __init__(
        self,
        image_shape: tuple[int, int, int],
        to_inputs: Callable[[torch.Tensor], torch.Tensor],
        settings: InversionSettings = InversionSettings(),
    ) -> None:
        self.image_shape, self.to_inputs, self.settings = image_shape, to_inputs, settings

    def applies(self, model: nn.Module, layer: str) -> bool:
        """A hidden layer, with no training-mode Dropout below (its random mask is the client's)."""
        return bool(acting_layers_below(model, layer)) and not random_masks_below(model, layer)

    def __call__(
        self,
        model: nn.Module,
        layer: str,
        gradients: Mapping[str, torch.Tensor],
        reconstruction: Reconstruction,
    ) -> Inversion:
        check_no_random_masks(model, layer, "feature inversion cannot reach the data")
        below = nn.Sequential(*(m for _, m in layers_below(model, layer)))
        features = recovered_inputs(reconstruction)
        images = invert_features(below, features, self.image_shape, self.to_inputs, self.settings)
        inputs = self.to_inputs(images).to(torch.float64)
        with torch.no_grad():
            dtype = next((p.dtype for p in below.parameters()), torch.float64)
            out = below(inputs.to(dtype))
        target = features.to(out.dtype)
        misfit = float((out - target).norm() / target.norm().clamp(min=1e-30))
        note = "images estimated by feature inversion (optimization, total-variation prior): not verified"
        return Inversion(inputs, self.name, False, misfit, [note])
