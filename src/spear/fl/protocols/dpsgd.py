"""DP-SGD (Abadi et al. 2016) with Opacus: per-sample clipping to norm C and Gaussian noise of
standard deviation ``sigma C`` on the sum, divided by the batch size (SPEAR's App. E.6).

The client's step is Opacus' own: ``PrivacyEngine.make_private`` wraps the model, optimizer and
data loader, and one optimizer step on the client's batch gives the update the server sees
(``W_before - W_after`` at learning rate 1: the privatized mean gradient).

**Clipping alone changes nothing SPEAR relies on** (App. E.6): sample j's whole gradient is
multiplied by ``f_j = min(1, C / ||g_j||)``, every layer alike, so ``dL/dW`` is still
``sum_j (f_j / B) dL/dZ_j x_j^T`` with the same ReLU zeros. The model certificate then fits the
weight ``f_j / B`` instead of ``1 / B``; the server knows C, recomputes ``||g_j||`` from the
recovered sample and its label, and checks the weight (:class:`ClippedWeights`). Noise makes
the gradient full-rank and its zeros approximate: see the README for where recovery stops.
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from spear import checks
from spear.errors import InputError
from spear.fl.protocols.base import Protocol, named_update

#: noise multipliers beyond this give epsilon ~0 and overflow Opacus' accountant
MAX_NOISE_MULTIPLIER = 1e6
#: Opacus divides the clipping norm by ``||g_j|| + 1e-6`` (DPOptimizer.clip_and_accumulate)
OPACUS_NORM_EPS = 1e-6
#: the privacy accounting reported with every DP record: a plausible training run
DEFAULT_DELTA = 1e-5


@dataclass(frozen=True)
class TrainingRun:
    """A training run to account privacy for: ``steps`` steps at sampling rate ``sample_rate``
    (the client's batch over its data set). Default: 10 epochs of batches of 1% of the data."""

    sample_rate: float = 0.01
    steps: int = 1000


@dataclass
class DPSGD(Protocol):
    """One DP-SGD step (Opacus) with noise multiplier ``noise_multiplier`` and per-sample clipping
    norm ``max_grad_norm``; ``delta`` and ``run`` set the epsilon reported."""

    noise_multiplier: float = 0.0
    max_grad_norm: float = 1.0
    delta: float = DEFAULT_DELTA
    run: TrainingRun = TrainingRun()
    name: ClassVar[str] = "dpsgd"

    def __post_init__(self) -> None:
        if not 0 <= self.noise_multiplier <= MAX_NOISE_MULTIPLIER:
            raise InputError(
                f"the DP noise multiplier must be >= 0 and at most {MAX_NOISE_MULTIPLIER:g} "
                f"(got {self.noise_multiplier})"
            )
        if not 0 < self.max_grad_norm < math.inf:
            raise InputError(f"the DP clipping norm must be a finite number > 0 (got {self.max_grad_norm})")

    def epsilon(self) -> float:
        """Epsilon of ``run`` at ``delta`` from Opacus' RDP accountant (inf without noise)."""
        if self.noise_multiplier == 0:
            return float("inf")
        from opacus.accountants import RDPAccountant

        accountant = RDPAccountant()
        accountant.history = [(self.noise_multiplier, self.run.sample_rate, self.run.steps)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tiny noise: "optimal order is the smallest alpha"
            return float(accountant.get_epsilon(delta=self.delta))

    def settings(self) -> dict[str, Any]:
        return {
            "protocol": self.name,
            "dp_noise_multiplier": self.noise_multiplier,
            "dp_max_grad_norm": self.max_grad_norm,
            "dp_delta": self.delta,
            "dp_epsilon": self.epsilon(),
            "dp_accounting": {"sample_rate": self.run.sample_rate, "steps": self.run.steps},
        }

    def attack_options(self, model: nn.Module, update: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {"sample_weights": ClippedWeights(self.max_grad_norm)}

    @checks.outside_inference_mode
    def client_update(
        self, model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, seed: int = 0
    ) -> dict[str, torch.Tensor]:
        from opacus import PrivacyEngine

        b = inputs.shape[0]
        local = copy.deepcopy(model)
        before = {name: p.detach().clone() for name, p in local.named_parameters()}
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, labels), batch_size=b)
        optimizer = torch.optim.SGD(local.parameters(), lr=1.0)
        noise = torch.Generator().manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Opacus warns about secure RNG and the sample rate
            engine = PrivacyEngine(accountant="rdp")
            private, optimizer, loader = engine.make_private(
                module=local,
                optimizer=optimizer,
                data_loader=loader,
                noise_multiplier=self.noise_multiplier,
                max_grad_norm=self.max_grad_norm,
                poisson_sampling=False,
                noise_generator=noise,
            )
            for x, y in loader:
                optimizer.zero_grad()
                nn.functional.cross_entropy(private(x), y).backward()
                optimizer.step()
        return named_update(local, before, 1.0)


class ClippedWeights:
    """The loss weight DP-SGD's clipping gives each sample, up to the common ``1/B``:
    ``min(1, C / (||grad_theta loss(x_j, y_j)|| + 1e-6))`` over all parameters, as Opacus
    computes it. Needs the sample as the
    model's input (the attacked layer is the first)."""

    def __init__(self, max_grad_norm: float) -> None:
        self.max_grad_norm = max_grad_norm

    def __call__(self, model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        params = [p for p in model.parameters() if p.requires_grad]
        factors = []
        for x, y in zip(inputs, labels, strict=True):
            loss = nn.functional.cross_entropy(model(x[None]), y[None])
            grads = torch.autograd.grad(loss, params)
            norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads))
            factors.append(torch.clamp(self.max_grad_norm / (norm + OPACUS_NORM_EPS), max=1.0))
        return torch.stack(factors)
