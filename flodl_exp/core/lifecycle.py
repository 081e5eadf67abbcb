"""The run's lifecycle: the one writer of the coordinator's phase and the run's end status.

Phases and the transitions allowed between them (anything else is a bug and
raises :class:`IllegalTransition`)::

    CONNECTING ──> TRAINING <──> CHECKPOINTING          (epoch-boundary bundle, next epoch held)
                     │  │  └──> PREEMPTING ──┐          (time limit / preemption bundle)
                     │  └─────> DRAINING ──> FINISHING (final eval + bundle)
                     └──(any live phase)──> SAVING     (ShutdownWithSave: unrecoverable loss)
    any live phase ──> SHUTDOWN (shutdown sent, ranks exiting) ──> DONE
    any phase ──> DONE (SIGTERM on SLURM: no waiting)

The status is RUNNING until the run ends: FINISHED, FAILED, KILLED or
PREEMPTED; the first failure's text wins unless the caller says otherwise.
"""
from __future__ import annotations

import enum
from typing import Optional


class Phase(enum.Enum):
    CONNECTING = "connecting"
    TRAINING = "training"
    CHECKPOINTING = "checkpointing"
    DRAINING = "draining"
    FINISHING = "finishing"
    SAVING = "saving"
    PREEMPTING = "preempting"
    SHUTDOWN = "shutdown"
    DONE = "done"


class Status(str, enum.Enum):
    RUNNING = "RUNNING"
    FINISHED = "FINISHED"
    FAILED = "FAILED"
    KILLED = "KILLED"
    PREEMPTED = "PREEMPTED"


_LIVE = {Phase.TRAINING, Phase.CHECKPOINTING, Phase.DRAINING, Phase.FINISHING, Phase.PREEMPTING}
ALLOWED: dict[Phase, frozenset[Phase]] = {
    Phase.CONNECTING: frozenset({Phase.TRAINING, Phase.SHUTDOWN, Phase.DONE}),
    Phase.TRAINING: frozenset({Phase.CHECKPOINTING, Phase.DRAINING, Phase.PREEMPTING, Phase.SAVING, Phase.SHUTDOWN, Phase.DONE}),
    Phase.CHECKPOINTING: frozenset({Phase.TRAINING, Phase.SAVING, Phase.SHUTDOWN, Phase.DONE}),
    Phase.DRAINING: frozenset({Phase.FINISHING, Phase.SAVING, Phase.SHUTDOWN, Phase.DONE}),
    Phase.FINISHING: frozenset({Phase.SAVING, Phase.SHUTDOWN, Phase.DONE}),
    Phase.PREEMPTING: frozenset({Phase.SAVING, Phase.SHUTDOWN, Phase.DONE}),
    Phase.SAVING: frozenset({Phase.SHUTDOWN, Phase.DONE}),
    Phase.SHUTDOWN: frozenset({Phase.DONE}),
    Phase.DONE: frozenset(),
}
"""Every allowed transition, written down once (tests/test_control_lifecycle.py walks it)."""

TRAINING_PHASES = frozenset({Phase.TRAINING, Phase.CHECKPOINTING})
"""Phases in which reduces fire and epochs aggregate."""


class RunFailure(RuntimeError):
    """The run cannot start or go on (a rank lost before training, a SIGTERM while connecting)."""


class IllegalTransition(RuntimeError):
    """A coordinator bug: a component asked for a transition the table does not allow."""


class Lifecycle:
    def __init__(self) -> None:
        self._phase = Phase.CONNECTING
        self._status = Status.RUNNING
        self._failure: Optional[str] = None
        self._end_reason: Optional[str] = None
        self._shutdown_at: Optional[float] = None
        """Monotonic time the shutdown was broadcast (the ranks get a bounded time to exit)."""
        self.history: list[Phase] = [Phase.CONNECTING]

    @property
    def shutdown_at(self) -> Optional[float]:
        return self._shutdown_at

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def status(self) -> Status:
        return self._status

    @property
    def failure(self) -> Optional[str]:
        return self._failure

    @property
    def end_reason(self) -> Optional[str]:
        return self._end_reason

    def outcome(self) -> dict[str, Optional[str]]:
        """The run's end as result.json records it: the status and the failure, if any."""
        return {"status": self._status.value, "failure": self._failure}

    @property
    def live(self) -> bool:
        """Training, or on its way to a clean end (no shutdown sent yet)."""
        return self._phase in _LIVE

    @property
    def ending(self) -> bool:
        return self._phase in (Phase.SHUTDOWN, Phase.DONE)

    def is_(self, *phases: Phase) -> bool:
        return self._phase in phases

    def move(self, to: Phase, *, at: Optional[float] = None) -> None:
        """Change the phase (an allowed transition only); ``at``: when, recorded for SHUTDOWN (its grace)."""
        if to is Phase.SHUTDOWN and at is not None and self._phase is not Phase.SHUTDOWN:
            self._shutdown_at = at
        if to is self._phase:
            return
        if to not in ALLOWED[self._phase]:
            raise IllegalTransition(f"phase {self._phase.value} -> {to.value} is not allowed")
        self._phase = to
        self.history.append(to)

    def end(self, status: Status, failure: Optional[str] = None, *, end_reason: Optional[str] = None,
            overwrite: bool = False) -> None:
        """Record how the run ends (the phase moves separately). The first failure text stays unless ``overwrite``."""
        self._status = status
        if failure is not None and (self._failure is None or overwrite):
            self._failure = failure
        if end_reason is not None:
            self._end_reason = end_reason
