"""Label recovery from the output layer's gradient, for attacks that need labels first.

With the mean cross-entropy over b samples, the output bias gradient is
``dL/db = mean_j (softmax(f(x_j)) - onehot(y_j))``. For b = 1 its only negative entry is the
label (iDLG, Zhao et al. 2020). For b > 1, ``b * (p_mean - dL/db)`` counts the samples of each
class, where ``p_mean`` is the mean softmax over the batch; the server does not know it, and
estimates it as the model's mean softmax over random samples of the data domain (the idea of
LLG's impact estimate, Wainakh et al. 2022). Counts are rounded by largest remainder to sum to b,
and every class with a negative entry (certainly present) gets at least one sample.
"""

from __future__ import annotations

import torch
from torch import nn

from spear.baselines.base import AttackTarget
from spear.errors import InputError

#: random domain samples for the mean-softmax estimate
PROBE_SAMPLES = 256


def output_layer(model: nn.Module) -> tuple[str, nn.Linear]:
    """The name and module of the model's last ``nn.Linear`` (the logits)."""
    linear = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linear:
        raise InputError("the model has no nn.Linear output layer to read labels from")
    return linear[-1]


def recover_labels(target: AttackTarget) -> torch.Tensor:
    """(b,) labels estimated from the server's view (sorted: the order of a batch is arbitrary)."""
    name, layer = output_layer(target.model)
    if layer.bias is None:
        row_sums = target.gradients[f"{name}.weight"].sum(1)
        if target.batch_size == 1:  # iDLG: the true class's row is the only negative one
            return row_sums.argmin().reshape(1).cpu()
        raise InputError("label recovery for b > 1 needs the output layer's bias gradient; pass labels")
    grad = target.gradients[f"{name}.bias"].detach().to(torch.float64).cpu()
    if target.batch_size == 1:
        return grad.argmin().reshape(1)
    counts = class_counts(grad, _mean_softmax(target), target.batch_size)
    return torch.repeat_interleave(torch.arange(grad.numel()), counts)


def class_counts(bias_grad: torch.Tensor, mean_softmax: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Integer class counts summing to ``batch_size`` from ``b * (p_mean - dL/db)``."""
    raw = (batch_size * (mean_softmax - bias_grad)).clamp(min=0)
    present = bias_grad < 0
    floor = present.long()  # a class with a negative entry has at least one sample
    counts = torch.maximum(raw.floor().long(), floor)
    while int(counts.sum()) > batch_size:  # too many: drop where the count exceeds raw the most
        excess = torch.where(counts > floor, counts - raw, torch.full_like(raw, -torch.inf))
        if not bool(torch.isfinite(excess).any()):
            excess = torch.where(counts > 0, counts - raw, torch.full_like(raw, -torch.inf))
        counts[int(excess.argmax())] -= 1
    remainder = raw - counts
    while int(counts.sum()) < batch_size:
        top = int(remainder.argmax())
        counts[top] += 1
        remainder[top] -= 1
    return counts


def _mean_softmax(target: AttackTarget) -> torch.Tensor:
    generator = torch.Generator().manual_seed(target.seed)
    domain = target.domain
    shape = (PROBE_SAMPLES, *domain.shape)
    if domain.low is not None and domain.high is not None:
        samples = domain.low + (domain.high - domain.low) * torch.rand(shape, generator=generator)
    else:
        samples = torch.randn(shape, generator=generator)
    inputs = domain.to_inputs(samples.to(torch.float64)).to(target.dtype)
    with torch.no_grad():
        return torch.softmax(target.model(inputs), dim=1).mean(0).to(torch.float64).cpu()
