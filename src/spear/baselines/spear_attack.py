"""SPEAR (Dimitrov et al. 2024) behind the common attack interface, alone or with an optimization
prior (paper Table 5).

:class:`SpearAttack` runs :func:`spear.attack_layer` on the model's feature layer (or ``layer``),
then takes hidden inputs back to the data (:func:`spear.inversion.invert_to_inputs`). The output
is verified when the client's data is proven. :class:`SpearWithPrior` first runs an optimization
attack (Geiping et al. by default) and hands its approximate batch, pushed through the layers
below, to guided sampling (:class:`spear.core.proposers.PriorGuidedProposer`).
"""

from __future__ import annotations

from typing import Any

import torch

import spear
from spear.baselines.base import Attack, AttackOutput, AttackTarget
from spear.baselines.geiping import GeipingAttack
from spear.core.proposers import PriorGuidedProposer
from spear.fl import attackable_layers, feature_layer, layer_inputs
from spear.inversion import InversionSettings, invert_to_inputs, layers_below
from spear.inversion.base import acting_layers_below


class SpearAttack(Attack):
    """The exact attack. ``options`` go to :func:`spear.attack_layer` (``max_proposals``,
    ``time_budget``, ``proposer``, ...)."""

    name = "spear"

    def __init__(self, layer: str | None = None, **options: Any) -> None:
        self.layer = layer
        self.options = options

    def settings(self) -> dict[str, Any]:
        return {"layer": self.layer, **{k: v for k, v in self.options.items() if k != "progress"}}

    def run(self, target: AttackTarget) -> AttackOutput:
        return self._attack(target, dict(self.options))

    def _attack(self, target: AttackTarget, options: dict[str, Any]) -> AttackOutput:
        model = target.model
        layer = self.layer or feature_layer(model)
        options.setdefault("sparsity", attackable_layers(model).get(layer, "output"))
        rec = spear.attack_layer(model, layer, target.gradients, seed=target.seed, **options)
        rec = rec.to(next(model.parameters()).device)  # the inversion runs on the model
        inputs, verified, notes = rec.inputs, rec.verified, list(rec.notes)
        details: dict[str, Any] = {"layer": layer, "reconstruction": rec.summary()}
        hidden = bool(acting_layers_below(model, layer))
        if hidden and rec.inputs is not None and rec.grad_outputs is not None:
            domain = target.domain
            image_shape = domain.shape if domain.image else None
            to_inputs = domain.to_inputs if domain.image else None
            inversion = invert_to_inputs(
                model,
                layer,
                target.gradients,
                rec,
                image_shape=image_shape,
                to_inputs=to_inputs,
                settings=InversionSettings(seed=target.seed),
            )
            inputs, verified = inversion.inputs, inversion.verified
            notes += inversion.notes
            details["inversion"] = inversion.as_dict()
        elif hidden:
            inputs = None
        labels = None if rec.labels is None or inputs is None else rec.labels.clone()
        return AttackOutput(
            self.name, inputs, labels, verified, notes=notes, details=details, reconstruction=rec
        )


class SpearWithPrior(SpearAttack):
    """SPEAR whose guided sampler is seeded by an optimization attack's approximate batch."""

    name = "spear+prior"

    def __init__(self, prior: Attack | None = None, layer: str | None = None, **options: Any) -> None:
        super().__init__(layer, **options)
        self.prior = prior if prior is not None else GeipingAttack()

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "prior": self.prior.name, "prior_settings": self.prior.settings()}

    def run(self, target: AttackTarget) -> AttackOutput:
        approximate = self.prior(target)
        layer = self.layer or feature_layer(target.model)
        guesses = approximate.inputs.to(target.dtype)
        if layers_below(target.model, layer):
            guesses = layer_inputs(target.model, layer, guesses)  # the server's own forward pass
        options = dict(self.options)
        options["proposer"] = PriorGuidedProposer(guesses.to(torch.float64))
        output = self._attack(target, options)
        output.details["prior"] = approximate.as_dict()
        output.notes.insert(
            0, f"guided by {self.prior.name}'s approximate batch ({approximate.seconds:.1f} s)"
        )
        return output
