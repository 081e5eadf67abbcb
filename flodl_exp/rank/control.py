"""A rank's control state and its handler of every coordinator message, apart from the socket.

    wait for plan -> begin_epoch -> (next_batch -> train_step -> after_step)* -> end_epoch

:class:`RankControl` owns what the managed loop and the cooperative tier train from: the plans the
coordinator handed out, the running chunk, the throttle and barrier flags, the collective group, the last
consensus, the trained steps not reported yet. Control messages are handled between batches (never while a
collective could deadlock): start_epoch, extend_partition, form_group, regroup, sync_now, request_params,
update, set_global_step, throttle, execute_eval, set_epoch_role, epoch_aggregated, stage_advisory, save,
checkpoint, request_session, evict, shutdown, and (``cluster.node_reduce``) node_group and node_update. The rank is
mode-agnostic: policies live in the coordinator.

It sends through a ``send(payload)`` function and reads from a :class:`~flodl_exp.rank.inbox.ControlInbox`;
it opens no socket, starts no thread and says no hello, so its tests build it directly (a list's ``append``
for ``send``, a queue for the inbox). The I/O shell, :class:`flodl_exp.rank.worker.RankWorker`, dials and
handshakes, builds the replica and this object, and runs the reader and heartbeat threads.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from flodl_exp.averaging import consensus_state
from flodl_exp.bundle_meta import Resume
from flodl_exp.outer import OuterOptimizer, OuterSpec, UserOuter, resets_inner
from flodl_exp.outer_step import OuterStep
from flodl_exp.protocol.messages import Batch as BatchReport
from flodl_exp.protocol.messages import (
    Checkpoint,
    CheckpointResult,
    CoordHeartbeat,
    EpochAggregated,
    EpochFnResult,
    EvalBroadcast,
    EvalResult,
    Evict,
    ExecuteEval,
    ExtendPartition,
    FormGroup,
    Lockstep,
    NodeDrop,
    NodeGroup,
    NodeUpdate,
    Payload,
    Probe,
    ProbeResult,
    Regroup,
    ReportPace,
    RequestParams,
    RequestSession,
    Save,
    SaveResult,
    SessionReady,
    SetEpochRole,
    SetGlobalStep,
    Shutdown,
    StageAdvisory,
    StartEpoch,
    SyncAck,
    SyncNow,
    Throttle,
    Update,
)
from flodl_exp.rank.backends import (
    CollectiveBackend,
    CollectiveInterrupted,
    CollectiveTimeout,
    CoordinatorBackend,
    LockstepMisaligned,
    SentState,
    snapshot_nbytes,
)
from flodl_exp.rank.fault_inject import ARMED_KINDS, fire_armed, inject_fault
from flodl_exp.rank.hold_clock import HoldClock
from flodl_exp.rank.inbox import ControlInbox
from flodl_exp.rank.node_relay import LeaderRelay, MemberRelay, NodeRelay
from flodl_exp.rank.trainer import Batch as BatchData
from flodl_exp.rank.trainer import EpochState, PendingStep, RankTrainer

log = logging.getLogger("flodl_exp.rank")

GroupJoiner = Callable[[FormGroup, Callable[[], None]], CollectiveBackend]
"""Forms the cohort's process group for a FormGroup, calling the poll (control) while it waits on its members."""
RelayOpener = Callable[[NodeGroup, float], Optional[NodeRelay]]
"""cpu backend, ``cluster.node_reduce``: this rank's end of its node's relay for a NodeGroup, given the mass exponent
(rank/node_relay.py ``open_relay``); None: no relay, the rank answers the coordinator directly."""


class Evicted(RuntimeError):
    """The coordinator declared this rank dead (its main thread made no progress)."""


@dataclass
class OverlappedSync:
    """nccl, ``mode.overlap``: the reduce whose all-reduce runs while this rank trains on (landed between batches)."""

    version: int
    n: int
    """The steps this rank's answer holds (the window it sent)."""
    divergence: bool
    relaunch: bool = False
    """Its group failed and a new one formed: the all-reduce goes again, with the replica as sent."""


class RankControl:
    """The rank's control state and message handlers; see the module docstring.

    ``send``: a payload to the coordinator. ``inbox``: the coordinator's messages. ``trainer``: the replica,
    its optimizer and its data (rank/trainer.py). ``gamma``: the collective average's mass exponent
    (``mode.gamma``). ``outer_spec``/``outer``: the run's outer optimizer, and on the nccl backend its
    replicated state (cpu: it runs at the coordinator, ``outer`` is None). ``cpu``: the snapshot/update
    codec of the cpu backend. ``join_group``: forms the process group a FormGroup names (None: this rank
    cannot join one). ``pace``: the coordinator's ReportPace for ``send``'s Batch coalescing
    (rank/report_pacer.py; None: ignored, every report goes at once). ``fault``: an injected fault (step, kind) from ``FLODL_FAULT_INJECT``.
    ``open_relay``: opens this rank's end of its node's relay for a NodeGroup (``cluster.node_reduce``; the worker
    builds it: this object opens no socket); None: a NodeGroup is ignored and the rank answers directly."""

    def __init__(self, send: Callable[[Payload], None], inbox: ControlInbox, trainer: RankTrainer, *, rank: int,
                 world_size: int, device: torch.device, gamma: float = 1.0, outer_spec: Optional[OuterSpec] = None,
                 outer: Optional[OuterOptimizer] = None, cpu: Optional[CoordinatorBackend] = None,
                 join_group: Optional[GroupJoiner] = None, pace: Optional[Callable[[int], None]] = None,
                 fault: Optional[tuple[int, str]] = None, open_relay: Optional[RelayOpener] = None) -> None:
        self.send = send
        self._pace = pace
        self.inbox = inbox
        self.trainer = trainer
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.gamma = gamma
        self.outer_spec = outer_spec if outer_spec is not None else OuterSpec()
        self.outer = outer
        self._resets_inner = resets_inner(self.outer_spec)
        """Adoption clears the inner optimizer's state (DiLoCo, or a user outer optimizer's ``resets_inner``)."""
        self.cpu = cpu if cpu is not None else CoordinatorBackend()
        self._join_group = join_group
        self._open_relay = open_relay
        self.relay: Optional[NodeRelay] = None
        """cpu backend, ``cluster.node_reduce``: this rank's end of its node's relay (rank/node_relay.py), once a
        NodeGroup opened it; None, or ``down``: snapshots go to the coordinator directly."""
        self.adopted_version: Optional[int] = None
        """The version of the last update adopted: a second copy of it (sent directly by the coordinator after the
        node leader that handed on the first died) is ignored."""
        self.fault = fault
        self.state = "wait"
        """What the main thread is doing, for the heartbeat: train | collective | eval | save | wait | callback | loop."""
        self.stopping = False
        self.throttled = False
        self.awaiting_update = False
        self.sent: Optional[SentState] = None
        """``mode.overlap``: this rank's state as it answered the reduce in flight (its version, float32 copies of its
        parameters and float buffers): the update is applied as the correction ``W += W_avg - W_sent``."""
        self.overlapped: Optional[OverlappedSync] = None
        """nccl, ``mode.overlap``: the reduce whose all-reduce is in flight while this rank trains on."""
        self.hold = HoldClock()
        """``mode.overlap``: the time training stood still for averaging since the last answer (``held_ms``)."""
        self.plans: deque[StartEpoch] = deque()
        """Chunks handed out and not started yet, in order."""
        self.chunk: Optional[EpochState] = None
        """The chunk being trained (a dead rank's remainder of its epoch is appended to it)."""
        self.chunk_extra: list[int] = []
        """Chunk ids appended to the running chunk (reported with its metrics)."""
        self.unreported: deque[tuple[PendingStep, float, int, float]] = deque()
        """Trained steps not yet reported (step, data wait ms, chunk, lr): see report_batches."""
        self.callback_ms = 0.0
        """Time spent in callbacks (evals, the epoch hook) so far: kept out of the data wait a batch reports."""
        self.epoch_role: Optional[int] = None
        """The rank that runs ``experiment.epoch_fn`` (SetEpochRole) ..."""
        self.epoch_role_from = 0
        """... from this epoch on."""
        self.epoch_fn_done: set[int] = set()
        self.last_epoch_metrics: dict[str, float] = {}
        """The latest EpochAggregated metrics (handed to experiment.epoch_fn)."""
        self.last_metrics_epoch: Optional[int] = None
        self.evals: list[EvalBroadcast] = []
        """Every eval result the coordinator broadcast, in order (a cooperative loop's ``w.poll_eval()``)."""
        self.last_consensus: dict[str, torch.Tensor] = {}
        """cpu backend: the last consensus frame adopted (bundles save it, not the blended replica)."""
        self.collective: Optional[CollectiveBackend] = None
        """nccl modes: formed when the coordinator's FormGroup names the cohort's backend."""
        self.synced = 0
        """The reduces this rank took part in so far (the next one's version): a sync_now's version + 1."""
        self.lockstep_until = 0
        """nccl_sync: the coordinator's license (Lockstep): all_reduce after each step while :attr:`synced` is below."""
        self.pending_regroup: Optional[Regroup] = None
        """A regroup that ended a pending collective's wait (handled by the retry that follows)."""
        self.armed_fault: Optional[str] = None
        """An injected fault that fires at the next averaging or save (fault_inject.ARMED_KINDS)."""
        self.resume_stem: Optional[str] = None
        """The resume bundle whose optimizer state is not loaded yet: loaded as training starts (:meth:`train`, or
        the cooperative ``w.epochs()``, after ``w.setup`` registered the loop's optimizers)."""
        self._handlers = self._handler_table()
        if self.outer is not None:
            # The replicated outer state (2x the parameter bytes) is live from now on, before the data plane sizes
            # its device pool at the first chunk, so the pool's budget counts it (it used to appear at the first sync).
            self.outer.allocate(list(trainer.model.parameters()))

    # -- resume -------------------------------------------------------------
    def resume_from(self, resume: Optional[Resume]) -> None:
        """Load model (and nccl: outer optimizer) state from the resume bundle (validated by the launcher)."""
        if resume is None:
            return
        from flodl_exp.checkpoint import load_model_state

        stem = resume.stem
        self.trainer.model.load_state_dict(load_model_state(stem, map_location=str(self.device)))
        self.resume_stem = stem  # the optimizer state follows as training starts (load_resumed_optimizer)
        self.trainer.global_step = resume.meta.global_step
        if self.outer is not None:
            from flodl_exp.checkpoint import load_outer_state

            self.outer.load_state_dict(load_outer_state(stem), device=self.device)
            log.info("rank %d: outer optimizer %s resumed (momentum norm %.6g)", self.rank,
                     self.outer.spec.describe(), self.outer.momentum_norm())

    def load_resumed_optimizer(self) -> None:
        """The optimizer state of the resume bundle (this rank's piece, else the primary's), once."""
        from flodl_exp.checkpoint import optim_path

        stem, self.resume_stem = self.resume_stem, None
        if stem is None:
            return
        for path in (optim_path(stem, self.rank, primary=False), optim_path(stem, self.rank, primary=True)):
            if os.path.exists(path):
                # On the host, then load_state_dict moves each moment to its parameter's device, while Adam's
                # ``step`` stays a CPU tensor (unless fused/capturable): loaded onto the GPU, non-fused Adam would
                # read it back with .item(), a device sync per parameter per step for the rest of the run.
                self.trainer.optimizer.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
                return
        log.warning("rank %d: the bundle %s holds no optimizer state for this rank: a fresh optimizer", self.rank, stem)

    # -- the managed loop ---------------------------------------------
    def train(self) -> None:
        """The managed tier: train every chunk the coordinator hands out until it says shutdown."""
        self.load_resumed_optimizer()
        while not self.stopping:
            if self.plans:
                self.run_chunk(self.plans.popleft())
                continue
            self.wait_for_plans()

    def run_chunk(self, plan: StartEpoch) -> None:
        with self.doing("train"):
            for batch in self.chunk_batches(plan):
                self.book_step(batch, self.trainer.step(batch), plan.chunk)

    def chunk_batches(self, plan: StartEpoch) -> Iterator[BatchData]:
        """The batches of one chunk, control handled between them (the managed loop and the cooperative
        tier's ``w.batches()`` both train from here). Each yielded batch must be booked with
        :meth:`book_step` before the next one is asked for; the chunk's metrics go out when it ends."""
        tr = self.trainer
        self._maybe_epoch_fn(plan.epoch)
        st = tr.begin_epoch(plan.epoch, plan.offset, plan.size)
        self.chunk = st
        while True:
            if st.cursor + tr.batch_size > len(st.picks):
                # Done: report the chunk before handling control, so a reduce that follows never
                # sees this chunk as still in flight (coverage snapshots count in-flight as uncovered).
                break
            self._land_overlapped(block=False)
            self.drain()
            if self.stopping:
                break
            callbacks_before = self.callback_ms
            batch = tr.next_batch(st)
            if batch is None:
                break
            # A callback run while this batch was awaited (the data wait drains control) is not data wait:
            # the coordinator would read it as this rank's delivered cost and shrink its share.
            batch.wait_ms = max(0.0, batch.wait_ms - (self.callback_ms - callbacks_before))
            yield batch
        self._run_out_lockstep()
        self.chunk = None
        self.report_batches(wait=True)
        m = tr.end_epoch(st, plan.chunk)
        m.extra_chunks, self.chunk_extra = self.chunk_extra, []
        self.send(m)

    def book_step(self, batch: BatchData, step: PendingStep, chunk: int) -> None:
        """Count one trained batch of the running chunk: its metrics, its Batch report, the fault hook."""
        tr = self.trainer
        assert self.chunk is not None, "book_step outside a chunk"
        tr.record_step(self.chunk, batch, step)
        self.unreported.append((step, batch.wait_ms, chunk, tr.current_lr()))
        self.report_batches(wait=False)
        if self.fault is not None and tr.step_count >= self.fault[0]:
            self.report_batches(wait=True)
            self.send_held_reports()  # the coordinator has every report before the fault, as without coalescing
            if self.fault[1] in ARMED_KINDS:
                self.armed_fault = self.fault[1]
            else:
                inject_fault(self.fault[1], self.rank, tr.step_count, serve=self._serve_while_gated)
        if self.synced < self.lockstep_until and self.collective is not None and not self.stopping:
            self._lockstep_sync()

    def _lockstep_sync(self) -> None:
        """One reduce of the coordinator's license (Lockstep), right after this rank's step: the report of every
        trained step goes first (the coordinator's ledger counts it before the answer), then the all_reduce and
        its ack, as for a sync_now of this version."""
        self.report_batches(wait=True)
        self._sync_collective(SyncNow(version=self.synced, divergence=True))

    def _run_out_lockstep(self) -> None:
        """The chunk ended below the license (steps were trained while no license was out: the coordinator sized it
        from the steps left when this rank answered, and this rank trained on meanwhile): take part in the rest of
        its reduces with what is left (n 0 after the first), or the peers would wait in them for this rank. No
        control is handled between them (an ExtendPartition handled here would join a chunk whose loop is over:
        its picks never trained); a shutdown or a regroup still ends a collective's wait."""
        for _ in range(max(0, self.lockstep_until - self.synced)):
            if self.stopping or self.collective is None or self.synced >= self.lockstep_until:
                return
            self._lockstep_sync()

    def report_batches(self, wait: bool) -> None:
        """Send the Batch reports of trained steps: those whose device work finished (no wait), or all
        (``wait``). On CUDA a step's loss and time stay on the device until then, so training never
        waits on the GPU per batch; on CPU every step is ready at once."""
        while self.unreported and (wait or self.unreported[0][0].ready()):
            step, wait_ms, chunk, lr = self.unreported.popleft()
            loss, ms = step.resolve()
            self.send(BatchReport(ms=ms, data_ms=wait_ms, chunk=chunk, loss=loss, lr=lr))

    @contextlib.contextmanager
    def doing(self, state: str) -> Iterator[None]:
        """The main thread's state for the heartbeat while the block runs (nesting restores the outer one)."""
        outer, self.state = self.state, state
        try:
            yield
        finally:
            self.state = outer

    def stop(self) -> None:
        """The run is over for this rank: loops and waits end at their next check."""
        self.stopping = True

    def abandon_overlapped(self) -> None:
        """The rank is ending: an overlapped all-reduce still in flight is given up (its group aborted), so nothing
        after waits behind it."""
        if self.overlapped is not None and self.collective is not None:
            self.overlapped = None
            self.collective.abort()

    def close(self) -> None:
        """Stop, leave the collective group (if one was formed) and close the node relay (if one was opened)."""
        self.stopping = True
        relay, self.relay = self.relay, None
        if relay is not None:
            relay.close()
        if self.collective is not None:
            self.collective.close()

    # -- reading control ----------------------------------------------------
    COUNT_FREE = (CoordHeartbeat, EvalBroadcast, EpochAggregated, StageAdvisory, SetEpochRole, SetGlobalStep, StartEpoch,
                  ReportPace, Lockstep)
    """Messages whose handling sends nothing that counts steps: they do not make :meth:`drain` wait for the device.
    (A Lockstep that finds the rank between chunks runs out its reduces at once: each one reports every trained step
    itself, waiting for the device, before its answer.)"""

    def drain(self) -> None:
        """Handle every control message already queued (between batches).

        Before a message whose answer counts steps (a sync ack, a snapshot, a save, ...) every trained step is
        reported: the coordinator's ledger must have seen each of them as a Batch before that. That report
        waits for the device; the coordinator's 1 Hz heartbeat and other messages in :attr:`COUNT_FREE` do not
        force it (they used to, draining the GPU about once a second)."""
        while not self.stopping:
            msg = self.inbox.next(block=False, stopping=self.stopping)
            if msg is None:
                return
            if self.unreported and not isinstance(msg, self.COUNT_FREE):
                self.report_batches(wait=True)
            self.handle(msg)

    def _serve_while_gated(self) -> bool:
        """A gated rank reads control as between batches (see fault_inject.wait_gate); True: stopping."""
        self.drain()
        return self.stopping

    def wait_until(self, done: Callable[[], bool], held: bool = False) -> None:
        """Block handling control messages until ``done()`` (throttle, barrier, idle). ``held``: the wait is for the
        reduce this rank answered (``mode.overlap``: its next chunk or its update comes after that reduce), so while
        that answer is unresolved the waiting, not the messages handled meanwhile, is time averaging held the rank."""
        with self.doing("wait"):
            while not self.stopping and not done():
                answering = held and (self.sent is not None or self.overlapped is not None)
                if self.overlapped is not None:  # nothing to train meanwhile: its all-reduce lands (and acks) first
                    self._land_overlapped(block=True, held=answering)
                    continue
                with self.hold.holding() if answering else contextlib.nullcontext():
                    msg = self.inbox.next(block=True, stopping=self.stopping)
                if msg is not None:
                    self.handle(msg)

    def wait_for_plans(self) -> None:
        """Idle until the coordinator hands out a chunk. With ``mode.overlap`` a rank that trained through its next
        window before the reduce it answered finished is idle because of that reduce (the chunk after comes with the
        finish): that idle is the reduce's cost to it (:meth:`wait_until`'s ``held``), which ElChe grows windows for."""
        self.wait_until(lambda: bool(self.plans), held=True)

    def handle(self, msg: Payload) -> None:
        handler = self._handlers.get(type(msg))
        if handler is None:
            log.warning("rank %d: message %r is not for a rank: ignored", self.rank, msg.KIND.value)
            return
        handler(msg)

    def _handler_table(self) -> dict[type, Callable[[Any], None]]:
        return {
            StartEpoch: self.plans.append, ExtendPartition: self._on_extend, Regroup: self._on_regroup, FormGroup: self._form_group,
            SyncNow: self._sync_collective, RequestParams: self._on_request_params, Update: self._on_update,
            SetGlobalStep: self._on_global_step, Throttle: self._on_throttle, ExecuteEval: self._on_eval,
            SetEpochRole: self._on_epoch_role, EpochAggregated: self._on_epoch_aggregated,
            EvalBroadcast: self._on_eval_broadcast,
            StageAdvisory: self._on_stage_advisory,
            Save: self._save, Checkpoint: self._on_checkpoint, Shutdown: self._on_shutdown, CoordHeartbeat: lambda m: None,
            RequestSession: self._on_request_session, Evict: self._on_evict, Probe: self._on_probe,
            ReportPace: self._on_report_pace, Lockstep: self._on_lockstep,
            NodeGroup: self._on_node_group, NodeUpdate: self._on_node_update, NodeDrop: self._on_node_drop,
        }

    def _on_lockstep(self, m: Lockstep) -> None:
        self.lockstep_until = max(self.lockstep_until, int(m.until))
        if self.chunk is None:  # the license found this rank between chunks (its share done before it came): its
            self._run_out_lockstep()  # reduces now, or the peers wait in them for good

    def _on_report_pace(self, m: ReportPace) -> None:
        if self._pace is not None:
            self._pace(m.flush_at)

    def send_held_reports(self) -> None:
        """Send every Batch report the pacer holds, and every later one at once until the coordinator paces the
        next window: a reduce was asked for (the old window's pace would hold the next window's first reports
        until its new pace came), or a fault is about to be injected."""
        if self._pace is not None:
            self._pace(0)

    # -- handlers: work and averaging ---------------------------------------------
    def _on_extend(self, m: ExtendPartition) -> None:
        """Survivors take over a dead rank's remainder: append it to the running chunk of that
        epoch, or run it as a chunk of its own when none is running."""
        if self.chunk is not None and self.chunk.epoch == m.epoch:
            self.chunk.extend(m.offset, self._picks(m.epoch, m.offset, m.size))
            self.chunk_extra.append(m.chunk)
        else:
            self.plans.append(StartEpoch(epoch=m.epoch, offset=m.offset, size=m.size, chunk=m.chunk))

    def _picks(self, epoch: int, offset: int, size: int) -> Any:
        from flodl_exp.partition import make_partition

        return make_partition(offset, size, self.trainer.total_picks, epoch, self.trainer.seed)

    def _on_request_params(self, m: RequestParams) -> None:
        self._await_correction()  # at most one reduce in flight: the last one's update first (a held wait)
        with self.hold.holding():
            self.send_held_reports()
            fire_armed(self.armed_fault, "killsync", self.rank)
            tr = self.trainer
            n = tr.steps_since_avg
            snap = self.cpu.snapshot(tr.model, n)
            snap.version = m.version
            if m.overlap:
                # Train on: the steps from here are the next window's, and the update corrects what was sent.
                self.sent = SentState(m.version, *self.cpu.keep_sent(tr.model))
                tr.steps_in_flight, tr.steps_since_avg = n, 0
            held_ms = self.hold.take_ms()  # the sending's own time counts for the next window
            if m.overlap:
                snap.held_ms = held_ms
            relay = self.relay
            if relay is None or relay.down or not relay.submit(snap):  # the node's relay answers for it, or directly
                self.send(snap)
        if m.barrier:
            self.awaiting_update = True
            self.wait_until(lambda: not self.awaiting_update)

    def _on_node_group(self, m: NodeGroup) -> None:
        """``cluster.node_reduce``: open this rank's end of its node's relay (the leader binds it, a member connects,
        bounded). Sent once; a rank that cannot open it (or is told nothing) answers the coordinator directly."""
        if self.relay is not None or self._open_relay is None:
            if self.relay is not None:
                log.warning("rank %d: a second node group (leader %d) ignored", self.rank, m.leader)
            return
        with self.doing("wait"):
            self.relay = self._open_relay(m, self.gamma)

    def _on_node_update(self, m: NodeUpdate) -> None:
        """This node's consensus (the rank leads it): the relay hands each member its update and answers the drift;
        the leader adopts its own."""
        relay = self.relay
        if not isinstance(relay, LeaderRelay):
            log.warning("rank %d: a node update for reduce %d but this rank leads no node relay: ignored", self.rank,
                        m.version)
            return
        with self.hold.holding() if self.sent is not None else contextlib.nullcontext():  # the node's hand-on
            own = relay.on_node_update(m)
        if own is not None:
            self._on_update(own)

    def _on_node_drop(self, m: NodeDrop) -> None:
        """A rank of this node was declared dead: a leader stops waiting for it; a member whose leader it was
        answers the coordinator directly."""
        relay = self.relay
        if isinstance(relay, LeaderRelay):
            relay.drop(m.rank)
        elif isinstance(relay, MemberRelay) and relay.leader == m.rank:
            relay.leader_gone()

    def _await_correction(self) -> None:
        """``mode.overlap``: wait for the update of the reduce this rank answered (it is on its way: the coordinator
        sends it, or its node leader hands it on), so a second reduce or a bundle never finds one in flight."""
        if self.sent is not None:
            self.wait_until(lambda: self.sent is None, held=True)

    def _on_update(self, m: Update) -> None:
        if m.version is not None and self.adopted_version is not None and m.version <= self.adopted_version:
            return  # a second copy of the update adopted (its node leader died after handing on the first)
        sent, self.sent = self.sent, None
        if sent is not None and sent.version != m.version:
            log.warning("rank %d: the update of reduce %s came for the snapshot of reduce %d: adopted in full",
                        self.rank, m.version, sent.version)
            sent = None
        if not m.skip:
            with self.hold.holding() if sent is not None else contextlib.nullcontext():  # an overlapped one's cost
                if sent is not None and self.trainer.steps_since_avg > 0:
                    self.cpu.adopt_correction(self.trainer.model, m, m.alpha, sent.params, sent.buffers)
                else:  # nothing trained since the snapshot: W + (avg - W) would leave the replicas apart in the last bit
                    self.cpu.adopt_update(self.trainer.model, m, m.alpha)
            self.last_consensus = dict(m.tensors)
            if self._resets_inner:
                self.trainer.reset_optimizer_state()
        if sent is None:
            self.trainer.steps_since_avg = 0  # adoption resets the window (algorithms.md 3.9): no residual carries over
        if m.version is not None:
            self.adopted_version = m.version
        self.awaiting_update = False
        self.throttled = False
        if m.next_plan is not None:
            try:
                plan = [int(x) for x in m.next_plan]
            except (TypeError, ValueError):
                plan = []
            if len(plan) != 4 or min(plan) < 0:
                log.warning("rank %d: malformed next_plan %r in an update: ignored", self.rank, m.next_plan)
            else:
                self.plans.append(StartEpoch(epoch=plan[0], offset=plan[1], size=plan[2], chunk=plan[3]))

    def _on_global_step(self, m: SetGlobalStep) -> None:
        self.trainer.global_step = m.global_step
        self.trainer.steps_in_flight = 0  # the finished reduce's steps are in the global step now

    def _on_throttle(self, m: Throttle) -> None:
        if not self.throttled:
            self.throttled = True
            self.wait_until(lambda: not self.throttled)

    def _on_stage_advisory(self, m: StageAdvisory) -> None:
        """The picks this rank is likely to get next: its data plane retains their samples while idle."""
        from flodl_exp.partition import epoch_permutation

        total = self.trainer.total_picks
        if total <= 0:
            return
        perms: dict[int, Any] = {}
        parts = []
        for seg in m.segments:
            if not (isinstance(seg, list) and len(seg) == 3 and all(isinstance(x, int) and x >= 0 for x in seg)):
                log.warning("rank %d: malformed stage advisory segment %r: ignored", self.rank, seg)
                continue
            e, off, size = seg
            if e not in perms:
                perms[e] = epoch_permutation(self.trainer.seed, e, total)
            parts.append(perms[e][off:min(off + size, total)])
        if parts:
            self.trainer.data_pipeline().stage(np.concatenate(parts))

    def _on_shutdown(self, m: Shutdown) -> None:
        self.stopping = True

    def _on_evict(self, m: Evict) -> None:
        raise Evicted(m.reason)

    # -- handlers: callbacks --------------------------------------------------------
    def _on_epoch_role(self, m: SetEpochRole) -> None:
        self.epoch_role, self.epoch_role_from = m.rank, m.from_epoch

    def _on_epoch_aggregated(self, m: EpochAggregated) -> None:
        self.last_epoch_metrics = {str(k): float(v) for k, v in m.metrics.items() if isinstance(v, (int, float))}
        self.last_metrics_epoch = m.epoch

    def _on_eval_broadcast(self, m: EvalBroadcast) -> None:
        self.evals.append(m)

    def _maybe_epoch_fn(self, epoch: int) -> None:
        """The epoch-role rank runs ``experiment.epoch_fn`` once per epoch, before training it (algorithms.md
        3.15); a failing hook is reported, never fatal. Its time counts as callback time, not data wait."""
        fn = self.trainer.exp.epoch_fn
        if fn is None or self.epoch_role != self.rank or epoch < self.epoch_role_from or epoch in self.epoch_fn_done:
            return
        self.epoch_fn_done.add(epoch)
        err: Optional[str] = None
        metrics: dict[str, float] = {}
        t0 = time.perf_counter()
        try:
            with self.doing("callback"):
                out = fn(epoch, self.trainer.model, dict(self.last_epoch_metrics))
            for k, v in (out or {}).items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    metrics[str(k)] = float(v)
        except Exception as e:  # a broken hook must not kill training
            err = f"{type(e).__name__}: {e}"
        elapsed_ms = (time.perf_counter() - t0) * 1e3
        self.callback_ms += elapsed_ms
        self.send(EpochFnResult(epoch=epoch, elapsed_ms=elapsed_ms, metrics=metrics, error=err))

    def _on_eval(self, m: ExecuteEval) -> None:
        err: Optional[str] = None
        t0 = time.perf_counter()
        try:
            with self.doing("eval"):
                res = self.trainer.evaluate()
        except Exception as e:  # a broken eval must not kill training
            res, err = {}, f"{type(e).__name__}: {e}"
        elapsed_ms = (time.perf_counter() - t0) * 1e3
        self.callback_ms += elapsed_ms
        self.send(EvalResult(epoch=m.epoch, metrics=res, error=err, final=m.final, elapsed_ms=elapsed_ms))

    def _save(self, m: Save) -> None:
        """Write this rank's bundle pieces atomically (temp file + rename)."""
        from flodl_exp.checkpoint import save_rank_pieces

        if m.consensus and self.sent is not None and (m.reduces is None or self.sent.version < m.reduces):
            # the bundle holds the consensus of the last reduce finished, whose update is on its way; not one still in
            # flight (a stalled reduce's ShutdownWithSave: the last consensus adopted is what the bundle's meta says)
            self._await_correction()
        if self.armed_fault is not None:
            self.send_held_reports()
        fire_armed(self.armed_fault, "killsave", self.rank)
        err = None
        try:
            with self.doing("save"):
                state = None
                if m.model and m.consensus and self.last_consensus:
                    state = consensus_state(self.trainer.model, self.last_consensus)
                save_rank_pieces(m.stem, self.trainer.model, self.trainer.optimizer, rank=self.rank,
                                 primary=m.primary, write_model=m.model, model_state=state,
                                 outer_state=self.outer.state_dict() if self.outer is not None else None)
        except Exception as e:  # save errors are reported, never fatal
            err = f"{type(e).__name__}: {e}"
        self.send(SaveResult(stem=m.stem, error=err))

    def _on_checkpoint(self, m: Checkpoint) -> None:
        """Run ``experiment.checkpoint_fn(version, model)`` (algorithms.md 8.3), right after this rank wrote the
        bundle's model piece, on the same state: the cpu backend's consensus frame on a copy of the model (the
        training replica is never handed out there), else the replica. An error (or no function configured) is
        reported, never fatal: the coordinator tries another rank. Its time counts as callback time."""
        fn = getattr(self.trainer.exp, "checkpoint_fn", None)
        err: Optional[str] = None
        t0 = time.perf_counter()
        try:
            if fn is None:
                raise RuntimeError("no experiment.checkpoint_fn is configured on this rank")
            with self.doing("callback"):
                model = self.trainer.model
                if m.consensus and self.last_consensus:
                    import copy

                    model = copy.deepcopy(model)
                    model.load_state_dict(consensus_state(model, self.last_consensus))
                fn(m.version, model)
        except Exception as e:  # a broken export must not kill training
            err = f"{type(e).__name__}: {e}"
        elapsed_ms = (time.perf_counter() - t0) * 1e3
        self.callback_ms += elapsed_ms
        self.send(CheckpointResult(version=m.version, elapsed_ms=elapsed_ms, error=err))

    def _on_probe(self, m: Probe) -> None:
        """``mode.auto``: time a few training steps before the first chunk (RankTrainer.probe: nothing is kept)."""
        err: Optional[str] = None
        step_ms: list[float] = []
        data_ms: list[float] = []
        try:
            with self.doing("train"):
                step_ms, data_ms = self.trainer.probe(m.steps)
        except Exception as e:  # the coordinator falls back to the configured mode
            err = f"{type(e).__name__}: {e}"
        self.send(ProbeResult(step_ms=step_ms, data_ms=data_ms, model_bytes=snapshot_nbytes(self.trainer.model),
                              error=err))

    # -- handlers: the collective (nccl modes) ------------------------------------------
    def _on_request_session(self, m: RequestSession) -> None:
        """This rank is the regroup's generator: a fresh session id names the new group (on NCCL, the
        unique id would travel here)."""
        import secrets

        self.send(SessionReady(generation=m.generation, session=secrets.token_hex(8)))

    def _form_group(self, m: FormGroup) -> None:
        """Join the cohort's process group on the backend the coordinator chose for every rank."""
        if self.collective is not None:
            return
        if self._join_group is None:
            raise RuntimeError(f"rank {self.rank} was told to form a {m.backend} group but has no way to join one")
        with self.doing("collective"):
            self.collective = self._join_group(m, self._poll_during_collective)
            self.collective.prepare(self.trainer.model)  # the sync's buffers, before the first chunk sizes the pool
        if self.rank == 0:
            log.info("collective backend: %s (%s)", m.backend, m.reason)

    def _poll_during_collective(self) -> None:
        """Between checks of a pending collective: read control. A regroup or a shutdown ends the wait
        (the group is aborted and the retry path takes over); anything else waits its turn."""
        while True:
            msg = self.inbox.read(block=False, stopping=self.stopping)
            if msg is None:
                return
            if isinstance(msg, Regroup):
                self.pending_regroup = msg
                raise CollectiveInterrupted(f"regroup to generation {msg.generation} arrived mid-collective")
            if isinstance(msg, Shutdown):
                self.handle(msg)
                raise CollectiveInterrupted("shutdown arrived mid-collective")
            if isinstance(msg, (CoordHeartbeat, SetGlobalStep, RequestSession)):
                self.handle(msg)  # a session id for the next regroup: asked while this rank waits on the last one
            else:
                self.inbox.defer(msg)

    def _on_regroup(self, m: Regroup) -> None:
        ov = self.overlapped
        if ov is not None and self.collective is not None and self.collective.overlapped_done():
            # The overlapped all-reduce ended before the regroup came: landed first if it summed (its consensus holds
            # every member), else its failure's recovery forms this regroup and sends it again.
            self.pending_regroup = m
            self._land_overlapped(block=False)
            pending, self.pending_regroup = self.pending_regroup, None
            if pending is None:
                return
        try:
            formed = self._regroup(m)
        except Exception as e:  # a member vanished while the group formed: wait for the coordinator's next regroup
            if self.collective is None:
                raise
            if self.overlapped is not None:
                formed = self._recover_overlapped(e, 0)
            else:  # (it used to end the rank, though it had done nothing wrong: _await_regroup tolerates the same)
                self.collective.abort()
                log.warning("rank %d: regroup to generation %d failed: %s; waiting for the next", self.rank,
                            m.generation, str(e).splitlines()[0] if str(e) else type(e).__name__)
                formed = self._await_regroup()
        if formed and self.overlapped is not None:
            # The all-reduce in flight went with the old group: every survivor sends it again in the new one.
            self.overlapped.relaunch = True
            self._land_overlapped(block=False)

    def _regroup(self, m: Regroup) -> bool:
        """Re-form the process group with the survivors (fresh store prefix, renumbered ranks). True once formed.

        A later regroup arriving while this one waits for its members (a node loss: two deaths a little apart)
        ends that wait and is formed instead; a shutdown ends it for good (False). Before, that interrupt
        escaped the handler when the regroup came to an idle rank, and ended the rank (two-node SLURM test)."""
        if self.collective is None:
            return False
        msg: Optional[Regroup] = m
        for _ in range(32):  # bounded: each pass is a newer generation
            if msg is None or self.stopping:
                return False
            try:
                with self.doing("collective"):  # forming a group waits on every member
                    self.collective.rebuild(msg.generation, msg.new_rank, msg.world_size, msg.session)
                    self._resync_outer()
            except CollectiveInterrupted as e:
                log.warning("rank %d: regroup to generation %d interrupted: %s", self.rank, msg.generation, e)
                msg, self.pending_regroup = self.pending_regroup, None
                continue
            log.info("rank %d: regrouped as %d/%d (generation %d)", self.rank, msg.new_rank, msg.world_size,
                     msg.generation)
            return True
        return False

    def _resync_outer(self) -> None:
        """Every member of a new group takes the outer optimizer's state of the group's rank 0 (one broadcast). A
        collective that failed on some ranks and not others leaves the survivors' replicated states apart (some
        stepped, some restored), and nothing else would ever bring them back together."""
        if self.outer is None or self.collective is None:
            return
        state = self.outer.state_buffer
        if state is None:  # allocated at start-up; a model without parameters has nothing to agree on
            if isinstance(self.outer, UserOuter):  # a user's state has no flat buffer to broadcast: every member
                self.outer.forget()               # restarts it together rather than keep states that may differ
            return
        root = self.collective.rank == 0  # the sender's state is only read: kept whatever happens
        try:
            self.collective.broadcast_(state, src=0)
        except CollectiveInterrupted:
            if not root:
                self.outer.forget()  # a newer regroup re-syncs it; meanwhile nothing half-received is kept
            raise
        except Exception as e:  # a member died meanwhile: the next collective fails and regroups (and re-syncs) again
            if not root:
                self.outer.forget()
            self.collective.abort()
            log.warning("rank %d: re-syncing the outer optimizer after the regroup failed: %s (its momentum restarts "
                        "unless the next regroup brings rank 0's)", self.rank, str(e).splitlines()[0] if str(e) else e)
            return
        self.outer.state_changed()

    def _await_regroup(self, deadline_s: float = 60.0) -> bool:
        """After a failed collective: wait for the coordinator's regroup. Only new frames are read; other work
        is deferred (what was deferred before stays behind it)."""
        end = time.monotonic() + deadline_s
        while not self.stopping and time.monotonic() < end:
            msg: Optional[Payload] = self.pending_regroup
            self.pending_regroup = None
            if msg is None:
                msg = self.inbox.read(block=True, stopping=self.stopping)
            if msg is None:
                continue
            if isinstance(msg, Regroup):
                try:
                    if self._regroup(msg):
                        return True
                    continue
                except Exception as e:  # a member vanished during init: wait for the next generation
                    log.warning("rank %d: regroup failed: %s", self.rank, e)
                    continue
            if isinstance(msg, (Shutdown, Save, CoordHeartbeat, SetGlobalStep, RequestSession)):
                self.handle(msg)
            else:
                self.inbox.defer(msg)
        return False

    def _sync_collective(self, m: SyncNow) -> None:
        with self.doing("collective"):
            self._sync_collective_now(m)

    def _start_overlapped(self, m: SyncNow) -> None:
        """``mode.overlap``: launch this reduce's all-reduce and train on; :meth:`_land_overlapped` applies it and acks.
        The steps from here are the next window's (the LR's position counts the sent ones until SetGlobalStep)."""
        coll = self.collective
        assert coll is not None
        failed: Optional[Exception] = None
        with self.hold.holding():  # the launch (the regroup after a failed one is not averaging's, as a landing's)
            self.send_held_reports()
            fire_armed(self.armed_fault, "killsync", self.rank)
            tr = self.trainer
            n = tr.steps_since_avg
            self.overlapped = ov = OverlappedSync(m.version, n, m.divergence)
            tr.steps_in_flight, tr.steps_since_avg = n, 0
            try:
                coll.start_overlapped(tr.model, n, self.gamma)
            except Exception as e:  # the launch itself failed (a peer gone): recovered as a landing is
                failed = e
        if failed is not None and self._recover_overlapped(failed, 0):
            ov.relaunch = True
        self._land_overlapped(block=False)

    def _land_overlapped(self, block: bool, held: bool = True) -> None:
        """The overlapped all-reduce, once it finished (or waiting for it, ``block``): the consensus into the replica
        as the correction ``W += G - W_sent`` (``G``: after the outer step), then the ack. A failed one is sent again
        in the group the coordinator forms from the survivors, as a failed sync is redone. The correction is time
        averaging held the rank, and so is the landing (a wait for it included) when ``held`` (False: a wait that is
        not for this reduce, a barrier or a throttle); the ack carries what this reduce held the rank (``held_ms``)."""
        ov, coll = self.overlapped, self.collective
        if ov is None or coll is None:
            return
        tr = self.trainer
        for attempt in range(32):  # bounded: each retry follows a regroup to a newer generation
            try:
                if ov.relaunch:
                    ov.relaunch = False
                    coll.relaunch_overlapped()
                if not block and not coll.overlapped_done():
                    if not coll.overlapped_overdue():
                        return
                    raise CollectiveTimeout(f"an overlapped all-reduce waited {coll.op_timeout_s:.0f}s for its peers "
                                            "(cluster.collective_timeout_s)")
                with self.doing("collective"), self.hold.holding() if held else contextlib.nullcontext():
                    d, post, pre = coll.land_overlapped(tr.model, ov.divergence, keep_current=tr.steps_since_avg > 0)
                break
            except LockstepMisaligned:
                raise
            except Exception as e:  # a peer died mid-collective, or a regroup or shutdown came
                if not self._recover_overlapped(e, attempt):
                    return
                ov.relaunch = True
        else:
            raise RuntimeError(f"the overlapped all-reduce of reduce {ov.version} failed 32 times")
        self.overlapped = None
        with self.hold.holding():
            step = self._outer_step()
            coll.apply_correction(tr.model)
        tr.step_count += 1
        self.synced = ov.version + 1
        self.send(SyncAck(n=ov.n, d=d, post=post, pre=pre, outer_step=step.step_norm if step else None,
                          outer_momentum=step.momentum_norm if step else None, generation=coll.generation,
                          version=ov.version, left=self._steps_left(), held_ms=self.hold.take_ms()))

    def _recover_overlapped(self, e: BaseException, attempt: int) -> bool:
        """After the overlapped all-reduce failed: tear the group down and wait for the regroup (True: formed, send it
        again). The replica is not restored: it trained on, and what it sent is still in the sync's buffer."""
        coll = self.collective
        assert coll is not None
        coll.abort()
        if isinstance(e, torch.OutOfMemoryError):
            raise RuntimeError("out of GPU memory during the overlapped sync (it needs about 4x the parameter bytes "
                               "free beside training; lower data_plane.vram_max_usage or the batch size, or set "
                               "mode.overlap=false)") from e
        log.warning("rank %d: overlapped collective failed (attempt %d): %s", self.rank, attempt + 1,
                    str(e).splitlines()[0] if str(e) else type(e).__name__)
        if self._await_regroup() and not self.stopping:
            return True
        self.overlapped = None
        if not self.stopping:
            raise RuntimeError("the overlapped collective failed and no regroup arrived") from e
        return False

    def _sync_collective_now(self, m: SyncNow) -> None:
        self._land_overlapped(block=True)  # at most one reduce in flight: the last one's consensus first
        if m.overlap and self.collective is not None and not self.stopping:
            self._start_overlapped(m)
            return
        self.send_held_reports()
        fire_armed(self.armed_fault, "killsync", self.rank)
        with_div = m.divergence
        n = self.trainer.steps_since_avg
        d: Optional[float] = 0.0
        post: Optional[float] = None
        pre: Optional[float] = None
        lockstep = m.version < self.lockstep_until
        if self.collective is not None:
            model = self.trainer.model
            for attempt in range(32):
                try:
                    d, post, pre = self.collective.sync(model, n, self.gamma, with_div,
                                                        lockstep_version=m.version if lockstep else None)
                    break
                except LockstepMisaligned:
                    raise  # some members paced, some in lockstep: no retry can pair them again
                except torch.OutOfMemoryError as e:  # this rank's fault, not a dead peer's: say so and end
                    self.collective.abort()
                    raise RuntimeError("out of GPU memory during the sync (it needs about 3x the parameter bytes "
                                       "free beside training; lower data_plane.vram_max_usage or the batch size)") from e
                except Exception as e:  # a peer died mid-collective (or a regroup arrived): restore, regroup, retry
                    self.collective.abort()
                    self.collective.restore(model)  # the replica as the sync found it (kept in the sync's buffer)
                    log.warning("rank %d: collective failed (attempt %d): %s", self.rank, attempt + 1, str(e).splitlines()[0])
                    if not self._await_regroup() or self.stopping:
                        if not self.stopping:
                            raise RuntimeError("collective failed and no regroup arrived") from e
                        return
        step = self._outer_step()
        self.trainer.steps_since_avg = 0
        self.trainer.step_count += 1
        self.synced = m.version + 1
        gen = self.collective.generation if self.collective is not None else 0
        self.send(SyncAck(n=n, d=d, post=post, pre=pre, outer_step=step.step_norm if step else None,
                          outer_momentum=step.momentum_norm if step else None, generation=gen,
                          version=m.version, left=self._steps_left()))
        top = self.collective.realigned_to if self.collective is not None and lockstep else None
        if top is not None and top > m.version:
            # A peer was further (it had completed reduces this rank redid after a regroup): this all-reduce averaged
            # them together; the reduces this rank skips are answered with nothing, so every member counts from the
            # same version on.
            log.warning("rank %d: lockstep reduce %d met a peer at %d after a regroup: re-aligned", self.rank,
                        m.version, top)
            for v in range(m.version + 1, top + 1):
                self.send(SyncAck(n=0, d=0.0, generation=gen, version=v, left=self._steps_left()))
            self.synced = top + 1

    def _steps_left(self) -> int:
        """Steps the running chunk has left (0 between chunks): how far the coordinator may extend a Lockstep."""
        st = self.chunk
        if st is None:
            return 0
        bs = int(getattr(self.trainer, "batch_size", 0) or 0)
        return max(0, (len(st.picks) - st.cursor) // bs) if bs > 0 else 0

    def _outer_step(self) -> Optional[OuterStep]:
        """nccl: the outer optimizer on the all-reduced parameters, after the divergence read-out. Every
        rank holds the same consensus and the same state, so every rank computes the same global. None when the
        sync averaged nothing (nobody moved: no step), for outer=avg, and for the seeding window."""
        if self.outer is None or self.collective is None or not self.collective.reduced:
            return None
        params = list(self.trainer.model.parameters())
        try:
            step = self.outer.apply(params, workspace=self.collective.workspace)
        except torch.OutOfMemoryError as e:
            raise RuntimeError("out of GPU memory in the outer optimizer step (it keeps the last global and the "
                               "momentum on the device, 2x the parameter bytes; lower data_plane.vram_max_usage "
                               "or use outer=avg)") from e
        if self._resets_inner:
            self.trainer.reset_optimizer_state()
        return None if step is None or step.seeded else step
