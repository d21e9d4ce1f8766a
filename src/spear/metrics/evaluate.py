"""Order-invariant evaluation of a reconstructed batch against the truth."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from spear.errors import InputError
from spear.metrics.base import Metric, metrics_for
from spear.metrics.image import batch_exact

#: the matching cost of a pair with a non-finite entry (NaN or Inf estimates): after every finite
#: pair, so such an estimate is matched last, and it scores as not recovered
NON_FINITE_COST = 1e300


def match_samples(estimate: torch.Tensor, reference: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Hungarian assignment minimising the total MSE between estimated and true samples.
    Returns index arrays (est_idx, ref_idx). A non-finite estimate is matched last."""
    _check_samples(estimate, reference)
    cost = torch.cdist(estimate.flatten(1).double(), reference.flatten(1).double()) ** 2
    cost = torch.nan_to_num(cost, nan=NON_FINITE_COST, posinf=NON_FINITE_COST)
    return linear_sum_assignment(cost.cpu().numpy())


def _check_samples(estimate: torch.Tensor, reference: torch.Tensor) -> None:
    """Both (k, ...) tensors of samples with as many features each (their shapes may differ), and
    the reference (the truth) finite: a NaN there costs every pair with it the same, and the
    other samples were matched arbitrarily (review 46: 8 exact estimates counted 6 exact)."""
    for name, value in (("estimate", estimate), ("reference", reference)):
        if not isinstance(value, torch.Tensor) or value.dim() < 2:
            raise InputError(f"{name} must be a tensor of samples, (k, ...) with k first; got {value!r:.80}")
    if not bool(torch.isfinite(reference).all()):
        raise InputError("the reference samples contain NaN or Inf: the truth must be finite")
    if math.prod(estimate.shape[1:]) != math.prod(reference.shape[1:]):
        raise InputError(
            f"estimate samples have shape {tuple(estimate.shape[1:])} and reference samples "
            f"{tuple(reference.shape[1:])}: they must hold as many features each"
        )


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
    Fewer estimates than reference samples (a partial recovery) leave the unmatched ones
    *missing*: NaN in every metric, never exact, and left out of the means (``exact_samples``
    and ``batch_size`` say how many there are). More estimates than samples raise
    :class:`~spear.errors.InputError`: matching would keep the best of them and hide the rest.
    """
    metrics = metrics if metrics is not None else metrics_for("image")
    _check_samples(estimate, reference)
    if estimate.shape[0] > reference.shape[0]:
        raise InputError(
            f"evaluate_batch got {estimate.shape[0]} estimates for {reference.shape[0]} reference "
            "samples: pass at most one estimate per sample (an attack's own choice of them)"
        )
    est_idx, ref_idx = match_samples(estimate, reference)
    dtype = reference.dtype if reference.is_floating_point() else torch.float64
    ordered = torch.full(reference.shape, torch.nan, dtype=dtype, device=reference.device)
    ordered[ref_idx] = estimate[est_idx].reshape(-1, *reference.shape[1:]).to(dtype)
    missing = torch.ones(len(reference), dtype=torch.bool)
    missing[ref_idx] = False
    per_sample: dict[str, list[float]] = {}
    means: dict[str, float] = {}
    for metric in metrics:
        scored = metric.available() and metric.accepts(reference)
        values = metric(ordered, reference) if scored else torch.full((len(reference),), np.nan)
        values = torch.where(missing, torch.nan, values.double().cpu())  # whatever a metric makes of NaN rows
        per_sample[metric.name] = [float(v) for v in values]
        means[metric.name] = float(values.double().nanmean())
    exact = batch_exact(ordered, reference, exact_atol)
    per_sample["exact"] = [bool(v) for v in exact]
    return BatchEvaluation(per_sample, means, bool(exact.all()), int(exact.sum()), len(reference), ordered)
