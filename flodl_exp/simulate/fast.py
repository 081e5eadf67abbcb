"""The simulator's dispatcher: the real one, plus one cheap test the engine asks before aggregating.

The coordinator's books are O(1) where a thousand ranks made them scan (the dispatcher's ``ChunkBook``
counts chunks per rank and epoch; a pool keeps ``remaining()`` as a running count), so the simulator
uses them as they are. ``check=True`` (the tests) compares those running counts with a full scan on
every aggregation check.
"""
from __future__ import annotations

from typing import Any

from ..control.dispatch import Dispatcher


class SimDispatcher(Dispatcher):
    def __init__(self, *, check: bool = False, **kw: Any) -> None:
        super().__init__(**kw)
        self.check = check

    def maybe_ready(self) -> bool:
        """A cheap necessary condition for ``pop_aggregated`` to return an epoch (no chunk of the next
        epoch in flight; when progressive, its pool handed everything out)."""
        e = self.last_aggregated + 1
        book = self.chunks
        if self.check:
            for r in range(self.W):
                assert (book.by_rank[r] > 0) == any(c.rank == r for c in book.values())
            assert (book.by_epoch[e] > 0) == any(c.epoch == e for c in book.values())
            for p in self.pools.values():
                assert p.remaining() == p._recount()
        if e >= self.epochs or book.by_epoch[e] > 0:
            return False
        pool = self.pools.get(e)
        return not self.progressive or (pool is not None and pool.remaining() == 0)
