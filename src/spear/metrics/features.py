"""Metrics of recovered hidden features (the inputs of a later or a CNN's feature layer)."""

from __future__ import annotations

import torch

from spear.metrics.base import Metric, register


@register
class FeatureCosine(Metric):
    """Cosine similarity between recovered and true feature vectors (1 when identical up to a
    positive scale; the Cocktail Party Attack reports it for its recovered features)."""

    name = "feature_cosine"
    modality = "features"

    def __call__(self, estimate: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        self.check(estimate, reference)
        return torch.nn.functional.cosine_similarity(estimate.double(), reference.double(), dim=1)


@register
class FeatureError(Metric):
    """Relative error ``||f_hat - f|| / ||f||`` per sample (0 when exact; sees the scale, which
    the cosine does not)."""

    name = "feature_error"
    higher_is_better = False
    modality = "features"

    def __call__(self, estimate: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        self.check(estimate, reference)
        diff = (estimate.double() - reference.double()).norm(dim=1)
        return diff / reference.double().norm(dim=1).clamp(min=torch.finfo(torch.float64).tiny)
