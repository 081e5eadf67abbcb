"""The rank's training primitives: begin_epoch -> (next_batch -> train_step -> after_step)* -> end_epoch.

One replica, its optimizer and its data; no sockets. The managed loop in
``rank/worker.py`` drives these between control messages, and tests drive
them directly. Timing follows the reference ledger: ``compute`` is the
train-step wall (including the simulated slowdown of ``rank_speeds``),
``data`` the wall blocked waiting for a batch (control work handled while
waiting excluded), and ``share_complete_ms`` their sum: the rank's own work,
never the idle at barriers.

Batches come from a ``DataPipeline`` (``rank/data``): begin_epoch opens a
``Feed`` for the chunk (reader threads prefetch through the sample cache),
next_batch takes the next ready batch. Without an attached pipeline the
trainer builds a single-stage synchronous one (ram_max_usage=0): the plain
``fetch_batch`` of the experiment's dataset, as before.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from .. import protocol
from ..experiment import Experiment
from ..partition import make_partition
from ..scalars import drain_scalars


@dataclass
class EpochState:
    """Cursor over one plan/chunk: the picks to train and what training them cost."""

    epoch: int
    offset: int
    picks: np.ndarray
    batch_size: int
    cursor: int = 0
    batches: int = 0
    loss_sum: float = 0.0
    compute_ms: float = 0.0
    data_ms: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    ranges: list[list[int]] = field(default_factory=list)
    """[offset, size] ranges of the epoch permutation this chunk covers (for coverage checks)."""
    feed: Any = None
    """The data pipeline's Feed for this chunk (None: nothing to fetch)."""

    @property
    def total_batches(self) -> int:
        return len(self.picks) // self.batch_size

    def extend(self, offset: int, picks: np.ndarray) -> None:
        """ExtendPartition: append another slice of the same permutation."""
        self.picks = np.concatenate([self.picks, picks])
        self.ranges.append([int(offset), int(len(picks))])
        if self.feed is not None:
            self.feed.extend(picks)  # the readers pick the new batches up at once


@dataclass
class Batch:
    data: Any
    data_ms: float
    """Data wait without control work (per-chunk ``data_starve_ms``)."""
    ids: np.ndarray
    wait_ms: float = 0.0
    """Data wait with control work: what the coordinator's cost feed gets (algorithms.md 9.1)."""


class RankTrainer:
    """One replica and the per-batch mechanics around the user's train step."""

    def __init__(
        self,
        exp: Experiment,
        *,
        device: torch.device,
        world_size: int = 1,
        seed: int = 42,
        augment: int = 1,
        batch_size: int = 32,
        speed: float = 1.0,
        lr_scale_ratio: float = 1.0,
        max_grad_norm: Optional[float] = None,
        pipeline: Any = None,
    ) -> None:
        self.exp = exp
        self.model = exp.model
        self.optimizer = exp.optimizer
        self.device = device
        self.seed = seed
        self.augment = max(1, int(augment))
        self.batch_size = batch_size
        self.speed = speed
        self.max_grad_norm = max_grad_norm
        self.total_picks = len(exp.train_data) * self.augment
        self.global_step = 0
        """Batches trained by the whole cohort up to the last reduce (SetGlobalStep)."""
        self.steps_since_avg = 0
        self.step_count = 0
        """Monotonic local counter: batches + completed collective syncs (NCCL ack gate)."""
        self.last_loss = float("nan")
        factor = 1.0 + (world_size - 1) * lr_scale_ratio if (world_size > 1 and lr_scale_ratio > 0) else 1.0
        self.lr_scale = factor if factor > 1 else 1.0
        self.base_lrs = [g["lr"] for g in self.optimizer.param_groups]
        if exp.lr_factor is None and self.lr_scale > 1:
            for g, base in zip(self.optimizer.param_groups, self.base_lrs):
                g["lr"] = base * self.lr_scale
        self.pipeline = pipeline
        """rank.data.DataPipeline; built lazily (synchronous) when none is attached."""
        self.on_data_wait: Optional[Callable[[], None]] = None
        self.stop_data_wait: Optional[Callable[[], bool]] = None

    # -- data plane -----------------------------------------------------
    def attach_pipeline(self, pipeline: Any, on_wait: Optional[Callable[[], None]] = None,
                        should_stop: Optional[Callable[[], bool]] = None) -> None:
        """Use ``pipeline`` for batches; ``on_wait`` runs every 10 ms while blocked on one (control drain)."""
        if self.pipeline is not None and self.pipeline is not pipeline:
            self.pipeline.close()
        self.pipeline = pipeline
        self.on_data_wait = on_wait
        self.stop_data_wait = should_stop

    def data_pipeline(self) -> Any:
        if self.pipeline is None:
            from .data import DataPipeline

            self.pipeline = DataPipeline(self.exp.train_data, device=self.device, batch_size=self.batch_size,
                                         augment=self.augment, seed=self.seed, ram_max_usage=0.0)
        return self.pipeline

    def close_data(self) -> None:
        """Stop the reader threads and drop the caches (removes the disk-stage file)."""
        if self.pipeline is not None:
            self.pipeline.close()

    # -- primitives -------------------------------------------------------
    def begin_epoch(self, epoch: int, offset: int, size: int) -> EpochState:
        picks = make_partition(offset, size, self.total_picks, epoch, self.seed)
        self.model.train()
        feed = self.data_pipeline().open(epoch, picks)
        return EpochState(epoch=epoch, offset=offset, picks=picks, batch_size=self.batch_size,
                          ranges=[[int(offset), int(len(picks))]], feed=feed)

    def next_batch(self, st: EpochState) -> Optional[Batch]:
        """The next full batch of the plan (prefetched or fetched now), or None when the plan is done.

        Also None when ``stop_data_wait()`` turned true while waiting (shutdown
        seen by the control drain); the cursor then stays where it was.
        """
        if st.cursor + self.batch_size > len(st.picks):
            return None
        if st.feed is None:
            st.feed = self.data_pipeline().open(st.epoch, st.picks[st.cursor:])
        got = st.feed.next(self.on_data_wait, self.stop_data_wait)
        if got is None:
            return None
        st.cursor += self.batch_size
        return Batch(data=got.data, data_ms=got.data_ms, ids=got.ids, wait_ms=got.wait_ms)

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def train_step(self, batch: Batch) -> tuple[float, float]:
        """Forward + backward + clip + optimizer step; returns (loss, compute ms).

        With a scheduler the LR is set from the global position
        ``global_step + steps_since_avg`` times the linear-scaling factor, so all
        ranks agree without exchanging LRs.
        """
        t0 = time.perf_counter()
        if self.exp.lr_factor is not None:
            f = self.exp.lr_factor(self.global_step + self.steps_since_avg) * self.lr_scale
            for g, base in zip(self.optimizer.param_groups, self.base_lrs):
                g["lr"] = base * f
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.exp.train_step(self.model, batch.data)
        loss.backward()
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        loss_v = float(loss.detach())
        step_ms = (time.perf_counter() - t0) * 1e3
        if self.speed < 1.0:
            # Simulated slower device: idle (1/s - 1) x the real step time inside the step.
            time.sleep((1.0 / self.speed - 1.0) * step_ms / 1e3)
            step_ms = (time.perf_counter() - t0) * 1e3
        return loss_v, step_ms

    def after_step(self, st: EpochState, batch: Batch, loss: float, compute_ms: float) -> None:
        st.batches += 1
        if math.isfinite(loss):
            st.loss_sum += loss
        st.compute_ms += compute_ms
        st.data_ms += batch.data_ms
        self.steps_since_avg += 1
        self.step_count += 1
        self.last_loss = loss

    def end_epoch(self, st: EpochState, chunk: int = 0) -> protocol.ChunkMetrics:
        """The chunk's metrics (algorithms.md 9.2) as the wire payload the coordinator gets."""
        wall = (time.perf_counter() - st.started) * 1e3
        # Coverage: the first `batches * batch_size` picks of the (possibly extended) plan.
        left = st.batches * st.batch_size
        trained = []
        for off, size in st.ranges:
            take = min(size, left)
            if take > 0:
                trained.append([off, take])
            left -= take
        return protocol.ChunkMetrics(
            epoch=st.epoch,
            chunk=chunk,
            avg_loss=st.loss_sum / st.batches if st.batches else 0.0,
            batches=st.batches,
            samples=st.batches * st.batch_size,
            epoch_ms=wall,
            share_complete_ms=st.compute_ms + st.data_ms,
            compute_only_ms=st.compute_ms,
            data_starve_ms=st.data_ms,
            scalars={k: [float(sm), float(c)] for k, (sm, c) in drain_scalars().items()},
            ranges=trained,
        )

    # -- state ----------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        if self.exp.eval_fn is None or self.exp.eval_data is None:
            return {}
        was = self.model.training
        self.model.eval()
        try:
            return {k: float(v) for k, v in self.exp.eval_fn(self.model, self.exp.eval_data, self.device).items()}
        finally:
            self.model.train(was)
