"""The control core: every decision of the run's training loop, in one place, for the coordinator and the
simulator alike.

The core owns the cohort, the averaging cycle (with ElChe, the guard and the meta-controller), dispatch
and epoch aggregation, the user's intents, callback slack, the periodic evals and the end of the run. It
alone decides when a reduce fires (:meth:`ControlCore.fire_reduce`, the one caller of
``AveragingCycle.trigger``), when an epoch aggregates, when an epoch-boundary bundle is due and when
training ends. It holds no socket, thread or file: what it decides leaves through four ports,

* the :class:`~.outbox.Outbox` (messages to ranks: the coordinator encodes them onto sockets, the
  simulator hands them to simulated ranks; :class:`CommandOutbox` records them as commands);
* a :class:`CoreObserver` (what the shell records: the timeline, window records, MLflow, events.jsonl; the
  core never reads back from it);
* a :class:`~.bundle_store.BundleStore` (bundle files and the preemption mark: the coordinator's on disk,
  the simulator's and the tests' in memory);
* an :class:`~.averager.Averager` (the cpu backend's tensor arithmetic and outer optimizer state: torch, in
  the shell's :class:`~.cpu_averager.TorchAverager`).

It reads no clock: the monotonic ``clock`` and the ``wall_clock`` (Unix time, for the records it writes) are
the shell's, passed in.

This module is the wiring and the order: it builds the components (each with one job, in its own module:
reduces.py fires and finishes reduces, epochs.py aggregates epochs and answers their boundaries,
run_end.py runs evals, intents, the stop rule and the run's end, deaths.py carries a death to the work in
progress, reports.py records the ranks' other reports; faults.py, preemption.py, checkpoints.py and
checkpoint_fn.py as before), routes each rank message to the one that decides on it
(:meth:`on_message`), and keeps the reference's tick (:meth:`tick`: steps 5, 8, 10 and 11 of
algorithms.md 3.1, in order, readable here); the shell keeps 2-4 (heartbeats, deaths, regroups) and the
signals around it. :meth:`handle` takes one event and returns the commands it caused, for tests that
feed a scripted sequence (tests/test_control_core.py).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from flodl_exp import events as ev
from flodl_exp.bundle_meta import BundleMeta
from flodl_exp.config import Config, RunShape
from flodl_exp.core.auto_choice import PROBE_STEPS, AutoDecision, AutoProbeStarts, ModesPredicted
from flodl_exp.core.averager import Averager
from flodl_exp.core.bundle_store import BundleStore, MemoryBundles
from flodl_exp.core.callback_slack import CallbackSlack
from flodl_exp.core.checkpoint_fn import CheckpointFnRole
from flodl_exp.core.checkpoints import BundleWriter, Checkpoints, CheckpointSettings, MetaFacts
from flodl_exp.core.cohort import Cohort, ProgressWatch
from flodl_exp.core.commands import (
    AnchorHint,
    AwaitingRanks,
    ClosedBeforeStart,
    Closing,
    Command,
    CommandOutbox,
    Event,
    HeartbeatFrom,
    LostBeforeJoin,
    PreemptAsked,
    RankDeath,
    RankHeard,
    RankJoined,
    RankMessage,
    RecordingObserver,
    Resumed,
    RunFailed,
    SaveAndStop,
    StartupCheck,
    Stop,
    TerminateAsked,
    Tick,
    TrainingStarts,
)
from flodl_exp.core.cycle import AveragingCycle, CycleSettings
from flodl_exp.core.deaths import Deaths
from flodl_exp.core.dispatch import Dispatcher, DispatchSettings, Gate
from flodl_exp.core.epoch_plan import EpochPlan
from flodl_exp.core.epochs import EpochBoundaries
from flodl_exp.core.faults import SHUTDOWN_GRACE_S, FaultHandler, FaultSettings
from flodl_exp.core.intents import Intents
from flodl_exp.core.lifecycle import TRAINING_PHASES, Lifecycle, Phase, Status
from flodl_exp.core.node_groups import node_groups
from flodl_exp.core.outbox import Outbox
from flodl_exp.core.ports import CoreObserver, NullObserver
from flodl_exp.core.preemption import Preemption, PreemptionSettings, kills_on_bad_exit
from flodl_exp.core.reduces import Reduces
from flodl_exp.core.report_pace import ReportPacing, pace_enabled
from flodl_exp.core.reports import RankReports
from flodl_exp.core.run_end import RunEnd, RunEndSettings
from flodl_exp.core.run_state import run_state
from flodl_exp.core.seams import Ports
from flodl_exp.core.startup import StartupBlame
from flodl_exp.core.view import CoreView
from flodl_exp.policy.controllers import build_elche, build_run_guard, guard_name
from flodl_exp.policy.meta import LrEventMeta
from flodl_exp.policy.mode import Mode
from flodl_exp.protocol.messages import (
    Batch,
    Batches,
    CheckpointResult,
    ChunkMetrics,
    EpochFnResult,
    EvalResult,
    Evict,
    Exiting,
    Intent,
    LoopNotice,
    NodeDrift,
    NodePartial,
    Payload,
    Probe,
    ProbeResult,
    RankError,
    SaveResult,
    SessionReady,
    SetEpochRole,
    Snapshot,
    SyncAck,
    Telemetry,
)
from flodl_exp.protocol.messages import Shutdown as ShutdownMsg

log = logging.getLogger("flodl_exp.coordinator")

_GATE_FOR = {Phase.TRAINING: Gate.OPEN, Phase.CHECKPOINTING: Gate.HOLD_EPOCH}

LIVENESS_CHECK_S = 0.25
"""How often the tick scans the ranks for a stale heartbeat or a stuck main thread. Their timeouts are seconds
(``cluster.heartbeat_timeout_s`` 30, ``progress_timeout_s`` 600 by default); a scan on every turn of the loop was
a fifth of the coordinator's main-thread time at 1,024 paced ranks (experiments/bench_coordinator.py --pace,
py-spy)."""


@dataclass(frozen=True)
class RunFacts:
    """What the core needs of the job beyond the config (the launcher's spec)."""

    checkpoint_stem: str = "bundle"
    shuffle_seed: int = 42
    attempt: int = 0
    relay_prefix: str = "flodl-relay"
    """``cluster.node_reduce``: the node leaders' socket names start with it (unique to the job and attempt)."""


class ControlCore:
    """The run's decisions; see the module docstring. Build it with :meth:`from_config`."""

    def __init__(self, *, shape: RunShape, cfg: Config, outbox_for: Optional[Callable[[Cohort], Outbox]] = None,
                 clock: Optional[Callable[[], float]] = None, wall_clock: Callable[[], float], observer: CoreObserver,
                 store: BundleStore, facts: RunFacts = RunFacts(), averager: Optional[Averager] = None,
                 is_local: Callable[[int], bool] = lambda r: False,
                 dispatcher: Callable[..., Dispatcher] = Dispatcher, start: float = 0.0,
                 commands: Optional[list[Command]] = None, watch_liveness: bool = False) -> None:
        w = shape.world_size
        epochs = cfg.experiment.epochs
        plan = self.plan = EpochPlan(epochs)
        """The run's epoch count, one object every component reads (core/epoch_plan.py)."""
        self.W, self.shape = w, shape
        self._now = start
        """The time of the event being handled (:meth:`handle`)."""
        self.clock: Callable[[], float] = clock if clock is not None else self._event_time
        """What every component reads as the time: the shell's clock port when one is given, else the time each
        event brought in (the simulator's)."""
        self._commands: list[Command] = commands if commands is not None else []
        """What :meth:`handle` returns: the payloads of a core built without an outbox port, and the
        observations of one whose observer records into the same list (:func:`recording_core`)."""
        self._anchor_seeded = False
        """Whether the last :class:`AnchorHint` set ElChe's cold-start anchor."""
        self.obs = observer
        self._node_reduce = bool(cfg.cluster.node_reduce)
        self._relay_prefix = facts.relay_prefix
        self.epoch_fn = cfg.experiment.epoch_fn is not None
        self.stall_ceiling = max(10 * cfg.cluster.heartbeat_timeout_s, 300.0)
        self.mode = Mode.of(cfg)
        """The policy and backend as one value, resolved once (flodl_exp/policy/mode.py)."""
        self.life = Lifecycle()
        self._watch_liveness = watch_liveness
        """The shell reports heartbeats (the coordinator; the simulator models none): each tick, a working rank
        silent for ``cluster.heartbeat_timeout_s`` is dead, and one whose steps stopped while it trains is
        evicted (``cluster.progress_timeout_s``)."""
        self._hb_timeout = float(cfg.cluster.heartbeat_timeout_s)
        self._next_liveness_check = -math.inf
        self.progress = ProgressWatch(cfg.cluster.progress_timeout_s)
        self.cohort = Cohort(w, shape.fixed_callback_rank, start, wall_clock)
        self.outbox: Outbox = (outbox_for(self.cohort) if outbox_for is not None
                               else CommandOutbox(self.cohort, self._commands))
        ports = Ports(out=self.outbox, obs=observer, clock=self.clock, wall_clock=wall_clock, store=store,
                      is_local=is_local)
        """The shell's side, handed to each component as one value (core/seams.py); the core itself is each
        component's :class:`~.seams.RunControl` (enter, shutdown, shutdown_with_save, fire_reduce)."""
        elche = build_elche(cfg.mode, w) if w >= 2 else None
        self.cycle = AveragingCycle(
            settings=CycleSettings(world_size=w, mode=self.mode, gamma=cfg.mode.gamma, alpha=shape.easgd_alpha,
                                   progressive=shape.progressive, relax_up=cfg.mode.relax_up,
                                   max_batch_diff=cfg.mode.max_batch_diff, outer=shape.outer,
                                   lockstep_ahead=cfg.mode.lockstep_ahead, overlap=bool(cfg.mode.overlap)),
            elche=elche, guard=build_run_guard(cfg.guard, shape.easgd_alpha),
            meta=LrEventMeta() if (cfg.mode.meta_controller and elche is not None) else None,
            outbox=self.outbox, clock=self.clock, averager=averager)
        self.dispatch = dispatcher(
            settings=DispatchSettings(world_size=w, batch_size=cfg.experiment.batch_size, mode=self.mode,
                                      progressive=shape.progressive, max_overshoot=cfg.mode.max_overshoot,
                                      partition_ratios=cfg.mode.partition_ratios,
                                      scalar_reductions=dict(cfg.scalar_reductions),
                                      advise=cfg.data_plane.stage_advisories),
            epochs=plan, cohort=self.cohort, cycle=self.cycle, outbox=self.outbox, clock=self.clock)
        self.intents = Intents()
        """``w.request_eval()`` / ``w.request_checkpoint()``: which boundary answers them (core/intents.py)."""
        self.slack = CallbackSlack(enabled=cfg.eval.callback_slack, eval_every=cfg.eval.every,
                                   epochs=plan, epoch_fn=self.epoch_fn)
        self.store = store
        self.writer = BundleWriter(
            stem=facts.checkpoint_stem, cohort=self.cohort, cycle=self.cycle, dispatch=self.dispatch, ports=ports,
            plan=plan, facts=MetaFacts(world_size=w, experiment=cfg.experiment.name,
                                       guard_kind=guard_name(cfg.guard), batch_size=cfg.experiment.batch_size,
                                       shuffle_seed=facts.shuffle_seed, mode=self.mode))
        self.checkpoint_fn = CheckpointFnRole(cohort=self.cohort, outbox=self.outbox, obs=observer,
                                              consensus=self.mode.is_cpu)
        """``experiment.checkpoint_fn``: run with periodic and requested bundles, failing over (core/checkpoint_fn.py)."""
        self.checkpoints = Checkpoints(
            settings=CheckpointSettings(every=cfg.checkpoint.every, at_epoch=cfg.checkpoint.at_epoch,
                                        progressive=shape.progressive, world_size=w),
            epochs=plan, writer=self.writer, cohort=self.cohort, cycle=self.cycle, dispatch=self.dispatch,
            intents=self.intents, ports=ports, run=self,
            checkpoint_fn=self.checkpoint_fn if cfg.experiment.checkpoint_fn else None)
        if cfg.experiment.checkpoint_fn and not (0 < cfg.checkpoint.every < epochs) and not cfg.experiment.loop:
            log.warning("experiment.checkpoint_fn is set but will not run: it runs with periodic bundles "
                        "(checkpoint.every=%d of %d epochs takes none) and with w.request_checkpoint() of a "
                        "cooperative loop (experiment.loop is not set)", cfg.checkpoint.every, epochs)
        self.faults = FaultHandler(
            settings=FaultSettings(world_size=w, max_failure=shape.max_failure, backend=self.mode.backend),
            life=self.life, cohort=self.cohort, cycle=self.cycle, dispatch=self.dispatch, writer=self.writer,
            ports=ports, run=self)
        self.preemption = Preemption(
            settings=PreemptionSettings(attempt=facts.attempt, progressive=shape.progressive, world_size=w,
                                        kill_on_bad_exit=kills_on_bad_exit(cfg.cluster)),
            life=self.life, cohort=self.cohort, cycle=self.cycle, dispatch=self.dispatch, writer=self.writer,
            checkpoints=self.checkpoints, ports=ports, run=self)
        self.run_end = RunEnd(
            settings=RunEndSettings(world_size=w, blended=shape.easgd_alpha is not None, mode=self.mode),
            epochs=plan, life=self.life, cohort=self.cohort, cycle=self.cycle, dispatch=self.dispatch,
            writer=self.writer, checkpoint_fn=self.checkpoint_fn, slack=self.slack, intents=self.intents,
            ports=ports, run=self)
        """Evals, the user's eval and stop intents, the final consensus and the run's end (core/run_end.py)."""
        self.startup = StartupBlame()
        """Whom a run that cannot start blames (core/startup.py)."""
        self.reduces = Reduces(
            mode=self.mode, fold_updates=self.mode.folds_updates(shape.progressive), life=self.life,
            cohort=self.cohort, cycle=self.cycle, dispatch=self.dispatch, checkpoints=self.checkpoints,
            ports=ports, preempt_snapshot=self.preemption.on_reduce_finished, may_run_ahead=self._may_run_ahead,
            preempt_armed=lambda: self.preemption.armed)
        """The one place a reduce fires, and what its finish sets going (core/reduces.py)."""
        self.boundaries = EpochBoundaries(
            eval_every=cfg.eval.every, life=self.life, cohort=self.cohort, cycle=self.cycle, dispatch=self.dispatch,
            checkpoints=self.checkpoints, intents=self.intents, run_end=self.run_end, ports=ports, run=self)
        """Epoch aggregation and what each boundary runs: an eval, a bundle (core/epochs.py)."""
        self.deaths = Deaths(
            life=self.life, faults=self.faults, dispatch=self.dispatch, writer=self.writer,
            checkpoint_fn=self.checkpoint_fn, run_end=self.run_end, obs=observer, reduces=self.reduces,
            after_saves=self.after_saves)
        """What a death does to the work in progress, after FaultHandler's recovery (core/deaths.py)."""
        self.reports = RankReports(loop_error=str(cfg.cluster.loop_error), cohort=self.cohort, dispatch=self.dispatch,
                                   slack=self.slack, obs=observer, run=self)
        """Errors, the epoch hook's result, exits, telemetry, loop notices (core/reports.py)."""
        self.pacing = ReportPacing(
            enabled=pace_enabled(self.mode, cfg.cluster.report_coalesce_ms, cfg.mode.max_batch_diff, w),
            world_size=w, cycle=self.cycle, outbox=self.outbox)
        """Which Batch report of each rank completes its count: the ranks coalesce the others (core/report_pace.py)."""
        self._handlers = self._message_routes()
        self.cycle.stage_slack_from(self.run_end.callback_slack)
        self._epoch_role_sent: Optional[int] = None
        self._first_batch_seen = False
        self._auto: Optional[AutoDecision] = None
        """mode.auto's probe and choice, once the shell said every rank joined (core/auto_choice.py)."""
        self._view = CoreView(self, life=self.life, cohort=self.cohort, cycle=self.cycle, dispatch=self.dispatch,
                              writer=self.writer, preemption=self.preemption, startup=self.startup, run_end=self.run_end,
                              mode=self.mode)

    @classmethod
    def from_config(cls, cfg: Config, *, wall_clock: Callable[[], float],
                    outbox_for: Optional[Callable[[Cohort], Outbox]] = None, clock: Optional[Callable[[], float]] = None,
                    observer: Optional[CoreObserver] = None, store: Optional[BundleStore] = None,
                    facts: RunFacts = RunFacts(), is_local: Callable[[int], bool] = lambda r: False,
                    dispatcher: Callable[..., Dispatcher] = Dispatcher, averager: Optional[Averager] = None,
                    start: Optional[float] = None, commands: Optional[list[Command]] = None,
                    watch_liveness: bool = False) -> ControlCore:
        """The core of a run config (the coordinator's, or the simulator's run_config of a rig). Without
        ``outbox_for`` what it sends is returned by :meth:`handle`; without ``clock`` it runs on its events' time."""
        t0 = start if start is not None else clock() if clock is not None else 0.0
        return cls(shape=RunShape.of(cfg), cfg=cfg, outbox_for=outbox_for, clock=clock, wall_clock=wall_clock,
                   observer=observer or NullObserver(), store=store or MemoryBundles(), facts=facts,
                   is_local=is_local, dispatcher=dispatcher, start=t0, averager=averager, commands=commands,
                   watch_liveness=watch_liveness)

    def _event_time(self) -> float:
        return self._now

    @property
    def anchor_seeded(self) -> bool:
        """Whether the last :class:`AnchorHint` set ElChe's cold-start anchor."""
        return self._anchor_seeded

    @property
    def view(self) -> CoreView:
        """What the shells may read of the core: one small read-only view (core/view.py)."""
        return self._view

    @property
    def epochs(self) -> int:
        """The run's epoch count (fewer than the config's once a loop asked to stop: RunEnd.stop_early)."""
        return self.plan.epochs

    # -- resume ---------------------------------------------------------------------
    def restore(self, meta: BundleMeta, guard_kind: str) -> None:
        """Seed the trajectory from a bundle's meta: step counters, ElChe, guard history (a bundle of another
        guard kind leaves the guard fresh)."""
        self.cycle.restore(meta.global_step, meta.sync_round)
        self.cycle.restore_controllers(meta.elche_state,
                                       meta.guard_state if meta.guard_kind == guard_kind else None)

    def seed_anchor(self, r: int) -> bool:
        """A cold-start anchor from the hellos (the slowest device's rank), unless a speed hint, partition
        ratios or a resumed ElChe state already set one; True when it took."""
        return self.cycle.seed_anchor(r)

    @property
    def global_step(self) -> int:
        return self.cycle.global_step

    @property
    def syncs(self) -> int:
        return self.cycle.version

    @property
    def saved_stem(self) -> Optional[str]:
        """The bundle the run ended on other than its final one (failure or preemption), if any."""
        return self.faults.failure_stem or self.preemption.saved_stem

    def outcome(self) -> dict[str, Any]:
        """The run's result as the core knows it (result.json's decisions part)."""
        return {
            **self.life.outcome(),
            "epochs": self.epochs,
            "global_step": self.cycle.global_step,
            "syncs": self.cycle.version,
            "lockstep_syncs": self.cycle.lockstep_syncs,
            **self.run_end.eval_outcome(),
            **self.cohort.outcome(),
            **self.dispatch.outcome(),
            "stem": self.writer.stem,
            "saved_stem": self.saved_stem,
        }

    def startup_failed(self, failure: Optional[str]) -> None:
        """The start-up blame's verdict (core/startup.py), while the ranks connect: a failure ends the run."""
        if failure is not None and self.life.is_(Phase.CONNECTING):
            self.startup.failed(failure)
            self.fail(failure)

    def fail(self, failure: str) -> None:
        """The shell's loop raised (RunFailure or a crash): the run ends FAILED and the ranks are told."""
        self.life.end(Status.FAILED, failure, overwrite=True)
        self.shutdown()

    def shutdown_with_save(self, reason: str, detail: str) -> None:
        """Unrecoverable: every survivor saves its bundle pieces, the meta records why, the run ends FAILED."""
        self.faults.shutdown_with_save(reason, detail)

    def stall_state(self, now: float) -> dict[str, Any]:
        """What the stall watchdog dumps: the phase, the reduce in flight, each rank's books."""
        return run_state(life=self.life, cohort=self.cohort, cycle=self.cycle, dispatch=self.dispatch,
                         pending_saves=self.writer.pending, now=now)

    # -- phase --------------------------------------------------------------------
    def enter(self, phase: Phase) -> None:
        """The one way the phase changes: the lifecycle checks the transition, dispatch follows the phase."""
        self.life.move(phase)
        self.dispatch.set_gate(_GATE_FOR.get(phase, Gate.CLOSED))

    def current_epoch(self) -> int:
        return self.dispatch.current_epoch()

    def start(self, total_picks: int, resume_meta: Optional[dict[str, Any]]) -> None:
        """Every rank said hello: plan the first epoch (or the resumed coverage)."""
        self.push_epoch_role()
        self._form_node_groups()
        self.enter(Phase.TRAINING)
        self.dispatch.start(total_picks, resume_meta)

    def _form_node_groups(self) -> None:
        """``cluster.node_reduce`` on the cpu backend: each node's ranks are told their group and its leader
        (core/node_groups.py); from then on the leader answers a reduce for them (NodePartial)."""
        if not (self._node_reduce and self.mode.is_cpu and self.W >= 2):
            return
        groups = node_groups(self.cohort.hosts())
        self.cycle.set_node_groups(groups.members)
        for r, msg in groups.messages(self._relay_prefix):
            self.outbox.send(r, msg)
        if groups.members:
            log.info("cluster.node_reduce: %d node(s) average their ranks first (leaders %s)", len(groups.members),
                     sorted(groups.members))
            self.obs.emit(ev.NodeGroups(groups={q: list(rs) for q, rs in groups.members.items()}))
        else:
            log.info("cluster.node_reduce: no node holds two ranks; every rank answers the coordinator directly")

    def push_epoch_role(self) -> None:
        """Tell every rank who runs ``experiment.epoch_fn`` (the callback rank), at the start and when it moves.
        A role that moves mid-run moves from the epoch after the newest one started, so no epoch's hook runs
        twice (one whose first chunk the old holder never reached is skipped)."""
        r = self.cohort.callback_rank
        if not self.epoch_fn or r == self._epoch_role_sent:
            return
        first = 0 if self._epoch_role_sent is None else max(self.dispatch.rank_epoch, default=-1) + 1
        self._epoch_role_sent = r
        self.outbox.broadcast(SetEpochRole(rank=r, from_epoch=first))

    def _may_run_ahead(self) -> bool:
        """The lockstep license may be extended (core/reduces.py): training with the whole cohort, and nothing
        that needs it held at a reduce soon (a preemption or termination asked for, a regroup, a bundle being
        written, an eval running)."""
        return (self.life.is_(Phase.TRAINING) and not self.cohort.deaths and self.faults.regroup is None
                and self.preemption.request is None and self.preemption.terminate_at is None
                and not self.checkpoints.busy and not self.eval_holds_sync())

    def eval_holds_sync(self) -> bool:
        """nccl: a periodic eval is running on a live rank, so no collective may start yet."""
        return self.run_end.eval_holds_sync()

    # -- the reduce: the one place it fires -----------------------------------------
    def fire_reduce(self, *, final: bool = False) -> bool:
        """Start a reduce over the live ranks (a consensus one when ``final``); False when one is in flight.
        Every reduce of the run starts here (Reduces.fire): the gate in :meth:`tick`, the end of training,
        and the requests for a bundle's consensus or preemption."""
        return self.reduces.fire(final=final)

    # -- rank messages ------------------------------------------------------------------
    def on_batches(self, r: int, bs: Batches) -> None:
        """Several reports in one frame (a paced rank: rank/report_pacer.py), booked one by one in order."""
        for b in bs.records():
            self.on_batch(r, b)

    def on_batch(self, r: int, b: Batch) -> None:
        self.pacing.on_report(r)
        if not self._first_batch_seen:  # the run's first trained batch (start-up ends here: bench_startup)
            self._first_batch_seen = True
            self.obs.emit(ev.FirstBatch(rank=r))
        self.cohort.on_batch(r)
        self.obs.on_batch(r, b, self.dispatch.chunk_epoch(b.chunk), self.cycle.version)
        self.cycle.on_batch(r, b, speaks_for_lr=self.cohort.lowest_alive() == r)
        self.dispatch.on_batch(r, b.chunk)
        probe_ms = (self.cycle.seed_from_probe(self.cohort.alive_ranks())
                    if self.cycle.probing and self.cycle.probe_full >= self.cohort.alive_count() else None)
        if probe_ms is not None:  # the first window re-sized by measured speed: the fast ranks get its rest
            self.obs.emit(ev.Probe(ms_per_batch=[round(m, 3) for m in probe_ms], counts=self.cycle.counts))
            self.dispatch.after_finish()

    # -- the tick: steps 4-11 -------------------------------------------------------------
    def tick(self, now: Optional[float] = None) -> None:
        """One turn of the reference's tick from step 4 (algorithms.md 3.1; the shell takes 2-3, heartbeats
        and dead ranks, before it): regroup retries and signals, the run's ending phases, a periodic bundle,
        the stall ceiling, then in the training phases the epoch role, the throttle (5), the reduce gate (8),
        aggregation (10) and the end of training (11)."""
        now = self.clock() if now is None else now
        if self._watch_liveness and now >= self._next_liveness_check:
            self._next_liveness_check = now + LIVENESS_CHECK_S
            self._check_liveness(now)                         # 3. dead and stuck ranks, before any gate
        self.faults.tick(now)                                 # 4. regroup retries (a silent generator)
        self.preemption.tick()                                #    signals (SLURM, time limit)
        if self._tick_ending(now):
            return
        if self.life.is_(Phase.CHECKPOINTING) and self.checkpoints.tick_periodic():
            self.enter(Phase.TRAINING)
            self.dispatch.advance()
        if self.cycle.stalled(now, self.stall_ceiling):       # 6-7. stall ceiling
            self.faults.shutdown_with_save("reduce_stall",
                                           f"a reduce waited {self.stall_ceiling:.0f}s with the cohort alive")
            return
        if self.life.phase in TRAINING_PHASES:
            self.push_epoch_role()                            #    the epoch role moved (an election, a death)
            alive = self.cohort.alive_ranks()
            self.cycle.throttle(alive, self.dispatch.in_flight)  # 5. max_batch_diff
            if (self.faults.regroup is None and self.cycle.in_flight is None and not self.eval_holds_sync()
                    and not self.reduces.gate_blocked(alive) and self.cycle.should_average(alive, self.dispatch.quiesced,
                                                                                     self.dispatch.in_flight)):
                self.fire_reduce()                            # 8. fire a reduce
            self.pacing.tick(alive)                           #    the window's counts moved: re-pace the ranks
            self.boundaries.aggregate()                       # 10. aggregate ready epochs
            if self.dispatch.all_aggregated() and self.life.is_(Phase.TRAINING):
                self.enter(Phase.DRAINING)
        if self.life.is_(Phase.DRAINING) and self.cycle.in_flight is None and not self.eval_holds_sync():
            self.run_end.drain_or_finish()                    # 11. end of run (3.14)

    def _tick_ending(self, now: float) -> bool:
        """Shutdown and ShutdownWithSave wait here; True when nothing else may happen this tick."""
        if self.life.is_(Phase.DONE):
            return True
        if self.life.is_(Phase.SHUTDOWN):
            assert self.life.shutdown_at is not None
            if not self.cohort.working() or now - self.life.shutdown_at > SHUTDOWN_GRACE_S:
                self.enter(Phase.DONE)
            return True
        if self.life.is_(Phase.SAVING):
            if self.faults.saving_overdue(now):
                self.shutdown()
            return True
        return self.life.is_(Phase.PREEMPTING)

    # -- signals ---------------------------------------------------------------------------
    def request_preempt(self) -> None:
        """SIGUSR2 or a time limit near: a resumable bundle, then PREEMPTED (the next ticks carry it out)."""
        self.preemption.request_preempt()

    def request_terminate(self) -> None:
        """SIGTERM: the job step is ending (cancelled, or the first half of a preemption)."""
        self.preemption.request_terminate()

    # -- deaths ---------------------------------------------------------------------------
    def _check_liveness(self, now: float) -> None:
        """Step 3 of the tick: a working rank not heard from for the heartbeat timeout is dead; one whose heartbeat
        arrives but whose training steps stopped (a hung data read, a loop holding a batch) is evicted."""
        for r in self.cohort.stale(now, self._hb_timeout):
            self.on_death(r, f"no heartbeat for {self._hb_timeout:.0f}s")
        for r, idle in self.progress.stuck(now):
            if self.progress.states.get(r) == "loop":
                self.evict(r, f"its training loop held a batch for {idle:.0f}s without calling w.step() "
                              "(cluster.progress_timeout_s)")
                continue
            self.evict(r, f"no training step for {idle:.0f}s with a chunk in progress while its heartbeat "
                          "still arrives (its main thread is stuck; cluster.progress_timeout_s)")

    def _on_heartbeat(self, e: HeartbeatFrom) -> None:
        self.cohort.seen(e.rank, e.now)
        if self.cohort.alive(e.rank):
            self.progress.on_heartbeat(e.rank, e.state, e.steps, e.now)

    def on_death(self, r: int, reason: str) -> None:
        """Rank ``r`` is gone (its connection closed, its heartbeat went stale, it was evicted): recover without
        it, or end the run with a bundle when the loss is unrecoverable (algorithms.md 7; core/deaths.py)."""
        self.progress.forget(r)
        self.deaths.on_death(r, reason)

    def evict(self, r: int, reason: str) -> None:
        """Declare a live-but-stuck rank dead and tell its process to go (its exit frees peers blocked with it
        in a collective); recovery is as for a crash."""
        self.outbox.send(r, Evict(reason=reason))
        self.on_death(r, reason)

    # -- saves ------------------------------------------------------------------
    def on_save_result(self, r: int, res: SaveResult) -> None:
        self.writer.on_result(r, res)
        self.after_saves()

    def on_checkpoint_result(self, r: int, res: CheckpointResult) -> None:
        """``experiment.checkpoint_fn`` ran (or failed: another live rank tries); a progressive bundle waiting for
        it is done now (a non-progressive one is taken on by the next tick)."""
        if self.checkpoint_fn.on_result(r, res):
            self.after_saves()

    def after_saves(self) -> None:
        if not self.writer.settled:
            return
        self.checkpoints.on_saves_settled()
        if self.life.is_(Phase.SAVING):
            self.faults.on_saves_settled()
        elif self.life.is_(Phase.PREEMPTING):
            self.preemption.on_saves_settled()
        self.maybe_complete()

    # -- the end ------------------------------------------------------------------------
    def maybe_complete(self) -> bool:
        """Finishing, the final eval reported and every save settled: the run ends and the ranks are told (True)."""
        return self.run_end.maybe_complete()

    def shutdown(self) -> None:
        """Tell every rank to go (with the failure, if any); the shell waits for them in SHUTDOWN."""
        if self.life.ending:
            return
        self.life.move(Phase.SHUTDOWN, at=self.clock())
        self.dispatch.set_gate(Gate.CLOSED)
        self.outbox.broadcast(ShutdownMsg(reason=self.life.failure or "completed"))

    # -- routing: rank messages and scripted events ----------------------------------------
    def _message_routes(self) -> dict[type, Callable[[int, Any], None]]:
        """Which component decides on (or records) each rank message (:meth:`on_message`)."""
        return {
            Batch: self.on_batch, Batches: self.on_batches, SyncAck: self.reduces.on_ack, Snapshot: self.reduces.on_snapshot,
            NodePartial: self.reduces.on_partial, NodeDrift: self.reduces.on_drift,
            ChunkMetrics: self.dispatch.on_metrics, EvalResult: self.run_end.on_eval, Intent: self.run_end.on_intent,
            SaveResult: self.on_save_result, CheckpointResult: self.on_checkpoint_result,
            SessionReady: self.faults.on_session_ready, RankError: self.reports.on_error,
            Exiting: self.reports.on_exiting, Telemetry: self.reports.on_telemetry,
            EpochFnResult: self.reports.on_epoch_fn, LoopNotice: self.reports.on_loop_notice,
            ProbeResult: self._on_probe_result}

    def on_message(self, r: int, payload: Payload) -> bool:
        """A rank message the core decides on; False when it is not one (the shell handles it)."""
        handler = self._handlers.get(type(payload))
        if handler is None:
            return False
        handler(r, payload)
        return True

    def handle(self, event: Event) -> list[Command]:
        """The one way a shell drives the core: one event in, the commands it caused out (the payloads to send when
        the core was built without an outbox port, and what a recording observer recorded). The time is the
        event's."""
        self._now = event.now
        _HANDLERS[type(event)](self, event)
        if not self._commands:  # the coordinator's every message: its payloads left through its outbox port
            return []
        out = list(self._commands)
        self._commands.clear()
        return out

    # -- mode.auto (core/auto_choice.py) ----------------------------------------------------
    def _on_auto_probe(self, e: AutoProbeStarts) -> None:
        """Every rank joined a mode.auto run: each times a few steps before the first chunk (nothing is kept)."""
        if self._auto is not None or not self.life.is_(Phase.CONNECTING):
            return
        self._auto = AutoDecision(self.W, self.mode.name, started=e.now)
        log.info("mode=auto: every rank times %d training steps before the first chunk (nothing is kept)", PROBE_STEPS)
        self.outbox.broadcast(Probe(steps=PROBE_STEPS))

    def _on_probe_result(self, r: int, res: ProbeResult) -> None:
        if self._auto is not None and not self.life.ending:
            self._auto.on_result(r, res)
            self._conclude_probe(self._now)

    def _conclude_probe(self, now: float) -> None:
        """The probe is over (every rank answered, or its time passed): the verdict, or the request for predictions."""
        out = self._auto.conclude(now) if self._auto is not None else None
        if out is not None:
            self._commands.append(out)

    def _on_modes_predicted(self, e: ModesPredicted) -> None:
        chosen = self._auto.on_predicted(e) if self._auto is not None else None
        if chosen is not None:
            self._commands.append(chosen)

    def _on_startup_check(self, e: StartupCheck) -> None:
        self.startup_failed(self.startup.check(self.cohort.missing(), e.now))
        self._conclude_probe(e.now)

    def _on_hint(self, e: AnchorHint) -> None:
        self._anchor_seeded = self.seed_anchor(e.rank)

    def _on_message(self, e: RankMessage) -> None:
        self.cohort.seen(e.rank, e.now)
        if not self.on_message(e.rank, e.payload):
            log.warning("message %s is not for the coordinator (from rank %d): ignored", type(e.payload).__name__,
                        e.rank)

    def _on_resumed(self, e: Resumed) -> None:
        self.restore(e.meta, e.guard_kind)
        if e.outer_state is None:
            return
        norm = self.cycle.restore_outer(e.outer_state)
        if norm is not None:
            log.info("outer optimizer %s resumed from %s (momentum norm %.6g)", self.shape.outer.describe(), e.stem,
                     norm)
            self.obs.emit(ev.OuterRestored(stem=e.stem, momentum_norm=norm))

    def settle_status(self) -> None:
        """The run's final status, as the result is written: FAILED when the bundle it ends on (its last when
        FINISHED, its preemption bundle when PREEMPTED) failed (a full disk ...), never FINISHED silently."""
        status = self.life.status
        ended_on = (self.writer.stem if status is Status.FINISHED
                    else self.saved_stem if status is Status.PREEMPTED else None)
        failed = self.writer.failed
        if ended_on is None or ended_on not in failed:
            return
        self.life.end(Status.FAILED, f"bundle {ended_on} failed: {failed[ended_on]}", end_reason="bundle_failed",
                      overwrite=True)
        log.error("the run ends FAILED: %s", self.life.failure)


_HANDLERS: dict[type, Callable[[ControlCore, Any], object]] = {
    RankJoined: lambda c, e: c.cohort.join(e.rank, e.now, e.host),
    TrainingStarts: lambda c, e: c.start(e.total_picks, e.resume_meta),
    RankMessage: ControlCore._on_message,
    RankHeard: lambda c, e: c.cohort.seen(e.rank, e.now),
    HeartbeatFrom: ControlCore._on_heartbeat,
    Resumed: ControlCore._on_resumed,
    PreemptAsked: lambda c, e: c.request_preempt(),
    TerminateAsked: lambda c, e: c.request_terminate(),
    Closing: lambda c, e: c.settle_status(),
    RankDeath: lambda c, e: c.on_death(e.rank, e.reason),
    Tick: lambda c, e: c.tick(e.now),
    RunFailed: lambda c, e: c.fail(e.failure),
    SaveAndStop: lambda c, e: c.shutdown_with_save(e.reason, e.detail),
    Stop: lambda c, e: c.shutdown(),
    AnchorHint: ControlCore._on_hint,
    AwaitingRanks: lambda c, e: c.startup.awaiting(e.timeout_s, e.now),
    ClosedBeforeStart: lambda c, e: c.startup_failed(c.startup.on_close(e.rank, e.error, c.cohort.missing(), e.now)),
    LostBeforeJoin: lambda c, e: c.startup_failed(c.startup.on_lost(e.rank, e.cause, e.set_up_failed)),
    StartupCheck: ControlCore._on_startup_check,
    AutoProbeStarts: ControlCore._on_auto_probe,
    ModesPredicted: ControlCore._on_modes_predicted,
}
"""Each event kind's handler (:meth:`ControlCore.handle`)."""


def recording_core(cfg: Config, clock: Optional[Callable[[], float]] = None, *, store: Optional[BundleStore] = None,
                   facts: RunFacts = RunFacts(),
                   averager: Optional[Averager] = None) -> tuple[ControlCore, list[Command]]:
    """A core whose every output is a command, observations included (tests, the same-commands check); bundles in
    memory. The list is the core's own buffer: what a direct call (a test's) caused waits there, and
    :meth:`~ControlCore.handle` returns and empties it. ``clock`` (also the wall clock): a port, as the
    coordinator's; none: the core runs on its events' time, as the simulator's."""
    commands: list[Command] = []
    core = ControlCore.from_config(cfg, clock=clock, wall_clock=clock or (lambda: 0.0),
                                   observer=RecordingObserver(commands), store=store, facts=facts, averager=averager,
                                   commands=commands)
    return core, commands
