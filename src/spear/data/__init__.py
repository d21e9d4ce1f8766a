"""Data sets: built-in offline sources, loaders for real on-disk formats, normalization.

Images are held as float64 tensors (N, C, H, W) in [0, 1]; models see them flattened and
normalized per channel (:meth:`ImageDataset.normalize`). Tabular data comes later.
"""

from spear.data.base import ImageDataset, sample_batch
from spear.data.builtin import DATASETS, available_datasets, load_dataset
from spear.data.formats import load_cifar10_batches, load_image_folder, load_mnist_idx

__all__ = [
    "DATASETS",
    "ImageDataset",
    "available_datasets",
    "load_cifar10_batches",
    "load_dataset",
    "load_image_folder",
    "load_mnist_idx",
    "sample_batch",
]
