"""The image data set type, normalization and batch sampling."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

import torch

from spear.errors import InputError

if TYPE_CHECKING:
    from spear.data.tabular import TabularDataset


@dataclass(frozen=True)
class ImageDataset:
    """Images (N, C, H, W) float64 in [0, 1] with integer labels.

    ``mean`` and ``std`` are per-channel statistics of this data set (or the conventional ones of
    the data set it stands in for); :meth:`normalize` maps images to model inputs.
    """

    name: str
    images: torch.Tensor
    labels: torch.Tensor
    classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    note: str = ""

    def __post_init__(self) -> None:
        if self.images.ndim != 4:
            raise InputError(f"images must be (N, C, H, W), got shape {tuple(self.images.shape)}")
        if self.images.shape[0] != self.labels.shape[0]:
            raise InputError("images and labels differ in length")
        if len(self.mean) != self.channels or len(self.std) != self.channels:
            raise InputError("mean/std must have one entry per channel")

    modality = "image"

    def __len__(self) -> int:
        return int(self.images.shape[0])

    @property
    def samples(self) -> torch.Tensor:
        """The data as :func:`sample_batch` draws it (the images)."""
        return self.images

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """The shape of one sample before flattening: (C, H, W)."""
        return self.image_shape

    @property
    def channels(self) -> int:
        return int(self.images.shape[1])

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.images.shape[1:])  # type: ignore[return-value]

    @property
    def features(self) -> int:
        c, h, w = self.image_shape
        return c * h * w

    def _stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = torch.tensor(self.mean, dtype=like.dtype, device=like.device).view(1, -1, 1, 1)
        std = torch.tensor(self.std, dtype=like.dtype, device=like.device).view(1, -1, 1, 1)
        return mean, std

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) images in [0, 1] -> flattened model inputs (B, C*H*W), per channel."""
        mean, std = self._stats(images)
        return ((images - mean) / std).reshape(images.shape[0], -1)

    def denormalize(self, inputs: torch.Tensor) -> torch.Tensor:
        """Flattened model inputs (B, C*H*W) -> images (B, C, H, W); exact inverse of normalize."""
        images = inputs.reshape(inputs.shape[0], *self.image_shape)
        mean, std = self._stats(images)
        return images * std + mean


def sample_batch(
    dataset: Dataset, batch_size: int, seed: int = 0, *, single_label: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random batch (samples, labels) without replacement, reproducible from ``seed``: images
    (b, C, H, W) of an image data set, encoded rows (b, F) of a tabular one.

    ``single_label=True`` draws every image from one class (the heterogeneous client of
    Appendix D).
    """
    if batch_size < 1:
        raise InputError("batch_size must be >= 1")
    g = torch.Generator().manual_seed(seed)
    if single_label:
        label = int(dataset.labels[torch.randint(len(dataset), (1,), generator=g)])
        pool = torch.nonzero(dataset.labels == label).squeeze(1)
    else:
        pool = torch.arange(len(dataset))
    if batch_size > pool.numel():
        what = f"class {label} of " if single_label else ""
        raise InputError(f"batch size {batch_size} exceeds the {pool.numel()} images of {what}{dataset.name}")
    pick = pool[torch.randperm(pool.numel(), generator=g)[:batch_size]]
    return dataset.samples[pick], dataset.labels[pick]


#: every data set type: images or tabular rows (same interface: samples, labels, classes,
#: input_shape, features, normalize, denormalize, name, note, modality)
Dataset = Union[ImageDataset, "TabularDataset"]
