"""What the shells may read of the control core: one small read-only view.

The coordinator and the simulator drive the core only through :meth:`~.core.ControlCore.handle` and read it only
through :class:`CoreView` (``core.view``), so the core's components stay its own: a shell that needs to know more
asks for a query here, not for a component. Everything here is a value or a copy; nothing hands out a component.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Protocol

from flodl_exp.core.checkpoints import BundleWriter
from flodl_exp.core.cohort import Cohort
from flodl_exp.core.cycle import AveragingCycle
from flodl_exp.core.dispatch import Dispatcher
from flodl_exp.core.lifecycle import Lifecycle, Phase, Status
from flodl_exp.core.preemption import Preemption
from flodl_exp.core.run_end import RunEnd
from flodl_exp.core.startup import StartupBlame
from flodl_exp.policy.mode import Mode


class _Core(Protocol):
    """What the view asks of :class:`~.core.ControlCore` itself (a Protocol: the core imports the view)."""

    @property
    def anchor_seeded(self) -> bool: ...
    def outcome(self) -> dict[str, Any]: ...
    def current_epoch(self) -> int: ...
    def stall_state(self, now: float) -> dict[str, Any]: ...
    @property
    def saved_stem(self) -> Optional[str]: ...


@dataclass(frozen=True)
class ReduceInFlight:
    """The reduce in flight, as the simulator's cost model needs it."""

    members: frozenset[int]
    snapshot_steps: Mapping[int, int]
    """cpu backend: each snapshot received so far, its rank's steps in the window."""


class CoreView:
    """A read-only window on a :class:`~.core.ControlCore` (see the module docstring)."""

    __slots__ = ("_core", "_life", "_cohort", "_cycle", "_dispatch", "_writer", "_preemption", "_startup", "_run_end",
                 "_is_nccl")

    def __init__(self, core: _Core, *, life: Lifecycle, cohort: Cohort, cycle: AveragingCycle, dispatch: Dispatcher,
                 writer: BundleWriter, preemption: Preemption, startup: StartupBlame, run_end: RunEnd,
                 mode: Mode) -> None:
        self._core = core
        self._life, self._cohort, self._cycle, self._dispatch = life, cohort, cycle, dispatch
        self._writer, self._preemption, self._startup, self._run_end = writer, preemption, startup, run_end
        self._is_nccl = bool(mode.is_nccl)

    # -- the run's phase and end ----------------------------------------------------------------
    @property
    def phase(self) -> Phase:
        return self._life.phase

    def is_(self, *phases: Phase) -> bool:
        return self._life.is_(*phases)

    @property
    def status(self) -> Status:
        return self._life.status

    @property
    def ending(self) -> bool:
        """The run is on its way out (a ShutdownWithSave, a failure): no new work."""
        return self._life.ending

    @property
    def failure(self) -> Optional[str]:
        return self._life.failure

    @property
    def end_reason(self) -> Optional[str]:
        return self._life.end_reason

    # -- progress ----------------------------------------------------------------------------------
    @property
    def global_step(self) -> int:
        """Batches averaged into the consensus so far, all ranks together."""
        return self._cycle.global_step

    @property
    def syncs(self) -> int:
        """Finished reduces."""
        return self._cycle.version

    @property
    def epochs_aggregated(self) -> int:
        return self._dispatch.last_aggregated + 1

    def current_epoch(self) -> int:
        """The newest epoch a rank started."""
        return self._core.current_epoch()

    @property
    def eval_pending(self) -> Optional[int]:
        """The periodic eval in flight (its epoch), if any."""
        return self._run_end.eval_pending

    # the averaging window, as the window records read it (records.CycleView)
    @property
    def anchor(self) -> Optional[int]:
        return self._cycle.anchor

    @property
    def window_t0(self) -> float:
        return self._cycle.window_t0

    def window_loss(self) -> float:
        return self._cycle.window_loss()

    def reduce_in_flight(self) -> Optional[ReduceInFlight]:
        red = self._cycle.in_flight
        if red is None:
            return None
        return ReduceInFlight(frozenset(red.members), {r: s.n for r, s in red.snapshots.items()})

    # -- the cohort --------------------------------------------------------------------------------
    def alive(self, r: int) -> bool:
        return self._cohort.alive(r)

    def alive_ranks(self) -> list[int]:
        return self._cohort.alive_ranks()

    def all_joined(self) -> bool:
        return self._cohort.all_joined()

    def closed_before_start(self) -> bool:
        """A joined rank's connection closed while the ranks connect (the core waits to decide whom to blame)."""
        return bool(self._startup.closes)

    @property
    def startup_failure(self) -> Optional[str]:
        """Why the core failed the run before training started (core/startup.py), or None."""
        return self._startup.failure

    def missing(self) -> list[int]:
        """Ranks not (or no longer) in the cohort."""
        return self._cohort.missing()

    def exited(self, r: int) -> bool:
        """Whether the rank said it exits cleanly."""
        return self._cohort.exited(r)

    def error_of(self, r: int) -> Optional[str]:
        """The error the rank reported before failing, if any."""
        return self._cohort.error_of(r)

    def stale(self, now: float, timeout: float) -> list[int]:
        """Working ranks heard from last more than ``timeout`` s before ``now``."""
        return self._cohort.stale(now, timeout)

    # -- the result --------------------------------------------------------------------------------
    @property
    def anchor_seeded(self) -> bool:
        """Whether the last :class:`~.commands.AnchorHint` set ElChe's cold-start anchor."""
        return self._core.anchor_seeded

    def outcome(self) -> dict[str, Any]:
        return self._core.outcome()

    def stall_state(self, now: float) -> dict[str, Any]:
        """What the stall watchdog dumps."""
        return self._core.stall_state(now)

    @property
    def is_nccl(self) -> bool:
        return self._is_nccl

    @property
    def wants_outer_state(self) -> bool:
        """A resumed run's ``.outer.pt`` is the core's to load (cpu backend, a stateful outer optimizer)."""
        return self._cycle.wants_outer_state

    @property
    def saved_stem(self) -> Optional[str]:
        """The bundle the run ended on other than its final one (failure or preemption), if any."""
        return self._core.saved_stem

    @property
    def bundle_stem(self) -> str:
        """The run's checkpoint stem (its final bundle)."""
        return str(self._writer.stem)

    @property
    def failed_bundles(self) -> dict[str, str]:
        """stem -> why, for every bundle that failed (a copy)."""
        return dict(self._writer.failed)

    @property
    def terminated(self) -> bool:
        """SIGTERM was carried out (the job step is ending)."""
        return bool(self._preemption.terminated)
