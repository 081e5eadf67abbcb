"""The record stream: sub-epoch window reports and the on-disk record log (algorithms.md 9.5).

* :class:`WindowReporter` decides, at each reduce, whether the window closes
  one of the ``reports_per_epoch`` slices of the epoch's work; slices still
  owed when the epoch is aggregated are flushed then, so an epoch always
  yields exactly ``n`` window records.
* :class:`WindowRecorder` writes them (MLflow ``window/*``, events, record log).
* :class:`RingLog` is an append-only JSONL file that never exceeds
  ``max_bytes``: the oldest records are dropped first (a drop-oldest ring).
* :class:`RecordLog` keeps one ring per record node: ``root.log`` for the
  coordinator's stream and ``<host>/rank<r>.log`` per rank.
"""
from __future__ import annotations

import json
import logging
import os
from collections import deque
from collections.abc import Callable
from typing import Any, Optional, Protocol

from flodl_exp import events as ev
from flodl_exp.fsio import atomic_write

log = logging.getLogger("flodl_exp.coordinator")


# What the window records read of their neighbours, as Protocols rather than imports: event_log.py imports
# this module for RecordLog, and the core's components import records' readers, so importing back would close a circle.
class CycleView(Protocol):
    """The averaging cycle as a window record reads it (:class:`flodl_exp.core.cycle.AveragingCycle`)."""

    @property
    def anchor(self) -> Optional[int]: ...

    @property
    def global_step(self) -> int: ...

    @property
    def window_t0(self) -> float: ...

    def window_loss(self) -> float: ...


class OutcomeView(Protocol):
    """A finished reduce as a window record reads it (:class:`flodl_exp.core.cycle.ReduceOutcome`)."""

    @property
    def n(self) -> dict[int, int]: ...

    @property
    def k_used(self) -> int: ...

    @property
    def sync_ms(self) -> float: ...

    @property
    def held_ms(self) -> Optional[float]: ...

    @property
    def window_loss(self) -> float: ...

    @property
    def window_s(self) -> float: ...

    @property
    def d_max(self) -> Optional[float]: ...


class EventSink(Protocol):
    """Where events go (:class:`flodl_exp.coordinator.event_log.EventLog`)."""

    def emit(self, event: ev.EventRecord) -> None: ...


class WindowReporter:
    def __init__(self, per_epoch: int, epoch_work: int) -> None:
        self.per_epoch = max(0, int(per_epoch))
        self.epoch_work = max(1, int(epoch_work))
        self.work: dict[int, int] = {}
        self.fired: dict[int, int] = {}

    def on_window(self, epoch: int, k_used: int) -> bool:
        """Add a window's batches to ``epoch``; True when it closes a new slice (at most one per window)."""
        if self.per_epoch == 0:
            return False
        self.work[epoch] = self.work.get(epoch, 0) + int(k_used)
        due = min(self.per_epoch, self.work[epoch] * self.per_epoch // self.epoch_work)
        if due > self.fired.get(epoch, 0):
            self.fired[epoch] = self.fired.get(epoch, 0) + 1
            return True
        return False

    def owed(self, epoch: int) -> int:
        """Reports still owed for ``epoch`` when it is aggregated (then counted as fired)."""
        if self.per_epoch == 0:
            return 0
        n = self.per_epoch - self.fired.get(epoch, 0)
        self.fired[epoch] = self.per_epoch
        return max(0, n)


class WindowRecorder:
    """Writes the window records: MLflow metrics under ``window/`` (step = global step), an event,
    and a per-rank record-log line, at the reduces that close a slice and for slices still owed
    when an epoch is aggregated."""

    def __init__(self, *, reports_per_epoch: int, world_size: int, epochs: int, batch_size: int, cycle: CycleView,
                 sink: Any, events: EventSink, records: RecordLog, clock: Callable[[], float]) -> None:
        self.per_epoch = reports_per_epoch
        self.world_size = world_size
        self.epochs = epochs
        self.batch_size = batch_size
        self._cycle = cycle
        self._sink = sink
        self._events = events
        self._records = records
        self._clock = clock
        self.reporter = WindowReporter(0, 1)
        self.last_loss = float("nan")

    def start(self, total_picks: int) -> None:
        self.reporter = WindowReporter(self.per_epoch, total_picks // self.batch_size)

    def on_reduce(self, out: OutcomeView, epoch: int) -> None:
        if epoch >= self.epochs or not self.reporter.on_window(epoch, out.k_used):
            return  # the drain reduce after the last epoch belongs to no epoch's slices
        self._write(out, epoch)

    def flush_epoch(self, epoch: int) -> None:
        for _ in range(self.reporter.owed(epoch)):
            self._write(None, epoch)

    def _write(self, out: Optional[OutcomeView], epoch: int) -> None:
        cycle = self._cycle
        k_used = out.k_used if out is not None else 0
        n = out.n if out is not None else {}
        loss = out.window_loss if out is not None else cycle.window_loss()
        if loss != loss:  # a flushed slice with no batches: carry the last loss
            loss = self.last_loss
        self.last_loss = loss
        window_s = out.window_s if out is not None else max(self._clock() - cycle.window_t0, 1e-6)
        rec: dict[str, float] = {
            "window/loss": loss,
            "window/samples_per_s": k_used * self.batch_size / window_s,
            "window/sync_ms": out.sync_ms if out is not None else 0.0,
            "window/epoch": float(epoch),
        }
        if out is not None and out.held_ms is not None:  # mode.overlap: what the reduce cost the ranks
            rec["window/held_ms"] = out.held_ms
        if cycle.anchor is not None:
            rec["window/anchor"] = float(cycle.anchor)
        d_max = out.d_max if out is not None else None
        if d_max is not None:
            rec["window/divergence"] = d_max
        for r in range(self.world_size):
            rec[f"window/rank{r}/share"] = n.get(r, 0) / k_used if k_used else 0.0
            rec[f"window/rank{r}/steps"] = float(n.get(r, 0))
        rec = {k: v for k, v in rec.items() if v == v}
        gs = cycle.global_step
        self._sink.log_metrics(rec, step=gs)
        self._events.emit(ev.Window(step=gs, values={k[len("window/"):]: v for k, v in rec.items()}))
        for r in range(self.world_size):
            self._records.rank(r, "window", {"step": gs, "steps": n.get(r, 0)})


class RingLog:
    """JSONL file bounded to ``max_bytes``; whole lines only, oldest dropped first.

    A write that fails (a full disk) never raises: it is logged once and counted in ``write_errors``
    (the record stays in memory and reaches the file with the next rewrite)."""

    def __init__(self, path: str, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = int(max_bytes)
        self.lines: deque[bytes] = deque()
        self.size = 0
        self.write_errors = 0
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        except OSError as e:
            self._failed(e)

    def _failed(self, e: OSError) -> None:
        if self.write_errors == 0:
            log.warning("record log %s: write failed (%s); further failures are counted, not logged", self.path, e)
        self.write_errors += 1

    def append(self, record: dict) -> None:
        try:
            self._append(record)
        except OSError as e:
            self._failed(e)

    def _append(self, record: dict) -> None:
        line = (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()
        if len(line) > self.max_bytes:
            return  # one record larger than the whole ring: dropped, never truncated mid-line
        self.lines.append(line)
        self.size += len(line)
        dropped = False
        while self.size > self.max_bytes:
            self.size -= len(self.lines.popleft())
            dropped = True
        if dropped:
            self._rewrite()
        else:
            with open(self.path, "ab") as fh:
                fh.write(line)

    def _rewrite(self) -> None:
        # no fsync: the ring is rewritten at every append once full, and a record log lost to a power cut costs little
        atomic_write(self.path, lambda fh: fh.writelines(self.lines), fsync=False)


class RecordLog:
    def __init__(self, root_dir: Optional[str], max_bytes: int) -> None:
        self.dir = root_dir
        self.max_bytes = max_bytes
        self.rings: dict[str, RingLog] = {}
        self.hosts: dict[int, str] = {}

    @property
    def enabled(self) -> bool:
        return self.dir is not None

    @property
    def write_errors(self) -> int:
        return sum(r.write_errors for r in self.rings.values())

    def _ring(self, rel: str) -> RingLog:
        if rel not in self.rings:
            self.rings[rel] = RingLog(os.path.join(self.dir, rel), self.max_bytes)  # type: ignore[arg-type]
        return self.rings[rel]

    def root(self, kind: str, fields: dict[str, Any]) -> None:
        if self.enabled:
            self._ring("root.log").append({"kind": kind, **fields})

    def rank(self, r: int, kind: str, fields: dict[str, Any]) -> None:
        if self.enabled:
            host = self.hosts.get(r, "unknown").replace("/", "_")
            self._ring(os.path.join(host, f"rank{r}.log")).append({"kind": kind, "rank": r, **fields})
