"""Gradient matching: the objective every optimization attack minimises and LAVP differentiates.

A candidate batch ``x`` with labels ``y`` is scored by how far its gradient, computed through the
server's own model, lies from the gradient the client sent:

* ``l2``: ``sum_k ||g_k(x) - g_k||^2`` over the parameters (DLG, Zhu et al. 2019);
* ``cosine``: ``1 - <g(x), g> / (||g(x)|| ||g||)`` over all parameters at once (Geiping et al.
  2020, Eq. 4; their ``cost_fn="sim"``).

The client's loss is the mean cross-entropy, the FedSGD update spear-fl simulates; labels are
class indices or, for DLG's soft dummy labels, probability rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from spear.errors import InputError


def parameter_gradients(
    model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, *, create_graph: bool = True
) -> list[torch.Tensor]:
    """The gradient of the mean cross-entropy of ``(inputs, labels)`` for every parameter of
    ``model``, in ``model.parameters()`` order, differentiable in ``inputs`` (``create_graph``)."""
    params = [p for p in model.parameters()]
    loss = nn.functional.cross_entropy(model(inputs), labels)
    return list(torch.autograd.grad(loss, params, create_graph=create_graph))


def l2_distance(grads: Sequence[torch.Tensor], target: Sequence[torch.Tensor]) -> torch.Tensor:
    """``sum_k ||grads_k - target_k||^2`` (DLG's matching loss)."""
    return sum(((g - t) ** 2).sum() for g, t in zip(grads, target, strict=True))


def cosine_distance(grads: Sequence[torch.Tensor], target: Sequence[torch.Tensor]) -> torch.Tensor:
    """``1 - cos(grads, target)`` with both flattened over all parameters (Geiping et al. 2020)."""
    dot = sum((g * t).sum() for g, t in zip(grads, target, strict=True))
    norm_g = sum((g * g).sum() for g in grads).sqrt()
    norm_t = sum((t * t).sum() for t in target).sqrt()
    return 1 - dot / (norm_g * norm_t).clamp(min=torch.finfo(norm_t.dtype).tiny)


#: the matching losses by name
MATCHING: dict[str, Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], torch.Tensor]] = {
    "l2": l2_distance,
    "cosine": cosine_distance,
}


def matching_loss(name: str) -> Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], torch.Tensor]:
    if name not in MATCHING:
        raise InputError(f"unknown matching loss {name!r}; choose one of {', '.join(MATCHING)}")
    return MATCHING[name]


def ordered_gradients(model: nn.Module, gradients) -> list[torch.Tensor]:
    """The server's gradients in ``model.parameters()`` order, in the model's dtype."""
    dtype = next(model.parameters()).dtype
    return [gradients[name].detach().to(dtype) for name, _ in model.named_parameters()]
