"""A rank's Batch reports, several to a frame while the coordinator needs none of them at once.

At 1,024 ranks the coordinator's cost is per frame (read, MAC, decode, one event each): one frame per trained
batch per rank is what saturated it (issue 30). Between two reduces the coordinator books a rank's batches but
decides nothing on them until the one that completes the rank's count; that one triggers the reduce and must
not wait. So the coordinator tells each rank, as a window's counts are set, which of its reports completes
the count (:class:`~flodl_exp.protocol.messages.ReportPace`): the reports before it wait here, at most ``interval_s``,
and leave together as one :class:`~flodl_exp.protocol.messages.Batches` frame; that report and every later one go at
once, with whatever waited before it. Any other message flushes what waited first, so the coordinator reads
every Batch before a chunk's metrics, a sync ack, a snapshot or an exit, as it did without coalescing.

Until a rank hears a pace (sync modes, ``max_batch_diff`` throttling, the cold-start probe) every report
goes at once: coalescing is an optimisation the coordinator opts a rank into, never a default of the rank.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Optional

from flodl_exp.protocol.messages import Batch, Batches, Payload

log = logging.getLogger("flodl_exp.rank")

MAX_HELD = 512
"""Reports held at most: a frame of them stays far under the wire's header cap, whatever the step rate."""


class BatchReportPacer:
    """Wraps the rank's ``send``: Batch reports are coalesced under the coordinator's pace, everything else is
    sent in order after them. ``interval_s`` <= 0 turns coalescing off (every report at once). Thread-safe: the
    main thread, the heartbeat thread and the flush timer (:meth:`start`) all send through it; without
    :meth:`start` a caller flushes what is due with :meth:`flush_if_due` (the coordinator bench's simulated
    ranks, tests)."""

    def __init__(self, send: Callable[[Payload], None], interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._send = send
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Condition()
        self._held: list[Batch] = []
        self._held_at: list[float] = []
        self.reports = 0
        """Batch reports taken so far (held or sent): the index the coordinator's ``flush_at`` counts in."""
        self.flush_at = 0
        """The report that completes this rank's count (ReportPace); from it on every report goes at once."""
        self.frames = 0
        """Frames sent with Batch reports in them (single or coalesced), for tests and benches."""
        self._closed = False
        self._thread: Optional[threading.Thread] = None

    # -- the send path ------------------------------------------------------------
    def send(self, payload: Payload) -> None:
        """Send ``payload``, or hold it when it is a Batch report the coordinator does not need yet."""
        with self._lock:
            if isinstance(payload, Batch):
                self.reports += 1
                hold = (self.interval_s > 0 and self.reports < self.flush_at and not self._closed
                        and len(self._held) < MAX_HELD - 1)
                if hold and not self._held:
                    self._lock.notify()  # the timer: a new deadline
                self._held.append(payload)
                self._held_at.append(self._clock())
                if not hold:
                    self._flush_locked()
                return
            self._flush_locked()
            self._send(payload)

    def pace(self, flush_at: int) -> None:
        """The coordinator's pace for the window in progress: hold reports until the ``flush_at``-th."""
        with self._lock:
            self.flush_at = flush_at
            if self._held and self.reports >= flush_at:
                self._flush_locked()

    def flush(self) -> None:
        """Send whatever is held now."""
        with self._lock:
            self._flush_locked()

    def due(self) -> Optional[float]:
        """When what is held must leave (None: nothing held)."""
        with self._lock:
            return self._held_at[0] + self.interval_s if self._held else None

    def flush_if_due(self, now: Optional[float] = None) -> None:
        with self._lock:
            if self._held and (self._clock() if now is None else now) >= self._held_at[0] + self.interval_s:
                self._flush_locked()

    def _flush_locked(self) -> None:
        held, at = self._held, self._held_at
        if not held:
            return
        self._held, self._held_at = [], []
        self.frames += 1
        now = self._clock()
        if len(held) == 1:  # a report alone keeps its age (a held one left by the timer or another message)
            age = max(0.0, (now - at[0]) * 1e3)
            self._send(dataclasses.replace(held[0], age_ms=age) if age > 0 else held[0])
            return
        self._send(Batches.of(held, [max(0.0, (now - t) * 1e3) for t in at]))

    # -- the flush timer ------------------------------------------------------------
    def start(self) -> BatchReportPacer:
        """Flush what is held when its interval is up, from a daemon thread (the rank's)."""
        if self.interval_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rank-report-pacer", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        with self._lock:
            while not self._closed:
                if not self._held:
                    self._lock.wait()
                    continue
                wait = self._held_at[0] + self.interval_s - self._clock()
                if wait > 0:
                    self._lock.wait(wait)
                    continue
                try:
                    self._flush_locked()
                except Exception as e:  # a broken connection: the reader thread reports it, the main thread ends
                    log.warning("batch reports not sent (%s: %s): the connection is gone or broken",
                                type(e).__name__, e)
                    return

    def close(self, flush: bool = True) -> None:
        """Stop holding reports (what is held goes out when ``flush``) and end the timer."""
        with self._lock:
            self._closed = True
            try:
                if flush:
                    self._flush_locked()
            finally:
                self._held, self._held_at = [], []
                self._lock.notify_all()
