"""Attacks side by side on identical batches (``spear compare``): one simulated FedSGD round, the
server's view handed to every method (:mod:`spear.baselines`), every result scored by the same
metrics after the same order-invariant matching.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from spear.baselines import AttackOutput, make_attack
from spear.errors import InputError, SpearError
from spear.experiments.case import ClientCase
from spear.experiments.evaluation import evaluate_inputs
from spear.experiments.run import EXACT_ATOL, ExperimentSettings, versions

#: what ``spear compare`` runs without ``--methods``
DEFAULT_METHODS = ("spear", "geiping", "dlg", "cpa")
#: how the optimization baselines get labels: recovered from the output layer (the server's view)
#: or given (the ground truth, as many papers grant them)
LABEL_SOURCES = ("recovered", "given")


@dataclass
class Comparison:
    """Per method: a JSON-ready record and the reconstructed images in the truth's order."""

    records: list[dict[str, Any]]
    images: dict[str, torch.Tensor | None]
    truth: torch.Tensor | None
    settings: ExperimentSettings
    batch: dict[str, Any] = field(default_factory=dict)


def spear_options(settings: ExperimentSettings, progress=None) -> dict[str, Any]:
    """The experiment's attack settings as options of :class:`spear.baselines.SpearAttack`."""
    options = {
        "max_proposals": settings.max_proposals,
        "time_budget": settings.time_budget,
        "p_fr": settings.p_fr,
        "device": settings.device,
        "progress": progress,
    }
    if settings.proposer != "auto":
        options["proposer"] = settings.proposer
    return options


def run_comparison(
    settings: ExperimentSettings,
    methods: Sequence[str] = DEFAULT_METHODS,
    method_options: Mapping[str, Mapping[str, Any]] | None = None,
    labels: str = "recovered",
    on_result: Callable[[dict[str, Any]], None] | None = None,
    progress=None,
) -> Comparison:
    """Run ``methods`` on one batch drawn by ``settings`` (FedSGD, one client) and score each.

    ``method_options`` overrides a method's settings by name (e.g. ``{"geiping": {"iterations":
    500}}``); SPEAR's come from ``settings`` (budget, proposer, layer)."""
    if not methods:
        raise InputError("name at least one method to compare")
    if len(set(methods)) != len(methods):
        raise InputError(f"each method once, please: got {', '.join(methods)}")
    if labels not in LABEL_SOURCES:
        raise InputError(f"labels must be one of {', '.join(LABEL_SOURCES)}, got {labels!r}")
    if settings.protocol != "fedsgd" or settings.clients != 1:
        raise InputError(
            "compare runs on one client's FedSGD gradient (the baselines match FedSGD gradients); "
            f"got protocol {settings.protocol} with {settings.clients} client(s)"
        )
    case = ClientCase.draw(settings)
    dataset, layer, secret = case.dataset, case.layer, case.secret
    target = case.target(labels_given=labels == "given")
    attacks = []
    for name in methods:
        options = dict((method_options or {}).get(name, {}))
        if name.startswith("spear"):
            options = {**spear_options(settings, progress), "layer": layer, **options}
        elif name == "cpa":
            options.setdefault("layer", layer)
        attacks.append(make_attack(name, **options))  # all built first: bad options fail early
    records, images = [], {}
    atol = EXACT_ATOL[settings.arithmetic_dtype]
    for attack in attacks:
        try:
            output = attack(target)
        except SpearError as exc:  # one method's failure is its record, not the comparison's end
            output = AttackOutput(attack.name, None, notes=[f"{type(exc).__name__}: {exc}"])
        evaluation = evaluate_inputs(
            dataset, output.inputs, output.labels, secret, atol, output.reconstruction
        )
        record = {
            "method": attack.name,
            "method_settings": attack.settings(),
            "settings": settings.as_dict(),
            "layer": layer,
            "labels_given": labels == "given",
            **evaluation.record,
            **output.as_dict(),
            "versions": versions(),
        }
        records.append(record)
        images[attack.name] = evaluation.matched
        if on_result is not None:
            on_result(record)
    truth = secret.images if dataset.modality == "image" else None
    return Comparison(records, images, truth, settings)
