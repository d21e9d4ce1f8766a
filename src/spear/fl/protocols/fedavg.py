"""FedAvg (McMahan et al. 2017; SPEAR's App. F): the client trains locally for E epochs of
mini-batch SGD and sends its new weights; the server sees ``W_before - W_after``.

The client is a real Flower client (:class:`spear.fl.flower.LocalTrainingClient`, a ``flwr``
``NumPyClient``)
whose ``fit`` receives the global weights and the server's configuration (``local_epochs``,
``batch_size``, ``lr``) exactly as in a Flower deployment; the simulation calls it in-process.
The update is divided by the learning rate the server configured, so a one-step FedAvg update
is the FedSGD gradient. Its weight part is still ``sum_j u_j x_j^T`` over the client's samples
(``u_j`` sums sample j's ``dL/dZ`` over the steps that used it), so SPEAR recovers X exactly;
the columns ``u_j`` are only nearly ReLU-sparse, which :mod:`spear.fl.replay` makes up for by
replaying the local training (the server knows E, eta and the mini-batch size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import nn

from spear import checks
from spear.core.deadline import NEVER, Deadline
from spear.core.result import Reconstruction
from spear.errors import InputError
from spear.fl.protocols.base import Protocol, named_update


def local_sgd(
    model: nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    batches: list[torch.Tensor],
    lr: float,
) -> None:
    """Plain SGD (no momentum) on the mean cross-entropy of each mini-batch, in place; ``batches``
    lists the sample indices of every step in order."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for index in batches:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(inputs[index]), labels[index]).backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def shuffled_batches(b: int, epochs: int, batch_size: int, generator: torch.Generator) -> list[torch.Tensor]:
    """The client's private mini-batch order: a fresh permutation per epoch, cut into batches of
    ``batch_size`` (the last one smaller when it does not divide b, like a DataLoader)."""
    steps: list[torch.Tensor] = []
    for _ in range(epochs):
        steps += list(torch.randperm(b, generator=generator).split(batch_size))
    return steps


@dataclass
class FedAvg(Protocol):
    """E local epochs of mini-batch SGD (batch size ``batch_size``, None: the whole batch) at
    learning rate ``lr``; the server receives ``(W_before - W_after) / lr``."""

    epochs: int = 1
    batch_size: int | None = None
    lr: float = 0.1
    name: ClassVar[str] = "fedavg"

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise InputError(f"FedAvg needs at least one local epoch (got local_epochs={self.epochs})")
        if self.batch_size is not None and self.batch_size < 1:
            raise InputError(f"the local batch size must be >= 1 (got {self.batch_size})")
        if not 0 < self.lr < math.inf:
            raise InputError(f"the local learning rate must be a finite number > 0 (got {self.lr})")

    def check_batch(self, batch_size: int) -> None:
        super().check_batch(batch_size)
        if self.batch_size is not None and self.batch_size > batch_size:
            raise InputError(
                f"the local batch size {self.batch_size} exceeds the client's {batch_size} samples; "
                "use at most the client's batch size (or leave it unset for full-batch steps)"
            )

    def config(self, b: int) -> dict[str, Any]:
        """What the server sends with the weights (Flower's fit config)."""
        return {"local_epochs": self.epochs, "batch_size": self.batch_size or b, "lr": self.lr}

    def settings(self) -> dict[str, Any]:
        return {
            "protocol": self.name,
            "local_epochs": self.epochs,
            "local_batch_size": self.batch_size,
            "local_lr": self.lr,
        }

    def attack_options(self, model: nn.Module, update: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The columns sum per-sample gradients of several steps, so the one-step model
        certificate does not apply; the replay (:mod:`spear.fl.replay`) does, and stops the
        attack as soon as it accepts a batch."""
        from spear.fl.replay import replay_accepts

        self._check = replay_accepts(model, update, self)  # its certificate is reused by certify
        return {"certify": False, "stop_when": self._check}

    def certify(
        self,
        model: nn.Module,
        update: dict[str, torch.Tensor],
        rec: Reconstruction,
        clients: int = 1,
        deadline: Deadline = NEVER,
    ) -> Reconstruction:
        """Replay the local training on the recovered batch (:mod:`spear.fl.replay`), until
        ``deadline``; a batch the attack's ``stop_when`` (:meth:`attack_options`) accepted keeps
        that replay's certificate. The replay
        is one client's: a sum of ``clients`` > 1 clients' local trainings (secure aggregation)
        is left not certified, and the message says why (review 46: it blamed the data for the
        factor the sum of two clients' updates makes)."""
        from spear.fl.replay import apply_replay

        if clients > 1 and rec.inputs is not None:
            message = (
                f"not certified: the update sums {clients} clients' local trainings (secure "
                "aggregation), and the replay certificate replays one client's; the recovered "
                "batch is unchecked by it (FedSGD under secure aggregation is certified by the model)"
            )
            notes = (*rec.notes, f"attack before the replay: {rec.message}")
            return replace(rec, verified=False, verified_by=None, message=message, notes=notes)
        return apply_replay(model, update, self, rec, deadline=deadline, check=getattr(self, "_check", None))

    @checks.outside_inference_mode
    def client_update(
        self, model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, seed: int = 0
    ) -> dict[str, torch.Tensor]:
        self.check_batch(inputs.shape[0])
        from spear.fl.flower import LocalTrainingClient

        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        client = LocalTrainingClient(model, inputs, labels, seed)
        weights, _, _ = client.fit(client.get_parameters({}), self.config(inputs.shape[0]))
        client.set_parameters(weights)
        return named_update(client.model, before, self.lr)
