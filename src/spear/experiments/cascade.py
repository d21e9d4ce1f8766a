"""One model cascade end to end (:func:`spear.cascade.attack_model`): simulate a FedSGD round,
attack the server's view layer after layer, and count the recovered samples that are exact."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from spear.cascade import CascadeStep, attack_model
from spear.data import load_dataset
from spear.experiments.evaluation import _exact_data, evaluate_inputs
from spear.experiments.run import EXACT_ATOL, ExperimentSettings, prepare_model, versions
from spear.fl import simulate_round
from spear.inversion import Inversion


def run_cascade_experiment(
    settings: ExperimentSettings,
    layers: Sequence[str] | None = None,
    attack_budget: float | None = None,
    max_rounds: int = 4,
    progress: Callable[[CascadeStep], None] | None = None,
) -> dict[str, Any]:
    """The JSON-ready record of one cascade on the settings' batch (FedSGD; ``time_budget`` and
    ``max_proposals`` of the settings bound the whole cascade and each attack)."""
    dataset = load_dataset(settings.dataset)
    model, _, _ = prepare_model(settings, dataset)
    protocol = settings.make_protocol()
    view, secret = simulate_round(model, dataset, settings.batch_size, protocol, settings.seed)
    began = time.perf_counter()
    # --- the attacker's side: the server's view only ---
    result = attack_model(
        view.model,
        view.gradients,
        layers,
        time_budget=settings.time_budget,
        attack_budget=attack_budget,
        max_rounds=max_rounds,
        progress=progress,
        seed=settings.seed,
        max_proposals=settings.max_proposals,
        p_fr=settings.p_fr,
        proposer=settings.proposer,
        device=settings.device,
    )
    seconds = time.perf_counter() - began
    # --- evaluation: ground truth meets the result ---
    atol = EXACT_ATOL[settings.arithmetic_dtype]
    record: dict[str, Any] = {"settings": settings.as_dict(), "cascade": result.summary(), "seconds": seconds}
    inputs, labels = result.inputs.cpu(), result.labels.cpu()  # whatever device the attack ran on
    if result.complete:
        scored = evaluate_inputs(dataset, inputs, labels, secret, atol)
        record.update(scored.record)
    else:
        found = Inversion(inputs, "cascade", False, exact=torch.ones(len(inputs), dtype=torch.bool))
        record["exact_samples"] = _exact_data(dataset, found, secret, atol)
        record["batch_size"] = settings.batch_size
    record["versions"] = versions()
    return record
