"""MNIST-shaped data: the IDX parser, real MNIST from a folder, or the bundled digits at 28x28.

Why a parser of our own: MNIST ships as IDX files (optionally gzipped), a ten-line format; reading
it directly needs no download helper (torchvision would fetch from the network) and no pickle. The
parser checks everything a damaged file can break (magic, element type, header length, payload
size) and says which file and what in one line, so a half-copied data set fails at start-up rather
than training on garbage.

Without ``data_dir`` the data sets use scikit-learn's bundled 8x8 digits (``flodl_exp.zoo.digits``:
same fixed split, same cache), upsampled bilinearly to 28x28 so the reference's MNIST architectures
(Linear(784, 10), LeNet-5's 5x5 convolutions, the autoencoder's two stride-2 stages) run unchanged.
"""
from __future__ import annotations

import gzip
import os
import zlib
from functools import lru_cache
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8), 0x09: np.dtype(np.int8), 0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8"),
}
"""IDX element-type codes (the third magic byte) and their big-endian numpy types."""

MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
SIDE = 28


def _read_bytes(path: str) -> bytes:
    """The file's bytes, gunzipped when it is a gzip file (by its magic, whatever its name)."""
    with open(path, "rb") as fh:
        raw = fh.read()
    if raw[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise ValueError(f"{path}: corrupt or truncated gzip data ({e})") from None
    return raw


def parse_idx(raw: bytes, name: str = "<bytes>") -> np.ndarray:
    """An IDX payload as an array of its declared shape (native byte order).

    Layout: two zero bytes, the element-type code, the number of dimensions ``n``, ``n`` big-endian
    uint32 sizes, then the elements in C order, big-endian. Anything else is refused.
    """
    if len(raw) < 4:
        raise ValueError(f"{name}: truncated IDX header ({len(raw)} bytes, need at least 4)")
    if raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{name}: bad IDX magic {raw[:4].hex()} (must start with 0000)")
    code, ndim = raw[2], raw[3]
    if code not in IDX_DTYPES:
        raise ValueError(f"{name}: bad IDX magic {raw[:4].hex()} (unknown element type 0x{code:02x})")
    if ndim == 0:
        raise ValueError(f"{name}: bad IDX magic {raw[:4].hex()} (zero dimensions)")
    head = 4 + 4 * ndim
    if len(raw) < head:
        raise ValueError(f"{name}: truncated IDX header ({len(raw)} bytes, {ndim} dimensions need {head})")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dt = IDX_DTYPES[code]
    want = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    got = len(raw) - head
    if got < want:
        raise ValueError(f"{name}: truncated IDX data (shape {shape} needs {want} bytes, found {got})")
    if got > want:
        raise ValueError(f"{name}: size mismatch ({got - want} bytes after the {want} bytes of shape {shape})")
    return np.frombuffer(raw, dtype=dt, count=want // dt.itemsize, offset=head).reshape(shape).astype(dt.newbyteorder("="))


def read_idx(path: str) -> np.ndarray:
    """``parse_idx`` of a file (plain or gzipped); errors name the file."""
    return parse_idx(_read_bytes(path), path)


def _find(data_dir: str, stem: str) -> str:
    """The IDX file for ``stem`` in ``data_dir``: either distribution name (``-idx3-ubyte`` or ``.idx3-ubyte``),
    plain or ``.gz``, also inside a ``MNIST/raw`` folder as torchvision leaves it."""
    alt = stem.replace("-idx", ".idx")
    for folder in (data_dir, os.path.join(data_dir, "MNIST", "raw"), os.path.join(data_dir, "raw")):
        for name in (stem, stem + ".gz", alt, alt + ".gz"):
            p = os.path.join(folder, name)
            if os.path.isfile(p):
                return p
    raise FileNotFoundError(f"{data_dir}: no {stem}[.gz] (MNIST IDX files expected, e.g. {stem}.gz)")


def load_mnist(data_dir: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 [n, 28, 28], labels int64 [n]) of ``split`` from an MNIST folder, checked for shape,
    count and label range."""
    if split not in MNIST_FILES:
        raise ValueError(f"split={split!r}: expected 'train' or 'test'")
    img_path, lab_path = (_find(os.path.expanduser(data_dir), s) for s in MNIST_FILES[split])
    images, labels = read_idx(img_path), read_idx(lab_path)
    if images.ndim != 3 or images.shape[1:] != (SIDE, SIDE) or images.dtype != np.uint8:
        raise ValueError(f"{img_path}: expected uint8 images [n, 28, 28], found {images.dtype} {list(images.shape)}")
    if labels.ndim != 1 or labels.dtype != np.uint8:
        raise ValueError(f"{lab_path}: expected uint8 labels [n], found {labels.dtype} {list(labels.shape)}")
    if len(labels) != len(images):
        raise ValueError(f"{lab_path}: size mismatch ({len(labels)} labels for {len(images)} images in {img_path})")
    if len(labels) and int(labels.max()) > 9:
        raise ValueError(f"{lab_path}: label {int(labels.max())} out of range 0..9")
    return images, labels.astype(np.int64)


@lru_cache(maxsize=2)
def bundled_digits(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The bundled 8x8 digits of ``split`` upsampled to [n, 1, 28, 28] in [0, 1] (bilinear, clamped)."""
    from flodl_exp.zoo.digits import DigitsDataset

    d = DigitsDataset(split)
    x = F.interpolate(d.x, size=(SIDE, SIDE), mode="bilinear", align_corners=False).clamp_(0.0, 1.0)
    return x.contiguous(), d.y


class MnistDataset:
    """MNIST-shaped samples: (images float32 [n, 1, 28, 28] in [0, 1], labels int64 [n]).

    ``data_dir``: a folder with the four MNIST IDX files (plain or ``.gz``); unset, the bundled digits
    at 28x28. ``limit``: keep the first ``limit`` samples (CPU presets), None for all.
    """

    def __init__(self, split: str = "train", data_dir: Optional[str] = None, limit: Optional[int] = None) -> None:
        if split not in ("train", "test"):
            raise ValueError(f"split={split!r}: expected 'train' or 'test'")
        if data_dir:
            images, labels = load_mnist(data_dir, split)
            x = torch.from_numpy(images).unsqueeze(1).float().div_(255.0)
            y = torch.from_numpy(labels)
            self.source = f"MNIST IDX ({os.path.expanduser(data_dir)})"
        else:
            x, y = bundled_digits(split)
            self.source = "bundled digits, 8x8 upsampled to 28x28"
        if limit is not None:
            x, y = x[: int(limit)], y[: int(limit)]
        self.x, self.y = x, y

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def get_batch(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(np.asarray(ids, dtype=np.int64))
        return self.x[idx], self.y[idx]
