"""The rank's training primitives: begin_epoch -> (next_batch -> train_step -> after_step)* -> end_epoch.

One replica, its optimizer and its data; no sockets. The managed loop in
``rank/control.py`` drives these between control messages, and tests drive
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

No host sync per batch on the hot path: ``step`` leaves the loss on the device
and times the step with CUDA events (a CPU rank keeps the wall clock);
``record_step`` adds the loss to a device-side accumulator and folds in the
step times whose events have already completed (``Event.query``, no wait).
``end_epoch`` resolves the rest: one wait for the chunk's last step and one read
of the accumulated loss per chunk. ``train_step`` (-> ``after_step``) is the same
step resolved at once, for callers that need per-batch host values (the
per-batch ``Batch`` report's ``ms`` and ``loss``); on CUDA that is one wait per
batch. Either way a chunk's metrics mean the same: ``compute_only_ms`` is the
sum of the steps' compute times (device time between the events on CUDA, plus
the simulated slowdown), ``avg_loss`` the sum of the finite step losses over
the batches.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from flodl_exp.experiment import AMP_DTYPES, Experiment
from flodl_exp.partition import make_partition
from flodl_exp.protocol import messages as protocol
from flodl_exp.scalars import drain_scalars


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
    loss_acc: Optional[torch.Tensor] = None
    """Device-side sum (float64) of the finite losses of ``record_step``'s steps; read once, in end_epoch."""
    pending: deque[PendingStep] = field(default_factory=deque)
    """``record_step``'s steps whose time is not in ``compute_ms`` yet (their end event had not completed)."""
    unlossed: int = 0
    """Steps booked without a loss (the cooperative ``w.step()`` without ``loss=``)."""

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
class PendingStep:
    """One trained batch whose loss and time may still be on the device.

    ``loss``: the detached loss tensor (on the model's device). ``start``/``end``:
    CUDA events recorded around the step (None on CPU). ``host_ms``: on CPU the
    step's wall time; on CUDA the host wall added to the device time (the
    simulated slowdown's sleep, else 0). ``loss_host``: on CUDA a pinned host copy
    of the loss, enqueued before ``end``: once ``ready()`` it is read without
    touching the device (``float(loss)`` would wait for the whole stream, later
    steps included).
    """

    loss: torch.Tensor
    host_ms: float
    start: Any = None
    end: Any = None
    loss_host: Optional[torch.Tensor] = None
    has_loss: bool = True
    """False: the cooperative loop stepped without reporting a loss (kept out of the chunk's mean loss)."""

    def ready(self) -> bool:
        """The step's time can be read without waiting (``Event.query`` does not block)."""
        return self.end is None or bool(self.end.query())

    @property
    def ms(self) -> float:
        """The step's compute time in ms; on CUDA this waits for the step's end event."""
        if self.end is None:
            return self.host_ms
        self.end.synchronize()
        return float(self.start.elapsed_time(self.end)) + self.host_ms

    def resolve(self) -> tuple[float, float]:
        """(loss, ms) as host floats: waits for this step's end event on CUDA (no wait once ``ready()``)."""
        ms = self.ms
        return float(self.loss_host if self.loss_host is not None else self.loss), ms


@dataclass
class Batch:
    data: Any
    data_ms: float
    """Data wait without control work (per-chunk ``data_starve_ms``)."""
    ids: np.ndarray
    wait_ms: float = 0.0
    """Data wait with control work: what the coordinator's cost feed gets (algorithms.md 9.1)."""


class OptimizerSet:
    """Several optimizers stepped by one cooperative loop (``w.setup(opt_a, opt_b)``), seen as one by the
    rank: their param groups for the LR schedule, one state dict for bundles, every state for DiLoCo's reset."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        if not optimizers:
            raise ValueError("OptimizerSet needs at least one optimizer")
        self.optimizers = list(optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("optimizers") if isinstance(state, dict) else None
        if not isinstance(saved, list) or len(saved) != len(self.optimizers):
            have = len(saved) if isinstance(saved, list) else "no list of"
            raise ValueError(f"the bundle holds {have} optimizer states; this loop set up {len(self.optimizers)}")
        for opt, sd in zip(self.optimizers, saved):
            opt.load_state_dict(sd)


_ZERO_IS_FRESH: tuple[type, ...] = (torch.optim.Adam, torch.optim.AdamW)
"""Optimizers whose fresh per-parameter state is all zeros (``step`` included)."""


def _reset_in_place(opt: torch.optim.Optimizer) -> bool:
    """Zero ``opt``'s per-parameter state in place when that is exactly its fresh state; False (nothing done) else."""
    plain_sgd = type(opt) is torch.optim.SGD and all(float(g.get("dampening", 0.0)) == 0.0 for g in opt.param_groups)
    if not (type(opt) in _ZERO_IS_FRESH or plain_sgd):
        return False
    with torch.no_grad():
        for state in opt.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    value.zero_()
                elif isinstance(value, (int, float)):
                    state[key] = type(value)(0)
    return True


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
        self.steps_in_flight = 0
        """``mode.overlap``: the steps of this rank's answer to the reduce in flight (in no global step yet): the LR's
        position counts them until the reduce's SetGlobalStep does."""
        self.step_count = 0
        """Monotonic local counter: batches + completed collective syncs (NCCL ack gate)."""
        self._last_loss: Any = float("nan")
        self.device_timing = device.type == "cuda"
        """Time steps with CUDA events (else the host wall clock)."""
        factor = 1.0 + (world_size - 1) * lr_scale_ratio if (world_size > 1 and lr_scale_ratio > 0) else 1.0
        self.lr_scale = factor if factor > 1 else 1.0
        self._unscaled_lr: dict[int, float] = {}
        """Each param group's own LR, by ``id(group)``, before the linear scaling (so scaling applies once)."""
        self.base_lrs: list[float] = []
        self.use_optimizer(self.optimizer)
        self.amp_dtype: Optional[torch.dtype] = AMP_DTYPES[exp.amp] if exp.amp else None
        """The managed step's autocast dtype (``experiment.amp``); None: float32."""
        self.scaler: Optional[torch.amp.GradScaler] = (torch.amp.GradScaler(device.type) if exp.amp == "fp16"
                                                       else None)
        """fp16 only (bf16 has float32's range): the loss is scaled before backward so small gradients do not
        underflow, unscaled before clipping, and a step with inf/NaN gradients is skipped."""
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
        pipeline.reserve_for_sync(self.model)  # the VRAM budget keeps a sync's working memory (5x parameter bytes)
        self.on_data_wait = on_wait
        self.stop_data_wait = should_stop

    def data_pipeline(self) -> Any:
        if self.pipeline is None:
            from flodl_exp.rank.data import DataPipeline

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

    def probe(self, steps: int) -> tuple[list[float], list[float]]:
        """``mode.auto``'s measurement before the first chunk: ``steps`` real training steps (forward, backward,
        clip, optimizer step; the simulated slowdown included) on the first picks of epoch 0, each one's compute
        and data-wait ms. The model, the optimizer and the RNG are then put back as they were, so nothing is
        trained and every rank still starts from the same weights (BatchNorm statistics and optimizer moments
        included)."""
        import copy

        if self.exp.train_step is None:
            raise RuntimeError("a cooperative loop (experiment.loop) has no step the framework can time")
        model_state = copy.deepcopy(self.model.state_dict())
        optim_state = copy.deepcopy(self.optimizer.state_dict())
        scaler_state = self.scaler.state_dict() if self.scaler is not None else None
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if self.device.type == "cuda" else None
        step_ms: list[float] = []
        data_ms: list[float] = []
        try:
            st = self.begin_epoch(0, 0, min(self.total_picks, max(1, steps) * self.batch_size))
            for _ in range(max(1, steps)):
                batch = self.next_batch(st)
                if batch is None:
                    break
                step_ms.append(self.step(batch).resolve()[1])
                data_ms.append(float(batch.wait_ms))
        finally:
            self.model.load_state_dict(model_state)
            self.optimizer.load_state_dict(optim_state)
            self.optimizer.zero_grad(set_to_none=True)
            if self.scaler is not None and scaler_state is not None:
                self.scaler.load_state_dict(scaler_state)
            torch.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
        return step_ms, data_ms

    def reset_optimizer_state(self) -> None:
        """Forget the inner optimizer's per-parameter state (moments, momentum buffers): DiLoCo restarts the
        inner optimizer from each adopted global. The learning rate and its schedule are kept.

        Where a zeroed state is exactly a fresh one (Adam, AdamW; SGD without dampening) it is zeroed in place:
        the same tensors, keys and devices, so a compiled optimizer step is not recompiled every window and
        nothing is reallocated; any other optimizer's state is cleared (its own fresh state may not be zeros:
        Adagrad's initial accumulator, Rprop's step sizes)."""
        for opt in self.optimizers():
            if not _reset_in_place(opt):
                opt.state.clear()

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers the rank trains with (one, or those of an :class:`OptimizerSet`)."""
        return self.optimizer.optimizers if isinstance(self.optimizer, OptimizerSet) else [self.optimizer]

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def last_loss(self) -> float:
        """The last step's loss (read from the device when asked, not per batch)."""
        return float(self._last_loss)

    def _cuda_event(self) -> Any:
        """A timing event recorded now on the device's current stream (returns at once)."""
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def step(self, batch: Batch) -> PendingStep:
        """Forward + backward + clip + optimizer step, with no host sync: the loss stays on the device
        and, on CUDA, the time is a pair of events resolved later (``PendingStep.ms``).

        With a scheduler the LR is set from the global position
        ``global_step + steps_since_avg`` times the linear-scaling factor, so all
        ranks agree without exchanging LRs.
        """
        started = self.begin_step()
        self.optimizer.zero_grad(set_to_none=True)
        assert self.exp.train_step is not None, "the managed step needs experiment.train_step"
        with self.autocast():
            loss = self.exp.train_step(self.model, batch.data)
        if self.scaler is None:
            loss.backward()
            self.clip_grads()
            self.optimizer.step()
        else:
            self.scaler.scale(loss).backward()
            for opt in self.optimizers():
                self.scaler.unscale_(opt)  # clipping sees the true gradients
            self.clip_grads()
            for opt in self.optimizers():
                self.scaler.step(opt)  # skipped when the gradients hold inf/NaN
            self.scaler.update()
        return self.end_step(started, loss)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The user's forward and loss under ``experiment.amp``'s autocast (nothing without it)."""
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.amp_dtype)

    def begin_step(self) -> tuple[float, Any]:
        """Open a step's timing (the host clock and, on CUDA, a start event) and set the LR of the
        global position. The cooperative tier opens one when it hands a batch to the user's loop."""
        t0 = time.perf_counter()
        start: Any = self._cuda_event() if self.device_timing else None
        if self.exp.lr_factor is not None:
            f = self.exp.lr_factor(self.global_step + self.steps_in_flight + self.steps_since_avg) * self.lr_scale
            for g, base in zip(self.optimizer.param_groups, self.base_lrs):
                g["lr"] = base * f
        return t0, start

    def clip_grads(self) -> None:
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)

    def end_step(self, started: tuple[float, Any], loss: Optional[torch.Tensor], host_extra_ms: float = 0.0) -> PendingStep:
        """Close the step opened by :meth:`begin_step`: its loss (None: the loop reported none) stays on the
        device, its time is the host wall on CPU or a pair of CUDA events, the simulated slowdown added.
        ``host_extra_ms``: host work of the step outside that window (a cooperative loop's code after its
        previous ``w.step``), added on CUDA (on CPU the caller moved ``started`` back by it)."""
        t0, start = started
        has_loss = loss is not None
        if loss is None:
            loss = torch.full((), float("nan"), device=self.device)
        loss_host = None
        if self.device_timing and loss.is_cuda:
            loss_host = torch.empty((), dtype=loss.dtype, pin_memory=True)
            loss_host.copy_(loss.detach().reshape(()), non_blocking=True)
        end = self._cuda_event() if self.device_timing else None
        step_ms = (time.perf_counter() - t0) * 1e3
        if end is None:
            if self.speed < 1.0:
                # Simulated slower device: idle (1/s - 1) x the real step time inside the step.
                time.sleep((1.0 / self.speed - 1.0) * step_ms / 1e3)
                step_ms = (time.perf_counter() - t0) * 1e3
            return PendingStep(loss=loss.detach(), host_ms=step_ms, has_loss=has_loss)
        extra_ms = host_extra_ms
        if self.speed < 1.0:
            # The same on CUDA, which needs the step's device time now: a wait per batch, only
            # for this simulation knob.
            end.synchronize()
            t1 = time.perf_counter()
            time.sleep((1.0 / self.speed - 1.0) * float(start.elapsed_time(end)) / 1e3)
            extra_ms += (time.perf_counter() - t1) * 1e3
        return PendingStep(loss=loss.detach(), host_ms=extra_ms, start=start, end=end, loss_host=loss_host,
                           has_loss=has_loss)

    def use_optimizer(self, optimizer: Any) -> None:
        """Train with ``optimizer`` (the cooperative tier's ``w.setup``): it gets the run's linear LR scaling
        and schedule, its state is what bundles save and DiLoCo resets."""
        self.optimizer = optimizer
        self.base_lrs = [self._unscaled_lr.setdefault(id(g), g["lr"]) for g in optimizer.param_groups]
        if self.exp.lr_factor is None and self.lr_scale > 1:
            for g, base in zip(optimizer.param_groups, self.base_lrs):
                g["lr"] = base * self.lr_scale

    def train_step(self, batch: Batch) -> tuple[float, float]:
        """``step`` resolved at once: (loss, compute ms) as host floats, for per-batch consumers
        (pair with ``after_step``). On CUDA this waits for the step: the hot path is
        ``step`` + ``record_step``."""
        return self.step(batch).resolve()

    def after_step(self, st: EpochState, batch: Batch, loss: float, compute_ms: float) -> None:
        """Book a step whose loss and time the caller already read (``train_step``)."""
        st.batches += 1
        if math.isfinite(loss):
            st.loss_sum += loss
        st.compute_ms += compute_ms
        st.data_ms += batch.data_ms
        self.steps_since_avg += 1
        self.step_count += 1
        self._last_loss = loss

    def record_step(self, st: EpochState, batch: Batch, step: PendingStep) -> None:
        """Book a ``step`` without reading anything from the device: its loss is added to the
        chunk's device-side sum (non-finite as 0, as ``after_step`` skips it), its time is folded
        into ``compute_ms`` once its end event has completed, at the latest in ``end_epoch``."""
        loss = torch.nan_to_num(step.loss.detach().reshape(()).to(torch.float64), nan=0.0, posinf=0.0, neginf=0.0)
        st.loss_acc = loss if st.loss_acc is None else st.loss_acc.add_(loss)
        st.pending.append(step)
        st.unlossed += 0 if step.has_loss else 1
        while st.pending and st.pending[0].ready():
            st.compute_ms += st.pending.popleft().ms
        st.batches += 1
        st.data_ms += batch.data_ms
        self.steps_since_avg += 1
        self.step_count += 1
        self._last_loss = step.loss

    def end_epoch(self, st: EpochState, chunk: int = 0) -> protocol.ChunkMetrics:
        """The chunk's metrics (algorithms.md 9.2) as the wire payload the coordinator gets.

        Resolves ``record_step``'s steps: waits for the last one's end event (so the wall
        covers the device's work too), then reads the accumulated loss (one host read)."""
        while st.pending:
            st.compute_ms += st.pending.popleft().ms
        if st.loss_acc is not None:
            st.loss_sum += float(st.loss_acc)
            st.loss_acc = None
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
            avg_loss=st.loss_sum / (st.batches - st.unlossed) if st.batches > st.unlossed else 0.0,
            loss_batches=st.batches - st.unlossed if st.unlossed else None,
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
