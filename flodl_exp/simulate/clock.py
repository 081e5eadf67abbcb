"""The discrete-event clock: a heap of timed events and the simulated time the real components read.

Nothing sleeps: :meth:`EventQueue.pop` jumps the clock to the next event. Events at the same time keep the
order they were scheduled in (a sequence number breaks ties), so a run is a pure function of its inputs.
"""
from __future__ import annotations

import heapq
from typing import Any


class SimClock:
    """Seconds since the simulated start; called like ``time.monotonic`` (the coordinator's components take
    their clock as an argument, so they read this one)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class EventQueue:
    """A min-heap of ``(time_s, seq, kind, rank, payload)`` with a hard bound on how many it hands out."""

    def __init__(self, clock: SimClock, max_events: int) -> None:
        self._heap: list[tuple[float, int, int, int, Any]] = []
        self._seq = 0
        self.clock = clock
        self.max_events = int(max_events)
        self.popped = 0
        """Events handed out so far (the run's cost, reported)."""

    def __len__(self) -> int:
        return len(self._heap)

    def at(self, t: float, kind: int, rank: int = -1, payload: Any = None) -> None:
        """Schedule an event at absolute time ``t`` (never before now)."""
        self._seq += 1
        heapq.heappush(self._heap, (max(t, self.clock.t), self._seq, kind, rank, payload))

    def after(self, dt_s: float, kind: int, rank: int = -1, payload: Any = None) -> None:
        self.at(self.clock.t + dt_s, kind, rank, payload)

    def pop(self) -> tuple[int, int, Any]:
        """The next event; moves the clock to its time. Raises RuntimeError past ``max_events``."""
        if self.popped >= self.max_events:
            raise RuntimeError(f"simulation stopped after max_events={self.max_events} events at t={self.clock.t:.3f}s "
                               "(raise max_events, or the rig does not finish)")
        t, _, kind, rank, payload = heapq.heappop(self._heap)
        self.popped += 1
        self.clock.t = t
        return kind, rank, payload
