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
