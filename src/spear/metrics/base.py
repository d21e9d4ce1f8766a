"""The one metric interface and the registry."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from spear.errors import InputError


class Metric(ABC):
    """A per-sample metric of one modality, on matched tensors: "image" metrics take (B, C, H, W)
    in [0, 1]; "features" metrics (B, n) hidden activations; "tabular" metrics (B, F) encoded rows."""

    name: str = "metric"
    higher_is_better: bool = True
    modality: str = "image"

    def available(self) -> bool:
        """False when an optional dependency or weight file is missing (reported as n/a)."""
        return True

    def accepts(self, reference: torch.Tensor) -> bool:
        """False for data this metric is not defined on (reported as n/a by
        :func:`~spear.metrics.evaluate_batch`; a direct call raises)."""
        return True

    @abstractmethod
    def __call__(self, estimate: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        """Per-sample values, shape (B,)."""

    def check(self, estimate: torch.Tensor, reference: torch.Tensor) -> None:
        dims = 4 if self.modality == "image" else 2
        if estimate.shape != reference.shape or estimate.ndim != dims:
            layout = "(B, C, H, W)" if dims == 4 else "(B, n)"
            raise InputError(
                f"{self.modality} metrics need two {layout} tensors of one shape, got "
                f"{tuple(estimate.shape)} and {tuple(reference.shape)}"
            )
        if self.modality == "image":
            check_images(reference)


#: how far outside [0, 1] a reference image may lie (rounding of a float32 pipeline)
RANGE_SLACK = 1e-6


def check_images(reference: torch.Tensor) -> None:
    """The true images: floating point, finite, in [0, 1], with pixels. Image metrics assume
    data range 1; review 46 found [0, 255] images scored PSNR 0 dB for one grey level apart and
    uint8 ones accepted. The estimate is not checked: an attack's may leave [0, 1] (DLG's do)."""
    if not reference.is_floating_point():
        raise InputError(
            f"image metrics take floating-point images in [0, 1], got {reference.dtype}: divide 8-bit "
            "images by 255"
        )
    if reference.numel() == 0:
        raise InputError(f"image metrics need images with pixels, got shape {tuple(reference.shape)}")
    if not bool(torch.isfinite(reference).all()):
        raise InputError("the reference images contain NaN or Inf: the true images must be finite")
    low, high = float(reference.min()), float(reference.max())
    if low < -RANGE_SLACK or high > 1 + RANGE_SLACK:
        raise InputError(
            f"image metrics take images in [0, 1] (data range 1); the reference spans [{low:.4g}, "
            f"{high:.4g}]: scale [0, 255] images by 1/255, and undo a normalization (dataset.denormalize)"
        )


METRICS: dict[str, type[Metric]] = {}


def register(cls: type[Metric]) -> type[Metric]:
    METRICS[cls.name] = cls
    return cls


def metrics_for(modality: str, **options) -> list[Metric]:
    """One instance of every registered metric of ``modality`` ("image", "features", or
    "tabular" with ``schema=``), constructed with ``options``."""
    found = [cls(**options) for cls in METRICS.values() if cls.modality == modality]
    if not found:
        kinds = sorted({cls.modality for cls in METRICS.values()})
        raise InputError(f"no metrics for modality {modality!r}; registered: {kinds}")
    return found


def get_metric(name: str) -> Metric:
    if name not in METRICS:
        raise InputError(f"unknown metric {name!r}; available: {sorted(METRICS)}")
    return METRICS[name]()
