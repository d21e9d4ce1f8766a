"""Deep Leakage from Gradients (Zhu, Liu & Han, NeurIPS 2019) and iDLG (Zhao, Mopuri & Bilen 2020).

DLG minimises the squared L2 distance between the dummy batch's gradient and the client's with
L-BFGS, optimizing dummy inputs and dummy *soft* labels (softmax of free logits) together:

    min_{x, z}  ||grad L(x, softmax(z)) - g||^2

Defaults are the authors' (``mit-han-lab/dlg``): ``torch.optim.LBFGS(lr=1)`` with its default 20
inner iterations per step, 300 steps, dummy data and label logits drawn from N(0, 1), no box
constraint. iDLG reads a single sample's label off the output layer (its only negative bias, or
weight-row, gradient) and optimizes the input alone; :class:`DLGAttack` uses it at b = 1
(``idlg=True``), or given labels at any b. L-BFGS can diverge: the best iterate by matching loss
is returned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spear.baselines.base import Attack, AttackOutput, AttackTarget
from spear.baselines.geiping import OptimizationRun
from spear.baselines.labels import recover_labels
from spear.baselines.matching import l2_distance, ordered_gradients, parameter_gradients
from spear.errors import InputError


@dataclass(frozen=True)
class DLGConfig:
    iterations: int = 300
    lr: float = 1.0
    inner_iterations: int = 20
    idlg: bool = True

    def __post_init__(self) -> None:
        if self.iterations < 0 or self.inner_iterations < 1 or self.lr <= 0:
            raise InputError(f"invalid DLG settings {self}: iterations >= 0, inner_iterations >= 1, lr > 0")


class DLGAttack(Attack):
    """L2 gradient matching with L-BFGS (DLG), with iDLG's label at b = 1."""

    name = "dlg"

    def __init__(self, config: DLGConfig | None = None, **overrides) -> None:
        self.config = DLGConfig(**overrides) if config is None else config

    def run(self, target: AttackTarget) -> AttackOutput:
        cfg, model, dtype = self.config, target.model, target.dtype
        truth = ordered_gradients(model, target.gradients)
        generator = torch.Generator().manual_seed(target.seed)
        b, n = target.batch_size, target.input_size
        inputs = torch.randn(b, n, generator=generator, dtype=dtype).requires_grad_(True)
        classes = model(inputs[:1]).shape[1]
        logits = torch.randn(b, classes, generator=generator, dtype=dtype).requires_grad_(True)
        fixed = target.labels
        how = "given"
        if fixed is None and b == 1 and cfg.idlg:
            fixed, how = recover_labels(target), "iDLG's rule"
        variables = [inputs] if fixed is not None else [inputs, logits]
        optimizer = torch.optim.LBFGS(variables, lr=cfg.lr, max_iter=cfg.inner_iterations)
        run = OptimizationRun(inputs)

        def objective() -> torch.Tensor:
            labels = fixed if fixed is not None else torch.softmax(logits, dim=1)
            return l2_distance(parameter_gradients(model, inputs, labels), truth)

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = objective()
            loss.backward()
            return loss

        for _ in range(cfg.iterations):
            before = inputs.detach().clone()
            run.record(float(optimizer.step(closure).detach()), before)  # the loss at `before`
            if not bool(torch.isfinite(inputs).all()):
                break  # diverged: keep the best iterate so far
        else:
            run.record(float(objective().detach()))
        labels = fixed if fixed is not None else logits.detach().argmax(1)
        source = how if fixed is not None else "optimized (soft dummy labels, argmax)"
        if run.best_inputs is None:  # diverged at the very start
            run.best_inputs = torch.zeros(b, n, dtype=dtype)
        return AttackOutput(
            self.name,
            run.best_inputs.to(torch.float64),
            labels.detach().clone().cpu(),
            objective={"start": run.first_loss, "end": run.best_loss},
            notes=[f"labels {source}; an estimate by optimization, never verified"],
        )
