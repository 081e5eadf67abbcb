"""Progress events for the launcher: ``events.jsonl`` in the job folder (the coordinator's, a file: the shell)."""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Callable

from flodl_exp.coordinator.records import RecordLog
from flodl_exp.events import EventRecord


class EventLog:
    """Append-only progress events (shared storage on SLURM), mirrored into the record log's root ring.

    A failed append (a full disk) never raises into the coordinator: logged once, counted in ``dropped``."""

    def __init__(self, job_dir: str, records: RecordLog, clock: Callable[[], float]) -> None:
        self._path = os.path.join(job_dir, "events.jsonl")
        self._records = records
        self._clock = clock
        self._t0 = clock()
        self.dropped = 0

    @property
    def path(self) -> str:
        return self._path

    def elapsed(self) -> float:
        return self._clock() - self._t0

    def emit(self, record: EventRecord) -> None:
        """One line of ``events.jsonl``: the record's JSON with the run's elapsed ``t`` and the ``wall`` time."""
        event = dict(record.record(), t=round(self.elapsed(), 3), wall=round(time.time(), 3))
        try:
            with open(self._path, "a") as fh:
                fh.write(json.dumps(event, default=str) + "\n")
        except OSError as e:
            if self.dropped == 0:
                logging.getLogger("flodl_exp.coordinator").warning(
                    "events %s: write failed (%s); further dropped events are counted, not logged", self._path, e)
            self.dropped += 1
        self._records.root(str(event.get("event", "event")), {k: v for k, v in event.items() if k != "event"})
