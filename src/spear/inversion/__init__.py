"""From a hidden layer's recovered inputs back to the client's data.

SPEAR recovers the inputs of the attacked layer. For a later layer of an MLP those are hidden
activations, for a CNN's head the conv features. Two inverters take them back to the data:

* :class:`GradientInverter` (exact): through Linear and ReLU layers, using the server's own
  weight gradients of the layers below; verified when the solution is unique and consistent.
* :class:`RowSpaceInverter` (exact, one sample at a time): through Linear and ReLU layers,
  each certified sample on its own, within the row space of each lower layer's gradient; for
  attacks that certified some samples but not the whole batch.
* :class:`FeatureInverter` (estimate): optimization through any known layers (convolutions,
  pools) with a total-variation prior, as the Cocktail Party Attack inverts VGG features.

:func:`invert_to_inputs` picks the exact one where it applies.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from spear import checks
from spear.core.result import Reconstruction
from spear.inversion.base import Inversion, Inverter, check_no_random_masks, layers_below
from spear.inversion.exact import GradientInverter
from spear.inversion.optimization import FeatureInverter, InversionSettings, invert_features, total_variation
from spear.inversion.row_space import RowSpaceInverter


@checks.outside_inference_mode
def invert_to_inputs(
    model: nn.Module,
    layer: str,
    gradients: Mapping[str, torch.Tensor],
    reconstruction: Reconstruction,
    *,
    image_shape: tuple[int, int, int] | None = None,
    to_inputs: Callable[[torch.Tensor], torch.Tensor] | None = None,
    settings: InversionSettings | None = None,
) -> Inversion:
    """The model inputs behind ``reconstruction`` (the inputs of ``layer``): exactly through the
    gradients when only Linear and ReLU layers lie below, otherwise by feature inversion, which
    needs ``image_shape`` and ``to_inputs`` (images in [0, 1] -> model inputs)."""
    check_no_random_masks(model, layer, "no inversion takes these inputs back to the data")
    exact = GradientInverter()
    if exact.applies(model, layer):
        return exact(model, layer, gradients, reconstruction)
    if image_shape is None or to_inputs is None:
        from spear.errors import InputError

        raise InputError(
            f"the layers below {layer!r} are not all Linear/ReLU: feature inversion needs the image "
            "shape and the normalization (image_shape=, to_inputs=)"
        )
    inverter = FeatureInverter(image_shape, to_inputs, settings or InversionSettings())
    return inverter(model, layer, gradients, reconstruction)


__all__ = [
    "FeatureInverter",
    "GradientInverter",
    "Inversion",
    "InversionSettings",
    "Inverter",
    "RowSpaceInverter",
    "invert_features",
    "invert_to_inputs",
    "layers_below",
    "total_variation",
]
