"""The stall watchdog (algorithms.md 3.1 step 9): when the global step has not moved for one interval
while ranks are alive, dump what the coordinator knows of every rank and of itself to the job folder and
the log; again every interval while it stays put. A dump explains a hang after the fact; it changes nothing.

The interval follows the reference's tiers (STALL_DUMP_PROD_SECS / STALL_DUMP_SECS): 120 s by default, so
healthy long windows (an epoch-sized cadence window on a slow rig, a long nccl eval holding the reduce) are
not reported as stalls; ``cluster.stall_dump_s=15`` is the reference's -vvv interval for active debugging.
Unlike the reference, which only prints, each dump is a file: at most :data:`MAX_DUMPS` a run, then one
log line says further dumps are suppressed, so a run held for hours cannot fill the job folder. What a dump holds
is the core's :func:`~.run_state.run_state` (pure, in the core); the files are the shell's, here."""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any, Optional

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
