"""TabLeak's measures of a reconstructed table (Vero et al. 2023): per row, the fraction of
categorical columns decoded to the true category and the fraction of numeric columns within
0.319 standard deviations of the truth.

Both take *normalized* rows (the model's inputs: numeric columns standardized, so one unit is
one standard deviation of the data set; one-hot blocks as they are), matched to the truth."""

from __future__ import annotations

import torch

from spear.data.tabular import CONTINUOUS_TOLERANCE, TabularSchema
from spear.metrics.base import Metric, register


class _TabularMetric(Metric):
    modality = "tabular"
    kind = "categorical"

    def __init__(self, schema: TabularSchema, tolerance: float = CONTINUOUS_TOLERANCE) -> None:
        self.schema, self.tolerance = schema, tolerance

    def _correct(self, estimate: torch.Tensor, reference: torch.Tensor, column, span) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, estimate: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        """Per row: the fraction of this kind's columns recovered (inputs: normalized rows (B, F),
        matched)."""
        self.check(estimate, reference)
        spans = [(c, s) for c, s in self.schema.slices() if c.kind == self.kind]
        if not spans:
            return torch.full((estimate.shape[0],), float("nan"), dtype=torch.float64)
        hits = [self._correct(estimate.double(), reference.double(), c, s) for c, s in spans]
        return torch.stack(hits, dim=1).double().mean(dim=1)


@register
class CategoricalAccuracy(_TabularMetric):
    """Fraction of categorical columns whose argmax category is the true one."""

    name = "categorical_accuracy"

    def _correct(self, estimate, reference, column, span):
        return estimate[:, span].argmax(dim=1) == reference[:, span].argmax(dim=1)


@register
class NumericAccuracy(_TabularMetric):
    """Fraction of numeric columns within ``tolerance`` standard deviations of the truth (in
    normalized rows, ``tolerance`` units)."""

    name = "numeric_accuracy"
    kind = "numeric"

    def _correct(self, estimate, reference, column, span):
        return (estimate[:, span.start] - reference[:, span.start]).abs() <= self.tolerance
