"""The core's outbox port: where the payloads it decides to send go, with no encoding, socket or file behind it.

The coordinator implements it with :class:`~.wire_outbox.WireOutbox` (frames on the rank sockets); a core built
without one records its payloads as the commands :meth:`~.core.ControlCore.handle` returns (a :class:`DirectOutbox`,
``commands.CommandOutbox``), which is how the simulator drives it.
The components import this module, never the wire: what leaves the core is a typed payload."""
from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Protocol

from flodl_exp.protocol.messages import Payload


class Outbox(Protocol):
    def send(self, r: int, payload: Payload) -> bool:
        """``payload`` to rank ``r``; False when it could not go (the rank is gone)."""
        ...

    def broadcast(self, payload: Payload) -> None:
        """``payload`` to every live rank."""
        ...

    def folding_updates(self, enabled: bool = True) -> AbstractContextManager[None]:
        """Within the block, a rank's messages behind its ``Update`` may leave with it (one frame on the wire)."""
        ...

    def sharing_tensors(self) -> AbstractContextManager[None]:
        """Within the block, one tensors dict sent to several ranks may be encoded once (it must not change)."""
        ...

    def coalescing(self) -> AbstractContextManager[None]:
        """Within the block, a rank's messages may leave together (one frame on the wire)."""
        ...


class DirectOutbox(abc.ABC):
    """An outbox whose payloads are handed over one by one as they are sent: framing is nobody's concern, so
    folding and sharing change nothing. Subclasses say where a payload goes (:meth:`send`, :meth:`broadcast`)."""

    @abc.abstractmethod
    def send(self, r: int, payload: Payload) -> bool:
        """``payload`` to rank ``r`` (recorded as a command for ``handle`` to return)."""

    @abc.abstractmethod
    def broadcast(self, payload: Payload) -> None:
        """``payload`` to every live rank."""

    @contextlib.contextmanager
    def folding_updates(self, enabled: bool = True) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def sharing_tensors(self) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def coalescing(self) -> Iterator[None]:
        yield
