"""32x32 RGB 10-class data: the CIFAR-10 binary-batch parser, a synthetic stand-in, and crop + flip.

Real data: CIFAR-10's "binary version" (``cifar-10-batches-bin/``: ``data_batch_1..5.bin``,
``test_batch.bin``), records of one label byte and 3072 pixel bytes (R, G, B planes of 32x32,
row-major). Parsed directly: no pickle (the Python version of CIFAR-10 is pickles), no download.

Default (no ``data_dir``): **synthetic shapes**, a generated task, not CIFAR. Each image is one of
ten shape classes (disk, square, ring, plus, triangle, horizontal stripes, vertical stripes, X,
checkerboard, pair of dots) drawn at a random position, size and slight rotation, in a random
bright colour over a random dark background colour with a linear gradient and pixel noise. Colour
and position carry no class information (a nearest-mean-colour classifier scores ~15 %), so a
model has to learn shape: chance is 10 %. (The fixed polarity, shape brighter than background,
keeps early SGD off the plateau a polarity-free version showed: ResNet-20 with SGD 0.1-0.2 stayed
at chance for 150 steps there, and reaches ~80 % in 100 steps here.) It is
generated deterministically in chunks of ``CHUNK`` samples, each from its own seeded stream, so
the first ``k`` samples are the same whatever size is asked for (a CPU preset's ``limit`` is a
prefix of the full set) and every rank builds the same arrays without sharing files.

Training augmentation (the reference's, per sample rather than per batch): pad 4 pixels (zero in
normalised space, i.e. the mean colour), random 32x32 crop, random horizontal flip. It is the
data plane's delivery transform (``transform(batch, sample_ids, views, epoch, seed)``), a pure
function of (seed, epoch, sample, view), so reruns and resumes see the same views.
"""
from __future__ import annotations

import os
from functools import lru_cache
from typing import Any, Optional

import numpy as np
import torch

RECORD = 1 + 3 * 32 * 32
"""Bytes per CIFAR-10 binary record: the label, then 3072 pixel bytes."""
TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
TEST_FILES = ("test_batch.bin",)
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2023, 0.1994, 0.2010)
"""CIFAR-10's per-channel statistics (the reference's constants), used for every source alike."""

SYNTH_CLASSES = ("disk", "square", "ring", "plus", "triangle", "h-stripes", "v-stripes", "x", "checker", "dots")
SYNTH_SIZES = {"train": 50_000, "test": 10_000}
"""The synthetic task's full sizes (CIFAR-10's), cut by ``limit`` in the CPU presets."""
CHUNK = 1000
PAD = 4


def parse_cifar_batch(raw: bytes, name: str = "<bytes>") -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 [n, 3, 32, 32], labels int64 [n]) of one CIFAR-10 binary batch."""
    if len(raw) == 0:
        raise ValueError(f"{name}: empty file (CIFAR-10 binary batch expected)")
    if len(raw) % RECORD:
        raise ValueError(f"{name}: truncated or size mismatch ({len(raw)} bytes is not a whole number of "
                         f"{RECORD}-byte records; {len(raw) % RECORD} bytes over {len(raw) // RECORD} records)")
    rec = np.frombuffer(raw, dtype=np.uint8).reshape(-1, RECORD)
    labels = rec[:, 0]
    bad = np.flatnonzero(labels > 9)
    if len(bad):
        raise ValueError(f"{name}: record {int(bad[0])} has label {int(labels[bad[0]])} (expected 0..9; not a CIFAR-10 batch?)")
    return rec[:, 1:].reshape(-1, 3, 32, 32).copy(), labels.astype(np.int64)


def read_cifar_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
    with open(path, "rb") as fh:
        return parse_cifar_batch(fh.read(), path)


def load_cifar10(data_dir: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    """``split`` of CIFAR-10 from ``data_dir`` (the ``cifar-10-batches-bin`` folder or its parent)."""
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r}: expected 'train' or 'test'")
    root = os.path.expanduser(data_dir)
    nested = os.path.join(root, "cifar-10-batches-bin")
    folder = nested if os.path.isdir(nested) else root
    names = TRAIN_FILES if split == "train" else TEST_FILES
    missing = [n for n in names if not os.path.isfile(os.path.join(folder, n))]
    if missing:
        raise FileNotFoundError(f"{folder}: missing {', '.join(missing)} (CIFAR-10 binary version expected)")
    parts = [read_cifar_batch(os.path.join(folder, n)) for n in names]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


# ----------------------------------------------------------------------------- synthetic shapes

def _shape_masks(label: np.ndarray, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Foreground masks [n, 32, 32] of each sample's class in its own (rotated, scaled) coordinates."""
    r = np.sqrt(u * u + v * v)
    box = np.maximum(np.abs(u), np.abs(v))
    masks = {
        0: r <= 1.0,
        1: box <= 0.85,
        2: (r >= 0.55) & (r <= 1.0),
        3: ((np.abs(u) <= 0.3) & (np.abs(v) <= 1.0)) | ((np.abs(v) <= 0.3) & (np.abs(u) <= 1.0)),
        4: (v >= -0.8) & (v <= 0.8) & (np.abs(u) <= 0.5 * (v + 0.8)),
        5: (box <= 1.0) & (np.cos(np.pi * 2.5 * v) > 0),
        6: (box <= 1.0) & (np.cos(np.pi * 2.5 * u) > 0),
        7: (box <= 0.95) & ((np.abs(u - v) <= 0.35) | (np.abs(u + v) <= 0.35)),
        8: (box <= 1.0) & ((np.floor((u + 1) * 2) + np.floor((v + 1) * 2)) % 2 == 0),
        9: ((u - 0.55) ** 2 + v * v <= 0.16) | ((u + 0.55) ** 2 + v * v <= 0.16),
    }
    out = np.zeros(u.shape, dtype=bool)
    for k, m in masks.items():
        sel = label == k
        out[sel] = m[sel]
    return out


@lru_cache(maxsize=8)
def _synthetic_chunk(seed: int, split: str, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``CHUNK`` samples of chunk ``chunk``: a pure function of (seed, split, chunk), balanced over classes."""
    rng = np.random.default_rng([int(seed), 0 if split == "train" else 1, int(chunk)])
    n = CHUNK
    label = rng.permutation(np.arange(n) % 10)
    col = lambda lo, hi: rng.uniform(lo, hi, (n, 1, 1))  # one value per sample
    cx, cy, scale, theta = col(10, 22), col(10, 22), col(6.5, 11), col(-0.3, 0.3)
    yy, xx = np.mgrid[0:32, 0:32].astype(np.float64)
    dx, dy = xx[None] - cx, yy[None] - cy
    u = (dx * np.cos(theta) + dy * np.sin(theta)) / scale
    v = (-dx * np.sin(theta) + dy * np.cos(theta)) / scale
    fg_mask = _shape_masks(label, u, v)[:, None]
    bg = rng.uniform(0.0, 0.45, (n, 3, 1, 1))
    fg = rng.uniform(0.55, 1.0, (n, 3, 1, 1))  # brighter than the background in every channel
    angle = rng.uniform(0, 2 * np.pi, (n, 1, 1, 1))
    grad = 0.15 * ((xx - 15.5) * np.cos(angle) + (yy - 15.5) * np.sin(angle)) / 16.0
    img = np.where(fg_mask, fg, bg + grad) + rng.normal(0, 0.06, (n, 3, 32, 32))
    return np.clip(np.rint(img * 255), 0, 255).astype(np.uint8), label.astype(np.int64)


@lru_cache(maxsize=4)
def synthetic_shapes(n: int, split: str = "train", seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The first ``n`` samples of the synthetic shapes task: (uint8 [n, 3, 32, 32], int64 [n])."""
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r}: expected 'train' or 'test'")
    parts = [_synthetic_chunk(int(seed), split, c) for c in range((n + CHUNK - 1) // CHUNK)]
    if not parts:
        return np.zeros((0, 3, 32, 32), np.uint8), np.zeros((0,), np.int64)
    return np.concatenate([p[0] for p in parts])[:n], np.concatenate([p[1] for p in parts])[:n]


# ----------------------------------------------------------------------------- data set

class Cifar10Dataset:
    """Normalised (images float32 [n, 3, 32, 32], labels int64 [n]) with the reference's augmentation.

    ``data_dir``: the CIFAR-10 binary batches; unset, the synthetic shapes task (``SYNTH_SIZES``).
    ``limit``: the first ``limit`` samples (the CPU presets), None for all. ``augment``: pad-crop-flip
    on delivery (the training split; the test split is never augmented).
    """

    def __init__(self, split: str = "train", data_dir: Optional[str] = None, limit: Optional[int] = None,
                 augment: bool = True, synthetic_seed: int = 0) -> None:
        if split not in ("train", "test"):
            raise ValueError(f"split={split!r}: expected 'train' or 'test'")
        if data_dir:
            images, labels = load_cifar10(data_dir, split)
            if limit is not None:
                images, labels = images[: int(limit)], labels[: int(limit)]
            self.source = f"CIFAR-10 binary ({os.path.expanduser(data_dir)})"
        else:
            n = SYNTH_SIZES[split] if limit is None else min(int(limit), SYNTH_SIZES[split])
            images, labels = synthetic_shapes(n, split, int(synthetic_seed))
            self.source = "synthetic shapes (generated, not CIFAR-10)"
        self.x = torch.from_numpy(np.ascontiguousarray(images))
        self.y = torch.from_numpy(labels)
        self.augment = bool(augment) and split == "train"

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def get_batch(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(np.asarray(ids, dtype=np.int64))
        return normalise(self.x[idx]), self.y[idx]

    def transform(self, batch: Any, sample_ids: np.ndarray, views: np.ndarray, epoch: int, seed: int) -> Any:
        """Pad-crop-flip of each sample, drawn from PCG64((seed, epoch, sample, view))."""
        if not self.augment:
            return batch
        x, y = batch
        draws = np.array([np.random.default_rng([int(seed), int(epoch), int(s), int(v)]).integers(0, 2 * PAD + 1, 3)
                          for s, v in zip(sample_ids, views)], dtype=np.int64).reshape(-1, 3)
        return crop_flip(x, torch.from_numpy(draws[:, 0]), torch.from_numpy(draws[:, 1]),
                         torch.from_numpy(draws[:, 2] % 2 == 1)), y


def normalise(images: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 3, H, W] -> float32, per-channel (x / 255 - mean) / std."""
    mean = torch.tensor(MEAN, dtype=torch.float32).view(1, 3, 1, 1)
    std = torch.tensor(STD, dtype=torch.float32).view(1, 3, 1, 1)
    return (images.float().div(255.0) - mean) / std


def crop_flip(x: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
    """Zero-pad ``PAD`` pixels, crop each sample at its (dy, dx) offset (0..2*PAD), mirror where ``flip``.

    One gather for the whole batch, on the batch's device (a CUDA rank augments on the GPU).
    """
    n, c, h, w = x.shape
    dev = x.device
    padded = torch.nn.functional.pad(x, (PAD, PAD, PAD, PAD))
    rows = (dy.to(dev).view(n, 1) + torch.arange(h, device=dev).view(1, h))  # [n, h]
    cols = (dx.to(dev).view(n, 1) + torch.arange(w, device=dev).view(1, w))  # [n, w]
    cols = torch.where(flip.to(dev).view(n, 1), cols.flip(1), cols)
    b = torch.arange(n, device=dev).view(n, 1, 1)
    out = padded.permute(0, 2, 3, 1)[b, rows.view(n, h, 1), cols.view(n, 1, w)]  # [n, h, w, c]
    return out.permute(0, 3, 1, 2).contiguous()
