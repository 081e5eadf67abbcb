"""Per-epoch aggregation of per-chunk rank metrics (algorithms.md 9.3). Pure.

Throughput uses ``share_complete_ms`` (compute + data wall), never the chunk
wall: a fast rank idling at a barrier must not look slow to the balancer or
the user. ``idle_frac`` is the rest of the epoch's wall time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from flodl_exp.outer_step import OuterStep
from flodl_exp.protocol.messages import ChunkMetrics


@dataclass
class RankSums:
    batches: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    loss_batches: int = 0
    """Batches with a loss (a cooperative loop may step without one)."""
    epoch_ms: float = 0.0
    share_ms: float = 0.0
    compute_ms: float = 0.0
    starve_ms: float = 0.0
    chunks: int = 0
    scalars: dict[str, list[float]] = field(default_factory=dict)
    """name -> [sum, count]"""
    telemetry: dict[str, list[float]] = field(default_factory=dict)
    """name -> [sum, count]"""


class EpochAccumulator:
    def __init__(self, epoch: int, world_size: int, started: float) -> None:
        self.epoch = epoch
        self.world_size = world_size
        self.started = started
        self.ranks = [RankSums() for _ in range(world_size)]
        self.ranges: list[list[int]] = []
        self.syncs = 0
        self.sync_ms: list[float] = []
        self.div_max = 0.0
        self.guard_action = 0
        self.reported: set[int] = set()
        self.outer_steps: list[float] = []
        self.outer_momentum: Optional[float] = None

    def add_chunk(self, rank: int, m: ChunkMetrics) -> None:
        s = self.ranks[rank]
        b = m.batches
        s.batches += b
        s.samples += m.samples
        lb = b if m.loss_batches is None else min(b, max(0, m.loss_batches))
        s.loss_batches += lb
        s.loss_sum += m.avg_loss * lb
        s.epoch_ms += m.epoch_ms
        s.share_ms += m.share_complete_ms
        s.compute_ms += m.compute_only_ms
        s.starve_ms += m.data_starve_ms
        s.chunks += 1
        for k, (sm, c) in m.scalars.items():
            acc = s.scalars.setdefault(k, [0.0, 0])
            acc[0] += float(sm)
            acc[1] += int(c)
        for off, size in m.ranges:
            self.ranges.append([int(off), int(size)])
        self.reported.add(rank)

    def add_telemetry(self, rank: int, f: dict[str, float]) -> None:
        """Resource samples (gpu_util, mem_gb, cpu_pct, rss_gb, ...): averaged per rank over the epoch."""
        for k, v in f.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                acc = self.ranks[rank].telemetry.setdefault(k, [0.0, 0])
                acc[0] += float(v)
                acc[1] += 1

    def add_sync(self, ms: float, div: Optional[float], action_code: int, outer: Optional[OuterStep] = None) -> None:
        if outer is not None and not outer.seeded:  # the seeding window stepped nothing
            self.outer_steps.append(outer.step_norm)
            self.outer_momentum = outer.momentum_norm
        self.syncs += 1
        self.sync_ms.append(ms)
        if div is not None and math.isfinite(div):
            self.div_max = max(self.div_max, div)
        self.guard_action = max(self.guard_action, action_code)

    def summary(self, wall_s: float, reductions: Optional[dict[str, str]] = None) -> dict[str, float]:
        total_b = sum(s.batches for s in self.ranks)
        loss_b = sum(s.loss_batches for s in self.ranks)
        total_samples = sum(s.samples for s in self.ranks)
        m: dict[str, float] = {
            "loss": sum(s.loss_sum for s in self.ranks) / loss_b if loss_b else float("nan"),
            "epoch_time_s": wall_s,
            "samples_per_s": total_samples / wall_s if wall_s > 0 else 0.0,
            "samples": float(total_samples),
            "syncs": float(self.syncs),
            "sync_ms_avg": sum(self.sync_ms) / len(self.sync_ms) if self.sync_ms else 0.0,
            "divergence_max": self.div_max,
            "guard_action": float(self.guard_action),
        }
        if self.outer_steps:  # outer=slowmo|diloco: the mean step over the epoch's reduces, the momentum at its last
            m["outer/step_norm"] = sum(self.outer_steps) / len(self.outer_steps)
            m["outer/momentum_norm"] = float(self.outer_momentum or 0.0)
        wall_ms = wall_s * 1e3
        for r, s in enumerate(self.ranks):
            p = f"rank{r}/"
            m[p + "batch_share"] = s.batches / total_b if total_b else 0.0
            m[p + "batches"] = float(s.batches)
            m[p + "samples_per_s"] = s.samples / (s.share_ms / 1e3) if s.share_ms > 0 else 0.0
            m[p + "data_starve_ms"] = s.starve_ms
            m[p + "compute_only_ms"] = s.compute_ms
            m[p + "idle_frac"] = max(0.0, 1.0 - s.share_ms / wall_ms) if wall_ms > 0 else 0.0
            if s.loss_batches:
                m[p + "loss"] = s.loss_sum / s.loss_batches
            for k, (sm, c) in s.scalars.items():
                if c:
                    m[p + k] = sm / c
            for k, (sm, c) in s.telemetry.items():
                if c:
                    m[p + k] = sm / c
        # User scalars: per-rank value = mean of what it recorded; across ranks by the declared
        # reduction (sum | max | min), else the batch-weighted mean.
        reductions = reductions or {}
        keys = {k for s in self.ranks for k in s.scalars}
        for k in keys:
            per_rank = [(sm / c, s.batches) for s in self.ranks for sm, c in [s.scalars.get(k, (0.0, 0))] if c]
            if not per_rank:
                continue
            red = reductions.get(k, "mean")
            if red == "sum":
                m[k] = sum(v for v, _ in per_rank)
            elif red == "max":
                m[k] = max(v for v, _ in per_rank)
            elif red == "min":
                m[k] = min(v for v, _ in per_rank)
            else:
                den = sum(b for _, b in per_rank)
                m[k] = sum(v * b for v, b in per_rank) / den if den else sum(v for v, _ in per_rank) / len(per_rank)
        return m
