"""The one attack interface: the server's view of one client update in, a reconstruction out.

Every attack spear-fl runs side by side (SPEAR itself, the optimization baselines, the Cocktail
Party Attack, SPEAR with an optimization prior) is one :class:`Attack` subclass in one file, so
that the same batches, metrics and JSON records serve all of them (:mod:`spear.experiments.compare`).
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from spear import checks
from spear.errors import InputError


@dataclass(frozen=True)
class Normalization:
    """Per-channel ``(x - mean) / std``, flattened: a data set's preprocessing, holding only its
    public statistics (never a reference to the data set itself)."""

    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __call__(self, samples: torch.Tensor) -> torch.Tensor:
        shape = (1, -1) + (1,) * (samples.ndim - 2)
        mean = torch.tensor(self.mean, dtype=samples.dtype, device=samples.device).view(shape)
        std = torch.tensor(self.std, dtype=samples.dtype, device=samples.device).view(shape)
        return ((samples - mean) / std).reshape(samples.shape[0], -1)


@dataclass(frozen=True)
class DataDomain:
    """What the server knows of the clients' data, and no more: the shape of one sample, the
    preprocessing that maps samples to the model's (flattened) inputs, and the range samples take.

    Optimization attacks search over samples in this range (their box constraint) and map them
    through ``to_inputs``; ``image`` says whether image priors (total variation) apply.
    """

    shape: tuple[int, ...]
    to_inputs: Callable[[torch.Tensor], torch.Tensor] = field(default=lambda x: x.flatten(1))
    low: float | None = 0.0
    high: float | None = 1.0
    image: bool = True

    @classmethod
    def of(cls, dataset: Any) -> DataDomain:
        """The domain of a :mod:`spear.data` data set: images in [0, 1] with the set's
        normalization, or standardized tabular rows (unbounded, no image prior)."""
        if getattr(dataset, "modality", "image") == "image":
            normalize = Normalization(tuple(dataset.mean), tuple(dataset.std))
            return cls(tuple(dataset.image_shape), normalize, 0.0, 1.0, True)
        return cls((dataset.features,), lambda x: x.flatten(1), None, None, False)

    def input_bounds(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The box in the model's input space, ``(low, high)`` of shape (n,): the corners of the
        sample box through ``to_inputs`` (an increasing affine map, as normalization is); None
        for an unbounded domain."""
        if self.low is None or self.high is None:
            return None
        low = self.to_inputs(torch.full((1, *self.shape), float(self.low), dtype=torch.float64))[0]
        high = self.to_inputs(torch.full((1, *self.shape), float(self.high), dtype=torch.float64))[0]
        return torch.minimum(low, high).to(dtype), torch.maximum(low, high).to(dtype)

    def samples(self, inputs: torch.Tensor) -> torch.Tensor:
        """Model inputs (b, n) reshaped to samples (b, *shape) for priors (no de-normalization)."""
        return inputs.reshape(inputs.shape[0], *self.shape)


@dataclass
class AttackTarget:
    """The server's view of one client update: the model it sent, the gradients it got back
    (by parameter name), how many samples the client reports (FedAvg's ``num_examples``; Flower's
    ``FitRes.num_examples``), and the data domain. ``labels`` are given only when the threat
    model grants them; otherwise each attack recovers them its own way."""

    model: nn.Module
    gradients: Mapping[str, torch.Tensor]
    batch_size: int
    domain: DataDomain
    labels: torch.Tensor | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise InputError(f"batch_size must be >= 1, got {self.batch_size}")
        names = {name for name, _ in self.model.named_parameters()}
        missing = names - set(self.gradients)
        if missing:
            raise InputError(
                f"the update lacks gradients for {sorted(missing)[:3]}: pass every parameter's gradient"
            )
        if self.labels is not None and self.labels.shape != (self.batch_size,):
            raise InputError(f"labels must have shape ({self.batch_size},), got {tuple(self.labels.shape)}")

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def input_size(self) -> int:
        """n, one sample's size as the model takes it (flattened)."""
        return math.prod(self.domain.shape)


@dataclass
class AttackOutput:
    """A reconstruction: model inputs (b, n) in arbitrary order, or None when the attack gives
    none; their labels where known. ``verified`` is the attack's own proof (only SPEAR has one);
    ``objective`` is the attack's loss at its start and end (optimization attacks)."""

    method: str
    inputs: torch.Tensor | None
    labels: torch.Tensor | None = None
    verified: bool = False
    seconds: float = 0.0
    objective: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    #: the attack's own result object (SPEAR's :class:`~spear.Reconstruction`), for evaluation
    reconstruction: Any = field(default=None, repr=False)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary (no tensors)."""
        return {
            "method": self.method,
            "verified": self.verified,
            "seconds": self.seconds,
            "objective": dict(self.objective),
            "labels": None if self.labels is None else [int(v) for v in self.labels.tolist()],
            "notes": list(self.notes),
            **self.details,
        }


class Attack(ABC):
    """A gradient-inversion attack. Subclasses implement :meth:`run`; calling the attack times
    it and stamps the method's name."""

    name: str = "attack"

    @abstractmethod
    def run(self, target: AttackTarget) -> AttackOutput:
        """Reconstruct the client's batch from ``target`` (the server's view only)."""

    @checks.outside_inference_mode
    def __call__(self, target: AttackTarget) -> AttackOutput:
        start = time.perf_counter()
        output = self.run(target)
        output.seconds = time.perf_counter() - start
        output.method = self.name
        return output

    def settings(self) -> dict[str, Any]:
        """The attack's hyperparameters, for the records."""
        config = getattr(self, "config", None)
        return {} if config is None else dict(vars(config))
