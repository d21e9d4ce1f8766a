"""Metrics the field reports, on images in [0, 1], after order-invariant matching.

Every metric implements :class:`Metric` (per-sample values); :func:`evaluate_batch` matches the
reconstruction to the ground truth (Hungarian assignment) and applies them.
"""

from spear.metrics.base import METRICS, Metric, get_metric
from spear.metrics.evaluate import BatchEvaluation, evaluate_batch, match_samples
from spear.metrics.image import MSE, PSNR, SSIM, batch_exact
from spear.metrics.lpips import LPIPS, lpips_available

__all__ = [
    "LPIPS",
    "METRICS",
    "MSE",
    "PSNR",
    "SSIM",
    "BatchEvaluation",
    "Metric",
    "batch_exact",
    "evaluate_batch",
    "get_metric",
    "lpips_available",
    "match_samples",
]
