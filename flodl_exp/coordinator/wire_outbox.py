"""The coordinator's outbox onto the rank sockets: the core's payloads encoded as wire frames (the shell side of
the :class:`~.outbox.Outbox` port).

Two framing concerns live here and nowhere in the core: within :meth:`WireOutbox.folding_updates` (the core asks
for it under cpu cadence) a rank's messages behind its held ``Update`` leave in one frame (``codec.bundle``), the
first ``StartEpoch`` riding inside the update as its ``next_plan``; within :meth:`WireOutbox.sharing_tensors` one
tensors dict sent to every rank is encoded once. The core's other outboxes (the commands of ``handle``, the
simulator's) hand payloads over one by one."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Optional, Protocol

from flodl_exp.core.cohort import Cohort
from flodl_exp.protocol.codec import bundle, encode
from flodl_exp.protocol.messages import ExtendPartition, Payload, StartEpoch, Update
from flodl_exp.protocol.wire import Message, SharedParts, WireError


class Transport(Protocol):
    def send(self, rank: int, msg: Message) -> bool: ...


class WireOutbox:
    """The :class:`~.outbox.Outbox` of the coordinator: payloads encoded and sent through ``transport``."""

    def __init__(self, transport: Transport, cohort: Cohort) -> None:
        self._transport = transport
        self._cohort = cohort
        self._held: Optional[dict[int, list[Payload]]] = None
        self._hold_all = False
        """Within :meth:`coalescing`: every rank's messages are held, not only those behind an update."""
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
        rank) share one encoding of it (:class:`~flodl_exp.protocol.wire.TensorPart`): the tensors must not change
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
        if held is not None and (self._hold_all or r in held or isinstance(payload, Update)):
            return self._hold(held, r, payload)
        return self._transport.send(r, self._encode(payload))

    def broadcast(self, payload: Payload, among: Optional[Callable[[int], bool]] = None) -> None:
        """``payload`` to every live rank (``among``: those it accepts), encoded once."""
        msg = encode(payload)
        for r in self._cohort.alive_ranks():
            if among is not None and not among(r):
                continue
            if self._held is not None and (self._hold_all or r in self._held):
                self._held.setdefault(r, []).append(payload)  # behind the rank's held messages, in order
            else:
                self._transport.send(r, msg)

    def _send_queue(self, r: int, queue: list[Payload]) -> None:
        """A rank's held messages, in order: in one frame (codec.bundle) when only the first carries tensors.
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

    def coalescing(self) -> contextlib.AbstractContextManager[None]:
        """Within the block every message to a rank is held, and leaving it sends each rank's as one frame: a
        hierarchical reduce's finish (the next chunks, paces, advisories and the global step of up to every rank,
        after the node leaders handed on the consensus) costs a frame a rank, as a folded update does."""
        return self._holding(hold_all=True)

    def folding_updates(self, enabled: bool = True) -> contextlib.AbstractContextManager[None]:
        """cpu cadence (algorithms.md 5.6): within the block an ``Update`` to a rank is held, the first
        ``StartEpoch`` to that rank rides inside it (``next_plan``: the next window starts with no extra
        message) unless another plan change (a chunk, an extension) is queued before it, and anything else
        to that rank queues behind the update, in order. Leaving the block sends it all.
        A held send reports success; a rank whose flush fails is one the heartbeat declares dead, and its
        chunks are reclaimed there."""
        return self._holding(hold_all=False) if enabled else contextlib.nullcontext()

    @contextlib.contextmanager
    def _holding(self, *, hold_all: bool) -> Iterator[None]:
        """Hold sends (behind an update, or every one with ``hold_all``) until the block ends, then each rank's in
        one frame; a block inside another holds into the outer one."""
        if self._held is not None:
            yield
            return
        self._held, self._hold_all = {}, hold_all
        try:
            yield
        finally:
            held, self._held, self._hold_all = self._held, None, False
            with self.sharing_tensors():  # held updates carry one consensus: encoded once for all
                for r, queue in held.items():
                    self._send_queue(r, queue)
