"""The interface every FL protocol implements: how a client turns its private batch into the
update the server receives.

A protocol is a small object holding the settings the *server* chose (and therefore knows):
local epochs and learning rate for FedAvg, the clipping norm for DP-SGD, and so on. Its
:meth:`Protocol.client_update` runs on the client's side; what it returns is everything the
server gets from that client, as gradient-like tensors by parameter name (a weight update is
divided by the learning rate the server configured). Secure aggregation is not a protocol of
its own but a sum over clients that run one (:func:`spear.fl.simulate_round`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
from torch import nn

from spear.core.deadline import NEVER, Deadline
from spear.core.result import Reconstruction
from spear.errors import InputError


class Protocol(ABC):
    """One client's local computation in one FL round (see the module doc)."""

    #: the name the CLI and the JSON records use
    name: ClassVar[str]

    @abstractmethod
    def client_update(
        self, model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, seed: int = 0
    ) -> dict[str, torch.Tensor]:
        """The update the server receives from a client holding ``(inputs, labels)``, as
        gradient-like tensors by parameter name, in the model's dtype. ``model`` is the global
        model; it is left unchanged. ``seed`` drives the client's private randomness (mini-batch
        order, DP noise)."""

    def settings(self) -> dict[str, Any]:
        """The protocol's settings, JSON-ready (for the experiment records)."""
        return {"protocol": self.name}

    def check_batch(self, batch_size: int) -> None:
        """Raise :class:`~spear.errors.InputError` if the settings do not fit a batch of this size."""
        if batch_size < 1:
            raise InputError("the client's batch size must be >= 1")

    def certify(
        self,
        model: nn.Module,
        update: dict[str, torch.Tensor],
        rec: Reconstruction,
        clients: int = 1,
        deadline: Deadline = NEVER,
    ) -> Reconstruction:
        """A protocol-specific certificate of an attack's result on the first layer (FedAvg
        replays the local training) of an update summed over ``clients`` clients (secure
        aggregation), within ``deadline`` (the rest of the attack's time budget); by default
        the attack's own verdict stands."""
        return rec

    def attack_options(self, model: nn.Module, update: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Options for :func:`spear.attack_layer` on ``model``'s first layer that describe this
        protocol's ``update`` to the attack (how it weights samples, a certificate that can stop
        it); empty by default."""
        return {}


def named_update(model: nn.Module, before: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """``(before - after) / scale`` for every parameter of ``model`` (after local training)."""
    return {name: (before[name] - param.detach()) / scale for name, param in model.named_parameters()}
