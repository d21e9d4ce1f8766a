"""Metrics the field reports, on images in [0, 1] and on recovered features, after
order-invariant matching.

Every metric implements :class:`Metric` (per-sample values); :func:`evaluate_batch` matches the
reconstruction to the ground truth (Hungarian assignment) and applies them.
"""

from spear.metrics.base import METRICS, Metric, get_metric, metrics_for
from spear.metrics.evaluate import BatchEvaluation, evaluate_batch, match_samples, relative_errors
from spear.metrics.features import FeatureCosine, FeatureError
from spear.metrics.image import MSE, PSNR, SSIM, batch_exact
from spear.metrics.lpips import LPIPS, lpips_available
from spear.metrics.tabular import CategoricalAccuracy, NumericAccuracy

__all__ = [
    "LPIPS",
    "METRICS",
    "MSE",
    "PSNR",
    "SSIM",
    "BatchEvaluation",
    "CategoricalAccuracy",
    "FeatureCosine",
    "FeatureError",
    "Metric",
    "NumericAccuracy",
    "batch_exact",
    "evaluate_batch",
    "get_metric",
    "lpips_available",
    "match_samples",
    "metrics_for",
    "relative_errors",
]
