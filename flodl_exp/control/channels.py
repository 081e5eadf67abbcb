"""What leaves the coordinator: typed messages to ranks (:class:`Outbox`) and progress
events for the launcher (:class:`EventLog`, ``events.jsonl`` in the job folder)."""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable, Protocol

from ..protocol import Payload, encode
from ..wire import Message
from .cohort import Cohort
from .records import RecordLog


class Transport(Protocol):
    def send(self, rank: int, msg: Message) -> bool: ...


class Outbox:
    def __init__(self, transport: Transport, cohort: Cohort) -> None:
        self._transport = transport
        self._cohort = cohort

    def send(self, r: int, payload: Payload) -> bool:
        return self._transport.send(r, encode(payload))

    def broadcast(self, payload: Payload) -> None:
        msg = encode(payload)
        for r in self._cohort.alive_ranks():
            self._transport.send(r, msg)


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

    def emit(self, event: dict[str, Any]) -> None:
        event = dict(event, t=round(self.elapsed(), 3))
        try:
            with open(self._path, "a") as fh:
                fh.write(json.dumps(event, default=str) + "\n")
        except OSError as e:
            if self.dropped == 0:
                logging.getLogger("flodl_exp.coordinator").warning(
                    "events %s: write failed (%s); further dropped events are counted, not logged", self._path, e)
            self.dropped += 1
        self._records.root(str(event.get("event", "event")), {k: v for k, v in event.items() if k != "event"})
