"""Simulated FL clients and the server's view of their updates."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from spear import checks
from spear.data.base import ImageDataset, sample_batch
from spear.errors import InputError
from spear.fl.protocols.base import Protocol
from spear.inversion.base import check_no_random_masks


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
    clients: torch.Tensor | None = None  # (b,) which client held each sample (secure aggregation)


@checks.outside_inference_mode
def fedsgd_gradients(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """The FedSGD update: gradients of the mean cross-entropy over the batch, by parameter name.

    The model is left unchanged (its .grad fields are restored). Frozen parameters
    (``requires_grad=False``) send no gradient and are left out, as a client's optimizer does."""
    checks.differentiable(model)
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    logits = model(_checked_inputs(model, inputs))
    loss = nn.functional.cross_entropy(logits, _checked_labels(labels, logits))
    grads = torch.autograd.grad(loss, list(params.values()))
    return {name: g.detach().clone() for name, g in zip(params, grads, strict=True)}


def _checked_inputs(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """Floating-point inputs in the model's dtype (integer inputs, e.g. token ids, pass as they are)."""
    if not isinstance(inputs, torch.Tensor):
        raise InputError(f"inputs must be a tensor, got {type(inputs).__name__}")
    dtype = next(model.parameters()).dtype
    if inputs.is_floating_point() and inputs.dtype != dtype:
        raise InputError(
            f"inputs are {inputs.dtype} but the model computes in {dtype}; cast one to the other"
        )
    return inputs


def _checked_labels(labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Class indices (any integer dtype, as long) within the logits' classes, or class
    probabilities of the logits' shape, one row per input."""
    if not isinstance(labels, torch.Tensor):
        raise InputError(f"labels must be a tensor, got {type(labels).__name__}")
    # cross-entropy's classes are dimension 1 of (B, C) or (B, C, d1, ...) logits
    classes = logits.shape[1] if logits.ndim > 1 else logits.shape[0]
    expected = (logits.shape[0], *logits.shape[2:]) if logits.ndim > 1 else ()
    if labels.is_floating_point():  # soft labels: one distribution per input
        if labels.shape != logits.shape:
            raise InputError(
                f"soft labels must have the logits' shape {tuple(logits.shape)}, got {tuple(labels.shape)}"
            )
        return labels
    if labels.dtype == torch.bool or labels.is_complex() or tuple(labels.shape) != expected:
        raise InputError(
            f"labels must be class indices of shape {expected} (or float class probabilities of shape "
            f"{tuple(logits.shape)}); got {labels.dtype} {tuple(labels.shape)}"
        )
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= classes):
        raise InputError(f"labels must lie in [0, {classes}) for this model's {classes} outputs")
    return labels.long()


def layer_inputs(model: nn.Module, layer: str, inputs: torch.Tensor) -> torch.Tensor:
    """What the module ``layer`` of ``model`` saw when the client ran ``inputs`` through it: the
    ground truth an attack on a later or a feature layer recovers (evaluation code only). A
    training-mode dropout below ``layer`` is refused: this forward pass would draw other masks
    than the client's, and call them the truth."""
    modules = dict(model.named_modules())
    if layer not in modules:
        raise InputError(f"model has no module named {layer!r}")
    check_no_random_masks(model, layer, "the inputs layer_inputs would replay")
    seen: list[torch.Tensor] = []
    hook = modules[layer].register_forward_hook(lambda module, args, output: seen.append(args[0]))
    try:
        with torch.no_grad():
            model(inputs)
    finally:
        hook.remove()
    return seen[0].detach()


@checks.outside_inference_mode
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
    checks.differentiable(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    dtype = next(model.parameters()).dtype
    for step in range(steps):
        images, labels = sample_batch(
            dataset, min(batch_size, len(dataset)), seed=checks.derived_seed(seed, step, 7919, 10_000)
        )
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(dataset.normalize(images).to(dtype)), labels)
        loss.backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    return model


def _check_input_size(model: nn.Module, dataset: ImageDataset) -> None:
    """A clear error when the model cannot take the data set's flattened images."""
    first = next((m for m in model.modules() if not isinstance(m, nn.Sequential)), None)
    if isinstance(first, nn.Linear):
        expected = first.in_features
    elif isinstance(first, nn.Unflatten):
        expected = math.prod(first.unflattened_size)
    else:
        return
    if expected != dataset.features:
        raise InputError(
            f"the model's first layer takes {expected} features but {dataset.name} images have "
            f"{dataset.features}"
        )


def _check_classes(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, name: str) -> None:
    """A clear error when the model's output has fewer classes than the batch's labels need
    (a label beyond them fails deep in the loss): one sample's forward pass tells, on a copy in
    eval mode (no running statistics updated, no dropout drawn from the client's generator)."""
    with torch.no_grad():
        out = copy.deepcopy(model).eval()(inputs[:1])
    if out.ndim != 2 or int(labels.max()) >= out.shape[1]:
        raise InputError(
            f"the model's output has shape {tuple(out.shape)} for one sample, but {name}'s labels go up "
            f"to {int(labels.max())}: a classifier needs one logit per class (e.g. fully_connected(..., "
            "classes=dataset.classes))"
        )


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
    return simulate_round(
        model, dataset, batch_size, seed=seed, single_label=single_label, normalize=normalize
    )


@checks.outside_inference_mode
def simulate_round(
    model: nn.Module,
    dataset: ImageDataset,
    batch_size: int,
    protocol: Protocol | None = None,
    seed: int = 0,
    *,
    clients: int = 1,
    single_label: bool = False,
    normalize: bool = True,
) -> tuple[ServerView, ClientBatch]:
    """One FL round: ``clients`` clients each draw ``batch_size`` samples (disjoint), run
    ``protocol`` (default FedSGD) in the model's dtype, and the server receives their updates.

    With ``clients > 1`` the server sees only the **sum** of the updates, as under secure
    aggregation: one batch of ``clients * batch_size`` samples in which each client's part
    carries its own ``1 / batch_size`` (Bonawitz et al. 2017). Returns the server's view and the
    private batches (concatenated, with each sample's client in ``ClientBatch.clients``).
    """
    from spear.fl.protocols import FedSGD

    protocol = protocol or FedSGD()
    if not hasattr(protocol, "client_update"):
        raise InputError(
            f"protocol must be a spear.fl.protocols Protocol (e.g. FedAvg(...)), got {protocol!r:.40}"
        )
    if not hasattr(dataset, "features") or not hasattr(dataset, "normalize"):
        raise InputError(
            f"dataset must be a spear.data data set (load_dataset(...)), got {type(dataset).__name__}"
        )
    batch_size, seed = checks.integer("batch_size", batch_size, 1), checks.seed(seed)
    clients = checks.integer("clients", clients, 1)
    protocol.check_batch(batch_size)
    checks.differentiable(model)
    _check_input_size(model, dataset)
    dtype = next(model.parameters()).dtype
    images, labels = sample_batch(dataset, batch_size * clients, seed, single_label=single_label)
    inputs = (dataset.normalize(images) if normalize else images.flatten(1)).to(dtype)
    _check_classes(model, inputs, labels, dataset.name)
    owner = torch.arange(clients).repeat_interleave(batch_size)
    total: dict[str, torch.Tensor] = {}
    for k in range(clients):
        part = owner == k
        update = protocol.client_update(model, inputs[part], labels[part], seed=checks.derived_seed(seed, k))
        total = update if not total else {name: total[name] + update[name] for name in total}
    metadata = {"dataset": dataset.name, **protocol.settings(), "clients": clients}
    view = ServerView(copy.deepcopy(model), total, protocol.name, metadata)
    return view, ClientBatch(images, inputs, labels, owner if clients > 1 else None)
