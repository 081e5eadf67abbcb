"""What leaves the coordinator: typed messages to ranks (:class:`Outbox`) and progress
events for the launcher (:class:`EventLog`, ``events.jsonl`` in the job folder)."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from typing import Callable, Optional, Protocol

from ..events import EventRecord
from ..protocol import ExtendPartition, Payload, StartEpoch, Update, bundle, encode
from ..wire import Message, SharedParts, WireError
from .cohort import Cohort
from .records import RecordLog


class Transport(Protocol):
    def send(self, rank: int, msg: Message) -> bool: ...


class Outbox:
    def __init__(self, transport: Transport, cohort: Cohort) -> None:
        self._transport = transport
        self._cohort = cohort
        self._held: Optional[dict[int, list[Payload]]] = None
        self._parts: Optional[SharedParts] = None

    def _encode(self, payload: Payload) -> Message:
        return self._shared(encode(payload))

    def _shared(self, msg: Message) -> Message:
        """``msg`` with its tensors' encoding shared within :meth:`sharing_tensors`; a tensor the wire refuses is
        left to the send, which logs it and fails that one message (as it did before the sharing)."""
        if self._parts is None:
            return msg
        try:
            return msg.sharing(self._parts)
        except WireError:
            return msg

    @contextlib.contextmanager
    def sharing_tensors(self) -> Iterator[None]:
        """Within the block, the messages that carry one tensors dict (the cpu backend's consensus, to every
        rank) share one encoding of it (:class:`~flodl_exp.wire.TensorPart`): the tensors must not change
        inside the block."""
        if self._parts is not None:
            yield
            return
        self._parts = {}
        try:
            yield
        finally:
            self._parts = None

    def send(self, r: int, payload: Payload) -> bool:
        held = self._held
        if held is not None and (r in held or isinstance(payload, Update)):
            return self._hold(held, r, payload)
        return self._transport.send(r, self._encode(payload))

    def broadcast(self, payload: Payload) -> None:
        msg = encode(payload)
        for r in self._cohort.alive_ranks():
            if self._held is not None and r in self._held:
                self._held[r].append(payload)  # behind the rank's held update, in order
            else:
                self._transport.send(r, msg)

    def _send_queue(self, r: int, queue: list[Payload]) -> None:
        """A rank's held messages, in order: in one frame (protocol.bundle) when only the first carries tensors.
        A bundle that does not go (a header over the wire's cap, a tensor it refuses) is sent again message by
        message, so one bad message never takes the update with it; a rank gone fails those sends at once."""
        if len(queue) > 1 and not any(getattr(p, "tensors", None) for p in queue[1:]):
            if self._transport.send(r, self._shared(bundle(queue))):
                return
        for p in queue:
            self._transport.send(r, self._encode(p))

    @staticmethod
    def _hold(held: dict[int, list[Payload]], r: int, payload: Payload) -> bool:
        queue = held.setdefault(r, [])
        first = queue[0] if queue else None
        # The folded chunk lands in the rank's plans ahead of what is queued behind the update: harmless for
        # everything but other plan changes, so a chunk or an extension in between stops the folding.
        reorders = any(isinstance(q, (StartEpoch, ExtendPartition)) for q in queue[1:])
        if isinstance(first, Update) and isinstance(payload, StartEpoch) and first.next_plan is None and not reorders:
            first.next_plan = [payload.epoch, payload.offset, payload.size, payload.chunk]
        else:
            queue.append(payload)
        return True

    @contextlib.contextmanager
    def folding_updates(self, enabled: bool = True) -> Iterator[None]:
        """cpu cadence (algorithms.md 5.6): within the block an ``Update`` to a rank is held, the first
        ``StartEpoch`` to that rank rides inside it (``next_plan``: the next window starts with no extra
        message) unless another plan change (a chunk, an extension) is queued before it, and anything else
        to that rank queues behind the update, in order. Leaving the block sends it all.
        A held send reports success; a rank whose flush fails is one the heartbeat declares dead, and its
        chunks are reclaimed there."""
        if not enabled or self._held is not None:
            yield
            return
        self._held = {}
        try:
            yield
        finally:
            held, self._held = self._held, None
            with self.sharing_tensors():  # the held updates carry one consensus: encoded once for all
                for r, queue in held.items():
                    self._send_queue(r, queue)


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
