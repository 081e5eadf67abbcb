"""Preemption, time limits and termination (signals arrive in coordinator/main.py; handlers only
record the request, the coordinator's tick acts on it here).

* Preemption / time limit (``SIGUSR1`` from task 0, see jobs/job.py): in progressive
  modes the coverage of every open epoch is snapshotted at the next reduce finish,
  exactly like ``at_epoch`` (when none comes within PREEMPT_ARM_FALLBACK_S, one is fired for it; an
  epoch-granular bundle only if that one does not finish either); otherwise one consensus reduce, then an epoch-granular
  bundle (the open epoch restarts on resume). Every live rank saves, the meta is
  written, ``preempted.json`` tells task 0 where the bundle is, and the run stops
  with status PREEMPTED (MLflow run left RUNNING: the requeued job resumes into it).
* ``SIGTERM`` on SLURM (scancel, ``--kill-on-bad-exit`` after a rank failed, the time
  limit): the run ends at once with FAILED (a rank failed, or the time limit hit a
  bundle in progress) or KILLED (cancelled), before the cluster's SIGKILL.
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

from flodl_exp import events as ev
from flodl_exp.core.checkpoints import BundleWriter, Checkpoints
from flodl_exp.core.cohort import Cohort
from flodl_exp.core.cycle import AveragingCycle
from flodl_exp.core.dispatch import Dispatcher
from flodl_exp.core.lifecycle import Lifecycle, Phase, Status
from flodl_exp.core.seams import Ports, RunControl
from flodl_exp.protocol.messages import Shutdown

log = logging.getLogger("flodl_exp.coordinator")

PREEMPT_ARM_FALLBACK_S = 10.0
"""Progressive modes wait this long for a reduce finish before saving an epoch-granular bundle."""
PREEMPT_SAVE_DEADLINE_S = 45.0
"""A preemption bundle not complete this long after the request fails the run (time limit)."""
TERM_GRACE_S = 2.0
"""After SIGTERM without a failure: how long a preemption request (SIGTERM, then USR2) may follow."""


class Stage(enum.Enum):
    REQUESTED = "requested"
    ARMED = "armed"
    """Progressive: waiting for the next reduce finish to snapshot coverage."""
    REDUCE = "reduce"
    """Non-progressive: one consensus reduce, then the bundle."""
    SAVING = "saving"
    DONE = "done"
    FAILED = "failed"
    IGNORED = "ignored"


IN_PROGRESS = (Stage.REQUESTED, Stage.ARMED, Stage.REDUCE, Stage.SAVING)


@dataclass
class PreemptRequest:
    requested_at: float
    stage: Stage = Stage.REQUESTED
    stem: str = ""
    attempt: int = 0
    deadline: float = 0.0
    armed_at: float = 0.0
    reduce_triggered: bool = False
    epoch: int = 0
    coverage: list[dict[str, Any]] = field(default_factory=list)


KILL_ON_BAD_EXIT_ARGS = ("--kill-on-bad-exit", "--kill-on-bad-exit=1", "-K", "-K1")


def kills_on_bad_exit(cluster: Any) -> bool:
    """A SLURM job whose ``cluster.slurm.srun_args`` make srun end the step when one task exits badly."""
    return cluster.executor == "slurm" and any(str(a) in KILL_ON_BAD_EXIT_ARGS for a in cluster.slurm.srun_args)


@dataclass(frozen=True)
class PreemptionSettings:
    """What a preemption's handling depends on besides the run's state."""

    attempt: int
    """The launcher's attempt number (a requeue counts one up)."""
    progressive: bool
    world_size: int
    kill_on_bad_exit: bool = False
    """srun --kill-on-bad-exit=1: a dead rank's task exit ends the step, so no recovery is attempted."""


class Preemption:
    def __init__(self, *, settings: PreemptionSettings, life: Lifecycle, cohort: Cohort, cycle: AveragingCycle,
                 dispatch: Dispatcher, writer: BundleWriter, checkpoints: Checkpoints, ports: Ports,
                 run: RunControl) -> None:
        self.attempt = settings.attempt
        self.progressive = settings.progressive
        self.world_size = settings.world_size
        self._store = ports.store
        self._life = life
        self._run = run
        """The core's run-wide actions: a phase change, the shutdowns, and its one way to start a reduce (asked
        for a bundle's consensus)."""
        self._cohort = cohort
        self._cycle = cycle
        self._dispatch = dispatch
        self._writer = writer
        self._checkpoints = checkpoints
        self._out = ports.out
        self._obs = ports.obs
        """Tags and events (the core's observer)."""
        self._clock = ports.clock
        self._request: Optional[PreemptRequest] = None
        self._terminate_at: Optional[float] = None
        self._terminated = False
        """The SIGTERM path ended the run (no waiting for the ranks: SIGKILL follows)."""
        self.kill_on_bad_exit = settings.kill_on_bad_exit
        """srun --kill-on-bad-exit=1: a dead rank's task exit ends the step, so no recovery is attempted."""

    @property
    def request(self) -> Optional[PreemptRequest]:
        return self._request

    @property
    def terminate_at(self) -> Optional[float]:
        return self._terminate_at

    @property
    def terminated(self) -> bool:
        return self._terminated

    # -- signal handlers (flags only) ------------------------------------
    def request_preempt(self) -> None:
        if self._request is None:
            self._request = PreemptRequest(self._clock())

    def request_terminate(self) -> None:
        if self._terminate_at is None:
            self._terminate_at = self._clock()

    # -- the tick ---------------------------------------------------------
    def tick(self) -> None:
        if (self.kill_on_bad_exit and self._cohort.deaths and self._life.status is Status.RUNNING
                and self._life.is_(Phase.TRAINING, Phase.CHECKPOINTING, Phase.DRAINING, Phase.PREEMPTING)):
            d = self._cohort.deaths[0]
            self._run.shutdown_with_save("task_failed", f"rank {d.rank} {d.reason} (srun --kill-on-bad-exit=1 ends the job)")
            return
        if self._terminate_at is not None and not self._terminated:
            self._tick_terminate()
            if self._life.is_(Phase.DONE):
                return
        p = self._request
        if p is None:
            return
        now = self._clock()
        if p.stage is Stage.REQUESTED:
            self._begin(p)
        elif p.stage is Stage.ARMED and self._cycle.in_flight is None and now - p.armed_at > PREEMPT_ARM_FALLBACK_S:
            alive = self._cohort.alive_ranks()
            if not self._cycle.any_steps(alive):  # nothing trained since the last reduce: its coverage is exact now
                self._save(p, coverage=True)
            elif not p.reduce_triggered and self.world_size > 1:
                # No reduce came (the ranks wait on something: a slow data read, a gate): fire one, so the bundle
                # is still coverage-granular (on_reduce_finished). An epoch-granular one would train the open
                # epoch's finished picks twice on resume.
                p.reduce_triggered = True
                log.warning("preemption: no reduce finished within %.0fs: firing one for the bundle's coverage",
                            PREEMPT_ARM_FALLBACK_S)
                self._run.fire_reduce()
            elif now - p.armed_at > 2 * PREEMPT_ARM_FALLBACK_S:
                log.warning("preemption: no reduce finished within %.0fs: saving an epoch-granular bundle",
                            2 * PREEMPT_ARM_FALLBACK_S)
                self._save(p, coverage=False)
        elif p.stage is Stage.REDUCE and self._cycle.in_flight is None:
            alive = self._cohort.alive_ranks()
            if not p.reduce_triggered and self.world_size > 1 and self._cycle.any_steps(alive):
                p.reduce_triggered = True
                self._run.fire_reduce(final=True)
            else:
                self._save(p, coverage=False)
        elif p.stage in (Stage.ARMED, Stage.REDUCE, Stage.SAVING) and now > p.deadline:
            pending = self._writer.pending
            self._life.end(Status.FAILED, f"time limit / preemption: the bundle {p.stem} was not complete after "
                                          f"{PREEMPT_SAVE_DEADLINE_S:.0f}s (pending saves of ranks {pending})",
                           end_reason="time_limit", overwrite=True)
            self._obs.set_tags({"end_reason": "time_limit"})
            p.stage = Stage.FAILED
            log.error(self._life.failure)
            self._run.shutdown()

    @property
    def armed(self) -> bool:
        """A request waits for a reduce finish to snapshot the coverage (an overlapped reduce's finish leaves it to a
        barrier reduce: its consensus lacks what the ranks trained past their answers)."""
        return self._request is not None and self._request.stage is Stage.ARMED

    def on_reduce_finished(self) -> bool:
        """At a reduce finish, before dispatch: an armed request snapshots coverage now. True = it did."""
        p = self._request
        if p is not None and p.stage is Stage.ARMED:
            self._save(p, coverage=True)
            return True
        return False

    def on_saves_settled(self) -> None:
        p = self._request
        if p is None or p.stage is not Stage.SAVING or not self._life.is_(Phase.PREEMPTING):
            return
        self._writer.write_meta("preempted", p.stem, epoch=p.epoch, coverage_epochs=p.coverage)
        gs = self._cycle.global_step
        self._store.mark_preempted({"attempt": p.attempt, "stem": p.stem, "epoch": p.epoch, "global_step": gs})
        self._life.end(Status.PREEMPTED)
        p.stage = Stage.DONE
        self._obs.set_tags({"preemptions": p.attempt + 1, "preempt_stem": p.stem})
        self._obs.emit(ev.Preempted(stem=p.stem, epoch=p.epoch, attempt=p.attempt, global_step=gs))
        log.warning("preemption bundle %s complete (epoch %d, global step %d): stopping for requeue", p.stem, p.epoch, gs)
        self._run.shutdown()

    @property
    def saved_stem(self) -> Optional[str]:
        return self._request.stem if self._request is not None and self._request.stage is Stage.DONE else None

    # -- steps ------------------------------------------------------------
    def _begin(self, p: PreemptRequest) -> None:
        life = self._life
        if life.is_(Phase.DRAINING, Phase.FINISHING, Phase.SAVING, Phase.PREEMPTING, Phase.SHUTDOWN, Phase.DONE):
            p.stage = Stage.IGNORED
            log.warning("preemption requested while the run is %s: it ends on its own", life.phase.value)
            self._obs.emit(ev.PreemptIgnored(phase=life.phase.value))
            return
        if not life.is_(Phase.TRAINING) or self._checkpoints.busy:
            return  # not started yet, or a bundle is being written: act after it
        now = self._clock()
        p.stem = self._writer.stem_for(f"preempt{self.attempt}")
        p.deadline = now + PREEMPT_SAVE_DEADLINE_S
        p.attempt = self.attempt
        if self.progressive:
            p.stage, p.armed_at = Stage.ARMED, now  # snapshot at the next reduce finish (on_reduce_finished)
        else:
            p.stage = Stage.REDUCE
        log.warning("preemption requested: bundle %s (%s)", p.stem,
                    "coverage at the next reduce" if self.progressive else "after one consensus reduce")
        self._obs.emit(ev.PreemptRequested(stem=p.stem, attempt=p.attempt))

    def _save(self, p: PreemptRequest, *, coverage: bool) -> None:
        p.coverage = self._dispatch.open_coverage() if coverage else []
        p.epoch = min((x["epoch"] for x in p.coverage), default=self._dispatch.current_epoch())
        p.stage = Stage.SAVING
        self._run.enter(Phase.PREEMPTING)  # no dispatch, no reduce, no aggregation until the run stops
        if self._cohort.alive_ranks():
            self._writer.send_saves(p.stem)

    def _rank_failures(self) -> str:
        return self._cohort.failure_summary()

    def _tick_terminate(self) -> None:
        assert self._terminate_at is not None
        now = self._clock()
        p = self._request
        in_preempt = p is not None and p.stage in IN_PROGRESS
        if p is not None and p.stage is Stage.DONE:
            self._terminated = True  # PREEMPTED: the requeue is under way
            return
        life = self._life
        if life.status is Status.FAILED or self._cohort.deaths or self._cohort.errors:
            base = life.failure or self._rank_failures() or "a rank failed"
            status, failure, why = Status.FAILED, f"{base} (then the job step was terminated: SIGTERM)", "rank_failure"
        elif in_preempt and p is not None and p.requested_at <= self._terminate_at:
            status, why = Status.FAILED, "time_limit"
            failure = "time limit reached: the job was terminated before the preemption bundle was complete"
        elif in_preempt:
            self._terminated = True  # preemption sequence (SIGTERM, then USR2): the bundle goes on
            return
        elif now - self._terminate_at < TERM_GRACE_S:
            return  # a preemption request may still follow
        else:
            status, why = Status.KILLED, "cancelled"
            failure = "cancelled: the job was terminated (SIGTERM: scancel or the cluster)"
        self._terminated = True
        life.end(status, failure, end_reason=why, overwrite=True)
        log.error("terminated: %s", failure)
        self._obs.emit(ev.Terminated(status=status.value, reason=why))
        self._out.broadcast(Shutdown(reason=failure))
        self._run.enter(Phase.DONE)  # SIGKILL follows within KillWait: no waiting for the ranks
