"""What the control core's :meth:`~.core.ControlCore.handle` takes (events) and returns (commands): a test
feeds a scripted sequence and reads the decisions as data."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Union

from ..protocol import Payload
from .cohort import Cohort
from .outbox import DirectOutbox


# -- commands (what :meth:`ControlCore.handle` returns) -------------------------------
@dataclass(frozen=True)
class Send:
    rank: int
    payload: Payload


@dataclass(frozen=True)
class Broadcast:
    payload: Payload
    to: tuple[int, ...]


@dataclass(frozen=True)
class Record:
    """An observation: ``kind`` is the observer method, ``args`` its arguments."""

    kind: str
    args: tuple[Any, ...]


Command = Union[Send, Broadcast, Record]


class CommandOutbox(DirectOutbox):
    """An outbox that records what would be sent (no transport, no encoding)."""

    def __init__(self, cohort: Cohort, commands: list[Command]) -> None:
        self._cohort = cohort
        self._commands = commands

    def send(self, r: int, payload: Payload) -> bool:
        self._commands.append(Send(r, payload))
        return True

    def broadcast(self, payload: Payload) -> None:
        self._commands.append(Broadcast(payload, tuple(self._cohort.alive_ranks())))


class RecordingObserver:
    """Every observation as a :class:`Record` command (the events and metrics included)."""

    def __init__(self, commands: list[Command]) -> None:
        self._commands = commands

    def __getattr__(self, kind: str) -> Callable[..., None]:
        if kind.startswith("_"):
            raise AttributeError(kind)

        def record(*args: Any, **kw: Any) -> None:
            self._commands.append(Record(kind, (*args, *kw.values())))
        return record


# -- events (what :meth:`ControlCore.handle` takes) -----------------------------------
@dataclass(frozen=True)
class RankMessage:
    rank: int
    payload: Payload


@dataclass(frozen=True)
class RankDeath:
    rank: int
    reason: str


@dataclass(frozen=True)
class Tick:
    pass


Event = Union[RankMessage, RankDeath, Tick]


