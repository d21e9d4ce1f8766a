"""PSNR, MSE, SSIM and exact-batch accuracy."""

from __future__ import annotations

import torch

from spear.errors import InputError
from spear.metrics.base import Metric, register


@register
class MSE(Metric):
    """Mean squared error per sample."""

    name = "mse"
    higher_is_better = False

    def __call__(self, estimate: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        self.check(estimate, reference)
        return ((estimate.double() - reference.double()) ** 2).flatten(1).mean(dim=1)


@register
class PSNR(Metric):
    """Peak signal-to-noise ratio ``10 log10(1 / MSE)`` for data range 1 (inf when identical)."""

    name = "psnr"

    def __call__(self, estimate: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        mse = MSE()(estimate, reference)
        return 10 * torch.log10(1.0 / mse)


def ssim_window(height: int, width: int) -> int:
    """Gaussian window (sigma 1.5): 11 taps, or the largest odd size that fits small images."""
    side = min(11, height, width)
    return side if side % 2 == 1 else side - 1


@register
class SSIM(Metric):
    """Structural similarity, data range 1, Gaussian window sigma 1.5 of 11 taps (fewer for images
    smaller than 11 pixels), no border padding: pytorch-msssim's definition, which equals
    scikit-image's ``structural_similarity(gaussian_weights=True, sigma=1.5,
    use_sample_covariance=False, data_range=1)`` (tested). The estimate is clipped to [0, 1]
    first, as an image is shown (the reference is checked to lie there); PSNR and MSE take it as
    it is. Images one pixel high or wide have a one-tap window: SSIM per pixel, averaged."""

    name = "ssim"

    def __call__(self, estimate: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        from pytorch_msssim import ssim

        self.check(estimate, reference)
        win = ssim_window(*estimate.shape[-2:])
        estimate, reference = estimate.double().clamp(0, 1), reference.double()
        if min(estimate.shape[-2:]) == 1:  # pytorch-msssim drops size-1 dimensions: repeat them
            size = [max(2, s) for s in estimate.shape[-2:]]  # (a one-tap map's mean is unchanged)
            estimate = estimate.expand(*estimate.shape[:2], *size)
            reference = reference.expand(*reference.shape[:2], *size)
        return ssim(estimate, reference, data_range=1.0, size_average=False, win_size=win)


def batch_exact(estimate: torch.Tensor, reference: torch.Tensor, atol: float = 1e-6) -> torch.Tensor:
    """Per sample: every pixel within ``atol`` (image scale [0, 1]) of the truth. A batch counts
    as exactly recovered (the paper's accuracy) when all its samples are."""
    if estimate.shape != reference.shape:
        raise InputError(
            f"batch_exact compares matched samples: estimate {tuple(estimate.shape)} and reference "
            f"{tuple(reference.shape)} must have one shape (match them first: evaluate_batch)"
        )
    return (estimate.double() - reference.double()).abs().flatten(1).amax(dim=1) <= atol
