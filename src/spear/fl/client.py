"""Simulated FL clients and the server's view of their updates."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from spear.data.base import ImageDataset, sample_batch
from spear.errors import InputError


@dataclass
class ServerView:
    """Everything an honest-but-curious server holds after one round: the global model it sent
    and the update the client returned (gradients by parameter name). Nothing else."""

    model: nn.Module
    gradients: dict[str, torch.Tensor]
    protocol: str = "fedsgd"
    metadata: dict = field(default_factory=dict)


@dataclass
class ClientBatch:
    """The client's private batch: ground truth for evaluation code only."""

    images: torch.Tensor  # (b, C, H, W) in [0, 1]
    inputs: torch.Tensor  # (b, n) normalized, flattened: what the first layer saw
    labels: torch.Tensor


def fedsgd_gradients(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """The FedSGD update: gradients of the mean cross-entropy over the batch, by parameter name.

    The model is left unchanged (its .grad fields are restored)."""
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(nn.functional.cross_entropy(model(inputs), labels), list(params.values()))
    return {name: g.detach().clone() for name, g in zip(params, grads, strict=True)}


def pretrain(
    model: nn.Module,
    dataset: ImageDataset,
    steps: int,
    batch_size: int = 64,
    lr: float = 0.05,
    seed: int = 0,
) -> nn.Module:
    """Train ``model`` in place for ``steps`` SGD steps on ``dataset`` (paper Fig. 7)."""
    if steps < 0:
        raise InputError("steps must be >= 0")
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    dtype = next(model.parameters()).dtype
    for step in range(steps):
        images, labels = sample_batch(
            dataset, min(batch_size, len(dataset)), seed=10_000 + seed * 7919 + step
        )
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(dataset.normalize(images).to(dtype)), labels)
        loss.backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    return model


def simulate_fedsgd(
    model: nn.Module,
    dataset: ImageDataset,
    batch_size: int,
    seed: int = 0,
    *,
    single_label: bool = False,
    normalize: bool = True,
) -> tuple[ServerView, ClientBatch]:
    """One FedSGD round: a client draws a batch, computes its gradient and sends it.

    ``normalize=False`` feeds the raw images in [0, 1] (``ToTensor`` without ``Normalize``, as in
    many FL code bases and the LT-code paper's setting) instead of standardized ones.
    Returns the server's view (a copy of the model and the gradients) and the private batch.
    """
    in_features = next(m for m in model.modules() if isinstance(m, nn.Linear)).in_features
    if in_features != dataset.features:
        raise InputError(
            f"the model's first layer takes {in_features} features but {dataset.name} images have "
            f"{dataset.features}"
        )
    dtype = next(model.parameters()).dtype
    images, labels = sample_batch(dataset, batch_size, seed, single_label=single_label)
    inputs = (dataset.normalize(images) if normalize else images.flatten(1)).to(dtype)
    grads = fedsgd_gradients(model, inputs, labels)
    view = ServerView(copy.deepcopy(model), grads, "fedsgd", {"dataset": dataset.name})
    return view, ClientBatch(images, inputs, labels)
