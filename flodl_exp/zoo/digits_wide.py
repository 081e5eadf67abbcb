"""A wider model for the digits task, sized so compute dominates messaging.

Used by ``experiment=digits_wide`` and the heterogeneity benchmark
(``experiments/bench_hetero.py``). A 3-layer CNN (48/96/192 channels in the
preset, no BatchNorm) on the 8x8 digits: ~0.22 M parameters (0.86 MB on the
wire) but ~20 MFLOP per sample forward, so at batch 16 one train step takes
~7 ms on one CPU thread while a full parameter exchange is about a millisecond
-- the regime of real GPUs, where a step is compute-bound and the all-reduce
is small next to it. Data, train step and eval come from
``flodl_exp.zoo.digits``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class WideCNN(nn.Module):
    """conv(1->c) -> conv(c->2c) -> pool -> conv(2c->4c) -> pool -> linear(4c*2*2 -> 10)."""

    def __init__(self, channels: int = 48) -> None:
        super().__init__()
        c = int(channels)
        self.conv1 = nn.Conv2d(1, c, 3, padding=1)
        self.conv2 = nn.Conv2d(c, 2 * c, 3, padding=1)
        self.conv3 = nn.Conv2d(2 * c, 4 * c, 3, padding=1)
        self.fc = nn.Linear(4 * c * 2 * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.max_pool2d(F.relu(self.conv3(x)), 2)
        return self.fc(x.flatten(1))
