"""The coordinator: the I/O shell around the control core, pacing N rank processes.

Every decision of the run is the :class:`~.core.ControlCore`'s (core/control_core.py). The coordinator turns
what arrives into the core's inputs and carries out what the core decides through its ports:

* the rank server's events become the core's events, through :meth:`ControlCore.handle` alone (rank messages,
  after the record log took each chunk's metrics; heartbeats, from which the core finds dead and stuck ranks; deaths:
  a closed connection; ticks, signals, the run's end); it reads the core only through ``core.view``;
* the core's messages go out through a :class:`~.wire_outbox.WireOutbox` onto the rank sockets;
* what the core decides is recorded by :class:`ShellObserver` (timeline, window records, MLflow, events.jsonl);
* bundle files go through :class:`~.disk_bundles.DiskBundles`.

It keeps start-up (the hellos, the collective, the cold-start anchor, blame for a rank lost before it
connected), the coordinator's heartbeat, liveness, the stall watchdog and the run's result. The reference's
tick order (algorithms.md 3.1) reads in :meth:`Coordinator.tick`: 2-3 here, 4-11 in the core's ``Tick``.
Time comes from an injected clock, so tests drive it with fakes (tests/test_control_*.py).
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import math
import os
import queue
import sys
import time
from collections.abc import Callable
from typing import Any, Optional

from flodl_exp import events as ev
from flodl_exp.bundle_meta import Resume
from flodl_exp.config import RunShape, load_config
from flodl_exp.coordinator.auto_probe import AutoProbe
from flodl_exp.coordinator.disk_bundles import DiskBundles
from flodl_exp.coordinator.event_log import EventLog
from flodl_exp.coordinator.records import RecordLog, WindowRecorder
from flodl_exp.coordinator.timeline import TimelineRecorder
from flodl_exp.coordinator.watchdog import StallWatchdog
from flodl_exp.coordinator.wire_outbox import Transport, WireOutbox
from flodl_exp.core.auto_choice import AutoProbeStarts, ModeChosen, PredictModes
from flodl_exp.core.cohort import Cohort
from flodl_exp.core.commands import (
    AnchorHint,
    AwaitingRanks,
    ClosedBeforeStart,
    Closing,
    HeartbeatFrom,
    LostBeforeJoin,
    PreemptAsked,
    RankDeath,
    RankHeard,
    RankJoined,
    RankMessage,
    Resumed,
    RunFailed,
    SaveAndStop,
    StartupCheck,
    Stop,
    TerminateAsked,
    Tick,
    TrainingStarts,
)
from flodl_exp.core.commands import Event as CoreEvent
from flodl_exp.core.control_core import ControlCore, RunFacts
from flodl_exp.core.cycle import Reduce, ReduceOutcome
from flodl_exp.core.lifecycle import TRAINING_PHASES, Phase, RunFailure, Status
from flodl_exp.core.node_groups import relay_prefix
from flodl_exp.core.ports import Sink
from flodl_exp.devices import CollectiveRefused, RankDevice, choose_collective, spec_prior_anchor
from flodl_exp.hooks import RunHooks
from flodl_exp.job_spec import JobSpec
from flodl_exp.policy.controllers import guard_name
from flodl_exp.policy.mode import Mode, variant_of
from flodl_exp.protocol.codec import decode
from flodl_exp.protocol.hello import Hello
from flodl_exp.protocol.messages import (
    Batch,
    ChunkMetrics,
    CoordHeartbeat,
    FormGroup,
    Heartbeat,
    ProbeResult,
    ProtocolError,
    RankError,
)
from flodl_exp.protocol.wire import Message
from flodl_exp.torch_averager import TorchAverager

log = logging.getLogger("flodl_exp.coordinator")

COORD_HEARTBEAT_S = 1.0
BEACON_SLICES = 10
"""The coordinator's heartbeat goes to one slice of the ranks (``rank % BEACON_SLICES``) every
``COORD_HEARTBEAT_S / BEACON_SLICES``: each rank still hears it once a second, and the loop never spends one turn
encoding and writing to every rank (~30 ms at 1,024 ranks, a reduce trigger waiting behind it)."""
ServerEvent = tuple[Any, ...]
"""From the rank server: ``("join", rank, Hello)``, ``("msg", rank, Message)``, ``("closed", rank, reason)``."""


def freeze_startup_heap() -> None:
    """Move everything alive at the start of training (the imports: torch, MLflow, Hydra; the ranks' books) out of
    the garbage collector's reach (``gc.freeze``): a full collection then walks only what the run itself made.
    Before, at 1,024 ranks, every full collection took 80-190 ms, about every 5 s, each one stalling the loop and
    the read thread together (a trigger, a reduce or a heartbeat waiting behind it); after, 3-43 ms
    (experiments/bench_coordinator.py --pace 20, the coordinator's gc callbacks). The price: a frozen object
    that later becomes part of an unreachable cycle is never collected; start-up objects live as long as the
    process, as a rule."""
    gc.collect()
    gc.freeze()


SWITCH_INTERVAL_S = 0.0005
"""The coordinator process's GIL switch interval (Python's default: 5 ms). Its read thread releases the GIL on every
``recv`` and MAC (C calls that drop it) and must then win it back from the main thread, which is busy with the very
messages the read thread hands it: with the default each such wait could last up to 5 ms, so a sweep of ~600 ready
sockets (a reduce's count-completing reports at 1,024 ranks) took 35-110 ms of wall for ~25 ms of CPU, and the
last rank's report, the one that triggers the reduce, waited in its socket meanwhile (experiments/bench_timeline.py;
py-spy put most of the read thread's samples on reacquiring the GIL after ``recv_into`` and the MAC). Measured in
measurements.md, "Fewer frames"."""


def tune_process() -> None:
    """The coordinator's own process, as training starts: the start-up heap frozen (:func:`freeze_startup_heap`)
    and a short GIL switch interval (:data:`SWITCH_INTERVAL_S`)."""
    freeze_startup_heap()
    sys.setswitchinterval(SWITCH_INTERVAL_S)


class ShellObserver:
    """The coordinator's records of the core's decisions: the timeline, the window records, MLflow and
    events.jsonl (the core's :class:`~.core.CoreObserver`)."""

    def __init__(self, *, timeline: TimelineRecorder, sink: Sink, events: EventLog,
                 hooks: Optional[RunHooks] = None) -> None:
        self.timeline, self.sink, self.events = timeline, sink, events
        self.windows: Optional[WindowRecorder] = None
        """Set once built (it reads the core's averaging cycle)."""
        self.hooks = hooks or RunHooks()
        """``hooks.metrics_fn`` / ``hooks.eval_result_fn`` (flodl_exp/hooks.py): called with what is recorded."""

    def on_batch(self, r: int, b: Batch, epoch: Optional[int], window: int) -> None:
        self.timeline.on_batch(r, b.ms, b.data_ms, chunk=b.chunk, epoch=epoch, window=window, age_ms=b.age_ms)

    def on_answer(self, r: int, started: float) -> None:
        self.timeline.on_answer(r, started)

    def on_reduce_finished(self, red: Reduce, out: ReduceOutcome, window: int, averaging_from: float,
                           epoch: int) -> None:
        self.timeline.on_reduce_finished(started=red.started, members=out.n, backend=red.backend, window=window,
                                         final=red.final, averaging_from=averaging_from)
        if self.windows is not None:
            self.windows.on_reduce(out, epoch)

    def on_eval_sent(self, r: int, epoch: int, final: bool = False) -> None:
        self.timeline.on_eval_sent(r, epoch, final=final)

    def on_eval_result(self, r: int, epoch: int, final: bool) -> None:
        self.timeline.on_eval_result(r, epoch, final)

    def on_epoch_aggregated(self, e: int, metrics: dict[str, float]) -> None:
        if self.windows is not None:
            self.windows.flush_epoch(e)
        self.timeline.on_epoch_aggregated(e, metrics)
        self.sink.log_metrics(metrics, step=e)
        self.hooks.on_epoch(e, metrics)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.sink.log_metrics(metrics, step=step)

    def set_tags(self, tags: dict[str, Any]) -> None:
        self.sink.set_tags(tags)

    def emit(self, event: ev.EventRecord) -> None:
        self.events.emit(event)
        if isinstance(event, ev.Eval) and event.metrics:  # a failed eval has none: logged and tagged, no hook call
            self.hooks.on_eval(event.epoch, event.metrics, event.final)

    def log_artifact(self, path: str, artifact_path: str) -> None:
        self.sink.log_artifact(path, artifact_path)


class Coordinator:
    """The I/O shell around the :class:`~.core.ControlCore` (see the module docstring)."""

    def __init__(self, spec: JobSpec, server: Transport, events: queue.Queue[ServerEvent], sink: Sink, job_dir: str,
                 *, clock: Callable[[], float] = time.monotonic, rejected: Callable[[], int] = lambda: 0,
                 owns_process: bool = False) -> None:
        cfg = load_config(spec.config)
        self._owns_process = owns_process
        """The coordinator's own process (main.py): process-wide tuning is ours to do (:func:`tune_process`),
        which a coordinator built inside a test or a launcher must not do to its host."""
        shape = RunShape.of(cfg)
        self.cfg, self.shape, self.spec = cfg, shape, spec
        self.inbox = events
        self.sink = sink
        self.job_dir = job_dir
        self.clock = clock
        self._rejected = rejected
        self.W = shape.world_size
        self.epochs = cfg.experiment.epochs
        self.t_start = clock()
        self._node = os.uname().nodename
        self.records = RecordLog(os.path.abspath(cfg.record_log.dir) if cfg.record_log.dir else None, cfg.record_log.max_bytes)
        self.events = EventLog(job_dir, self.records, clock)
        self.timeline = TimelineRecorder(self.W, clock)
        """Per-rank spans (compute, data wait, sync, eval) from what arrives here; written at the run's end."""
        self.observer = ShellObserver(sink=sink, events=self.events, timeline=self.timeline,
                                      hooks=RunHooks.of(cfg.hooks))
        self._server = server
        if cfg.mode.auto and spec.resume is not None:
            self._resume_auto_choice(spec.resume)
        self._build_core()
        self.auto = AutoProbe(cfg, self.W, clock) if cfg.mode.auto and self.W >= 2 and spec.resume is None else None
        """mode.auto: the probe before the first chunk, then the core rebuilt for the chosen mode (auto_probe.py)."""
        self.watchdog = StallWatchdog(job_dir, clock, interval_s=cfg.cluster.stall_dump_s)
        self.total_picks = 0
        self.devices: dict[int, RankDevice] = {}
        """What each rank trains on, from its hello (the cohort's collective is chosen from these)."""
        self.last_beacon = -math.inf
        """When the last beacon slice went."""
        self._beacon_slice = 0
        self.resume: Optional[Resume] = spec.resume
        self._asked: list[CoreEvent] = []
        """Signals caught since the last tick (a signal handler never re-enters the core: the tick delivers them)."""
        if self.resume is not None:
            self._resume(self.resume)
        self._inputs_logged = False

    def _build_core(self) -> None:
        """The core for ``self.cfg`` (again after mode.auto chose a mode: nothing has happened in the first one)."""
        cfg, spec, clock = self.cfg, self.spec, self.clock
        self.core = ControlCore(
            shape=self.shape, cfg=cfg, outbox_for=self._outbox_for, clock=clock,
            wall_clock=time.time, observer=self.observer, store=DiskBundles(self.job_dir, self.sink),
            averager=TorchAverager(self.shape.outer) if Mode.of(cfg).is_cpu else None,
            is_local=self._is_local, start=clock(), watch_liveness=True,
            facts=RunFacts(checkpoint_stem=spec.checkpoint_stem, shuffle_seed=spec.shuffle_seed, attempt=spec.attempt,
                           relay_prefix=relay_prefix(spec.job_dir, spec.attempt)))
        self.view = self.core.view
        """What the coordinator reads of the core (core/view.py): it names none of its components."""
        self.windows = WindowRecorder(reports_per_epoch=cfg.reports_per_epoch, world_size=self.W, epochs=self.epochs,
                                      batch_size=cfg.experiment.batch_size, cycle=self.view, sink=self.sink,
                                      events=self.events, records=self.records, clock=clock)
        self.observer.windows = self.windows

    def _outbox_for(self, cohort: Cohort) -> WireOutbox:
        """The core's outbox onto the rank sockets; the coordinator's own messages (its heartbeat, the collective,
        mode.auto's probe) go through it too."""
        self.wire_out = WireOutbox(self._server, cohort)
        return self.wire_out

    def _handle(self, event: CoreEvent) -> None:
        """One event to the core. What it sends has left through the wire outbox already (a core built with an
        outbox port returns no payloads), and the observer records directly; what it returns is mode=auto's
        request for predictions and its verdict."""
        for command in self.core.handle(event):
            if isinstance(command, PredictModes) and self.auto is not None:
                self._handle(self.auto.predict(command.measured, self.devices, self.total_picks))
            elif isinstance(command, ModeChosen) and self.auto is not None:
                self._adopt_choice(command)

    def _resume_auto_choice(self, resume: Resume) -> None:
        """mode=auto resumed (a requeue, a resume_from): train on in the mode the bundle was saved in (its meta's
        ``mode``; a meta without one keeps the configured mode), not probe again mid-trajectory."""
        saved = resume.meta.mode
        if not saved:
            return
        try:
            name, overlap = variant_of(saved)
            self._adopt_mode(Mode.from_name(name), overlap)
        except ValueError:
            log.warning("mode=auto resumed: the bundle's mode %r is not a mode: the configured one is kept", saved)
            return
        log.info("mode=auto resumed: the bundle was saved in %s, the run goes on in it", saved)
        self.sink.set_tags({"auto.choice": saved, "auto.reason": f"resumed from a bundle saved in {saved}",
                            **self._mode_tags()})

    def _adopt_mode(self, mode: Mode, overlap: bool) -> bool:
        """Run in ``mode`` (with ``mode.overlap`` or not) instead of the configured one (mode=auto); False when it is
        the configured one already. The caller builds the core after it."""
        if mode == Mode.of(self.cfg) and overlap == bool(self.cfg.mode.overlap):
            return False
        self.cfg.mode = dataclasses.replace(self.cfg.mode, backend=mode.backend.value, policy=mode.policy.name,
                                            name=mode.name, overlap=overlap)
        self.shape = RunShape.of(self.cfg)
        return True

    def _mode_tags(self) -> dict[str, str]:
        m = Mode.of(self.cfg)
        return {"mode": m.name, "policy": m.policy.name, "backend": m.backend.value}

    def _apply_auto(self) -> bool:
        """mode.auto, once every rank joined: the core probes and chooses (core/auto_choice.py); True once decided."""
        auto = self.auto
        if auto is None or auto.choice is not None:
            return True
        if not auto.sent:
            auto.sent = True
            self._handle(AutoProbeStarts(self.clock()))
        return auto.choice is not None

    def _adopt_choice(self, chosen: ModeChosen) -> None:
        """The core's verdict: rebuild the core for the chosen mode (nothing has happened in the first one)."""
        assert self.auto is not None
        choice = self.auto.chosen(chosen)
        name, overlap = variant_of(choice.mode)
        if self._adopt_mode(Mode.from_name(name), overlap):
            self._build_core()
            for r in range(self.W):  # every rank joined the first core (the probe needs them all)
                self._handle(RankJoined(r, self.clock(), self.records.hosts.get(r)))
        log.info("mode=auto chose %s: %s", choice.mode, choice.reason)
        self.sink.set_tags({**choice.tags(), **self._mode_tags()})
        self.events.emit(choice.as_event())

    @property
    def eval_pending(self) -> Optional[int]:
        return self.view.eval_pending

    def _resume(self, resume: Resume) -> None:
        """The bundle's trajectory into the core, with the outer optimizer's sidecar when the core keeps it (cpu
        backend: the launcher checked it exists)."""
        from flodl_exp.checkpoint import load_outer_state

        state = load_outer_state(resume.stem) if self.view.wants_outer_state else None
        self._handle(Resumed(resume.meta, guard_name(self.cfg.guard), resume.stem, state, self.clock()))

    def _is_local(self, r: int) -> bool:
        return self.records.hosts.get(r) == self._node

    def current_epoch(self) -> int:
        return self.view.current_epoch()

    # -- start-up ---------------------------------------------------------------
    def start(self) -> None:
        """Every rank said hello: the collective and the cold-start anchor from the hellos, then the core plans
        the first epoch (or the resumed coverage). mode.auto probes first (the ranks answer, then start again)."""
        if not self.view.is_(Phase.CONNECTING) or not self._apply_auto():
            return  # started already (the probe's last answer started it), or mode=auto is still probing
        self._form_group()
        self._apply_spec_prior()
        self.timeline.on_start()
        self.windows.start(self.total_picks)
        self.events.emit(ev.Started(world_size=self.W, epochs=self.epochs))
        if self._owns_process:
            tune_process()
        self._handle(TrainingStarts(self.total_picks, self.resume.meta.to_dict() if self.resume is not None else None,
                                    self.clock()))

    def _apply_spec_prior(self) -> None:
        """CUDA cohorts: the device scores of the hellos pick ElChe's cold-start anchor rank (the slowest
        guess), unless a speed hint or partition ratios pinned one, or the run resumed ElChe's own state."""
        if self.resume:
            return
        r = spec_prior_anchor(self.devices, self.W)
        if r is None:
            return
        self._handle(AnchorHint(r, self.clock()))
        if not self.view.anchor_seeded:
            return
        scores = {q: self.devices[q].score for q in sorted(self.devices)}
        log.info("spec prior: rank %d has the lowest device score %s: cold-start anchor", r, scores)
        self.events.emit(ev.SpecPrior(anchor_rank=r, scores=scores))

    def _form_group(self) -> None:
        """nccl modes: one collective backend for the cohort, chosen from the hellos (devices.py), sent
        before the first chunk; a forced NCCL the devices cannot run refuses the run with one line."""
        if not self.view.is_nccl or self.W < 2:
            return
        try:
            choice = choose_collective([self.devices[r] for r in sorted(self.devices)], self.cfg.cluster.collective)
        except CollectiveRefused as e:
            raise RunFailure(str(e)) from None
        log.info("collective backend: %s (%s)", choice.backend, choice.reason)
        self.sink.set_tags({"collective": choice.backend})
        self.events.emit(ev.Collective(backend=choice.backend, reason=choice.reason))
        self.wire_out.broadcast(FormGroup(backend=choice.backend, reason=choice.reason))

    # -- main loop ----------------------------------------------------------
    def run(self, connect_timeout: float) -> Status:
        self._handle(AwaitingRanks(connect_timeout, self.clock()))
        next_check = self.clock()
        while self.view.is_(Phase.CONNECTING):
            self.pump(0.1)
            if self.view.closed_before_start():
                self._find_lost_before_join()
            elif self.view.all_joined():
                self.start()
            elif self.clock() >= next_check:
                next_check = self.clock() + 1.0
                self._find_lost_before_join()
            self.check_startup()
        while not self.view.is_(Phase.DONE):
            self.pump(0.02)
            self.tick()
        return self.view.status

    def check_startup(self) -> None:
        """The core's start-up verdict now (a close past its grace, the connect deadline): RunFailure when the run
        cannot start."""
        if self.view.is_(Phase.CONNECTING):
            self._handle(StartupCheck(self.clock()))
        self._raise_if_failed_to_start()

    def _raise_if_failed_to_start(self) -> None:
        failure = self.view.startup_failure
        if failure is not None:
            raise RunFailure(failure)

    def _find_lost_before_join(self) -> None:
        """A task whose process is gone before its rank said hello can never join: each such rank found in the job
        folder (its death record, or its marker's process gone) goes to the core, which blames it first."""
        from flodl_exp.rendezvous import lost_before_join, setup_failure

        for r in self.view.missing():
            cause = setup_failure(self.job_dir, r, self.spec.attempt)
            if cause is not None:  # the rank said why (its death record), alive or not (rank 0 is a thread of task 0)
                self._handle(LostBeforeJoin(r, cause, True, self.clock()))
            else:
                why = lost_before_join(self.job_dir, r, self.spec.attempt)
                if why:
                    self._handle(LostBeforeJoin(r, why, False, self.clock()))
            self._raise_if_failed_to_start()

    def _on_close_while_connecting(self, r: int, err: str) -> None:
        """A rank's connection closed before training started: the run cannot start; the core decides whom to
        blame (a missing rank found lost within the grace leads: core/startup.py)."""
        self._handle(ClosedBeforeStart(r, err, self.clock()))
        self._raise_if_failed_to_start()
        self._find_lost_before_join()

    def pump(self, timeout: float) -> None:
        """Handle every queued rank event (waiting up to ``timeout`` for the first)."""
        try:
            item = self.inbox.get(timeout=timeout) if timeout > 0 else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self.on_event(item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def tick(self) -> None:
        """One turn of the loop, in the reference's order (algorithms.md 3.1)."""
        now = self.clock()
        self._deliver_signals(now)
        self._beacon(now)                                    # 2. coordinator -> rank heartbeat
        self._handle(Tick(now))                              # 3-11: the core's decisions (dead and stuck ranks first)
        if self.view.phase in TRAINING_PHASES and self.watchdog.check(self.view.global_step, self.stall_state):
            self.events.emit(ev.Stall(global_step=self.view.global_step, dump=self.watchdog.paths[-1]))

    def request_preempt(self) -> None:
        """SIGUSR1 (safe in a signal handler: the next tick delivers it)."""
        self._asked.append(PreemptAsked(self.clock()))

    def request_terminate(self) -> None:
        """SIGTERM (safe in a signal handler: the next tick delivers it)."""
        self._asked.append(TerminateAsked(self.clock()))

    def _deliver_signals(self, now: float) -> None:
        while self._asked:
            self._handle(self._asked.pop(0))

    def _beacon(self, now: float) -> None:
        """Step 2 of the tick: the coordinator's heartbeat, one slice of the ranks at a time (BEACON_SLICES)."""
        if now - self.last_beacon >= COORD_HEARTBEAT_S / BEACON_SLICES:
            self.last_beacon = now
            k, self._beacon_slice = self._beacon_slice, (self._beacon_slice + 1) % BEACON_SLICES
            self.wire_out.broadcast(CoordHeartbeat(), among=lambda r: r % BEACON_SLICES == k)

    # -- events ---------------------------------------------------------------
    def on_event(self, ev: ServerEvent) -> None:
        kind, rank = ev[0], int(ev[1])
        if kind == "join":
            self._on_join(rank, ev[2])
        elif kind == "msg":
            self.on_message(rank, ev[2])
        elif kind == "closed":
            if self.view.is_(Phase.CONNECTING) and not self.view.exited(rank):
                self._on_close_while_connecting(rank, self.view.error_of(rank) or str(ev[2]))
                return
            if self.view.error_of(rank) is None:
                self._error_from_death_record(rank)
            self.declare_dead(rank, "connection closed" if ev[2] == "closed" else str(ev[2]))

    def _error_from_death_record(self, r: int) -> None:
        """A failing rank writes its death record, then sends its RankError, then closes. When it closes with a frame
        of ours unread, its close is a reset, which can drop that RankError on the way (seen in CI: the run's error
        tag then said only "connection closed"). The record of this incarnation, in the job folder, stands in for it."""
        from flodl_exp.rendezvous import death_record_of

        rec = death_record_of(self.job_dir, r, self.spec.attempt)
        if rec is not None and rec.get("error"):
            self._handle(RankMessage(r, RankError(error=str(rec["error"]), traceback=str(rec.get("traceback") or "")),
                                     self.clock()))

    def _on_join(self, r: int, hello: Hello) -> None:
        self._handle(RankJoined(r, self.clock(), hello.host))
        self.records.hosts[r] = hello.host or "unknown"
        self.devices[r] = RankDevice.of(r, hello)
        if hello.inputs and not self._inputs_logged:  # rank 0's data sets, once (a rejoin sends them again)
            self._inputs_logged = True
            self.sink.log_inputs([dict(i) for i in hello.inputs])
        self.total_picks = hello.samples * max(1, self.cfg.data_plane.augment)
        log.info("rank %d joined from %s (%s)", r, hello.host, hello.device)
        self.events.emit(ev.Joined(rank=r, pid=hello.pid, host=hello.host, device=hello.device,
                                   device_uuid=hello.device_uuid))

    def on_message(self, r: int, msg: Message) -> None:
        now = self.clock()
        try:
            payload = decode(msg)
        except ProtocolError as e:
            log.warning("malformed %s from rank %d dropped: %s", msg.kind, r, e)
            self._handle(RankHeard(r, now))
            return
        if payload is None:
            log.warning("unknown message %r from rank %d ignored", msg.kind, r)
            self._handle(RankHeard(r, now))
            return
        if isinstance(payload, Heartbeat):
            self._handle(HeartbeatFrom(r, payload.state, payload.steps, now))
            return
        if isinstance(payload, ProbeResult):
            self._handle(RankMessage(r, payload, now))  # the core books it, and may choose the mode now
            if self.auto is not None and self.auto.choice is not None and self.view.is_(Phase.CONNECTING):
                self.start()
            return
        if isinstance(payload, ChunkMetrics):
            self.records.rank(r, "chunk", {k: v for k, v in dataclasses.asdict(payload).items() if k != "ranges"})
        self._handle(RankMessage(r, payload, now))

    # -- deaths -----------------------------------------------------------------
    def declare_dead(self, r: int, reason: str) -> None:
        self._handle(RankDeath(r, reason, self.clock()))

    def shutdown(self) -> None:
        self._handle(Stop(self.clock()))

    def shutdown_with_save(self, reason: str, detail: str) -> None:
        self._handle(SaveAndStop(reason, detail, self.clock()))

    def stall_state(self) -> dict[str, Any]:
        return self.view.stall_state(self.clock())

    # -- the result ---------------------------------------------------------------
    @property
    def saved_stem(self) -> Optional[str]:
        return self.view.saved_stem

    def result(self) -> dict[str, Any]:
        return {
            **self.view.outcome(),
            "world_size": self.W,
            "total_picks": self.total_picks,
            "wall_s": self.clock() - self.t_start,
            "rejected_connections": self._rejected(),
            "resumed_from": self.resume.stem if self.resume is not None else None,
            "auto": ({"mode": self.auto.choice.mode, "reason": self.auto.choice.reason}
                     if self.auto is not None and self.auto.choice is not None else None),
        }

    def fail(self, failure: str) -> None:
        """The loop raised (RunFailure or a crash): the run ends FAILED and the ranks are told."""
        self._deliver_signals(self.clock())
        self._handle(RunFailed(failure, self.clock()))

    def close(self) -> None:
        """The result is about to be written: the core settles the final status (a failed last bundle ends FAILED)."""
        self._deliver_signals(self.clock())
        self._handle(Closing(self.clock()))
        self.observer.hooks.close()
