"""FedSGD: the client sends the gradient of its mean loss over one batch (paper Section 2)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from spear.fl.protocols.base import Protocol


class FedSGD(Protocol):
    """One gradient of the mean cross-entropy over the client's batch."""

    name: ClassVar[str] = "fedsgd"

    def client_update(
        self, model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, seed: int = 0
    ) -> dict[str, torch.Tensor]:
        params = dict(model.named_parameters())
        loss = nn.functional.cross_entropy(model(inputs), labels)
        grads = torch.autograd.grad(loss, list(params.values()))
        return {name: g.detach().clone() for name, g in zip(params, grads, strict=True)}
