"""Loaders for the real on-disk formats users have: MNIST IDX, CIFAR-10 python batches, and an
ImageFolder tree (one sub-folder per class)."""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import torch

from spear.data.base import ImageDataset
from spear.errors import InputError

IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def _open(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def read_idx(path: str | Path) -> np.ndarray:
    """Read one IDX file (optionally gzipped), as used by MNIST and Fashion-MNIST."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"IDX file {path} does not exist")
    with _open(path) as fh:
        header = fh.read(4)
        if len(header) != 4 or header[0] != 0 or header[1] != 0 or header[2] not in IDX_DTYPES:
            raise InputError(f"{path} is not an IDX file (bad magic number {header!r})")
        dims = header[3]
        sizes = fh.read(4 * dims)
        if len(sizes) != 4 * dims:
            raise InputError(
                f"{path} is truncated: its header names {dims} dimensions but holds {len(sizes)} bytes"
            )
        shape = struct.unpack(f">{dims}I", sizes)
        data = np.frombuffer(fh.read(), dtype=IDX_DTYPES[header[2]])
    if data.size != int(np.prod(shape)):
        raise InputError(f"{path} is truncated: expected {int(np.prod(shape))} values, found {data.size}")
    return data.reshape(shape)


def load_mnist_idx(
    images_path: str | Path,
    labels_path: str | Path,
    name: str = "mnist",
    mean: float = 0.1307,
    std: float = 0.3081,
) -> ImageDataset:
    """MNIST-format images (N, 28, 28) uint8 and labels (N,) from IDX files."""
    images = read_idx(images_path)
    labels = read_idx(labels_path)
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise InputError(f"IDX images {images.shape} and labels {labels.shape} do not form a data set")
    x = torch.from_numpy(images.astype(np.float64) / 255.0).unsqueeze(1)
    return ImageDataset(name, x, torch.from_numpy(labels.astype(np.int64)), 10, (mean,), (std,))


CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


def load_cifar10_batches(root: str | Path, split: str = "test") -> ImageDataset:
    """CIFAR-10 'python version' batches (``data_batch_1..5`` / ``test_batch``) from ``root``."""
    root = Path(root)
    names = ["test_batch"] if split == "test" else [f"data_batch_{i}" for i in range(1, 6)]
    files = [root / n for n in names if (root / n).exists()]
    if not files:
        raise InputError(f"no CIFAR-10 batches ({', '.join(names)}) found in {root}")
    images, labels = [], []
    for f in files:
        with open(f, "rb") as fh:
            try:
                batch = pickle.load(fh, encoding="bytes")
            except Exception as exc:  # pickle raises many types on foreign files
                raise InputError(f"{f} is not a CIFAR-10 python batch: {exc}") from exc
        if b"data" not in batch or b"labels" not in batch:
            raise InputError(f"{f} lacks the b'data'/b'labels' entries of a CIFAR-10 batch")
        images.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        labels.append(np.asarray(batch[b"labels"], dtype=np.int64))
    x = torch.from_numpy(np.concatenate(images).astype(np.float64) / 255.0)
    return ImageDataset("cifar10", x, torch.from_numpy(np.concatenate(labels)), 10, CIFAR_MEAN, CIFAR_STD)


IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"}


def load_image_folder(
    root: str | Path, size: int = 32, grayscale: bool = False, limit_per_class: int | None = None
) -> ImageDataset:
    """An ImageFolder tree ``root/<class>/<image>``, resized to ``size x size`` (PIL)."""
    from PIL import Image

    root = Path(root)
    if not root.is_dir():
        raise InputError(f"image folder {root} does not exist")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    if not classes:
        raise InputError(f"{root} has no class sub-folders (expected root/<class>/<image>)")
    images, labels = [], []
    for k, cls in enumerate(classes):
        paths = sorted(p for p in (root / cls).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        for p in paths[:limit_per_class]:
            try:
                with Image.open(p) as img:
                    img = img.convert("L" if grayscale else "RGB").resize((size, size), Image.BILINEAR)
                    arr = np.asarray(img, dtype=np.float64) / 255.0
            except OSError as exc:  # PIL's UnidentifiedImageError included
                raise InputError(
                    f"{p} is not an image PIL can read ({exc}); remove it from the folder"
                ) from exc
            images.append(arr[None] if grayscale else arr.transpose(2, 0, 1))
            labels.append(k)
    if not images:
        raise InputError(f"no images ({', '.join(sorted(IMAGE_SUFFIXES))}) under {root}")
    x = torch.from_numpy(np.stack(images))
    c = x.shape[1]
    mean = tuple(float(v) for v in x.mean(dim=(0, 2, 3)))
    std = tuple(float(v) for v in x.std(dim=(0, 2, 3)).clamp_min(1e-3))
    return ImageDataset(root.name, x, torch.tensor(labels), len(classes), mean[:c], std[:c])
