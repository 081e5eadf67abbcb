"""When the coordinator's process runs its full garbage collections: just after a reduce, not whenever they fall.

A full (generation 2) collection holds every thread of the process, the read thread included. Even with the start-up
heap frozen (``coordinator.freeze_startup_heap``), at 1,024 ranks the run's own objects (the ranks' books, the
timeline's spans) made each one take 40-210 ms on the 2-core dev machine, 17-20 times a paced 60 s run
(experiments/bench_coordinator.py, the coordinator's gc callbacks), at moments Python's thresholds pick: one that
falls as a window's count-completing reports arrive delays the reduce's trigger by its length.

So in the coordinator's own process the automatic full collections are turned off (generations 0 and 1 keep
Python's thresholds) and one is run at the first tick after a reduce finished, its updates already sent: the ranks
then train a whole window before the next trigger can wait on anything. At most one every :data:`MIN_INTERVAL_S`
(a sync mode reduces every step), and at least one every :data:`BACKSTOP_S` whether reduces come or not, so
garbage in cycles is still freed and the heap stays bounded.
"""
from __future__ import annotations

import gc
from collections.abc import Callable

MIN_INTERVAL_S = 5.0
"""A full collection at most this often (Python's own thresholds gave one every 3-4 s at 1,024 ranks)."""
BACKSTOP_S = 30.0
"""A full collection at least this often, reduces or not."""
NEVER = 1 << 30
"""Generation 2's threshold that turns its automatic collections off (gen-1 collections between two of them)."""


class FullCollections:
    """Owns the process's full collections once :meth:`install` ran (the coordinator's own process only)."""

    def __init__(self, clock: Callable[[], float], collect: Callable[[int], int] = gc.collect) -> None:
        self._clock = clock
        self._collect = collect
        self._last = clock()
        self._wanted = False
        self.collections = 0
        """Full collections run here (tests, benches)."""

    def install(self) -> None:
        """Turn Python's automatic full collections off in this process (generations 0 and 1 unchanged)."""
        t0, t1, _ = gc.get_threshold()
        gc.set_threshold(t0, t1, NEVER)

    def after_reduce(self) -> None:
        """A reduce finished: the next :meth:`tick` may collect."""
        self._wanted = True

    def tick(self) -> bool:
        """Collect now if a reduce finished since the last one and :data:`MIN_INTERVAL_S` passed, or if
        :data:`BACKSTOP_S` passed anyway. True when it collected."""
        now = self._clock()
        since = now - self._last
        if not ((self._wanted and since >= MIN_INTERVAL_S) or since >= BACKSTOP_S):
            return False
        self._collect(2)
        self._last, self._wanted = self._clock(), False
        self.collections += 1
        return True
