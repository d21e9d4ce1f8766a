"""Models of the paper's experiments: fully connected ReLU networks (Section 6)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from spear import checks
from spear.errors import InputError
from spear.inversion.base import PASS_THROUGH, keeps_zeros


def _kaiming(layer: nn.Linear) -> None:
    nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
    nn.init.zeros_(layer.bias)


def _xavier(layer: nn.Linear) -> None:
    nn.init.xavier_uniform_(layer.weight)
    nn.init.zeros_(layer.bias)


def _normal(layer: nn.Linear) -> None:
    nn.init.normal_(layer.weight, std=0.05)
    nn.init.normal_(layer.bias, std=0.05)


def _seeded(seed: int, dtype: torch.dtype) -> None:
    """Check a model's seed and dtype before torch sees them, and seed torch's generator."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InputError(
            f"dtype must be a floating-point torch.dtype (torch.float64, torch.float32), got {dtype!r}"
        )
    torch.manual_seed(checks.seed(seed))


def _image_shape(image_shape: tuple[int, int, int]) -> tuple[int, int, int]:
    if not isinstance(image_shape, (tuple, list)) or len(image_shape) != 3:
        raise InputError(f"image_shape must be (channels, height, width), got {image_shape!r}")
    channels, height, width = image_shape
    return channels, height, width


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
    _seeded(seed, dtype)
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
    _seeded(seed, dtype)
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
    channels, height, width = _image_shape(image_shape)
    if min(channels, height, width) < 1 or height < 12 or width < 12:
        raise InputError(f"small_cnn needs images of at least 12x12 pixels, got {image_shape}")
    if hidden < 2 or classes < 2:
        raise InputError("hidden must be >= 2 and classes >= 2")
    _seeded(seed, dtype)
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


#: VGG-16's convolution stack (Simonyan & Zisserman 2015, configuration D): output channels of
#: each 3x3 convolution, "M" a 2x2 max-pool
VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")
#: the small VGG-style stack of ``--model cnn``: two blocks of two 3x3 convolutions
SMALL_VGG = (16, 16, "M", 32, 32, "M")


def vgg(
    image_shape: tuple[int, int, int],
    config: tuple[int | str, ...] = VGG16,
    head: tuple[int, ...] = (4096, 4096),
    classes: int = 1000,
    *,
    pool_to: tuple[int, int] | None = (7, 7),
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> nn.Sequential:
    """A VGG network without torchvision: 3x3 convolutions (padding 1) with ReLU and 2x2
    max-pools as ``config`` lists them, an optional adaptive average pool to ``pool_to``, then
    the classifier head ``Linear(features, head[0]) -> ReLU -> ... -> Linear(head[-1], classes)``.

    The defaults are VGG-16's shapes (13 convolutions, a 512 x 7 x 7 = 25,088-feature head of
    4096 -> 4096 -> 1000), the model of the paper's Table 6 and of the Cocktail Party Attack.
    Like every client model here it takes flattened images (B, C*H*W). The attacked layer is the
    head's first Linear (:func:`feature_layer`); its inputs, the conv features, are nonnegative
    and sparse after ReLU and pooling.
    """
    channels, height, width = _image_shape(image_shape)
    pools = sum(1 for c in config if c == "M")
    if min(channels, height, width) < 1 or min(height, width) < 2**pools:
        raise InputError(
            f"this VGG configuration pools {pools} times and needs images of at least {2**pools}x"
            f"{2**pools} pixels, got {image_shape}"
        )
    if not head or min(head) < 2 or classes < 2:
        raise InputError("the head needs at least one hidden layer of width >= 2, and classes >= 2")
    _seeded(seed, dtype)
    layers: list[nn.Module] = [nn.Unflatten(1, (channels, height, width))]
    previous = channels
    for entry in config:
        if entry == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(previous, int(entry), 3, padding=1), nn.ReLU()]
            previous = int(entry)
    if pool_to is not None:
        layers.append(nn.AdaptiveAvgPool2d(pool_to))
    layers.append(nn.Flatten())
    features = nn.Sequential(*layers)(torch.zeros(1, channels * height * width)).shape[1]
    sizes = (features, *head)
    for i in range(len(head)):
        layers += [nn.Linear(sizes[i], sizes[i + 1]), nn.ReLU()]
    layers.append(nn.Linear(head[-1], classes))
    return nn.Sequential(*layers).to(dtype)


def small_vgg(
    image_shape: tuple[int, int, int],
    width: int = 200,
    classes: int = 10,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> nn.Sequential:
    """``--model cnn``: a small VGG-style network for 28x28 to 64x64 images, two blocks of two
    3x3 convolutions (16 and 32 channels) with max-pools, then VGG's three-layer head
    ``Linear(features, width) -> ReLU -> Linear(width, width) -> ReLU -> Linear(width, classes)``.
    MNIST gives 32 x 7 x 7 = 1,568 features."""
    return vgg(image_shape, SMALL_VGG, (width, width), classes, pool_to=None, seed=seed, dtype=dtype)


def build_model(
    name: str,
    input_shape: tuple[int, ...],
    classes: int,
    *,
    width: int = 200,
    depth: int = 6,
    init: str = "default",
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> nn.Sequential:
    """The client model ``name`` of :data:`MODELS` for inputs of ``input_shape`` ((C, H, W) for
    images, (F,) for tabular rows)."""
    if name not in MODELS:
        raise InputError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    if name == "mlp":
        features = math.prod(input_shape)
        return fully_connected(features, width, depth, classes, init=init, seed=seed, dtype=dtype)
    if len(input_shape) != 3:
        raise InputError(
            f"--model {name} needs image data (C, H, W); this data set has rows of {input_shape}"
        )
    if init != "default":
        raise InputError(f"--init applies to --model mlp; {name} uses PyTorch's default initialisation")
    return small_vgg(input_shape, width, classes, seed=seed, dtype=dtype)


#: the client models the command line and the experiments build
MODELS = {
    "mlp": "fully connected ReLU network, --depth layers of --width (the paper's Sec. 6)",
    "cnn": "small VGG: 2 x (two 3x3 convs, max-pool) -> Linear(features, --width) -> ReLU -> "
    "Linear(--width, --width) -> ReLU -> Linear(--width, classes)",
}


def attackable_layers(model: nn.Module) -> dict[str, str]:
    """Every ``nn.Linear`` of a (nested) sequential model with a ReLU on either side, mapped to
    the sparsity SPEAR uses there: "output" when a ReLU follows it (dL/dZ sparse, the paper's
    case), else "input" when a ReLU precedes it (its inputs are sparse; e.g. the output layer).
    Layers with neither are left out: SPEAR has no sparsity to work with there. An alpha
    dropout in training mode between a ReLU and the Linear moves the ReLU's zeros
    (:func:`~spear.inversion.base.keeps_zeros`): no input sparsity there."""
    leaves = [(name, m) for name, m in model.named_modules() if next(m.children(), None) is None]
    out: dict[str, str] = {}
    for i, (name, module) in enumerate(leaves):
        if not isinstance(module, nn.Linear):
            continue
        after = next((m for _, m in leaves[i + 1 :] if not isinstance(m, PASS_THROUGH)), None)
        before = next((m for _, m in reversed(leaves[:i]) if not keeps_zeros(m)), None)
        if isinstance(after, nn.ReLU):
            out[name] = "output"
        elif isinstance(before, (nn.ReLU, nn.MaxPool2d)):
            out[name] = "input"
    return out
