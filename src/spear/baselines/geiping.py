"""Inverting Gradients (Geiping, Bauermeister, Droege & Moeller, NeurIPS 2020).

Minimise the cosine distance between the candidate batch's gradient and the client's, plus
total variation, with signed Adam steps and a box constraint:

    x* = argmin_{x in box}  1 - cos(grad L(x, y), g)  +  tv * TV(x)

Defaults are the configuration the authors' ``reconstruct_image.py`` runs ("ours", package
``inversefed``): ``cost_fn="sim"`` over all parameters (``indices="def"``) with equal weights,
``signed=True``, ``boxed=True``, Adam with lr 0.1 decayed 10x at 3/8, 5/8 and 7/8 of 4000
iterations, ``init="randn"`` in the model's (normalized) input space, TV weight 1e-4, one
restart (the best of ``restarts`` by final matching loss). Labels are given, or recovered from the
output layer (:mod:`spear.baselines.labels`: iDLG's rule at b = 1, as inversefed does; for
b > 1 class counts from the bias gradient, where inversefed optimizes one dummy label vector).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spear.baselines.base import Attack, AttackOutput, AttackTarget
from spear.baselines.labels import recover_labels
from spear.baselines.matching import matching_loss, ordered_gradients, parameter_gradients
from spear.checks import derived_seed
from spear.errors import InputError
from spear.inversion.optimization import total_variation


@dataclass(frozen=True)
class GeipingConfig:
    iterations: int = 4000
    lr: float = 0.1
    tv: float = 1e-4
    restarts: int = 1
    signed: bool = True
    boxed: bool = True
    lr_decay: bool = True
    cost: str = "cosine"

    def __post_init__(self) -> None:
        if self.iterations < 0 or self.restarts < 1 or self.lr <= 0 or self.tv < 0:
            raise InputError(
                f"invalid Geiping settings {self}: iterations >= 0, restarts >= 1, lr > 0, tv >= 0"
            )
        matching_loss(self.cost)


@dataclass
class OptimizationRun:
    """One restart's state: the candidate batch, its best iterate and the loss history ends."""

    inputs: torch.Tensor
    best_loss: float = float("inf")
    best_inputs: torch.Tensor | None = None
    first_loss: float = float("nan")

    def record(self, loss: float, inputs: torch.Tensor | None = None) -> None:
        """Note the matching loss of ``inputs`` (default: the current iterate)."""
        if self.first_loss != self.first_loss:
            self.first_loss = loss
        if loss < self.best_loss:  # NaN never compares smaller: a diverged step is never kept
            self.best_loss = loss
            self.best_inputs = (self.inputs if inputs is None else inputs).detach().clone()


class GeipingAttack(Attack):
    """Cosine gradient matching with total variation (Geiping et al. 2020)."""

    name = "geiping"

    def __init__(self, config: GeipingConfig | None = None, **overrides) -> None:
        self.config = GeipingConfig(**overrides) if config is None else config

    def run(self, target: AttackTarget) -> AttackOutput:
        labels = target.labels if target.labels is not None else recover_labels(target)
        best: OptimizationRun | None = None
        for restart in range(self.config.restarts):
            trial = self._optimize(target, labels, seed=derived_seed(target.seed, restart))
            if best is None or trial.best_loss < best.best_loss:
                best = trial
        assert best is not None and best.best_inputs is not None
        source = "given" if target.labels is not None else "recovered from the output layer"
        return AttackOutput(
            self.name,
            best.best_inputs.to(torch.float64),
            labels.clone(),
            objective={"start": best.first_loss, "end": best.best_loss},
            notes=[f"labels {source}; an estimate by optimization, never verified"],
        )

    def _optimize(self, target: AttackTarget, labels: torch.Tensor, seed: int) -> OptimizationRun:
        cfg = self.config
        model, dtype = target.model, target.dtype
        truth = ordered_gradients(model, target.gradients)
        n = target.input_size
        generator = torch.Generator().manual_seed(seed)
        inputs = torch.randn(target.batch_size, n, generator=generator, dtype=dtype).requires_grad_(True)
        bounds = target.domain.input_bounds(dtype) if cfg.boxed else None
        optimizer = torch.optim.Adam([inputs], lr=cfg.lr)
        milestones = [int(cfg.iterations * f) for f in (3 / 8, 5 / 8, 7 / 8)] if cfg.lr_decay else []
        schedule = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones, gamma=0.1)
        distance = matching_loss(cfg.cost)
        run = OptimizationRun(inputs)
        labels = labels.to(inputs.device)
        for step in range(cfg.iterations + 1):
            loss = distance(parameter_gradients(model, inputs, labels), truth)
            run.record(float(loss.detach()))  # the matching loss of the current iterate (the score)
            if step == cfg.iterations:
                break
            if cfg.tv > 0 and target.domain.image:
                loss = loss + cfg.tv * total_variation(target.domain.samples(inputs)).mean()
            (inputs.grad,) = torch.autograd.grad(loss, [inputs])
            if cfg.signed:
                inputs.grad.sign_()
            optimizer.step()
            schedule.step()
            if bounds is not None:
                with torch.no_grad():
                    inputs.copy_(torch.maximum(torch.minimum(inputs, bounds[1]), bounds[0]))
        return run
