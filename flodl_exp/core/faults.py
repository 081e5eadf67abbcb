"""Dead ranks: the rules of algorithms.md 7, as pure functions (the coordinator applies them).

A rank is dead when its connection closes or its heartbeat goes stale
(``cluster.heartbeat_timeout_s``) without a clean ``exiting``. Recovery hands its
unprocessed picks to the survivors (the epoch still trains every pick once), drops
it from the gate and aggregation, re-elects callback roles and, on the collective
backend, re-forms a smaller process group on a fresh store prefix. When the loss is
unrecoverable (``cluster.max_failure`` reached, fewer than 2 survivors on nccl, none
on cpu) the run ends with ShutdownWithSave: every survivor writes its bundle pieces,
the coordinator the meta with the reason, and the run ends FAILED.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Optional

from flodl_exp import events as ev
from flodl_exp.core.checkpoints import BundleWriter
from flodl_exp.core.cohort import Cohort, Death
from flodl_exp.core.cycle import AveragingCycle
from flodl_exp.core.dispatch import Dispatcher
from flodl_exp.core.lifecycle import Lifecycle, Phase, Status
from flodl_exp.core.seams import Ports, RunControl
from flodl_exp.policy.mode import Backend
from flodl_exp.protocol.messages import Regroup, RequestSession, SessionReady

log = logging.getLogger("flodl_exp.coordinator")

SAVE_DEADLINE_S = 60.0
"""ShutdownWithSave: how long the survivors get to write their pieces."""
SHUTDOWN_GRACE_S = 30.0
"""After the shutdown broadcast: how long ranks get to exit before the coordinator stops waiting."""


def unrecoverable_reason(*, world_size: int, alive: int, dead: int, max_failure: Optional[int],
                         backend: str) -> Optional[str]:
    """Why the run cannot go on after a death (the ShutdownWithSave reason), or None."""
    if max_failure is not None and dead >= max_failure:
        return "max_failure_exceeded"
    if backend == Backend.NCCL and world_size >= 2 and alive < 2:
        return "single_survivor"
    if alive == 0:
        return "all_ranks_lost"
    return None


REGROUP_RETRY_S = 5.0
"""A generator that has not answered this long is passed over for the next survivor (algorithms.md 7.4)."""


def regroup_plan(survivors: list[int], generation: int, session: str = "") -> dict[int, Regroup]:
    """Each survivor's place in the re-formed process group: renumbered in rank order."""
    return {r: Regroup(generation=generation, new_rank=i, world_size=len(survivors), ranks=list(survivors), session=session)
            for i, r in enumerate(survivors)}


def generator_order(alive: list[int], local: list[bool], step_ms: list[Optional[float]]) -> list[int]:
    """Who makes the new group's session id, best first (algorithms.md 7.4): the live ranks co-located with
    the coordinator by rank number, lowest first (the reference's tier 1, speed not consulted: a local rank
    reaches the coordinator's store without crossing the network, and the lowest one is a choice every
    reader of the log can predict), then the others by their per-batch compute wall this window, smallest
    first (no data last, ties to the lower rank). Retries walk the same order."""
    def key(r: int) -> tuple[bool, float, int]:
        if local[r]:
            return (False, 0.0, r)
        ms = step_ms[r]
        return (True, ms if ms is not None else math.inf, r)

    return sorted(alive, key=key)


@dataclass
class PendingRegroup:
    generation: int
    generator: int
    asked_at: float
    tried: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class FaultSettings:
    """What a death's recovery depends on besides the run's state."""

    world_size: int
    max_failure: Optional[int]
    """``cluster.max_failure``: deaths the run survives (None: any while a rank lives)."""
    backend: Backend


class FaultHandler:
    """Applies the rules above: records a death, recovers from it, or ends the run with a bundle.
    Owns the ShutdownWithSave state (the failure bundle's stem and its deadline)."""

    def __init__(self, *, settings: FaultSettings, life: Lifecycle, cohort: Cohort, cycle: AveragingCycle,
                 dispatch: Dispatcher, writer: BundleWriter, ports: Ports, run: RunControl) -> None:
        self.world_size = settings.world_size
        self.max_failure = settings.max_failure
        self._backend = settings.backend
        """nccl: a death regroups the survivors' collective; what survives a death depends on it."""
        self._life = life
        self._run = run
        """The core's run-wide actions (a phase change, the shutdown)."""
        self._cohort = cohort
        self._cycle = cycle
        self._dispatch = dispatch
        self._writer = writer
        self._out = ports.out
        self._obs = ports.obs
        """Tags, metrics and events (the core's observer)."""
        self._store = ports.store
        self._clock = ports.clock
        self._is_local = ports.is_local
        self._regroup: Optional[PendingRegroup] = None
        """A regroup waiting for its generator's session id."""
        self._failure_stem: Optional[str] = None
        """ShutdownWithSave: the stem of the failure bundle."""
        self.save_deadline = 0.0

    @property
    def regroup(self) -> Optional[PendingRegroup]:
        return self._regroup

    @property
    def failure_stem(self) -> Optional[str]:
        return self._failure_stem

    def record_death(self, r: int, reason: str) -> Optional[Death]:
        """Take ``r`` out of the cohort and the gate; None when it was already gone or had exited cleanly."""
        epoch = self._dispatch.current_epoch()
        death = self._cohort.mark_dead(r, reason, epoch=epoch, global_step=self._cycle.global_step,
                                       unreduced_steps=self._cycle.unreduced_steps(r), acked_steps=self._cycle.acked_steps(r))
        if death is None:
            return None
        log.error("rank %d declared dead: %s", r, death.reason)
        deaths = len(self._cohort.deaths)
        self._obs.set_tags({f"death.rank{r}": death.reason[:4000], "deaths": deaths})
        self._obs.log_metrics({"alive_ranks": len(self._cohort.alive_ranks()), "deaths": deaths}, epoch)
        self._obs.emit(ev.RankDead(rank=r, reason=death.reason))
        self._write_death_record()
        self._cycle.forget(r)
        return death

    def _write_death_record(self) -> None:
        """``<stem>.death.json`` beside the bundle: every death so far (who, when, last step, error), logged to MLflow."""
        try:
            self._store.write_deaths(self._writer.stem, [d.record() for d in self._cohort.deaths])
        except OSError as e:  # a full disk must not take the coordinator down with the rank
            log.warning("could not write %s.death.json: %s", self._writer.stem, e)

    def recover(self, death: Death) -> bool:
        """The run goes on without the rank (True), or ends with ShutdownWithSave (False)."""
        r = death.rank
        why = unrecoverable_reason(world_size=self.world_size, alive=len(self._cohort.alive_ranks()),
                                   dead=self._cohort.dead_count(), max_failure=self.max_failure, backend=self._backend)
        if why:
            self.shutdown_with_save(why, f"rank {r} {death.reason}")
            return False
        if not self._life.is_(Phase.CONNECTING):
            self._dispatch.on_rank_dead(r, death.unreduced_steps, death.acked_steps)
        if self._cohort.fixed_callback is None or self._cohort.callback_rank == r:
            self._cohort.elect_callback(self._cycle.calibrated_speeds(), force=True)
        if self._backend is Backend.NCCL:
            self._start_regroup()
        return True

    def _start_regroup(self) -> None:
        """Survivors re-form the process group: a generator makes the session id, then every survivor
        gets its new rank and the session (a fresh store prefix). One regroup at a time: a death while
        one is pending is folded in when the session arrives (the survivors are counted then)."""
        if self._regroup is not None or len(self._cohort.alive_ranks()) < 2:
            return
        gen = self._cohort.next_generation()
        self._regroup = PendingRegroup(gen, -1, self._clock())
        self._ask_next_generator()

    def _ask_next_generator(self) -> None:
        pr = self._regroup
        assert pr is not None
        alive = self._cohort.alive_ranks()
        w = self.world_size
        led = self._cycle.ledger
        step_ms: list[Optional[float]] = [led[r].wall_ms / led[r].window_batches if led[r].window_batches else None
                                          for r in range(w)]
        order = [r for r in generator_order(alive, [self._is_local(r) for r in range(w)], step_ms) if r not in pr.tried]
        if len(alive) < 2 or not order:
            self._regroup = None
            self.shutdown_with_save("single_survivor", f"no survivor produced a session for regroup generation {pr.generation}"
                                    f" (asked ranks {pr.tried})")
            return
        pr.generator, pr.asked_at = order[0], self._clock()
        pr.tried.append(order[0])
        self._out.send(order[0], RequestSession(generation=pr.generation))

    def tick(self, now: float) -> None:
        """A generator that died or stayed silent for 5 s is passed over."""
        pr = self._regroup
        if pr is not None and (not self._cohort.alive(pr.generator) or now - pr.asked_at > REGROUP_RETRY_S):
            log.warning("regroup generation %d: rank %d gave no session; asking the next survivor", pr.generation, pr.generator)
            self._ask_next_generator()

    def on_session_ready(self, r: int, m: SessionReady) -> None:
        pr = self._regroup
        if pr is None or m.generation != pr.generation or r != pr.generator:
            return  # an answer from a rank that was passed over, or for an old generation
        survivors = self._cohort.alive_ranks()
        if len(survivors) < 2:
            return  # the death that got here already decided the run's end
        self._regroup = None
        for q, msg in regroup_plan(survivors, pr.generation, m.session).items():
            self._out.send(q, msg)
        self._obs.emit(ev.Regroup(generation=pr.generation, ranks=survivors, generator=r))
        self._obs.set_tags({"regroups": pr.generation})
        log.warning("regroup generation %d with ranks %s (session from rank %d)", pr.generation, survivors, r)

    def shutdown_with_save(self, reason: str, detail: str) -> None:
        """Unrecoverable: every survivor saves its bundle pieces, the meta records why, the run ends FAILED."""
        if self._failure_stem is not None or self._life.ending:
            return
        self._life.end(Status.FAILED, f"{reason}: {detail}")
        stem = self._writer.stem_for("failure")
        self._failure_stem = stem
        self._obs.set_tags({"save_reason": reason})
        self._obs.emit(ev.ShutdownWithSave(reason=reason, stem=stem))
        log.error("ShutdownWithSave (%s): %s", reason, detail)
        self._writer.write_meta(reason, stem, epoch=self._dispatch.current_epoch())
        if not self._cohort.alive_ranks():
            self._run.shutdown()
            return
        self._run.enter(Phase.SAVING)
        self.save_deadline = self._clock() + SAVE_DEADLINE_S
        self._writer.send_saves(stem)

    def saving_overdue(self, now: float) -> bool:
        if now <= self.save_deadline:
            return False
        log.error("ShutdownWithSave: saves still pending after the deadline: ranks %s", self._writer.pending)
        return True

    def on_saves_settled(self) -> None:
        if self._life.is_(Phase.SAVING) and self._failure_stem is not None:
            self._writer.log_bundle(self._failure_stem, "checkpoints/failure")
            self._run.shutdown()
