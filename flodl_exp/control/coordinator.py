"""The coordinator: one event loop that paces N rank processes.

It composes components that each own their state and change it only through
their own methods:

* :class:`~.lifecycle.Lifecycle`: the phase and the run's end status (the only writer);
* :class:`~.cohort.Cohort`: liveness, deaths, errors, the callback role;
* :class:`~.cycle.AveragingCycle`: the window ledger, the reduce in flight, version and
  global step, ElChe, the guard and the meta-controller;
* :class:`~.dispatch.Dispatcher`: chunks and plans, pools, epoch accumulators, coverage;
* :class:`~.checkpoints.BundleWriter` / :class:`~.checkpoints.Checkpoints`: saves, metas,
  periodic and at_epoch bundles;
* :class:`~.preemption.Preemption`: preemption, time limits, SIGTERM;
* :class:`~.timeline.TimelineRecorder`: the per-rank timeline (spans, idle analysis).

The coordinator itself routes rank messages to them, applies the fault rules and
the end of the run, and keeps the reference's tick order (algorithms.md 3.1) in
:meth:`Coordinator.tick`. Time comes from an injected clock, so tests drive it
with fakes (tests/test_control_*.py): events in, messages out, no processes.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import queue
import time
from collections.abc import Callable
from typing import Any, Optional

from ..config import RunShape, load_config
from ..protocol import (
    INTENT_KINDS,
    Batch,
    ChunkMetrics,
    CoordHeartbeat,
    EpochAggregated,
    EpochFnResult,
    EvalResult,
    Evict,
    ExecuteEval,
    Exiting,
    FormGroup,
    Heartbeat,
    Intent,
    LoopNotice,
    ProtocolError,
    RankError,
    Save,
    SaveResult,
    SessionReady,
    SetEpochRole,
    Snapshot,
    SyncAck,
    Telemetry,
    decode,
)
from ..protocol import Shutdown as ShutdownMsg
from ..wire import Message
from .callback_slack import CallbackSlack
from .channels import EventLog, Outbox, Transport
from .checkpoints import BundleWriter, Checkpoints, MetaFacts
from .cohort import Cohort, ProgressWatch
from .controllers import build_elche, build_run_guard
from .cycle import AveragingCycle, ReduceOutcome
from .devices import CollectiveRefused, RankDevice, choose_collective, spec_prior_anchor
from .dispatch import Dispatcher, Gate
from .faults import SHUTDOWN_GRACE_S, FaultHandler
from .intents import Intents
from .lifecycle import TRAINING_PHASES, Lifecycle, Phase, RunFailure, Status
from .meta import LrEventMeta
from .preemption import Preemption
from .records import RecordLog, WindowRecorder
from .timeline import TimelineRecorder
from .watchdog import StallWatchdog, run_state

log = logging.getLogger("flodl_exp.coordinator")

COORD_HEARTBEAT_S = 1.0
LOST_PEER_GRACE_S = 3.0
"""Start-up: how long a joined rank's failure waits for a rank that never connected to be found lost before
the failure is blamed on the joined rank. A task's death ends its joined peers' setup at once (collateral
closes), often before its own process reads as gone (a zombie until the task manager reaps it; 24 polls a
second under submitit's local executor)."""

Event = tuple[Any, ...]
"""From the rank server: ``("join", rank, hello)``, ``("msg", rank, Message)``, ``("closed", rank, reason)``."""


_GATE_FOR = {Phase.TRAINING: Gate.OPEN, Phase.CHECKPOINTING: Gate.HOLD_EPOCH}


class Coordinator:
    def __init__(self, spec: dict[str, Any], server: Transport, events: queue.Queue[Event], sink: Any, job_dir: str,
                 *, clock: Callable[[], float] = time.monotonic, rejected: Callable[[], int] = lambda: 0) -> None:
        cfg = load_config(spec["config"])
        shape = RunShape.of(cfg)
        self.cfg, self.shape, self.spec = cfg, shape, spec
        self.inbox = events
        self.sink = sink
        self.job_dir = job_dir
        self.clock = clock
        self._rejected = rejected
        w = shape.world_size
        self.W = w
        self.epochs = cfg.experiment.epochs
        self.hb_timeout = cfg.cluster.heartbeat_timeout_s
        self.stall_ceiling = max(10 * self.hb_timeout, 300.0)
        self.t_start = clock()
        self._node = os.uname().nodename
        self.life = Lifecycle()
        self.cohort = Cohort(w, shape.fixed_callback_rank, clock())
        self.progress = ProgressWatch(cfg.cluster.progress_timeout_s)
        self.records = RecordLog(os.path.abspath(cfg.record_log.dir) if cfg.record_log.dir else None, cfg.record_log.max_bytes)
        self.events = EventLog(job_dir, self.records, clock)
        self.outbox = Outbox(server, self.cohort)
        elche = build_elche(cfg.mode, w) if w >= 2 else None
        self.cycle = AveragingCycle(
            world_size=w, policy=cfg.mode.policy, backend=cfg.mode.backend, gamma=cfg.mode.gamma, alpha=shape.easgd_alpha,
            progressive=shape.progressive, elche=elche, guard=build_run_guard(cfg.guard, shape.easgd_alpha),
            meta=LrEventMeta() if (cfg.mode.meta_controller and elche is not None) else None, relax_up=cfg.mode.relax_up,
            max_batch_diff=cfg.mode.max_batch_diff, outbox=self.outbox, clock=clock, outer=shape.outer)
        self.dispatch = Dispatcher(
            world_size=w, batch_size=cfg.experiment.batch_size, epochs=self.epochs, policy=cfg.mode.policy,
            progressive=shape.progressive, max_overshoot=cfg.mode.max_overshoot, partition_ratios=cfg.mode.partition_ratios,
            scalar_reductions=dict(cfg.scalar_reductions), cohort=self.cohort, cycle=self.cycle, outbox=self.outbox, clock=clock)
        self.writer = BundleWriter(
            stem=spec["checkpoint_stem"], cohort=self.cohort, cycle=self.cycle, dispatch=self.dispatch, outbox=self.outbox,
            sink=sink, facts=MetaFacts(world_size=w, epochs=self.epochs, experiment=cfg.experiment.name,
                                       guard_kind=cfg.guard.kind, batch_size=cfg.experiment.batch_size,
                                       shuffle_seed=int(spec.get("shuffle_seed", cfg.seed))))
        self.intents = Intents()
        """``w.request_eval()`` / ``w.request_checkpoint()``: which boundary answers them (control/intents.py)."""
        self.checkpoints = Checkpoints(
            every=cfg.checkpoint.every, at_epoch=cfg.checkpoint.at_epoch, epochs=self.epochs, progressive=shape.progressive,
            world_size=w, writer=self.writer, cohort=self.cohort, cycle=self.cycle, dispatch=self.dispatch, events=self.events,
            intents=self.intents)
        self.faults = FaultHandler(
            world_size=w, max_failure=shape.max_failure, life=self.life, enter=self.enter, shutdown=self.shutdown,
            cohort=self.cohort, cycle=self.cycle, dispatch=self.dispatch, writer=self.writer, outbox=self.outbox,
            events=self.events, sink=sink, clock=clock, is_local=self._is_local)
        self.preemption = Preemption(
            attempt=int(spec.get("attempt", 0)), progressive=shape.progressive, world_size=w, job_dir=job_dir,
            life=self.life, enter=self.enter, shutdown=self.shutdown, shutdown_with_save=self.shutdown_with_save,
            cohort=self.cohort, cycle=self.cycle, dispatch=self.dispatch, writer=self.writer, checkpoints=self.checkpoints,
            outbox=self.outbox, events=self.events, sink=sink, clock=clock)
        self.watchdog = StallWatchdog(job_dir, clock, interval_s=cfg.cluster.stall_dump_s)
        self.windows = WindowRecorder(reports_per_epoch=cfg.reports_per_epoch, world_size=w, epochs=self.epochs,
                                      batch_size=cfg.experiment.batch_size, cycle=self.cycle, sink=sink, events=self.events,
                                      records=self.records, clock=clock)
        self.timeline = TimelineRecorder(w, clock)
        """Per-rank spans (compute, data wait, sync, eval) from what arrives here; written at the run's end."""
        self.total_picks = 0
        self.devices: dict[int, RankDevice] = {}
        self.slack = CallbackSlack(enabled=cfg.eval.callback_slack and shape.progressive, eval_every=cfg.eval.every,
                                   epochs=self.epochs, epoch_fn=cfg.experiment.epoch_fn is not None)
        self._epoch_role_sent: Optional[int] = None
        self.cycle.slack_source = self._callback_slack
        self.dispatch.advise = shape.progressive and cfg.data_plane.stage_advisories
        self.fold_updates = cfg.mode.backend == "cpu" and cfg.mode.policy == "cadence" and shape.progressive
        """cpu cadence: each rank's next chunk rides in its Update (algorithms.md 5.6)."""
        """What each rank trains on, from its hello (the cohort's collective is chosen from these)."""
        self.eval_pending: Optional[int] = None
        self.eval_pending_epoch: Optional[int] = None
        """The epoch whose periodic eval is running (with eval_pending)."""
        """nccl: the rank running a periodic eval; no collective starts until it answers (its peers
        would wait in the all_reduce for as long as the eval takes)."""
        self.eval_history: list[dict[str, Any]] = []
        self.final_eval: dict[str, float] = {}
        self.final_eval_rank: Optional[int] = None
        """Finishing: the rank running the final eval and writing the consensus model (None once it reported)."""
        self.final_overwrite_done = False
        self.last_beacon = -math.inf
        self.resume: Optional[dict[str, Any]] = spec.get("resume")
        if self.resume:
            self._restore(self.resume["meta"])
            self._restore_outer(self.resume["stem"])
        self._handlers: dict[type, Callable[[int, Any], None]] = {
            Batch: self._on_batch, SyncAck: self._on_ack, Snapshot: self._on_snapshot, ChunkMetrics: self._on_metrics,
            EvalResult: self._on_eval, SaveResult: self._on_save_result, RankError: self._on_error,
            SessionReady: self.faults.on_session_ready,
            Exiting: self._on_exiting, Telemetry: self._on_telemetry, Heartbeat: self._on_heartbeat,
            EpochFnResult: self._on_epoch_fn, Intent: self._on_intent, LoopNotice: self._on_loop_notice,
        }
        self._first_batch_seen = False
        self._inputs_logged = False
        self._connect_closes: list[tuple[int, str]] = []
        """Joined ranks whose connection closed before training started (rank, error), in arrival order."""
        self._blame_by: Optional[float] = None
        """When the first of those closes is blamed if no rank that never connected was found lost by then."""

    def _restore(self, meta: dict[str, Any]) -> None:
        """Seed the trajectory from a bundle's meta: step counters, ElChe, guard history."""
        self.cycle.restore(int(meta["global_step"]), int(meta["sync_round"]))
        if self.cycle.elche is not None and meta.get("elche_state"):
            st = dict(meta["elche_state"])
            st.pop("trend_history", None)
            self.cycle.elche.load_state_dict(st)
        if meta.get("guard_state") and meta.get("guard_kind") == self.cfg.guard.kind:
            self.cycle.guard.load_state_dict(meta["guard_state"])

    def _restore_outer(self, stem: str) -> None:
        """cpu backend: the outer optimizer's momentum from the bundle's sidecar (the launcher checked it exists)."""
        from ..checkpoint import load_outer_state

        outer = self.cycle.outer
        if self.cycle.backend != "cpu" or not outer.spec.stateful:
            return
        outer.load_state_dict(load_outer_state(stem))
        norm = outer.momentum_norm()
        log.info("outer optimizer %s resumed from %s (momentum norm %.6g)", outer.spec.describe(), stem, norm)
        self.events.emit({"event": "outer_restored", "stem": stem, "momentum_norm": norm})

    # -- phase ------------------------------------------------------------
    def enter(self, phase: Phase) -> None:
        """The one way the phase changes: the lifecycle checks the transition, dispatch follows the phase."""
        self.life.move(phase)
        self.dispatch.gate = _GATE_FOR.get(phase, Gate.CLOSED)

    def _is_local(self, r: int) -> bool:
        return self.records.hosts.get(r) == self._node

    def current_epoch(self) -> int:
        return self.dispatch.current_epoch()

    def start(self) -> None:
        """Every rank said hello: plan the first epoch (or the resumed coverage)."""
        self._form_group()
        self._apply_spec_prior()
        self._push_epoch_role()
        self.enter(Phase.TRAINING)
        self.timeline.on_start()
        self.windows.start(self.total_picks)
        self.events.emit({"event": "started", "world_size": self.W, "epochs": self.epochs})
        self.dispatch.start(self.total_picks, self.resume["meta"] if self.resume else None)

    def _push_epoch_role(self) -> None:
        """Tell every rank who runs ``experiment.epoch_fn`` (the callback rank), at the start and when it moves.
        A role that moves mid-run moves from the epoch after the newest one started, so no epoch's hook runs
        twice (one whose first chunk the old holder never reached is skipped)."""
        r = self.cohort.callback_rank
        if self.cfg.experiment.epoch_fn is None or r == self._epoch_role_sent:
            return
        first = 0 if self._epoch_role_sent is None else max(self.dispatch.rank_epoch, default=-1) + 1
        self._epoch_role_sent = r
        self.outbox.broadcast(SetEpochRole(rank=r, from_epoch=first))

    def _on_epoch_fn(self, r: int, f: EpochFnResult) -> None:
        self.slack.on_elapsed(r, f.elapsed_ms, kind="epoch_fn")
        if f.error:
            log.warning("experiment.epoch_fn on rank %d before epoch %d failed: %s", r, f.epoch, f.error)
            self.sink.set_tags({"epoch_fn_error": f.error[:5000]})
        self.sink.log_metrics({"epoch_fn/elapsed_ms": f.elapsed_ms, **{f"epoch_fn/{k}": v for k, v in f.metrics.items()}},
                              step=f.epoch)
        self.events.emit({"event": "epoch_fn", "rank": r, "epoch": f.epoch, "elapsed_ms": f.elapsed_ms,
                          "error": f.error, **f.metrics})

    def _apply_spec_prior(self) -> None:
        """CUDA cohorts: the device scores of the hellos pick ElChe's cold-start anchor rank (the slowest
        guess), unless a speed hint or partition ratios pinned one, or the run resumed ElChe's own state."""
        elche = self.cycle.elche
        if elche is None or elche.anchor_rank is not None or self.resume:
            return
        r = spec_prior_anchor(self.devices, self.W)
        if r is None:
            return
        elche.with_initial_anchor(r)
        scores = {q: self.devices[q].score for q in sorted(self.devices)}
        log.info("spec prior: rank %d has the lowest device score %s: cold-start anchor", r, scores)
        self.events.emit({"event": "spec_prior", "anchor_rank": r, "scores": scores})

    def _form_group(self) -> None:
        """nccl modes: one collective backend for the cohort, chosen from the hellos (devices.py), sent
        before the first chunk; a forced NCCL the devices cannot run refuses the run with one line."""
        if self.cfg.mode.backend != "nccl" or self.W < 2:
            return
        try:
            choice = choose_collective([self.devices[r] for r in sorted(self.devices)], self.cfg.cluster.collective)
        except CollectiveRefused as e:
            raise RunFailure(str(e)) from None
        log.info("collective backend: %s (%s)", choice.backend, choice.reason)
        self.sink.set_tags({"collective": choice.backend})
        self.events.emit({"event": "collective", "backend": choice.backend, "reason": choice.reason})
        self.outbox.broadcast(FormGroup(backend=choice.backend, reason=choice.reason))

    def _eval_holds_sync(self) -> bool:
        """nccl: a periodic eval is running on a live rank, so no collective may start yet."""
        r = self.eval_pending
        return self.cycle.backend == "nccl" and r is not None and self.cohort.alive(r)

    # -- main loop ----------------------------------------------------------
    def run(self, connect_timeout: float) -> Status:
        deadline = self.clock() + connect_timeout
        next_check = self.clock()
        while self.life.is_(Phase.CONNECTING):
            self.pump(0.1)
            if self._connect_closes:
                self._check_connect_closes()
            elif self.cohort.all_joined():
                self.start()
            elif self.clock() > deadline:
                raise RunFailure(f"ranks {self.cohort.missing()} did not connect within {connect_timeout:.0f}s")
            elif self.clock() >= next_check:
                next_check = self.clock() + 1.0
                self._check_lost_before_join()
        while not self.life.is_(Phase.DONE):
            self.pump(0.02)
            self.tick()
        return self.life.status

    def _check_lost_before_join(self) -> None:
        """A task whose process is gone before its rank said hello can never join: fail now, naming it (its
        pid and host) first, then any joined rank that failed since (collateral: its setup waited for it)."""
        from ..jobs.rendezvous import lost_before_join

        closed = {q for q, _ in self._connect_closes}
        for r in self.cohort.missing():
            if r in closed:
                continue
            why = lost_before_join(self.job_dir, r, int(self.spec.get("attempt", 0)))
            if why:
                after = "".join(f"; after it, rank {q} failed: {err}" for q, err in self._connect_closes)
                raise RunFailure(f"rank {r} was lost before training started: {why}{after}")

    def _on_close_while_connecting(self, r: int, err: str) -> None:
        """A rank's connection closed before training started: the run cannot start. When another rank never
        connected, its loss is the likelier first cause (its death ends the joined ranks' setup at once): the
        failure waits up to LOST_PEER_GRACE_S for it to be found lost (``_check_connect_closes``), then
        blames this close."""
        self._connect_closes.append((r, err))
        self._check_lost_before_join()
        closed = {q for q, _ in self._connect_closes}
        others = [q for q in self.cohort.missing() if q not in closed]
        if not others:
            raise self._connect_failure()
        if self._blame_by is None:
            self._blame_by = self.clock() + LOST_PEER_GRACE_S
            log.warning("rank %d failed before training started (%s); ranks %s never connected: waiting up to "
                        "%.0fs for one of them to be found lost (the likelier first cause)", r, err, others,
                        LOST_PEER_GRACE_S)

    def _check_connect_closes(self) -> None:
        """Connecting with a close pending: a rank found lost leads the failure; past the grace, or once every
        rank joined after all, the first close is blamed."""
        self._check_lost_before_join()
        assert self._blame_by is not None
        if self.clock() >= self._blame_by or self.cohort.all_joined():
            raise self._connect_failure()

    def _connect_failure(self) -> RunFailure:
        """The first close before training started, blamed; any later ones after it."""
        (r, err), later = self._connect_closes[0], self._connect_closes[1:]
        closed = {q for q, _ in self._connect_closes}
        missing = [q for q in self.cohort.missing() if q not in closed]
        cause = f" (ranks {missing} never connected)" if missing else ""
        after = "".join(f"; then rank {q} failed: {e}" for q, e in later)
        return RunFailure(f"rank {r} failed before training started{cause}: {err}{after}")

    def pump(self, timeout: float) -> None:
        """Handle every queued rank event (waiting up to ``timeout`` for the first)."""
        try:
            ev = self.inbox.get(timeout=timeout) if timeout > 0 else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self.on_event(ev)
            try:
                ev = self.inbox.get_nowait()
            except queue.Empty:
                return

    def tick(self) -> None:
        """One turn of the loop, in the reference's order (algorithms.md 3.1)."""
        now = self.clock()
        self._beacon(now)                                    # 2. coordinator -> rank heartbeat
        for r in self.cohort.stale(now, self.hb_timeout):    # 3. dead ranks, before any gate
            self.declare_dead(r, f"no heartbeat for {self.hb_timeout:.0f}s")
        for r, idle in self.progress.stuck(now):             #    stuck main threads (heartbeat alive)
            if self.progress.states.get(r) == "loop":
                self.evict(r, f"its training loop held a batch for {idle:.0f}s without calling w.step() "
                              "(cluster.progress_timeout_s)")
                continue
            self.evict(r, f"no training step for {idle:.0f}s with a chunk in progress while its heartbeat "
                          "still arrives (its main thread is stuck; cluster.progress_timeout_s)")
        self.faults.tick(now)                                # 4. regroup retries (a silent generator)
        self.preemption.tick()                               #    signals (SLURM, time limit)
        if self._tick_ending(now):
            return
        if self.life.is_(Phase.CHECKPOINTING) and self.checkpoints.tick_periodic():
            self.enter(Phase.TRAINING)
            self.dispatch.advance()
        if self.cycle.stalled(now, self.stall_ceiling):      # 6-7. stall ceiling
            self.shutdown_with_save("reduce_stall", f"a reduce waited {self.stall_ceiling:.0f}s with the cohort alive")
            return
        if self.life.phase in TRAINING_PHASES:
            self._push_epoch_role()                          #    the epoch role moved (an election, a death)
            alive = self.cohort.alive_ranks()
            self.cycle.throttle(alive, self.dispatch.in_flight)  # 5. max_batch_diff
            if (self.faults.regroup is None and not self._eval_holds_sync()
                    and self.cycle.should_average(alive, self.dispatch.quiesced)):
                self.cycle.trigger(alive)                    # 8. fire a reduce
            if self.watchdog.check(self.cycle.global_step, self.stall_state):  # 9. stall watchdog
                self.events.emit({"event": "stall", "global_step": self.cycle.global_step, "dump": self.watchdog.paths[-1]})
            self._aggregate()                                # 10. aggregate ready epochs
            if self.dispatch.all_aggregated() and self.life.is_(Phase.TRAINING):
                self.enter(Phase.DRAINING)
        if self.life.is_(Phase.DRAINING) and self.cycle.in_flight is None and not self._eval_holds_sync():
            self._drain_or_finish()                          # 11. end of run (3.14)

    def _beacon(self, now: float) -> None:
        if now - self.last_beacon >= COORD_HEARTBEAT_S:
            self.last_beacon = now
            self.outbox.broadcast(CoordHeartbeat())

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

    def _drain_or_finish(self) -> None:
        """Every epoch aggregated: one last consensus reduce if replicas may differ, then the final eval and bundle."""
        if self.dispatch.any_in_flight():
            return  # a dead rank's picks are being retrained: the last reduce waits for them
        alive = self.cohort.alive_ranks()
        blended = self.shape.easgd_alpha is not None and not self.final_overwrite_done
        if self.W > 1 and (blended or self.cycle.any_steps(alive)):
            self.final_overwrite_done = True
            self.cycle.trigger(alive, final=True)
        else:
            self._finish_run()

    # -- events ---------------------------------------------------------------
    def on_event(self, ev: Event) -> None:
        kind, rank = ev[0], int(ev[1])
        if kind == "join":
            self._on_join(rank, ev[2])
        elif kind == "msg":
            self.cohort.seen(rank, self.clock())
            self.on_message(rank, ev[2])
        elif kind == "closed":
            if self.life.is_(Phase.CONNECTING) and not self.cohort.exited(rank):
                self._on_close_while_connecting(rank, str((self.cohort.errors.get(rank) or {}).get("error") or ev[2]))
                return
            self.declare_dead(rank, "connection closed" if ev[2] == "closed" else str(ev[2]))

    def _on_join(self, r: int, hello: dict[str, Any]) -> None:
        self.cohort.join(r, self.clock())
        self.records.hosts[r] = str(hello.get("host", "unknown"))
        self.devices[r] = RankDevice.of(r, hello)
        if hello.get("inputs") and not self._inputs_logged:  # rank 0's data sets, once (a rejoin sends them again)
            self._inputs_logged = True
            self.sink.log_inputs(list(hello["inputs"]))
        self.total_picks = int(hello.get("samples", 0)) * max(1, self.cfg.data_plane.augment)
        log.info("rank %d joined from %s (%s)", r, hello.get("host"), hello.get("device"))
        self.events.emit({"event": "joined", "rank": r, "pid": hello.get("pid"), "host": hello.get("host"),
                          "device": hello.get("device"), "device_uuid": hello.get("device_uuid")})

    def on_message(self, r: int, msg: Message) -> None:
        try:
            payload = decode(msg)
        except ProtocolError as e:
            log.warning("malformed %s from rank %d dropped: %s", msg.kind, r, e)
            return
        if payload is None:
            log.warning("unknown message %r from rank %d ignored", msg.kind, r)
            return
        handler = self._handlers.get(type(payload))
        if handler is None:
            log.warning("message %r is not for the coordinator (from rank %d): ignored", msg.kind, r)
            return
        handler(r, payload)

    def _on_batch(self, r: int, b: Batch) -> None:
        if not self._first_batch_seen:  # the run's first trained batch (start-up ends here: bench_startup)
            self._first_batch_seen = True
            self.events.emit({"event": "first_batch", "rank": r})
        self.cohort.batches[r] += 1
        chunk = self.dispatch.chunks.get(b.chunk)
        self.timeline.on_batch(r, b.ms, b.data_ms, chunk=b.chunk, epoch=chunk.epoch if chunk else None,
                               window=self.cycle.version)
        self.cycle.on_batch(r, b, speaks_for_lr=self.cohort.lowest_alive() == r)
        self.dispatch.on_batch(r, b.chunk)
        probe_ms = (self.cycle.seed_from_probe(self.cohort.alive_ranks())
                    if self.cycle.probing and self.cycle.probe_full >= self.cohort.alive_count() else None)
        if probe_ms is not None:  # the first window re-sized by measured speed: the fast ranks get its rest
            self.events.emit({"event": "probe", "ms_per_batch": [round(m, 3) for m in probe_ms],
                              "counts": self.cycle.counts})
            self.dispatch.after_finish()

    def _on_ack(self, r: int, ack: SyncAck) -> None:
        self._timeline_answer(r)
        self.cycle.on_ack(r, ack)
        self.dispatch.on_answer(r)
        self._try_finish_reduce()

    def _on_snapshot(self, r: int, snap: Snapshot) -> None:
        self._timeline_answer(r)
        self.cycle.on_snapshot(r, snap)
        self.dispatch.on_answer(r)
        self._try_finish_reduce()

    def _on_metrics(self, r: int, m: ChunkMetrics) -> None:
        self.records.rank(r, "chunk", {k: v for k, v in dataclasses.asdict(m).items() if k != "ranges"})
        self.dispatch.on_metrics(r, m)

    def _on_telemetry(self, r: int, t: Telemetry) -> None:
        if self.dispatch.on_telemetry(r, t) is None and self.dispatch.last_aggregated >= 0:
            # No epoch open (the run's tail, or epochs shorter than a report): the last epoch gets it.
            self.sink.log_metrics({f"rank{r}/{k}": v for k, v in t.values().items()}, step=self.dispatch.last_aggregated)

    def _on_error(self, r: int, e: RankError) -> None:
        self.cohort.record_error(r, {"error": e.error, "traceback": e.traceback})
        log.error("rank %d reported: %s", r, e.error)
        if e.loop:  # the user's own loop raised: a bug every rank would hit, not a fault to recover from
            self.sink.set_tags({"error": f"rank {r}: {e.error}\n{e.traceback}"[:5000]})
            self.shutdown_with_save("loop_error", f"rank {r}'s training loop raised {e.error}\n{e.traceback}")

    def _on_intent(self, r: int, i: Intent) -> None:
        """The user's loop asked for an eval or a bundle: folded into the next boundary (_on_epoch_aggregated
        for an eval and, in non-progressive modes, a bundle; the next reduce finish for a progressive bundle)."""
        if i.kind not in INTENT_KINDS:
            log.warning("rank %d asked for %r: not an intent (one of %s): ignored", r, i.kind, ", ".join(INTENT_KINDS))
            return
        self.events.emit({"event": "intent", "rank": r, "kind": i.kind, "epoch": i.epoch})
        if self.life.phase not in TRAINING_PHASES or not self.intents.ask(i.kind, i.epoch):
            return  # the run's end (its final eval and bundle) answers it, or a boundary already did
        if i.kind == "eval" and self.intents.due("eval", self.dispatch.last_aggregated):
            # its boundary passed before the intent came (a sync loop asks once the next epoch's plan is in):
            # evaluate now, not an epoch late
            e = self.dispatch.last_aggregated
            self.intents.answer("eval", e)
            if e != self.epochs - 1 and self.eval_pending is None:
                self._send_eval(e)
        # a bundle: at the next epoch boundary (_on_epoch_aggregated), or the next reduce finish when progressive

    def _on_loop_notice(self, r: int, n: LoopNotice) -> None:
        log.error("%s", n.message)
        self.sink.set_tags({f"loop_warning.rank{r}": n.message[:4000]})
        self.events.emit({"event": "loop_stalled", "rank": r, "held_s": n.held_s, "message": n.message})

    def _on_exiting(self, r: int, x: Exiting) -> None:
        self.cohort.mark_exited(r, {"rank": x.rank, "pid": x.pid, "hash": x.hash, "steps": x.steps,
                                    "global_step": x.global_step})

    # -- reduces and epochs -----------------------------------------------------
    def _timeline_answer(self, r: int) -> None:
        red = self.cycle.in_flight
        if red is not None and r in red.members:
            self.timeline.on_answer(r, red.started)

    def _try_finish_reduce(self) -> None:
        red, version, t = self.cycle.in_flight, self.cycle.version, self.clock()
        with self.outbox.folding_updates(self.fold_updates):
            out = self.cycle.try_finish(self.cohort.alive)
            if out is not None:
                assert red is not None
                self.timeline.on_reduce_finished(started=red.started, members=out.n, backend=red.backend, window=version,
                                                 final=red.final, averaging_from=t)
                self._after_reduce(out)

    def _after_reduce(self, out: ReduceOutcome) -> None:
        for r in out.dead_in:
            self.dispatch.release_held(r)
        for r in out.dead_out:  # its answer is not in the consensus: the survivors redid the collective without it
            picks = self.dispatch.retrain_held(r)
            log.warning("rank %d answered the reduce before it died, but the survivors completed it in a later "
                        "generation without its share: its %d picks are trained again", r, picks)
            self.events.emit({"event": "retrain", "rank": r, "picks": picks, "why": "answer_not_in_consensus"})
        elche = self.cycle.elche
        if elche is not None and elche.is_calibrated and self.cohort.fixed_callback is None and not self.cohort.roles_elected:
            self.cohort.roles_elected = True  # sticky: re-elected only on death
            self.cohort.elect_callback(elche.smoothed_ms)
        if elche is not None:
            self.dispatch.on_verdict(out.action)
        self.dispatch.on_reduce_finished(out.n, keep_after_answer=self.cycle.backend == "nccl")
        self.windows.on_reduce(out, self.current_epoch())
        self.dispatch.on_sync(out.sync_ms, out.d_max, out.action.code, out.outer)
        if self.preemption.on_reduce_finished():
            return
        if self.life.phase in TRAINING_PHASES:
            self.checkpoints.maybe_coverage_bundle()
        self.dispatch.after_finish()

    def _aggregate(self) -> None:
        while self.life.phase in TRAINING_PHASES:
            agg = self.dispatch.pop_aggregated()
            if agg is None:
                return
            self._on_epoch_aggregated(agg.epoch, agg.metrics)
            if self.life.is_(Phase.CHECKPOINTING):
                return  # the next epoch waits for the bundle
            self.dispatch.advance()

    def _on_epoch_aggregated(self, e: int, metrics: dict[str, float]) -> None:
        metrics["global_step"] = float(self.cycle.global_step)
        metrics["alive_ranks"] = float(len(self.cohort.alive_ranks()))
        if self.cycle.elche is not None:
            metrics["anchor"] = float(self.cycle.elche.anchor)
        self.windows.flush_epoch(e)
        self.timeline.on_epoch_aggregated(e, metrics)
        self.sink.log_metrics(metrics, step=e)
        self.outbox.broadcast(EpochAggregated(epoch=e, metrics={k: v for k, v in metrics.items() if "/" not in k}))
        self.events.emit({"event": "epoch", "epoch": e,
                          **{k: v for k, v in metrics.items() if not k.startswith("rank") or k.endswith("batch_share")}})
        last = e == self.epochs - 1  # the final eval and bundle answer every intent
        periodic = self.cfg.eval.every > 0 and (e + 1) % self.cfg.eval.every == 0
        if (self.intents.due("eval", e) or periodic) and not last and self._send_eval(e):
            self.intents.answer("eval", e)
        # (progressive modes take both kinds of bundle at a reduce finish instead: Checkpoints.maybe_coverage_bundle)
        bundle = not last and not self.checkpoints.progressive and (
            self.intents.due("checkpoint", e) or self.checkpoints.periodic_due(e))
        if bundle or last:
            self.intents.answer("checkpoint", e)
        if last:
            self.intents.answer("eval", e)
        if bundle:
            self.checkpoints.begin_periodic(e)
            self.enter(Phase.CHECKPOINTING)

    # -- eval, saves, end -----------------------------------------------------------
    def _send_eval(self, e: int) -> bool:
        """A periodic (or asked-for) eval of epoch e on the callback rank; False when that rank is dead. nccl:
        no collective starts until it answers (eval_pending)."""
        cb = self.cohort.callback_rank
        if not self.cohort.alive(cb):
            return False
        self.eval_pending, self.eval_pending_epoch = cb, e
        self.timeline.on_eval_sent(cb, e)
        self.outbox.send(cb, ExecuteEval(epoch=e))
        return True

    def _callback_slack(self) -> dict[int, float]:
        # The epoch whose last chunk is out; or, when it aggregated before this reduce finished (its chunks
        # done first, as in nccl cadence), the epoch whose eval is running now: the next window overlaps it.
        e = self.dispatch.closing_epoch()
        if e is None and self.eval_pending is not None:
            e = self.eval_pending_epoch
        due = self.slack.due(e, self.cohort.callback_rank)
        for r, ms in due.items():
            log.info("callback slack: rank %d gets %.0f ms less work in the window of the eval after epoch %s", r, ms, e)
            self.events.emit({"event": "callback_slack", "rank": r, "epoch": e, "ms": ms})
        return due

    def _on_eval(self, r: int, f: EvalResult) -> None:
        self.timeline.on_eval_result(r, f.epoch, f.final)
        if not f.final:
            self.slack.on_elapsed(r, f.elapsed_ms, kind="eval")
        if not f.final and self.eval_pending == r:
            self.eval_pending = None
        if f.error:
            log.warning("eval on rank %d failed: %s", r, f.error)
            self.sink.set_tags({"eval_error": f.error})
        metrics = {f"eval/{k}": v for k, v in f.metrics.items()}
        if metrics:
            self.sink.log_metrics(metrics, step=f.epoch)
        self.eval_history.append({"epoch": f.epoch, **metrics})
        self.events.emit({"event": "eval", "epoch": f.epoch, "final": f.final, **metrics})
        if f.final:
            self.final_eval = metrics
            self.final_eval_rank = None
            self._maybe_complete()

    def _on_save_result(self, r: int, res: SaveResult) -> None:
        self.writer.on_result(r, res)
        self._after_saves()

    def _after_saves(self) -> None:
        if not self.writer.settled:
            return
        self.checkpoints.on_saves_settled()
        if self.life.is_(Phase.SAVING):
            self.faults.on_saves_settled()
        elif self.life.is_(Phase.PREEMPTING):
            self.preemption.on_saves_settled()
        self._maybe_complete()

    def _finish_run(self) -> None:
        """Every epoch aggregated and the last reduce settled: final eval and bundle, then shutdown."""
        self.enter(Phase.FINISHING)
        cb = self.cohort.primary()
        self.final_eval_rank = cb
        self.timeline.on_eval_sent(cb, self.epochs - 1, final=True)
        self.outbox.send(cb, ExecuteEval(epoch=self.epochs - 1, final=True))
        self.writer.send_saves(self.writer.stem, model_rank=cb)

    def _maybe_complete(self) -> None:
        if self.life.is_(Phase.FINISHING) and self.final_eval_rank is None and self.writer.settled:
            self.writer.write_meta("completed", self.writer.stem, epoch=self.epochs)
            err = self.writer.failed.get(self.writer.stem)
            if err:  # the final bundle could not be written: the run says so rather than end FINISHED on nothing
                self.life.end(Status.FAILED, f"bundle {self.writer.stem} failed: {err}", end_reason="bundle_failed")
            else:
                self.life.end(Status.FINISHED)
            self.shutdown()

    def shutdown(self) -> None:
        if self.life.ending:
            return
        self.enter(Phase.SHUTDOWN)
        self.life.shutdown_at = self.clock()
        self.outbox.broadcast(ShutdownMsg(reason=self.life.failure or "completed"))

    # -- faults -------------------------------------------------------------------
    def declare_dead(self, r: int, reason: str) -> None:
        self.progress.forget(r)
        death = self.faults.record_death(r, reason)
        if death is None or self.life.ending:
            return
        if self.life.is_(Phase.FINISHING, Phase.SAVING, Phase.PREEMPTING):
            self._drop_pending_of(r)
            return
        lost, retrained = self.dispatch.lost_picks, self.dispatch.retrained_picks
        if not self.faults.recover(death):
            return
        self._report_picks_of_the_dead(r, lost, retrained)
        if r in self.writer.pending:  # a bundle in progress (periodic, coverage) does not wait for its pieces
            self.writer.on_rank_dead(r)
            self._after_saves()
        self._try_finish_reduce()

    def _report_picks_of_the_dead(self, r: int, lost_before: int, retrained_before: int) -> None:
        """What a death did to trained picks of epochs already aggregated: retrained by the survivors (an event),
        or, with none left to do it, lost, which the run says in a metric, a tag and its result."""
        d = self.dispatch
        if d.retrained_picks > retrained_before:
            self.events.emit({"event": "retrain", "rank": r, "picks": d.retrained_picks - retrained_before})
        if d.lost_picks > lost_before:
            self.sink.set_tags({"lost_picks": d.lost_picks})
            self.sink.log_metrics({"lost_picks": float(d.lost_picks)}, step=self.current_epoch())
            self.events.emit({"event": "lost_picks", "rank": r, "picks": d.lost_picks - lost_before})

    def _on_heartbeat(self, r: int, hb: Heartbeat) -> None:
        if self.cohort.alive(r):
            self.progress.on_heartbeat(r, hb.state, hb.steps, self.clock())

    def evict(self, r: int, reason: str) -> None:
        """Declare a live-but-stuck rank dead and tell its process to go (its exit frees peers blocked
        with it in a collective); recovery is as for a crash."""
        self.progress.forget(r)
        self.outbox.send(r, Evict(reason=reason))
        self.declare_dead(r, reason)

    def _drop_pending_of(self, r: int) -> None:
        """A rank died while a bundle was being written: its pieces are forfeit; the final eval and
        the consensus model move to another survivor."""
        alive = self.cohort.alive_ranks()
        if not (self.life.is_(Phase.FINISHING) and self.final_eval_rank == r and alive):
            self.writer.on_rank_dead(r)  # a model piece it owed moves to another survivor
            self._after_saves()
            return
        self.writer.drop(r)
        cb = alive[0]
        self.final_eval_rank = cb
        self.writer.expect(cb)
        self.timeline.on_eval_sent(cb, self.epochs - 1, final=True)
        self.outbox.send(cb, ExecuteEval(epoch=self.epochs - 1, final=True))
        self.outbox.send(cb, Save(stem=self.writer.stem, primary=True, model=True))

    def shutdown_with_save(self, reason: str, detail: str) -> None:
        self.faults.shutdown_with_save(reason, detail)

    def stall_state(self) -> dict[str, Any]:
        return run_state(life=self.life, cohort=self.cohort, cycle=self.cycle, dispatch=self.dispatch,
                         pending_saves=self.writer.pending, now=self.clock())

    # -- the result ---------------------------------------------------------------
    @property
    def saved_stem(self) -> Optional[str]:
        return self.faults.failure_stem or self.preemption.saved_stem

    def result(self) -> dict[str, Any]:
        return {
            "status": self.life.status.value,
            "failure": self.life.failure,
            "world_size": self.W,
            "epochs": self.epochs,
            "global_step": self.cycle.global_step,
            "syncs": self.cycle.version,
            "final_eval": self.final_eval,
            "evals": self.eval_history,
            "finals": {str(r): v for r, v in self.cohort.finals.items()},
            "coverage": {str(e): v for e, v in self.dispatch.coverage.items()},
            "total_picks": self.total_picks,
            "wall_s": self.clock() - self.t_start,
            "callback_rank": self.cohort.callback_rank,
            "stem": self.writer.stem,
            "rejected_connections": self._rejected(),
            "deaths": [d.as_dict() for d in self.cohort.deaths],
            "errors": {str(r): v for r, v in self.cohort.errors.items()},
            "regroups": self.cohort.generation,
            "lost_picks": self.dispatch.lost_picks,
            "retrained_picks": self.dispatch.retrained_picks,
            "saved_stem": self.saved_stem,
            "resumed_from": (self.resume or {}).get("stem"),
        }

    def fail(self, failure: str) -> None:
        """The loop raised (RunFailure or a crash): the run ends FAILED and the ranks are told."""
        self.life.end(Status.FAILED, failure, overwrite=True)
        self.shutdown()
