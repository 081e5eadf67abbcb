"""The digits task: sklearn's bundled 8x8 handwritten digits (1797 samples, 10 classes).

Small enough for CPU ranks with one torch thread, real enough that accuracy
means something. The train/test split is fixed (stratified, random_state=0) so
every rank and every run sees the same data.
"""
from __future__ import annotations

import math
import os
from functools import lru_cache
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from flodl_exp.fsio import atomic_write

TEST_FRACTION = 0.2
SPLIT_SEED = 0


CACHE_ENV = "FLODL_DATA_CACHE"
"""Where the prepared split is kept (default ``~/.cache/flodl_exp``)."""
SPLIT_NAMES = ("x_tr", "x_te", "y_tr", "y_te")
SAMPLES, FEATURES = 1797, 64
CACHE_FORMAT = 1
"""Bump when what ``_split`` builds changes (scaling, dtypes): older files are then not read."""


def split_cache_path() -> Optional[str]:
    """The .npz of the split for this scikit-learn version (its split may differ between versions), or None
    when there is no home to keep it in."""
    from importlib.metadata import PackageNotFoundError, version

    root = os.environ.get(CACHE_ENV)
    if not root:
        home = os.path.expanduser("~")
        if home == "~":
            return None
        root = os.path.join(home, ".cache", "flodl_exp")
    try:
        sk = version("scikit-learn")
    except PackageNotFoundError:
        sk = "none"
    return os.path.join(root, f"digits-split-t{TEST_FRACTION}-s{SPLIT_SEED}-sk{sk}-v{CACHE_FORMAT}.npz")


def _valid_split(parts: tuple[np.ndarray, ...]) -> bool:
    x_tr, x_te, y_tr, y_te = parts
    return (x_tr.dtype == x_te.dtype == np.float32 and y_tr.dtype == y_te.dtype == np.int64
            and x_tr.ndim == x_te.ndim == 2 and x_tr.shape[1] == x_te.shape[1] == FEATURES
            and len(x_tr) == len(y_tr) and len(x_te) == len(y_te) and len(x_tr) + len(x_te) == SAMPLES)


def _read_split(path: Optional[str]) -> Optional[tuple[np.ndarray, ...]]:
    if path is None:
        return None
    try:
        with np.load(path) as z:
            parts = tuple(np.asarray(z[k]) for k in SPLIT_NAMES)
    except Exception:  # missing, partial or corrupt: rebuilt
        return None
    return parts if _valid_split(parts) else None


def _write_split(path: Optional[str], parts: tuple[np.ndarray, ...]) -> None:
    """Atomic (flodl_exp.fsio: a temp file in the same folder, then a rename): a reader sees the old file or the new one."""
    if path is None:
        return
    try:
        named: dict[str, Any] = dict(zip(SPLIT_NAMES, parts))
        atomic_write(path, lambda fh: np.savez(fh, **named), mode=0o600)
    except OSError:  # a read-only or full disk: built each time
        pass


@lru_cache(maxsize=1)
def _split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The fixed stratified split. Kept as a .npz once made: every rank of every run would otherwise import
    scikit-learn (with scipy and pandas: ~2 s of each rank's start-up on 2 cores) to rebuild the same arrays."""
    path = split_cache_path()
    cached = _read_split(path)
    if cached is not None:
        x_tr, x_te, y_tr, y_te = cached
        return x_tr, x_te, y_tr, y_te
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int64)
    parts = tuple(train_test_split(x, y, test_size=TEST_FRACTION, random_state=SPLIT_SEED, stratify=y))
    _write_split(path, parts)
    x_tr, x_te, y_tr, y_te = parts
    return x_tr, x_te, y_tr, y_te


class DigitsDataset:
    """Indexable by an array of sample ids; returns (images [n, 1, 8, 8], labels [n])."""

    def __init__(self, split: str = "train") -> None:
        if split not in ("train", "test"):
            raise ValueError(f"split={split!r}: expected 'train' or 'test'")
        x_tr, x_te, y_tr, y_te = _split()
        x, y = (x_tr, y_tr) if split == "train" else (x_te, y_te)
        self.x = torch.from_numpy(x).reshape(-1, 1, 8, 8)
        self.y = torch.from_numpy(y)

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def get_batch(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(np.asarray(ids, dtype=np.int64))
        return self.x[idx], self.y[idx]


class Logistic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1))


class MLP(nn.Module):
    def __init__(self, hidden: int = 128, depth: int = 1) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = 64
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, 10))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))


class LeNet(nn.Module):
    """LeNet-style CNN sized for 8x8 inputs, with BatchNorm (its running stats are buffers)."""

    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(2 * channels)
        self.fc1 = nn.Linear(2 * channels * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def train_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


@torch.no_grad()
def evaluate(model: nn.Module, dataset: DigitsDataset, device: torch.device) -> dict[str, float]:
    x, y = dataset.x.to(device), dataset.y.to(device)
    logits = model(x)
    return {
        "accuracy": float((logits.argmax(1) == y).float().mean()),
        "loss": float(F.cross_entropy(logits, y)),
    }


def cosine_schedule(total_steps: int, world_size: int, warmup_frac: float = 0.1, floor: float = 0.01) -> Callable[[int], float]:
    """LR factor of the global step: linear warm-up then cosine to ``floor``.

    A pure function of the step, so every rank agrees without broadcasting LRs.
    """
    warm = max(1, int(total_steps * warmup_frac))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        t = min(1.0, (step - warm) / max(1, total_steps - warm))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))

    return factor


def train_step_recording(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``train_step`` that also records user scalars (shows ``flodl_exp.record_scalar``)."""
    from flodl_exp import record_scalar

    x, y = batch
    record_scalar("ones", 1.0)
    record_scalar("label_mean", float(y.float().mean()))
    return F.cross_entropy(model(x), y)


def epoch_probe(epoch: int, model: nn.Module, last_epoch: dict[str, float]) -> dict[str, float]:
    """An ``experiment.epoch_fn`` example: run on the epoch-role rank before each epoch, it records the
    replica's weight norm and the previous epoch's loss (from the EpochAggregated the rank received)."""
    with torch.no_grad():
        norm = float(torch.sqrt(sum(((p.float() ** 2).sum() for p in model.parameters()), torch.zeros(()))))
    out = {"weight_norm": norm}
    if "loss" in last_epoch:
        out["last_loss"] = float(last_epoch["loss"])
    return out


CHECKPOINT_FN_FAIL_ENV = "FLODL_TEST_CHECKPOINT_FN_FAIL_RANK"
"""Test hook: ``export_checkpoint`` raises on this rank (the coordinator then fails over to another rank)."""


def export_checkpoint(version: int, model: nn.Module) -> None:
    """An ``experiment.checkpoint_fn`` example: the model's ``state_dict`` as a plain ``torch.save`` file,
    ``<job folder>/checkpoint_exports/model_v<version>.pt``, written whole or not at all. It runs on the rank
    writing the bundle's model piece; the job folder comes from ``FLODL_JOB_DIR``, which every rank's process
    has (outside a job: the working directory)."""
    from flodl_exp.constants import JOB_DIR_ENV, RANK_ENV

    rank = os.environ.get(RANK_ENV)
    if rank is not None and os.environ.get(CHECKPOINT_FN_FAIL_ENV) == rank:
        raise RuntimeError(f"{CHECKPOINT_FN_FAIL_ENV}={rank}: this rank's export fails on purpose")
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    path = os.path.join(os.environ.get(JOB_DIR_ENV) or os.getcwd(), "checkpoint_exports", f"model_v{version}.pt")
    atomic_write(path, lambda fh: torch.save(state, fh))
