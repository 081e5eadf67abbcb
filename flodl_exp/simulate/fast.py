"""Indexes that keep the real dispatcher and chunk pool O(1) where they scan every rank.

At 1,024 ranks the coordinator's books scan: ``Dispatcher.in_flight(r)`` walks every chunk in flight,
``ChunkPool.remaining()`` sums every rank's residue, ``Dispatcher._ready(e)`` walks every chunk; each runs
several times per dispatched chunk, so a window costs O(W^2). The logic stays the real classes'; these
only answer the same questions from a running count kept beside the same data:

* :class:`IndexedChunks` is the dispatcher's ``chunks`` dict, counting chunks per rank and per epoch on
  every insert and removal (the only ways the dispatcher changes it);
* :class:`CountedPool` is a :class:`ChunkPool` whose ``remaining()`` is a running total: every
  ``take_chunk`` removes what it hands out, ``reopen`` and ``forfeit`` give back what they move to the
  reclaimed queue, a ``rollback_take`` recounts;
* :class:`PoolsDict` turns each pool the dispatcher stores into a CountedPool as it is stored.

``check=True`` (the tests) compares every answer with the real scan. The same running counts in the real
classes would make the coordinator itself O(W) per window (see the simulator's README section).
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Optional

from ..control.chunk_pool import ChunkPool, Range
from ..control.dispatch import Chunk, Dispatcher


class IndexedChunks(dict[int, Chunk]):
    def __init__(self) -> None:
        super().__init__()
        self.by_rank: Counter[int] = Counter()
        self.by_epoch: Counter[int] = Counter()

    def __setitem__(self, cid: int, ch: Chunk) -> None:
        old = self.get(cid)
        if old is not None:
            self._drop(old)
        super().__setitem__(cid, ch)
        self.by_rank[ch.rank] += 1
        self.by_epoch[ch.epoch] += 1

    def _drop(self, ch: Chunk) -> None:
        self.by_rank[ch.rank] -= 1
        self.by_epoch[ch.epoch] -= 1

    def __delitem__(self, cid: int) -> None:
        self._drop(self[cid])
        super().__delitem__(cid)

    def pop(self, cid: int, default: Any = None) -> Any:
        if cid in self:
            ch = super().pop(cid)
            self._drop(ch)
            return ch
        return default


class CountedPool(ChunkPool):
    _rem: int
    check: bool = False

    def remaining(self) -> int:
        if self.check:
            assert self._rem == ChunkPool.remaining(self), (self._rem, ChunkPool.remaining(self))
        return self._rem

    def take_chunk(self, size: int, rank: int) -> Optional[Range]:
        got = super().take_chunk(size, rank)
        if got is not None:
            self._rem -= got[1]
        return got

    def reopen(self, rank: int, offset: int, size: int) -> int:
        n = super().reopen(rank, offset, size)
        self._rem += n
        return n

    def forfeit(self, rank: int) -> int:
        n = super().forfeit(rank)
        self._rem += n
        return n

    def rollback_take(self, rank: int, offset: int, size: int) -> None:
        super().rollback_take(rank, offset, size)
        self._rem = ChunkPool.remaining(self)


class PoolsDict(dict[int, ChunkPool]):
    def __init__(self, check: bool) -> None:
        super().__init__()
        self.check = check

    def __setitem__(self, e: int, pool: ChunkPool) -> None:
        if type(pool) is ChunkPool:  # CountedPool adds no state the pool's own methods read
            pool.__class__ = CountedPool
            assert isinstance(pool, CountedPool)
            pool._rem = ChunkPool.remaining(pool)
            pool.check = self.check
        super().__setitem__(e, pool)


class SimDispatcher(Dispatcher):
    """The real dispatcher, with its chunk and pool books indexed (the answers are the same)."""

    def __init__(self, *, check: bool = False, **kw: Any) -> None:
        super().__init__(**kw)
        self.check = check
        self.chunks = IndexedChunks()
        self.pools = PoolsDict(check)

    def in_flight(self, r: int) -> bool:
        chunks = self.chunks
        assert isinstance(chunks, IndexedChunks)
        got = chunks.by_rank[r] > 0
        if self.check:
            assert got == Dispatcher.in_flight(self, r)
        return got

    def maybe_ready(self) -> bool:
        """A cheap necessary condition for ``pop_aggregated`` to return an epoch (no chunk of the next
        epoch in flight; when progressive, its pool handed everything out)."""
        e = self.last_aggregated + 1
        chunks = self.chunks
        assert isinstance(chunks, IndexedChunks)
        if e >= self.epochs or chunks.by_epoch[e] > 0:
            return False
        pool = self.pools.get(e)
        return not self.progressive or (pool is not None and pool.remaining() == 0)
