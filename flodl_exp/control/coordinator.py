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
    Batch,
    ChunkMetrics,
    CoordHeartbeat,
    EpochFnResult,
    EvalResult,
    Evict,
    Exiting,
    FormGroup,
    Heartbeat,
    LoopNotice,
    ProtocolError,
    RankError,
    Save,
    SaveResult,
    SessionReady,
    Telemetry,
    decode,
)
from ..wire import Message
from .channels import EventLog, Outbox, Transport
from .checkpoints import BundleWriter, Checkpoints, MetaFacts
from .cohort import ProgressWatch
from .core import ControlCore, NullObserver
from .cycle import Reduce, ReduceOutcome
from .devices import CollectiveRefused, RankDevice, choose_collective, spec_prior_anchor
from .faults import SHUTDOWN_GRACE_S, FaultHandler
from .lifecycle import TRAINING_PHASES, Phase, RunFailure, Status
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




class ShellObserver:
    """The coordinator's records of the core's decisions: the timeline, the window records, MLflow and
    events.jsonl (the core's :class:`~.core.CoreObserver`)."""

    def __init__(self, *, timeline: TimelineRecorder, windows: WindowRecorder, sink: Any, events: EventLog) -> None:
        self.timeline, self.windows, self.sink, self.events = timeline, windows, sink, events

    def on_batch(self, r: int, b: Batch, epoch: Optional[int], window: int) -> None:
        self.timeline.on_batch(r, b.ms, b.data_ms, chunk=b.chunk, epoch=epoch, window=window)

    def on_answer(self, r: int, started: float) -> None:
        self.timeline.on_answer(r, started)

    def on_reduce_finished(self, red: Reduce, out: ReduceOutcome, window: int, averaging_from: float,
                           epoch: int) -> None:
        self.timeline.on_reduce_finished(started=red.started, members=out.n, backend=red.backend, window=window,
                                         final=red.final, averaging_from=averaging_from)
        self.windows.on_reduce(out, epoch)

    def on_eval_sent(self, r: int, epoch: int, final: bool = False) -> None:
        self.timeline.on_eval_sent(r, epoch, final=final)

    def on_eval_result(self, r: int, epoch: int, final: bool) -> None:
        self.timeline.on_eval_result(r, epoch, final)

    def on_epoch_aggregated(self, e: int, metrics: dict[str, float]) -> None:
        self.windows.flush_epoch(e)
        self.timeline.on_epoch_aggregated(e, metrics)
        self.sink.log_metrics(metrics, step=e)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.sink.log_metrics(metrics, step=step)

    def set_tags(self, tags: dict[str, Any]) -> None:
        self.sink.set_tags(tags)

    def emit(self, event: dict[str, Any]) -> None:
        self.events.emit(event)


class ShellHooks:
    """The bundle writer and preemption, as the core consults them (the core's :class:`~.core.RunHooks`)."""

    def __init__(self, co: Coordinator) -> None:
        self._co = co

    @property
    def bundles_settled(self) -> bool:
        return self._co.writer.settled

    def after_reduce(self) -> bool:
        co = self._co
        if co.preemption.on_reduce_finished():
            return True
        if co.life.phase in TRAINING_PHASES:
            co.checkpoints.maybe_coverage_bundle()
        return False

    def periodic_bundle_due(self, e: int) -> bool:
        return self._co.checkpoints.periodic_due(e)

    def begin_periodic_bundle(self, e: int) -> None:
        self._co.checkpoints.begin_periodic(e)

    def progressive_bundles(self) -> bool:
        return self._co.checkpoints.progressive

    def send_final_saves(self, model_rank: int) -> None:
        w = self._co.writer
        w.send_saves(w.stem, model_rank=model_rank)

    def complete(self) -> Optional[str]:
        w = self._co.writer
        w.write_meta("completed", w.stem, epoch=self._co.epochs)
        err = w.failed.get(w.stem)
        return f"bundle {w.stem} failed: {err}" if err else None


class Coordinator:
    """The I/O shell around the :class:`~.core.ControlCore`: the rank transport, the sink, events.jsonl, the
    record log, bundles on disk, signals and timers. It turns what arrives into the core's inputs and keeps
    the tick order of the reference (algorithms.md 3.1) in :meth:`tick`."""

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
        self.progress = ProgressWatch(cfg.cluster.progress_timeout_s)
        self.records = RecordLog(os.path.abspath(cfg.record_log.dir) if cfg.record_log.dir else None, cfg.record_log.max_bytes)
        self.events = EventLog(job_dir, self.records, clock)
        self.timeline = TimelineRecorder(w, clock)
        """Per-rank spans (compute, data wait, sync, eval) from what arrives here; written at the run's end."""
        self.core = ControlCore(shape=shape, cfg=cfg, outbox_for=lambda cohort: Outbox(server, cohort), clock=clock,
                                observer=NullObserver(), hooks=ShellHooks(self), start=clock())
        core = self.core
        self.life, self.cohort, self.cycle, self.dispatch = core.life, core.cohort, core.cycle, core.dispatch
        self.outbox, self.intents, self.slack = core.outbox, core.intents, core.slack
        self.writer = BundleWriter(
            stem=spec["checkpoint_stem"], cohort=self.cohort, cycle=self.cycle, dispatch=self.dispatch, outbox=self.outbox,
            sink=sink, facts=MetaFacts(world_size=w, epochs=self.epochs, experiment=cfg.experiment.name,
                                       guard_kind=cfg.guard.kind, batch_size=cfg.experiment.batch_size,
                                       shuffle_seed=int(spec.get("shuffle_seed", cfg.seed))))
        self.checkpoints = Checkpoints(
            every=cfg.checkpoint.every, at_epoch=cfg.checkpoint.at_epoch, epochs=self.epochs, progressive=shape.progressive,
            world_size=w, writer=self.writer, cohort=self.cohort, cycle=self.cycle, dispatch=self.dispatch, events=self.events,
            intents=self.intents, fire_reduce=core.fire_reduce)
        self.faults = FaultHandler(
            world_size=w, max_failure=shape.max_failure, life=self.life, enter=core.enter, shutdown=core.shutdown,
            cohort=self.cohort, cycle=self.cycle, dispatch=self.dispatch, writer=self.writer, outbox=self.outbox,
            events=self.events, sink=sink, clock=clock, is_local=self._is_local)
        self.preemption = Preemption(
            attempt=int(spec.get("attempt", 0)), progressive=shape.progressive, world_size=w, job_dir=job_dir,
            life=self.life, enter=core.enter, shutdown=core.shutdown, shutdown_with_save=self.shutdown_with_save,
            cohort=self.cohort, cycle=self.cycle, dispatch=self.dispatch, writer=self.writer, checkpoints=self.checkpoints,
            outbox=self.outbox, events=self.events, sink=sink, clock=clock, fire_reduce=core.fire_reduce)
        self.watchdog = StallWatchdog(job_dir, clock, interval_s=cfg.cluster.stall_dump_s)
        self.windows = WindowRecorder(reports_per_epoch=cfg.reports_per_epoch, world_size=w, epochs=self.epochs,
                                      batch_size=cfg.experiment.batch_size, cycle=self.cycle, sink=sink, events=self.events,
                                      records=self.records, clock=clock)
        core.obs = ShellObserver(timeline=self.timeline, windows=self.windows, sink=sink, events=self.events)
        self.total_picks = 0
        self.devices: dict[int, RankDevice] = {}
        """What each rank trains on, from its hello (the cohort's collective is chosen from these)."""
        self.last_beacon = -math.inf
        self.resume: Optional[dict[str, Any]] = spec.get("resume")
        if self.resume:
            self._restore(self.resume["meta"])
            self._restore_outer(self.resume["stem"])
        self._handlers: dict[type, Callable[[int, Any], None]] = {
            SaveResult: self._on_save_result, RankError: self._on_error, SessionReady: self.faults.on_session_ready,
            Exiting: self._on_exiting, Telemetry: self._on_telemetry, Heartbeat: self._on_heartbeat,
            EpochFnResult: self._on_epoch_fn, LoopNotice: self._on_loop_notice, ChunkMetrics: self._on_metrics,
            EvalResult: self._on_eval,
        }
        self._inputs_logged = False
        self._connect_closes: list[tuple[int, str]] = []
        """Joined ranks whose connection closed before training started (rank, error), in arrival order."""
        self._blame_by: Optional[float] = None
        """When the first of those closes is blamed if no rank that never connected was found lost by then."""

    @property
    def eval_pending(self) -> Optional[int]:
        return self.core.evals.pending

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
        self.core.enter(phase)

    def _is_local(self, r: int) -> bool:
        return self.records.hosts.get(r) == self._node

    def current_epoch(self) -> int:
        return self.dispatch.current_epoch()

    def start(self) -> None:
        """Every rank said hello: the collective, the cold-start anchor, then the core plans the first epoch
        (or the resumed coverage)."""
        self._form_group()
        self._apply_spec_prior()
        self.timeline.on_start()
        self.windows.start(self.total_picks)
        self.core.push_epoch_role()
        self.core.enter(Phase.TRAINING)
        self.events.emit({"event": "started", "world_size": self.W, "epochs": self.epochs})
        self.dispatch.start(self.total_picks, self.resume["meta"] if self.resume else None)

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
        self.core.tick(regrouping=self.faults.regroup is not None)  # 5, 8, 10, 11: the core's decisions
        if self.watchdog.check(self.cycle.global_step, self.stall_state):  # 9. stall watchdog
            self.events.emit({"event": "stall", "global_step": self.cycle.global_step, "dump": self.watchdog.paths[-1]})

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
        if handler is None and self.core.on_message(r, payload):
            return
        if handler is None:
            log.warning("message %r is not for the coordinator (from rank %d): ignored", msg.kind, r)
            return
        handler(r, payload)

    def _on_metrics(self, r: int, m: ChunkMetrics) -> None:
        self.records.rank(r, "chunk", {k: v for k, v in dataclasses.asdict(m).items() if k != "ranges"})
        self.core.on_metrics(r, m)

    def _on_eval(self, r: int, f: EvalResult) -> None:
        self.core.on_eval(r, f)

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

    def _on_loop_notice(self, r: int, n: LoopNotice) -> None:
        log.error("%s", n.message)
        self.sink.set_tags({f"loop_warning.rank{r}": n.message[:4000]})
        self.events.emit({"event": "loop_stalled", "rank": r, "held_s": n.held_s, "message": n.message})

    def _on_exiting(self, r: int, x: Exiting) -> None:
        self.cohort.mark_exited(r, {"rank": x.rank, "pid": x.pid, "hash": x.hash, "steps": x.steps,
                                    "global_step": x.global_step})

    # -- eval, saves, end -----------------------------------------------------------
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
        self.core.maybe_complete()

    def shutdown(self) -> None:
        self.core.shutdown()

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
        self.core.try_finish_reduce()

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
        if not (self.life.is_(Phase.FINISHING) and self.core.evals.final_rank == r and alive):
            self.writer.on_rank_dead(r)  # a model piece it owed moves to another survivor
            self._after_saves()
            return
        self.writer.drop(r)
        cb = alive[0]
        self.writer.expect(cb)
        self.core.move_final_eval(cb)
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
            "final_eval": self.core.evals.final,
            "evals": self.core.evals.history,
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
