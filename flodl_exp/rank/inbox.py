"""The coordinator's messages as the rank's main thread reads them.

The reader thread (rank/worker.py) puts each frame it receives, or the exception that ended the
connection, into :class:`ControlInbox`; the main thread takes decoded payloads between batches. Kept apart
from the socket so the rank's control (rank/control.py) and its tests read from a plain queue, and apart
from the handlers so one object owns the coordinator's silence deadline and the messages put off while a
collective waits for its regroup.
"""
from __future__ import annotations

import logging
import queue
import time
from collections import deque
from typing import Callable, Optional

from flodl_exp.protocol.codec import decode, unbundle
from flodl_exp.protocol.messages import Payload, ProtocolError
from flodl_exp.protocol.wire import Message

log = logging.getLogger("flodl_exp.rank")


class CoordinatorLost(RuntimeError):
    """The coordinator closed the connection or went silent past the deadline."""


class ControlInbox:
    """Frames from the coordinator in arrival order, plus the payloads deferred while a collective waited.

    ``coord_timeout``: seconds without a frame (the coordinator's heartbeat included) after which a blocking
    read raises :class:`CoordinatorLost`. ``frames``: the queue the reader thread fills (tests pass their own)."""

    def __init__(self, coord_timeout: float, rank: int = 0, frames: Optional[queue.Queue[Message | BaseException]] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.coord_timeout = coord_timeout
        self.rank = rank
        self.frames: queue.Queue[Message | BaseException] = frames if frames is not None else queue.Queue()
        self.deferred: deque[Payload] = deque()
        """Payloads read while a collective waited, handled once it is over (in order, before newer frames)."""
        self.unpacked: deque[Payload] = deque()
        """The rest of a bundle frame's messages (codec.bundle), read before the next frame."""
        self._clock = clock
        self.last_coord = clock()
        """When the last frame arrived."""

    def put(self, item: Message | BaseException) -> None:
        """The reader thread: a frame, or what ended the connection."""
        self.frames.put(item)

    def defer(self, payload: Payload) -> None:
        self.deferred.append(payload)

    def has_waiting(self) -> bool:
        """Something is queued for the main thread (a deferred payload, the rest of a bundle, an unread frame)."""
        return bool(self.deferred) or bool(self.unpacked) or not self.frames.empty()

    def next(self, block: bool, stopping: bool) -> Optional[Payload]:
        """The next payload to handle: a deferred one first, else a frame (:meth:`read`)."""
        if self.deferred:
            return self.deferred.popleft()
        return self.read(block, stopping)

    def read(self, block: bool, stopping: bool) -> Optional[Payload]:
        """The next frame, decoded; None when none came (within half a second when ``block``), when it is
        malformed or unknown (logged and dropped), or when the connection ended after the rank began to stop.

        Raises :class:`CoordinatorLost` when the connection broke while the rank still runs, or when nothing
        arrived for ``coord_timeout``."""
        if self.unpacked:
            return self.unpacked.popleft()
        try:
            item = self.frames.get(timeout=0.5) if block else self.frames.get_nowait()
        except queue.Empty:
            if self._clock() - self.last_coord > self.coord_timeout:
                raise CoordinatorLost(f"no word from the coordinator for {self.coord_timeout:.0f}s") from None
            return None
        if isinstance(item, BaseException):
            if stopping:
                return None
            raise CoordinatorLost(f"coordinator connection lost: {item}") from item
        self.last_coord = self._clock()
        try:
            parts = unbundle(item)
        except ProtocolError as e:
            log.warning("rank %d: malformed bundle from the coordinator dropped: %s", self.rank, e)
            return None
        payloads = [p for p in map(self._decode, parts) if p is not None]
        self.unpacked.extend(payloads[1:])
        return payloads[0] if payloads else None

    def _decode(self, msg: Message) -> Optional[Payload]:
        """One message's payload; None (logged) when it is malformed or of a kind this version does not know."""
        try:
            payload = decode(msg)
        except ProtocolError as e:
            log.warning("rank %d: malformed %s from the coordinator dropped: %s", self.rank, msg.kind, e)
            return None
        if payload is None:
            log.warning("rank %d: unknown control message %r ignored", self.rank, msg.kind)
        return payload
