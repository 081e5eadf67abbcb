"""The stall watchdog (algorithms.md 3.1 step 9): when the global step has not moved for one interval
while ranks are alive, dump what the coordinator knows of every rank and of itself to the job folder and
the log; again every interval while it stays put. A dump explains a hang after the fact; it changes nothing.

The interval follows the reference's tiers (STALL_DUMP_PROD_SECS / STALL_DUMP_SECS): 120 s by default, so
healthy long windows (an epoch-sized cadence window on a slow rig, a long nccl eval holding the reduce) are
not reported as stalls; ``cluster.stall_dump_s=15`` is the reference's -vvv interval for active debugging.
Unlike the reference, which only prints, each dump is a file: at most :data:`MAX_DUMPS` a run, then one
log line says further dumps are suppressed, so a run held for hours cannot fill the job folder."""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from .cohort import Cohort
    from .cycle import AveragingCycle
    from .dispatch import Dispatcher
    from .lifecycle import Lifecycle

log = logging.getLogger("flodl_exp.coordinator")

DUMP_S = 120.0
"""The reference's production interval (STALL_DUMP_PROD_SECS): the default of ``cluster.stall_dump_s``."""
DEBUG_DUMP_S = 15.0
"""The reference's -vvv interval (STALL_DUMP_SECS)."""
MAX_DUMPS = 5
"""Stall files a run writes at most (the reference prints without bound; files would pile up)."""


class StallWatchdog:
    def __init__(self, job_dir: str, clock: Callable[[], float], *, interval_s: float = DUMP_S,
                 max_dumps: int = MAX_DUMPS) -> None:
        self.job_dir = job_dir
        self._clock = clock
        self.interval_s = interval_s
        self.max_dumps = max_dumps
        self._marker: Any = None
        self._since = clock()
        self._last_dump: Optional[float] = None
        self._suppressed = False
        self.paths: list[str] = []

    def check(self, marker: Any, state: Callable[[], dict[str, Any]]) -> Optional[str]:
        """``marker`` = the progress measure (the global step); ``state`` builds the dump when one is due.
        Returns the path of the dump written now, if any."""
        now = self._clock()
        if marker != self._marker:  # progress: re-arm (the next stall dumps again after a full interval)
            self._marker, self._since, self._last_dump = marker, now, None
            return None
        idle = now - self._since
        if idle < self.interval_s or (self._last_dump is not None and now - self._last_dump < self.interval_s):
            return None
        self._last_dump = now
        if len(self.paths) >= self.max_dumps:
            if not self._suppressed:
                self._suppressed = True
                log.warning("no progress for %.0fs (global step %s): %d stall dumps written this run, further "
                            "dumps are suppressed (see %s)", idle, marker, len(self.paths), self.paths[-1])
            return None
        path = os.path.join(self.job_dir, f"stall-{len(self.paths) + 1}.json")
        dump = {"idle_s": round(idle, 3), **state()}
        try:
            with open(path, "w") as fh:
                json.dump(dump, fh, indent=1, default=str)
        except OSError as e:
            log.warning("stall dump not written (%s): %s", path, e)
        self.paths.append(path)
        log.warning("no progress for %.0fs (global step %s, phase %s): state dumped to %s\n%s", idle, marker,
                    dump.get("phase"), path, json.dumps(dump, default=str)[:4000])
        return path


def run_state(*, life: Lifecycle, cohort: Cohort, cycle: AveragingCycle, dispatch: Dispatcher,
              pending_saves: list[int], now: float) -> dict[str, Any]:
    """What the coordinator knows of itself and every rank (the stall dump)."""
    red = cycle.in_flight
    counts = cycle.counts
    w = cohort.world_size
    in_flight = {r: sorted(cid for cid, c in dispatch.chunks.items() if c.rank == r) for r in range(w)}
    return {
        "phase": life.phase.value, "global_step": cycle.global_step, "syncs": cycle.version,
        "epoch": dispatch.current_epoch(), "dispatch_gate": dispatch.gate.value,
        "reduce": None if red is None else {
            "backend": red.backend, "final": red.final, "age_s": round(now - red.started, 3),
            "members": sorted(red.members), "answered": sorted(set(red.acks) | set(red.snapshots))},
        "pending_saves": pending_saves,
        "ranks": [{"rank": r, "alive": cohort.alive(r), "exited": cohort.exited(r),
                   "silent_s": round(cohort.silent_for(r, now), 3), "batches": cohort.batches[r],
                   "window_steps": cycle.steps(r), "count": counts[r], "throttled": cycle.ledger[r].throttled,
                   "chunks_in_flight": in_flight[r], "epoch": dispatch.rank_epoch[r]} for r in range(w)],
    }
