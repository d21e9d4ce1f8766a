"""FedSGD: the client sends the gradient of its mean loss over one batch (paper Section 2)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from spear import checks
from spear.errors import InputError
from spear.fl.protocols.base import Protocol

#: the dtypes a client's mixed precision computes in (``torch.autocast``), by name
AUTOCAST = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class FedSGD(Protocol):
    """One gradient of the mean cross-entropy over the client's batch.

    ``autocast``: the client's mixed precision, ``torch.float16`` or ``torch.bfloat16``: its
    forward and backward passes run under ``torch.autocast`` in that dtype, as an AMP training
    loop's do, and the gradients it sends stay in the parameters' dtype, each computed in the
    lower one (the attack reads that precision off their entries:
    :func:`spear.api.stored_precision`). None: everything in the model's dtype."""

    autocast: torch.dtype | None = None
    name: ClassVar[str] = "fedsgd"

    def __post_init__(self) -> None:
        if self.autocast is not None and self.autocast not in AUTOCAST.values():
            raise InputError(
                f"autocast must be torch.float16, torch.bfloat16 or None (got {self.autocast}); "
                "a client without mixed precision computes in the model's dtype"
            )

    def settings(self) -> dict[str, Any]:
        if self.autocast is None:
            return super().settings()
        name = next(name for name, dtype in AUTOCAST.items() if dtype == self.autocast)
        return {**super().settings(), "autocast": name}

    @checks.outside_inference_mode
    def client_update(
        self, model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, seed: int = 0
    ) -> dict[str, torch.Tensor]:
        params = dict(model.named_parameters())
        if self.autocast is not None and any(p.dtype == torch.float64 for p in params.values()):
            raise InputError(
                "autocast leaves float64 alone: a float64 model's client would compute in float64 "
                "while its update says mixed precision; build the model in float32 (dtype=torch.float32)"
            )
        with self._precision(inputs):
            loss = nn.functional.cross_entropy(model(inputs), labels)
        grads = torch.autograd.grad(loss, list(params.values()))
        return {name: g.detach().clone() for name, g in zip(params, grads, strict=True)}

    def _precision(self, inputs: torch.Tensor) -> contextlib.AbstractContextManager:
        """The client's autocast context (its backward runs in the dtypes its forward chose)."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(inputs.device.type, dtype=self.autocast)
