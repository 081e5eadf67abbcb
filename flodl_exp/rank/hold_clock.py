"""What an overlapped reduce costs a rank: the time its training stood still for averaging.

Without overlap a rank waits out the whole reduce, so the coordinator times the reduce itself (trigger to finish)
and hands that to ElChe as the window's fixed cost (``sync_ms``: the anchor grows until it is about 5 % of the
window). With ``mode.overlap`` the rank trains on while the reduce runs, and the reduce's length is no longer what it
costs: that is the launch (the replica copied for the all-reduce or the snapshot), the landing (the correction
``W += avg - W_sent``) and the rank's idle while its answer is unresolved (a rank that trained through its next
window before the reduce finished gets no more work until it does: the chunk after comes with the finish). The rank adds those up
here and sends the sum with its next answer (``held_ms`` on a SyncAck or a Snapshot); the coordinator feeds ElChe
the most any rank was held (core/cycle.py), so the window is sized on what averaging costs, not on how long it runs.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Optional


class HoldClock:
    """Adds up the time spent in :meth:`holding` blocks (nested blocks count once) until :meth:`take_ms`."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._held_s = 0.0
        self._since: Optional[float] = None
        """When the outermost open block began (None: none open)."""
        self._depth = 0

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Training stands still for averaging while the block runs."""
        if self._depth == 0:
            self._since = self._clock()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0 and self._since is not None:
                self._held_s += self._clock() - self._since
                self._since = None

    def take_ms(self) -> float:
        """The time held since the last call, an open block's included up to now (its rest counts for the next)."""
        held = self._held_s
        if self._since is not None:
            now = self._clock()
            held += now - self._since
            self._since = now
        self._held_s = 0.0
        return held * 1e3
