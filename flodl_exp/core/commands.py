"""What the control core's :meth:`~.core.ControlCore.handle` takes (events) and returns (commands): a test
feeds a scripted sequence and reads the decisions as data."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from flodl_exp.bundle_meta import BundleMeta
from flodl_exp.core.auto_choice import AutoProbeStarts, ModeChosen, ModesPredicted, PredictModes
from flodl_exp.core.cohort import Cohort
from flodl_exp.core.cycle import Reduce, ReduceOutcome
from flodl_exp.core.outbox import DirectOutbox
from flodl_exp.core.ports import CoreObserver
from flodl_exp.events import EventRecord
from flodl_exp.protocol.messages import Batch, Payload


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


Command = Union[Send, Broadcast, Record, PredictModes, ModeChosen]
"""What the core asks of its shell: a payload to send, an observation (a recording core), and mode=auto's
request for predictions and its verdict (core/auto_choice.py)."""


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


class RecordingObserver(CoreObserver):
    """Every observation as a :class:`Record` command (the events and metrics included): ``kind`` is the
    :class:`~.ports.CoreObserver` method, ``args`` its arguments in order."""

    def __init__(self, commands: list[Command]) -> None:
        self._commands = commands

    def _record(self, kind: str, *args: Any) -> None:
        self._commands.append(Record(kind, args))

    def on_batch(self, r: int, b: Batch, epoch: Optional[int], window: int) -> None:
        self._record("on_batch", r, b, epoch, window)

    def on_answer(self, r: int, started: float) -> None:
        self._record("on_answer", r, started)

    def on_reduce_finished(self, red: Reduce, out: ReduceOutcome, window: int, averaging_from: float,
                           epoch: int) -> None:
        self._record("on_reduce_finished", red, out, window, averaging_from, epoch)

    def on_eval_sent(self, r: int, epoch: int, final: bool = False) -> None:
        self._record("on_eval_sent", r, epoch, final)

    def on_eval_result(self, r: int, epoch: int, final: bool) -> None:
        self._record("on_eval_result", r, epoch, final)

    def on_epoch_aggregated(self, e: int, metrics: dict[str, float]) -> None:
        self._record("on_epoch_aggregated", e, metrics)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._record("log_metrics", metrics, step)

    def set_tags(self, tags: dict[str, Any]) -> None:
        self._record("set_tags", tags)

    def emit(self, event: EventRecord) -> None:
        self._record("emit", event)

    def log_artifact(self, path: str, artifact_path: str) -> None:
        self._record("log_artifact", path, artifact_path)


# -- events (what :meth:`ControlCore.handle` takes) -----------------------------------
# Each carries ``now``, the shell's monotonic clock when it happened: the core reads no clock of its own (one built
# without a clock port runs on its events' time, as the simulator's does).
@dataclass(frozen=True)
class RankJoined:
    """A rank said hello (the coordinator's server), or is there from the start (the simulator's)."""

    rank: int
    now: float
    host: Optional[str] = None
    """The node its hello named (``cluster.node_reduce`` groups the ranks of a node)."""


@dataclass(frozen=True)
class TrainingStarts:
    """Every rank joined: plan the first epoch, or a resumed bundle's coverage (its meta as a dict)."""

    total_picks: int
    resume_meta: Optional[dict[str, Any]]
    now: float


@dataclass(frozen=True)
class RankMessage:
    rank: int
    payload: Payload
    now: float


@dataclass(frozen=True)
class RankDeath:
    """The shell found the rank gone (its connection closed, its heartbeat stale)."""

    rank: int
    reason: str
    now: float


@dataclass(frozen=True)
class Tick:
    """One turn of the loop (algorithms.md 3.1, steps 4-11)."""

    now: float


@dataclass(frozen=True)
class RunFailed:
    """The shell's loop raised: the run ends FAILED and the ranks are told."""

    failure: str
    now: float


@dataclass(frozen=True)
class SaveAndStop:
    """ShutdownWithSave: a resumable bundle, then the run ends (``reason`` is its end reason)."""

    reason: str
    detail: str
    now: float


@dataclass(frozen=True)
class Stop:
    """Shutdown: the ranks are told to exit, with no bundle."""

    now: float


@dataclass(frozen=True)
class AnchorHint:
    """The shell's guess of the slowest rank (the hellos' device scores): ElChe's cold-start anchor, unless a speed
    hint, partition ratios or a resumed state set one (:attr:`CoreView.anchor_seeded` says whether it took)."""

    rank: int
    now: float


@dataclass(frozen=True)
class RankHeard:
    """Something arrived from the rank that the shell consumes itself (a heartbeat, a probe's answer): it is alive."""

    rank: int
    now: float


@dataclass(frozen=True)
class HeartbeatFrom:
    """A heartbeat from the rank: it is alive, and its main thread is in ``state`` at ``steps`` training steps
    (a core that watches liveness evicts a rank whose steps stop moving while it trains: ProgressWatch)."""

    rank: int
    state: Optional[str]
    steps: Optional[int]
    now: float


@dataclass(frozen=True)
class Resumed:
    """The run resumes from a bundle: its meta seeds the trajectory (step counters, ElChe, the guard's history when
    ``guard_kind`` matches) and, on the cpu backend, ``outer_state`` (its ``.outer.pt``) the outer optimizer."""

    meta: BundleMeta
    guard_kind: str
    stem: str
    outer_state: Optional[dict[str, Any]]
    now: float


@dataclass(frozen=True)
class PreemptAsked:
    """SIGUSR1 or a time limit near: a resumable bundle, then PREEMPTED."""

    now: float


@dataclass(frozen=True)
class TerminateAsked:
    """SIGTERM: the job step is ending (cancelled, or the first half of a preemption)."""

    now: float


@dataclass(frozen=True)
class Closing:
    """The shell is about to write the run's result: the core settles its final status (a run whose last bundle, or
    preemption bundle, failed ends FAILED, never FINISHED or requeued onto it)."""

    now: float


@dataclass(frozen=True)
class AwaitingRanks:
    """The shell started waiting for the ranks to join: every rank must have said hello within ``timeout_s``."""

    timeout_s: float
    now: float


@dataclass(frozen=True)
class ClosedBeforeStart:
    """A joined rank's connection closed before training started (its setup failed): the run cannot start, and
    the core decides whom the failure blames (core/startup.py)."""

    rank: int
    error: str
    now: float


@dataclass(frozen=True)
class LostBeforeJoin:
    """A rank that never joined was found lost: its task's death record says why its setup failed
    (``set_up_failed``), or its process is gone (``cause`` names its pid and host)."""

    rank: int
    cause: str
    set_up_failed: bool
    now: float


@dataclass(frozen=True)
class StartupCheck:
    """A turn of the shell's loop while the ranks connect: the core fails the run when a start-up failure is due
    (a close past its grace, the connect deadline)."""

    now: float


Event = Union[RankJoined, TrainingStarts, RankMessage, RankDeath, Tick, RunFailed, SaveAndStop, Stop,
              AnchorHint, RankHeard, HeartbeatFrom, Resumed, PreemptAsked, TerminateAsked, Closing, AwaitingRanks, ClosedBeforeStart,
              LostBeforeJoin, StartupCheck, AutoProbeStarts, ModesPredicted]
