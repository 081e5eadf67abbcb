"""A deliberately slow digits data set: the test bed of the rank data plane.

``SlowDigits`` is ``flodl_exp.zoo.digits.DigitsDataset`` whose own loading
sleeps ``sleep_ms`` per sample (think: decoding from network storage). Sleep
holds no CPU, so the cost it models stays visible on a small shared machine
and prefetching, the sample cache and the disk stage have something to hide.
With ``noise > 0`` it also defines the delivery transform of the data plane:
``transform(batch, sample_ids, views, epoch, seed)`` adds Gaussian noise that
is a pure function of (sample, view, epoch, seed), so every rank, every rerun
and every resume sees the same augmented view.

``experiment=digits_slow`` uses it (conf/experiment/digits_slow.yaml);
``experiments/bench_data.py`` times it under each data_plane preset.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from flodl_exp.zoo.digits import DigitsDataset


class SlowDigits(DigitsDataset):
    """Digits with ``sleep_ms`` of simulated loading per sample and an optional keyed-noise transform."""

    def __init__(self, split: str = "train", sleep_ms: float = 1.0, noise: float = 0.0) -> None:
        super().__init__(split)
        self.sleep_ms = float(sleep_ms)
        self.noise = float(noise)
        self.loaded = 0
        """Samples this process loaded from "storage" (what the caches save)."""

    def get_batch(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(ids)
        self.loaded += n
        if self.sleep_ms > 0:
            time.sleep(n * self.sleep_ms / 1e3)
        return super().get_batch(ids)

    def transform(self, batch: Any, sample_ids: np.ndarray, views: np.ndarray, epoch: int, seed: int) -> Any:
        """View ``v`` of sample ``s`` in ``epoch``: the image plus noise drawn from PCG64((seed, epoch, s, v))."""
        if self.noise <= 0:
            return batch
        x, y = batch
        noise = np.stack([np.random.default_rng([int(seed), int(epoch), int(s), int(v)]).standard_normal(64)
                          for s, v in zip(sample_ids, views)]).astype(np.float32)
        eps = torch.from_numpy(noise).reshape(x.shape).to(x.device)
        return x + self.noise * eps, y
