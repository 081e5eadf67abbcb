"""The user's ``experiment.checkpoint_fn(version, model)`` on the coordinator side (algorithms.md 3.15, 8.3).

:class:`CheckpointFnRole` sends ``checkpoint`` for one version to one rank (the bundle's model-piece rank,
right after its ``save``), waits for its ``checkpoint_result``, and fails over when that rank reports an
error or dies owing the result: to the lowest live rank not tried yet for that version. With none left it
gives up on the version (logged, tagged on the run, an event): the function's errors never fail a bundle
or the run. :attr:`CheckpointFnRole.settled` is what the bundle waits for before it lets training go on.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

from flodl_exp import events as ev
from flodl_exp.core.cohort import Cohort
from flodl_exp.core.outbox import Outbox
from flodl_exp.core.ports import CoreObserver
from flodl_exp.protocol.messages import Checkpoint, CheckpointResult

log = logging.getLogger("flodl_exp.coordinator")


@dataclass
class _Owed:
    version: int
    rank: int
    tried: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class CheckpointFnRole:
    """One version at a time: :meth:`fire`, then :meth:`on_result` / :meth:`on_rank_dead` until :attr:`settled`.

    ``consensus``: the cpu backend, where the rank hands the function its last consensus frame (``Checkpoint``)."""

    def __init__(self, *, cohort: Cohort, outbox: Outbox, obs: CoreObserver, consensus: bool) -> None:
        self._cohort = cohort
        self._out = outbox
        self._obs = obs
        self._consensus = consensus
        self.owed: Optional[_Owed] = None
        """The version in progress and the rank that owes its result (None: settled)."""
        self.done: dict[int, Optional[int]] = {}
        """version -> the rank whose run succeeded (None: every live rank failed, given up)."""

    @property
    def settled(self) -> bool:
        return self.owed is None

    def fire(self, version: int, rank: int) -> None:
        """Run the function for ``version`` on ``rank`` (another live rank when it is dead)."""
        if self.owed is not None:
            log.warning("checkpoint_fn: version %d starts while version %d is still owed by rank %d: that one is "
                        "no longer waited for", version, self.owed.version, self.owed.rank)
        self.owed = _Owed(version, rank)
        if self._cohort.alive(rank):
            self._send(rank)
        else:
            self._next(f"rank {rank} is dead")

    def _send(self, r: int) -> None:
        assert self.owed is not None
        self.owed.rank = r
        self.owed.tried.append(r)
        self._out.send(r, Checkpoint(version=self.owed.version, consensus=self._consensus))

    def _next(self, why: str) -> None:
        """The owing rank failed (``why``): the lowest live untried rank, else give up on the version."""
        o = self.owed
        assert o is not None
        o.errors.append(why)
        left = [q for q in self._cohort.alive_ranks() if q not in o.tried]
        if left:
            log.warning("checkpoint_fn version %d: %s; rank %d tries it", o.version, why, left[0])
            self._send(left[0])
            return
        self.owed, self.done[o.version] = None, None
        errors = "; ".join(o.errors)
        log.error("checkpoint_fn version %d: no live rank could run it (%s): given up, training goes on",
                  o.version, errors)
        self._obs.set_tags({f"checkpoint_fn_failed.v{o.version}": errors[:5000]})
        self._obs.emit(ev.CheckpointFn(version=o.version, rank=None, error=errors, gave_up=True, tried=list(o.tried)))

    def on_result(self, r: int, res: CheckpointResult) -> bool:
        """A rank's result; True when it settled the version or moved it to another rank (the caller then checks
        whether the bundle waiting for it can go on)."""
        o = self.owed
        if o is None or res.version != o.version or r != o.rank:
            log.info("checkpoint_fn: a late result from rank %d for version %d: ignored", r, res.version)
            return False
        self._obs.emit(ev.CheckpointFn(version=res.version, rank=r, error=res.error, elapsed_ms=res.elapsed_ms))
        if res.error:
            self._obs.set_tags({"checkpoint_fn_error": f"rank {r}, version {res.version}: {res.error}"[:5000]})
            self._next(f"rank {r}: {res.error}")
            return True
        self.owed, self.done[o.version] = None, r
        log.info("checkpoint_fn version %d ran on rank %d in %.0f ms", res.version, r, res.elapsed_ms)
        self._obs.log_metrics({"checkpoint_fn/elapsed_ms": float(res.elapsed_ms)}, res.version)
        self._obs.set_tags({"checkpoint_fn/last_version": res.version, "checkpoint_fn/last_rank": r})
        return True

    def on_rank_dead(self, r: int) -> bool:
        """``r`` died; True when it owed the result (the version moved on, or was given up)."""
        o = self.owed
        if o is None or o.rank != r:
            return False
        self._next(f"rank {r} died before it reported")
        return True
