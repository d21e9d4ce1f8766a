"""Models of the paper's experiments: fully connected ReLU networks (Section 6)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from spear.errors import InputError


def _kaiming(layer: nn.Linear) -> None:
    nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
    nn.init.zeros_(layer.bias)


def _xavier(layer: nn.Linear) -> None:
    nn.init.xavier_uniform_(layer.weight)
    nn.init.zeros_(layer.bias)


def _normal(layer: nn.Linear) -> None:
    nn.init.normal_(layer.weight, std=0.05)
    nn.init.normal_(layer.bias, std=0.05)


#: weight initialisations; "default" is PyTorch's (Kaiming-uniform weights, uniform bias)
INITS: dict[str, Callable[[nn.Linear], None] | None] = {
    "default": None,
    "kaiming": _kaiming,
    "xavier": _xavier,
    "normal": _normal,
}


def fully_connected(
    in_features: int,
    width: int = 200,
    depth: int = 6,
    classes: int = 10,
    *,
    init: str = "default",
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> nn.Sequential:
    """``depth`` linear layers (``depth - 1`` hidden of ``width``, ReLU between) -> ``classes``.

    The paper's default is depth 6, width 200. Layer ``"0"`` is the first linear layer.
    Note: with ``init="kaiming"`` or ``"xavier"`` biases start at zero, so dL/db is still informative
    but the first forward pass is bias-free.
    """
    if depth < 2:
        raise InputError("depth must be >= 2 (the attacked layer plus an output layer)")
    if width < 2 or in_features < 1 or classes < 2:
        raise InputError("width must be >= 2, in_features >= 1, classes >= 2")
    if init not in INITS:
        raise InputError(f"unknown init {init!r}; choose one of {sorted(INITS)}")
    torch.manual_seed(seed)
    sizes = [in_features] + [width] * (depth - 1)
    layers: list[nn.Module] = []
    for i in range(depth - 1):
        layers += [nn.Linear(sizes[i], sizes[i + 1]), nn.ReLU()]
    layers.append(nn.Linear(sizes[-1], classes))
    initialise = INITS[init]
    if initialise is not None:
        for layer in layers:
            if isinstance(layer, nn.Linear):
                initialise(layer)
    return nn.Sequential(*layers).to(dtype)


def shallow_mlp(
    in_features: int,
    width: int = 1000,
    classes: int = 10,
    *,
    first_std: float = 0.5,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> nn.Sequential:
    """``Linear(in, width) -> ReLU -> Linear(width, classes)`` with first-layer weights
    N(0, first_std^2), a Xavier-uniform second layer and all biases zero: the passive setting of
    the LT-code peeling paper (Shariati & Meybodi 2026, F -> 1000 -> 10, std 0.5)."""
    if width < 2 or in_features < 1 or classes < 2:
        raise InputError("width must be >= 2, in_features >= 1, classes >= 2")
    if not first_std > 0:
        raise InputError(f"first_std must be positive, got {first_std}")
    torch.manual_seed(seed)
    first, second = nn.Linear(in_features, width), nn.Linear(width, classes)
    nn.init.normal_(first.weight, std=first_std)
    nn.init.xavier_uniform_(second.weight)
    nn.init.zeros_(first.bias)
    nn.init.zeros_(second.bias)
    return nn.Sequential(first, nn.ReLU(), second).to(dtype)


def small_cnn(
    image_shape: tuple[int, int, int],
    hidden: int = 256,
    classes: int = 10,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> nn.Sequential:
    """A LeNet-style CNN whose classifier head is a ReLU MLP: two 5x5 convolutions (6 and 16
    channels, ReLU, 2x2 max-pool) -> ``Linear(features, hidden)`` -> ReLU -> ``Linear(hidden,
    classes)``. It takes flattened images (B, C*H*W), like every client model here; the first
    layer unflattens them. Its attack surface is the head (paper Sec. 6, Table 6): the first
    Linear's inputs are the conv features, nonnegative and sparse after ReLU and pooling.
    The attacked layer's name is :func:`feature_layer` of the model ("8").

    With 28x28 inputs (MNIST) the features are 16 x 5 x 5 = 400, as in LeNet-5 on 32x32.
    """
    channels, height, width = image_shape
    if min(channels, height, width) < 1 or height < 12 or width < 12:
        raise InputError(f"small_cnn needs images of at least 12x12 pixels, got {image_shape}")
    if hidden < 2 or classes < 2:
        raise InputError("hidden must be >= 2 and classes >= 2")
    torch.manual_seed(seed)
    conv = nn.Sequential(
        nn.Unflatten(1, (channels, height, width)),
        nn.Conv2d(channels, 6, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )
    features = conv(torch.zeros(1, channels * height * width)).shape[1]
    head = [nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes)]
    return nn.Sequential(*conv, *head).to(dtype)


def feature_layer(model: nn.Sequential) -> str:
    """The name of the first ``nn.Linear`` of a sequential model: for :func:`small_cnn` the
    layer whose inputs are the conv features, for an MLP its first layer."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            return name
    raise InputError("the model has no nn.Linear layer to attack")
