"""One simulated FedSGD client, prepared once, for the studies that run several attacks on it
(``spear compare``, ``spear vulnerability``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from spear.baselines import AttackTarget, DataDomain
from spear.data import load_dataset
from spear.experiments.run import ExperimentSettings, prepare_model
from spear.fl import ClientBatch, ServerView, simulate_round


@dataclass
class ClientCase:
    """The data set, the model (built, checked, trained), the attacked layer, the server's view
    and the private batch (evaluation only)."""

    settings: ExperimentSettings
    dataset: Any
    model: torch.nn.Module
    layer: str
    view: ServerView
    secret: ClientBatch

    @classmethod
    def draw(cls, settings: ExperimentSettings) -> ClientCase:
        dataset = load_dataset(settings.dataset)
        model, layer, _ = prepare_model(settings, dataset)
        view, secret = simulate_round(
            model, dataset, settings.batch_size, seed=settings.seed, single_label=settings.single_label
        )
        return cls(settings, dataset, model, layer, view, secret)

    def target(self, labels_given: bool = False) -> AttackTarget:
        """The server's view of the whole batch as an attack target (the true labels only when
        the threat model grants them)."""
        return AttackTarget(
            self.view.model,
            self.view.gradients,
            self.settings.batch_size,
            DataDomain.of(self.dataset),
            labels=self.secret.labels.clone() if labels_given else None,
            seed=self.settings.seed,
        )
