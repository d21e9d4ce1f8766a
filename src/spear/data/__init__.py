"""Data sets: built-in offline sources, loaders for real on-disk formats, normalization.

Images are held as float64 tensors (N, C, H, W) in [0, 1]; models see them flattened and
normalized per channel (:meth:`ImageDataset.normalize`). Tabular rows (:mod:`spear.data.tabular`)
are one-hot plus standardized numeric columns, and decode back to records.
"""

from spear.data.base import Dataset, ImageDataset, sample_batch
from spear.data.builtin import DATASETS, available_datasets, load_dataset
from spear.data.formats import load_cifar10_batches, load_image_folder, load_mnist_idx
from spear.data.tabular import Column, TabularDataset, TabularSchema, load_adult

__all__ = [
    "DATASETS",
    "Column",
    "Dataset",
    "ImageDataset",
    "TabularDataset",
    "TabularSchema",
    "available_datasets",
    "load_adult",
    "load_cifar10_batches",
    "load_dataset",
    "load_image_folder",
    "load_mnist_idx",
    "sample_batch",
]
