"""Order-invariant evaluation of a reconstructed batch against the truth."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from spear.metrics.base import Metric, metrics_for
from spear.metrics.image import batch_exact


def match_samples(estimate: torch.Tensor, reference: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Hungarian assignment minimising the total MSE between estimated and true samples.
    Returns index arrays (est_idx, ref_idx)."""
    cost = torch.cdist(estimate.flatten(1).double(), reference.flatten(1).double()) ** 2
    return linear_sum_assignment(cost.cpu().numpy())


def relative_errors(estimate: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """(k,) each estimated sample's error relative to its matched true sample's norm
    (:func:`match_samples`), in the estimate's order; NaN for a sample left unmatched."""
    est, ref = match_samples(estimate, reference)
    x, y = estimate.flatten(1).double(), reference.flatten(1).double()
    errors = torch.full((x.shape[0],), torch.nan, dtype=torch.float64)
    for e, r in zip(est, ref, strict=True):
        errors[e] = (x[e] - y[r]).norm() / y[r].norm().clamp_min(torch.finfo(y.dtype).tiny)
    return errors


@dataclass
class BatchEvaluation:
    """Per-sample values (after matching) and batch means; lpips is NaN when unavailable."""

    per_sample: dict[str, list[float]]
    means: dict[str, float]
    exact: bool
    exact_samples: int
    batch_size: int
    matched_estimates: torch.Tensor = field(repr=False)

    def as_dict(self) -> dict:
        return {
            "metrics": {**self.means, "accuracy": float(self.exact)},
            "exact_samples": self.exact_samples,
            "batch_size": self.batch_size,
            "per_sample": self.per_sample,
        }


def evaluate_batch(
    estimate: torch.Tensor,
    reference: torch.Tensor,
    metrics: list[Metric] | None = None,
    exact_atol: float = 1e-6,
) -> BatchEvaluation:
    """Match ``estimate`` to ``reference`` (both (B, C, H, W) in [0, 1], or (B, n) rows with
    ``metrics`` of that modality) and score every sample.

    The paper's accuracy: the batch is exact when every sample is within ``exact_atol``.
    """
    metrics = metrics if metrics is not None else metrics_for("image")
    est_idx, ref_idx = match_samples(estimate, reference)
    ordered = torch.empty_like(reference)
    ordered[ref_idx] = estimate[est_idx].to(reference.dtype)
    per_sample: dict[str, list[float]] = {}
    means: dict[str, float] = {}
    for metric in metrics:
        values = metric(ordered, reference) if metric.available() else torch.full((len(reference),), np.nan)
        per_sample[metric.name] = [float(v) for v in values]
        means[metric.name] = float(values.double().mean())
    exact = batch_exact(ordered, reference, exact_atol)
    per_sample["exact"] = [bool(v) for v in exact]
    return BatchEvaluation(per_sample, means, bool(exact.all()), int(exact.sum()), len(reference), ordered)
