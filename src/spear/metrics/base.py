"""The one metric interface and the registry."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from spear.errors import InputError


class Metric(ABC):
    """A per-sample image metric. Inputs: (B, C, H, W) float tensors in [0, 1], already matched."""

    name: str = "metric"
    higher_is_better: bool = True

    def available(self) -> bool:
        """False when an optional dependency or weight file is missing (reported as n/a)."""
        return True

    @abstractmethod
    def __call__(self, estimate: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        """Per-sample values, shape (B,)."""

    @staticmethod
    def check(estimate: torch.Tensor, reference: torch.Tensor) -> None:
        if estimate.shape != reference.shape or estimate.ndim != 4:
            raise InputError(
                f"metrics need two (B, C, H, W) tensors of one shape, got {tuple(estimate.shape)} "
                f"and {tuple(reference.shape)}"
            )


METRICS: dict[str, type[Metric]] = {}


def register(cls: type[Metric]) -> type[Metric]:
    METRICS[cls.name] = cls
    return cls


def get_metric(name: str) -> Metric:
    if name not in METRICS:
        raise InputError(f"unknown metric {name!r}; available: {sorted(METRICS)}")
    return METRICS[name]()
