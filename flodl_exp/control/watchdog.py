"""The stall watchdog (algorithms.md 3.1 step 9): when the global step has not moved for 15 s while
ranks are alive, dump what the coordinator knows of every rank and of itself to the job folder and
the log; again at 120 s, then every 120 s. A dump explains a hang after the fact; it changes nothing."""
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

FIRST_DUMP_S = 15.0
REPEAT_DUMP_S = 120.0


class StallWatchdog:
    def __init__(self, job_dir: str, clock: Callable[[], float], *, first_s: float = FIRST_DUMP_S,
                 repeat_s: float = REPEAT_DUMP_S) -> None:
        self.job_dir = job_dir
        self._clock = clock
        self.first_s = first_s
        self.repeat_s = repeat_s
        self._marker: Any = None
        self._since = clock()
        self._dumps = 0
        self.paths: list[str] = []

    def check(self, marker: Any, state: Callable[[], dict[str, Any]]) -> Optional[str]:
        """``marker`` = the progress measure (the global step); ``state`` builds the dump when one is due."""
        now = self._clock()
        if marker != self._marker:
            self._marker, self._since, self._dumps = marker, now, 0
            return None
        idle = now - self._since
        due = self.first_s if self._dumps == 0 else self.repeat_s * self._dumps
        if idle < due:
            return None
        self._dumps += 1
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
