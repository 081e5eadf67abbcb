"""The simulator's dispatcher: the real one, checking its running counts against full scans.

The coordinator's books are O(1) where a thousand ranks made them scan (the dispatcher's ``ChunkBook``
counts chunks per rank and epoch; a pool keeps ``remaining()`` as a running count), so the simulator
uses them as they are. ``check=True`` (the tests) compares those running counts with a full scan at
every aggregation check.
"""
from __future__ import annotations

from typing import Any

from flodl_exp.core.dispatch import Dispatcher


class SimDispatcher(Dispatcher):
    def __init__(self, *, check: bool = False, **kw: Any) -> None:
        super().__init__(**kw)
        self.check = check
        self._reported = False
        self.checks = 0
        """Full-scan comparisons made (``check=True``)."""

    def on_metrics(self, r: int, m: Any) -> None:
        super().on_metrics(r, m)
        self._reported = True

    def pop_aggregated(self) -> Any:
        if self.check and self._reported:  # the scans at each chunk report, not at each tick
            self._reported = False
            self.checks += 1
            book = self.chunks
            e = self.last_aggregated + 1
            for r in range(self.W):
                assert (book.by_rank[r] > 0) == any(c.rank == r for c in book.values())
            assert (book.by_epoch[e] > 0) == any(c.epoch == e for c in book.values())
            for p in self.pools.values():
                assert p.remaining() == p._recount()
        return super().pop_aggregated()
