"""The rank process: dial the coordinator, then run the managed loop.

    wait for plan -> begin_epoch -> (next_batch -> train_step -> after_step)* -> end_epoch

Control messages arrive on a reader thread and are handled between batches
(never while a collective could deadlock): start_epoch, extend_partition,
sync_now, request_params, update, set_global_step, throttle, execute_eval,
save, shutdown. The rank is mode-agnostic: policies live in the coordinator.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Optional

import numpy as np
import torch

from .. import wire
from ..averaging import consensus_state, float_buffers
from ..config import RunShape, load_config
from ..constants import FAULT_ENV, LOST_GRACE_S
from ..experiment import build_experiment
from ..outer import OuterOptimizer, OuterSpec, OuterStep
from ..protocol import Batch as BatchReport
from ..protocol import (
    CoordHeartbeat,
    EpochAggregated,
    EpochFnResult,
    EvalResult,
    Evict,
    ExecuteEval,
    Exiting,
    ExtendPartition,
    FormGroup,
    Heartbeat,
    LoopNotice,
    Payload,
    ProtocolError,
    RankError,
    Regroup,
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
    decode,
    encode,
)
from ..store_names import pin_gloo_to_loopback
from ..wire import Message
from .backends import CollectiveBackend, CollectiveInterrupted, CoordinatorBackend, snapshot_nbytes
from .fault_inject import ARMED_KINDS, fire_armed, inject_fault, parse_fault
from .trainer import Batch as BatchData
from .trainer import EpochState, PendingStep, RankTrainer

log = logging.getLogger("flodl_exp.rank")

HEARTBEAT_S = 1.0
EVICT_GRACE_S = 5.0
"""After an Evict, the main thread has this long to end the process before the reader thread does."""
EVICTED_EXIT = 75
COORDINATOR_LOST_EXIT = 76


class CoordinatorLost(RuntimeError):
    """The coordinator closed the connection or went silent past the deadline."""


class Evicted(RuntimeError):
    """The coordinator declared this rank dead (its main thread made no progress)."""


def pick_device(device: str, local_rank: int) -> torch.device:
    """``cuda:<local_rank mod visible GPUs>`` (ranks beyond the GPU count share; the coordinator then
    averages through Gloo, control/devices.py), else the CPU."""
    if device == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.device(f"cuda:{local_rank % torch.cuda.device_count()}")
    if device == "cuda":
        raise RuntimeError("cluster.device=cuda but this rank sees no CUDA device")
    return torch.device("cpu")


def requested_device(cluster: Any) -> tuple[str, Optional[str]]:
    """``cluster.device`` as this rank should read it, and a note to log when it was narrowed.

    On SLURM with ``gpus_per_node=0`` the job holds no GPU; a node without device cgroups still
    shows its GPUs, and ``auto`` would train on GPUs another job was given. Train on CPU, and say so.
    """
    if cluster.executor == "slurm" and cluster.device == "auto" and int(cluster.slurm.gpus_per_node) == 0:
        return "cpu", ("cluster.slurm.gpus_per_node=0 with cluster.device=auto: the job holds no GPU, so the ranks "
                       "train on CPU (set cluster.slurm.gpus_per_node to train on GPUs)")
    return str(cluster.device), None


def use_device(device: torch.device) -> None:
    """Make ``device`` the current CUDA device of this process (the main thread), so CUDA calls
    without an explicit device in user code land on the rank's GPU, not GPU 0."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def device_uuid(device: torch.device) -> Optional[str]:
    """The physical device's UUID (one GPU or MIG slice, whatever CUDA_VISIBLE_DEVICES renumbered), None on CPU."""
    if device.type != "cuda":
        return None
    try:
        return str(torch.cuda.get_device_properties(device).uuid)
    except Exception:  # an old driver without UUIDs: the coordinator falls back to host + device name
        return None


def cuda_device_score(device: torch.device) -> Optional[float]:
    """The spec prior's score of this rank's GPU (control/devices.device_score); None on CPU or a failed query."""
    if device.type != "cuda":
        return None
    try:
        from ..control.devices import device_score

        props = torch.cuda.get_device_properties(device)
        return device_score(props.major, props.total_memory)
    except Exception:
        return None


def state_hash(model: torch.nn.Module) -> str:
    """sha256 over parameters and float buffers: equal hashes = identical replicas."""
    h = hashlib.sha256()
    with torch.no_grad():
        for t in list(model.parameters()) + float_buffers(model):
            h.update(t.detach().to("cpu").float().contiguous().numpy().tobytes())
    return h.hexdigest()


class RankWorker:
    state: str = "wait"
    """What the main thread is doing, for the heartbeat: train | collective | eval | save | wait."""
    outer_spec = OuterSpec()
    """The run's outer optimizer (class default: avg, for workers built without __init__ in tests)."""
    outer: Optional[OuterOptimizer] = None
    """nccl backend: the outer optimizer, replicated on every rank (cpu: it runs at the coordinator)."""
    callback_ms = 0.0
    """Time spent in callbacks (evals, the epoch hook) so far: kept out of the data wait a batch reports."""
    epoch_role: Optional[int] = None
    """The rank that runs ``experiment.epoch_fn`` (SetEpochRole) ..."""
    epoch_role_from = 0
    """... from this epoch on."""

    armed_fault: Optional[str] = None
    """An injected fault that fires at the next averaging or save (fault_inject.ARMED_KINDS); set per instance."""
    resume_stem: Optional[str] = None
    """The resume bundle whose optimizer state is not loaded yet: loaded as training starts (:meth:`run`, or the
    cooperative ``w.epochs()``, after ``w.setup`` registered the loop's optimizers)."""
    loop_watch: Optional[Callable[[], Optional[LoopNotice]]] = None
    """The cooperative tier: asked every heartbeat whether the user's loop holds a batch too long."""

    def __init__(self, spec: dict[str, Any], rank: int, local_rank: int,
                 rendezvous: dict[str, Any] | Callable[[], dict[str, Any]], owns_process: bool = True) -> None:
        """``rendezvous``: the coordinator's address, or a wait for it, called once the replica, its optimizer
        and its data set are built (their imports and set-up, seconds, overlap the coordinator's start-up).
        ``owns_process``: the rank is its process's only job, so a stuck main thread may be ended by
        exiting (task 0 trains rank 0 on a thread beside the coordinator's keeper, which decides instead)."""
        cfg = load_config(spec["config"])
        self.owns_process = owns_process
        self.ended = threading.Event()
        """Set once run() has cleaned up: the reader thread's watchdogs wait on it."""
        self.cfg = cfg
        self.spec = spec
        self.rank = rank
        shape = RunShape.of(cfg)
        self.world_size = shape.world_size
        self.outer_spec = shape.outer
        self.outer = (
            OuterOptimizer(shape.outer) if cfg.mode.backend == "nccl" and shape.outer.stateful else None)
        wanted, note = requested_device(cfg.cluster)
        if note and rank == 0:
            log.info("%s", note)
        self.device = pick_device(wanted, local_rank)
        use_device(self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(1)
        speeds = cfg.cluster.rank_speeds or [1.0] * self.world_size
        augment = max(1, cfg.data_plane.augment)
        exp = build_experiment(cfg.experiment, world_size=self.world_size, device=self.device, seed=cfg.seed, augment=augment)
        self.trainer = RankTrainer(
            exp, device=self.device, world_size=self.world_size, seed=int(spec.get("shuffle_seed", cfg.seed)),
            augment=augment, batch_size=cfg.experiment.batch_size, speed=float(speeds[rank]),
            lr_scale_ratio=cfg.mode.lr_scale_ratio, max_grad_norm=cfg.mode.max_grad_norm,
        )
        self.gamma = cfg.mode.gamma
        self.coord_timeout = cfg.cluster.heartbeat_timeout_s
        inputs = self._describe_inputs(cfg, exp) if rank == 0 else []
        if callable(rendezvous):
            rendezvous = rendezvous()
        self.conn = wire.dial(rendezvous["host"], int(rendezvous["port"]), timeout=cfg.cluster.rendezvous_timeout_s)
        model_bytes = snapshot_nbytes(self.trainer.model)  # the wire's frame ceiling comes from it (both ends)
        self.welcome = wire.client_handshake(
            self.conn, rendezvous["token"],
            {"rank": rank, "host": os.uname().nodename, "pid": os.getpid(), "device": str(self.device),
             "device_uuid": device_uuid(self.device), "device_score": cuda_device_score(self.device), "model_bytes": model_bytes, "samples": len(exp.train_data),
             "inputs": inputs},
            timeout=cfg.cluster.rendezvous_timeout_s,
        )
        self.conn.max_frame_bytes = wire.frame_ceiling(model_bytes)
        self.rendezvous = rendezvous
        self.collective: Optional[CollectiveBackend] = None
        """nccl modes: formed when the coordinator's FormGroup names the cohort's backend."""
        self.pending_regroup: Optional[Regroup] = None
        """A regroup that ended a pending collective's wait (handled by the retry that follows)."""
        self.cpu = CoordinatorBackend(bf16_wire=cfg.mode.bf16_wire)
        self.inbox: queue.Queue[Message | BaseException] = queue.Queue()
        self.plans: deque[StartEpoch] = deque()
        self.stopping = False
        self.throttled = False
        self.awaiting_update = False
        self.last_coord = time.monotonic()
        self.chunk: Optional[EpochState] = None
        fault = parse_fault(os.environ.get(FAULT_ENV), rank)
        self.fault = fault if fault is not None and fault[0] >= 0 else None  # "connect" faults fire in the task
        self.deferred: deque[Payload] = deque()
        self.in_regroup_wait = False
        self.chunk_extra: list[int] = []
        self.unreported: deque[tuple[PendingStep, float, int, float]] = deque()
        """Trained steps not yet reported (step, data wait ms, chunk, lr): see report_batches."""
        self.epoch_fn_done: set[int] = set()
        self.last_epoch_metrics: dict[str, float] = {}
        """The latest EpochAggregated metrics (handed to experiment.epoch_fn)."""
        self.last_consensus: dict[str, torch.Tensor] = {}
        """cpu backend: the last consensus frame adopted (bundles save it, not the blended replica)."""
        self._handlers = self._handler_table()
        self.resume_from(spec)
        threading.Thread(target=self._reader, name="rank-reader", daemon=True).start()
        threading.Thread(target=self._heartbeat, name="rank-heartbeat", daemon=True).start()
        # Data plane (rank/data): prefetch + sample cache; control is drained while waiting on a batch.
        from .data import build_pipeline
        from .data.budget import ranks_sharing_device
        from .telemetry import Telemetry

        sharing = (ranks_sharing_device(cfg.cluster.ranks_per_node, torch.cuda.device_count(), local_rank)
                   if self.device.type == "cuda" else 1)
        self.trainer.attach_pipeline(
            build_pipeline(cfg.data_plane, exp.train_data, device=self.device, batch_size=cfg.experiment.batch_size,
                           augment=augment, seed=self.trainer.seed, ranks_per_node=cfg.cluster.ranks_per_node,
                           rank=rank, ranks_on_device=sharing),
            on_wait=self.drain, should_stop=lambda: self.stopping)
        self.telemetry = Telemetry(self.conn.send, self.device, rank=rank).start()


    @staticmethod
    def _describe_inputs(cfg: Any, exp: Any) -> list[dict[str, Any]]:
        """Rank 0's data sets as MLflow inputs (name, digest, source), for the coordinator to log: computed here,
        from the data sets already built, while the coordinator starts."""
        from ..experiment import _to_container
        from ..model_export import dataset_input

        node = _to_container(cfg.experiment)
        out = []
        try:
            out.append(dataset_input("training", exp.train_data, node.get("train_data")))
            if exp.eval_data is not None:
                out.append(dataset_input("eval", exp.eval_data, node.get("eval_data")))
        except Exception as e:  # a description is a record, never a reason to fail the rank
            log.warning("data sets not described for MLflow: %s", e)
        return out
    def load_resumed_optimizer(self) -> None:
        """The optimizer state of the resume bundle (this rank's piece, else the primary's), once."""
        from ..checkpoint import optim_path

        stem, self.resume_stem = self.resume_stem, None
        if stem is None:
            return
        for path in (optim_path(stem, self.rank, primary=False), optim_path(stem, self.rank, primary=True)):
            if os.path.exists(path):
                self.trainer.optimizer.load_state_dict(torch.load(path, map_location=str(self.device), weights_only=True))
                return
        log.warning("rank %d: the bundle %s holds no optimizer state for this rank: a fresh optimizer", self.rank, stem)

    def resume_from(self, spec: dict[str, Any]) -> None:
        """Load model and optimizer state from the resume bundle (validated by the launcher)."""
        resume = spec.get("resume")
        if not resume:
            return
        from ..checkpoint import load_model_state

        stem = resume["stem"]
        self.trainer.model.load_state_dict(load_model_state(stem, map_location=str(self.device)))
        self.resume_stem = stem  # the optimizer state follows as training starts (load_resumed_optimizer)
        self.trainer.global_step = int(resume["meta"]["global_step"])
        if self.outer is not None:
            from ..checkpoint import load_outer_state

            self.outer.load_state_dict(load_outer_state(stem), device=self.device)
            log.info("rank %d: outer optimizer %s resumed (momentum norm %.6g)", self.rank,
                     self.outer.spec.describe(), self.outer.momentum_norm())

    # -- threads --------------------------------------------------------
    def _reader(self) -> None:
        try:
            while True:
                msg = self.conn.recv()
                self.inbox.put(msg)
                if msg.kind == Evict.KIND.value:
                    log.error("rank %d: evicted by the coordinator: %s", self.rank, msg.fields.get("reason", ""))
                    self._exit_unless_main_ends("the eviction", EVICT_GRACE_S, EVICTED_EXIT, wait_for_end=False)
        except BaseException as e:  # closed or broken: hand the reason to the main loop
            self.inbox.put(e)
            if not self.stopping and self.owns_process:
                self._exit_unless_main_ends("the coordinator's connection broke", LOST_GRACE_S, COORDINATOR_LOST_EXIT)

    def _exit_unless_main_ends(self, what: str, grace_s: float, code: int, wait_for_end: bool = True) -> None:
        """The main thread may be stuck where it reads no control (a hung read, a store connect), so this
        thread ends the process if the run has not ended within the grace. The exit closes the rank's
        collective connections, freeing its peers. An eviction exits even after a clean end (the
        coordinator has written the rank off); a lost connection only if the main thread is still busy."""
        if not wait_for_end:
            time.sleep(grace_s)
        elif self.ended.wait(grace_s):
            return
        log.error("rank %d: the main thread did not stop within %.0fs of %s (state %s): exiting",
                  self.rank, grace_s, what, self.state)
        logging.shutdown()
        os._exit(code)

    def _heartbeat(self) -> None:
        while not self.stopping:
            time.sleep(HEARTBEAT_S)
            try:
                self.conn.send(encode(Heartbeat(steps=self.trainer.step_count, state=self.state)))
                watch = self.loop_watch  # close() may clear it meanwhile
                notice = watch() if watch is not None else None
                if notice is not None:
                    log.error("rank %d: %s", self.rank, notice.message)
                    self.conn.send(encode(notice))
            except Exception:
                return

    @contextlib.contextmanager
    def doing(self, state: str) -> Iterator[None]:
        """The main thread's state for the heartbeat while the block runs (nesting restores the outer one)."""
        outer, self.state = self.state, state
        try:
            yield
        finally:
            self.state = outer

    # -- control --------------------------------------------------------
    def _next(self, block: bool) -> Optional[Payload]:
        if self.deferred and not self.in_regroup_wait:
            return self.deferred.popleft()
        return self._from_inbox(block)

    def _from_inbox(self, block: bool) -> Optional[Payload]:
        try:
            item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            if time.monotonic() - self.last_coord > self.coord_timeout:
                raise CoordinatorLost(f"no word from the coordinator for {self.coord_timeout:.0f}s") from None
            return None
        if isinstance(item, BaseException):
            if self.stopping:
                return None
            raise CoordinatorLost(f"coordinator connection lost: {item}") from item
        self.last_coord = time.monotonic()
        try:
            payload = decode(item)
        except ProtocolError as e:
            log.warning("rank %d: malformed %s from the coordinator dropped: %s", self.rank, item.kind, e)
            return None
        if payload is None:
            log.warning("rank %d: unknown control message %r ignored", self.rank, item.kind)
        return payload

    def report_batches(self, wait: bool) -> None:
        """Send the Batch reports of trained steps: those whose device work finished (no wait), or all
        (``wait``). On CUDA a step's loss and time stay on the device until then, so training never
        waits on the GPU per batch; on CPU every step is ready at once."""
        while self.unreported and (wait or self.unreported[0][0].ready()):
            step, wait_ms, chunk, lr = self.unreported.popleft()
            loss, ms = step.resolve()
            self.conn.send(encode(BatchReport(ms=ms, data_ms=wait_ms, chunk=chunk, loss=loss, lr=lr)))

    def drain(self) -> None:
        """Handle every control message already queued (between batches).

        Every trained step is reported first: a sync ack, a snapshot or a save counts steps, and the
        coordinator's ledger must have seen each of them as a Batch before that."""
        if self.unreported and (self.deferred or not self.inbox.empty()):
            self.report_batches(wait=True)
        while not self.stopping:
            msg = self._next(block=False)
            if msg is None:
                return
            self.handle(msg)

    def _serve_while_gated(self) -> bool:
        """A gated rank reads control as between batches (see fault_inject.wait_gate); True: stopping."""
        self.drain()
        return self.stopping

    def wait_until(self, done: Callable[[], bool]) -> None:
        """Block handling control messages until ``done()`` (throttle, barrier, idle)."""
        with self.doing("wait"):
            while not self.stopping and not done():
                msg = self._next(block=True)
                if msg is not None:
                    self.handle(msg)

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
            StageAdvisory: self._on_stage_advisory,
            Save: self._save, Shutdown: self._on_shutdown, CoordHeartbeat: lambda m: None,
            RequestSession: self._on_request_session, Evict: self._on_evict,
        }

    def _on_extend(self, m: ExtendPartition) -> None:
        """Survivors take over a dead rank's remainder: append it to the running chunk of that
        epoch, or run it as a chunk of its own when none is running."""
        if self.chunk is not None and self.chunk.epoch == m.epoch:
            self.chunk.extend(m.offset, self._picks(m.epoch, m.offset, m.size))
            self.chunk_extra.append(m.chunk)
        else:
            self.plans.append(StartEpoch(epoch=m.epoch, offset=m.offset, size=m.size, chunk=m.chunk))

    def _on_request_params(self, m: RequestParams) -> None:
        fire_armed(self.armed_fault, "killsync", self.rank)
        n = self.trainer.steps_since_avg
        self.conn.send(encode(self.cpu.snapshot(self.trainer.model, n)))
        if m.barrier:
            self.awaiting_update = True
            self.wait_until(lambda: not self.awaiting_update)

    def _on_update(self, m: Update) -> None:
        if not m.skip:
            self.cpu.adopt_update(self.trainer.model, m, m.alpha)
            self.last_consensus = dict(m.tensors)
            if self.outer_spec.resets_inner:
                self.trainer.reset_optimizer_state()
        self.trainer.steps_since_avg = 0  # adoption resets the window (algorithms.md 3.9): no residual carries over
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

    def _on_throttle(self, m: Throttle) -> None:
        if not self.throttled:
            self.throttled = True
            self.wait_until(lambda: not self.throttled)

    def _on_stage_advisory(self, m: StageAdvisory) -> None:
        """The picks this rank is likely to get next: its data plane retains their samples while idle."""
        from ..partition import epoch_permutation

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

    def _on_epoch_role(self, m: SetEpochRole) -> None:
        self.epoch_role, self.epoch_role_from = m.rank, m.from_epoch

    def _on_epoch_aggregated(self, m: EpochAggregated) -> None:
        self.last_epoch_metrics = {str(k): float(v) for k, v in m.metrics.items() if isinstance(v, (int, float))}

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
        self.conn.send(encode(EpochFnResult(epoch=epoch, elapsed_ms=elapsed_ms, metrics=metrics, error=err)))

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
        self.conn.send(encode(EvalResult(epoch=m.epoch, metrics=res, error=err, final=m.final, elapsed_ms=elapsed_ms)))

    def _on_request_session(self, m: RequestSession) -> None:
        """This rank is the regroup's generator: a fresh session id names the new group (on NCCL, the
        unique id would travel here)."""
        import secrets

        self.conn.send(encode(SessionReady(generation=m.generation, session=secrets.token_hex(8))))

    def _on_shutdown(self, m: Shutdown) -> None:
        self.stopping = True

    def _on_evict(self, m: Evict) -> None:
        raise Evicted(m.reason)

    def _picks(self, epoch: int, offset: int, size: int) -> Any:
        from ..partition import make_partition

        return make_partition(offset, size, self.trainer.total_picks, epoch, self.trainer.seed)

    def _form_group(self, m: FormGroup) -> None:
        """Join the cohort's process group on the backend the coordinator chose for every rank."""
        if self.collective is not None:
            return
        c = self.cfg.cluster
        with self.doing("collective"):
            self._join_group(m, c)
        if self.rank == 0:
            log.info("collective backend: %s (%s)", m.backend, m.reason)

    def _join_group(self, m: FormGroup, c: Any) -> None:
        pin_gloo_to_loopback(self.rendezvous["host"])  # local runs: Gloo binds its pairs to the loopback interface
        self.collective = CollectiveBackend(
            host=self.rendezvous["host"], store_port=int(self.rendezvous["store_port"]), rank=self.rank,
            world_size=self.world_size, device=self.device, backend=m.backend, op_timeout_s=c.collective_timeout_s,
            store_timeout_s=c.rendezvous_timeout_s, poll=self._poll_during_collective, token=self.rendezvous["token"])

    def _poll_during_collective(self) -> None:
        """Between checks of a pending collective: read control. A regroup or a shutdown ends the wait
        (the group is aborted and the retry path takes over); anything else waits its turn."""
        while True:
            msg = self._from_inbox(block=False)
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
                self.deferred.append(msg)

    def _on_regroup(self, m: Regroup) -> None:
        self._regroup(m)

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
            except CollectiveInterrupted as e:
                log.warning("rank %d: regroup to generation %d interrupted: %s", self.rank, msg.generation, e)
                msg, self.pending_regroup = self.pending_regroup, None
                continue
            log.info("rank %d: regrouped as %d/%d (generation %d)", self.rank, msg.new_rank, msg.world_size,
                     msg.generation)
            return True
        return False

    def _await_regroup(self, deadline_s: float = 60.0) -> bool:
        """After a failed collective: wait for the coordinator's regroup (other work is deferred)."""
        end = time.monotonic() + deadline_s
        self.in_regroup_wait = True
        try:
            while not self.stopping and time.monotonic() < end:
                msg: Optional[Payload] = self.pending_regroup
                self.pending_regroup = None
                if msg is None:
                    msg = self._next(block=True)
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
                    self.deferred.append(msg)
            return False
        finally:
            self.in_regroup_wait = False

    def _sync_collective(self, m: SyncNow) -> None:
        with self.doing("collective"):
            self._sync_collective_now(m)

    def _sync_collective_now(self, m: SyncNow) -> None:
        fire_armed(self.armed_fault, "killsync", self.rank)
        with_div = m.divergence
        n = self.trainer.steps_since_avg
        d: Optional[float] = 0.0
        post: Optional[float] = None
        pre: Optional[float] = None
        if self.collective is not None:
            model = self.trainer.model
            scratch = [t.detach().clone() for t in list(model.parameters()) + float_buffers(model)]
            for attempt in range(32):
                try:
                    d, post, pre = self.collective.sync(model, n, self.gamma, with_div)
                    break
                except torch.OutOfMemoryError as e:  # this rank's fault, not a dead peer's: say so and end
                    self.collective.abort()
                    raise RuntimeError("out of GPU memory during the sync (it needs about 3x the parameter bytes "
                                       "free beside training; lower data_plane.vram_max_usage or the batch size)") from e
                except Exception as e:  # a peer died mid-collective (or a regroup arrived): restore, regroup, retry
                    self.collective.abort()
                    with torch.no_grad():
                        for t, saved in zip(list(model.parameters()) + float_buffers(model), scratch):
                            t.copy_(saved)
                    log.warning("rank %d: collective failed (attempt %d): %s", self.rank, attempt + 1, str(e).splitlines()[0])
                    if not self._await_regroup() or self.stopping:
                        if not self.stopping:
                            raise RuntimeError("collective failed and no regroup arrived") from e
                        return
        step = self._outer_step()
        self.trainer.steps_since_avg = 0
        self.trainer.step_count += 1
        self.conn.send(encode(SyncAck(n=n, d=d, post=post, pre=pre, outer_step=step.step_norm if step else None,
                                      outer_momentum=step.momentum_norm if step else None,
                                      generation=self.collective.generation if self.collective is not None else 0)))

    def _outer_step(self) -> Optional[OuterStep]:
        """nccl: the outer optimizer on the all-reduced parameters, after the divergence read-out. Every
        rank holds the same consensus and the same state, so every rank computes the same global. None when the
        sync averaged nothing (nobody moved: no step), for outer=avg, and for the seeding window."""
        if self.outer is None or self.collective is None or not self.collective.reduced:
            return None
        params = list(self.trainer.model.parameters())
        try:
            new, step = self.outer.step([p.detach() for p in params])
        except torch.OutOfMemoryError as e:
            raise RuntimeError("out of GPU memory in the outer optimizer step (it keeps the last global and the "
                               "momentum on the device, 2x the parameter bytes, and needs 2x more while stepping; "
                               "lower data_plane.vram_max_usage or use outer=avg)") from e
        with torch.no_grad():
            for p, t in zip(params, new):
                p.copy_(t)
        if self.outer_spec.resets_inner:
            self.trainer.reset_optimizer_state()
        return None if step is None or step.seeded else step

    def _save(self, m: Save) -> None:
        """Write this rank's bundle pieces atomically (temp file + rename)."""
        from ..checkpoint import save_rank_pieces

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
        self.conn.send(encode(SaveResult(stem=m.stem, error=err)))

    # -- the managed loop ---------------------------------------------
    def run_chunk(self, plan: StartEpoch) -> None:
        with self.doing("train"):
            self._run_chunk(plan)

    def _run_chunk(self, plan: StartEpoch) -> None:
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
        self.chunk = None
        self.report_batches(wait=True)
        m = tr.end_epoch(st, plan.chunk)
        m.extra_chunks, self.chunk_extra = self.chunk_extra, []
        self.conn.send(encode(m))

    def book_step(self, batch: BatchData, step: PendingStep, chunk: int) -> None:
        """Count one trained batch of the running chunk: its metrics, its Batch report, the fault hook."""
        tr = self.trainer
        assert self.chunk is not None, "book_step outside a chunk"
        tr.record_step(self.chunk, batch, step)
        self.unreported.append((step, batch.wait_ms, chunk, tr.current_lr()))
        self.report_batches(wait=False)
        if self.fault is not None and tr.step_count >= self.fault[0]:
            self.report_batches(wait=True)
            if self.fault[1] in ARMED_KINDS:
                self.armed_fault = self.fault[1]
                return
            inject_fault(self.fault[1], self.rank, tr.step_count, serve=self._serve_while_gated)

    def run(self) -> dict[str, Any]:
        """The managed tier: train every chunk the coordinator hands out until it says shutdown."""
        try:
            self.load_resumed_optimizer()
            while not self.stopping:
                if self.plans:
                    self.run_chunk(self.plans.popleft())
                    continue
                self.wait_until(lambda: bool(self.plans))
            return self.exit_cleanly()
        except BaseException as e:
            self.report_failure(e)
            raise
        finally:
            self.close()

    def exit_cleanly(self) -> dict[str, Any]:
        """The run ended (Shutdown): the last telemetry, then Exiting with the replica's hash."""
        self.telemetry.close(flush=True)  # the last report goes out before the exit, so it is counted
        final = Exiting(rank=self.rank, pid=os.getpid(), hash=state_hash(self.trainer.model),
                        steps=self.trainer.step_count, global_step=self.trainer.global_step)
        self.conn.send(encode(final))
        return dataclasses.asdict(final)

    def report_failure(self, e: BaseException, loop: bool = False) -> None:
        """Tell the coordinator why this rank fails, before the connection drops (not for a lost coordinator).
        ``loop``: the exception came out of the user's own training loop (the cooperative tier): the run fails."""
        if isinstance(e, CoordinatorLost):
            return
        import traceback

        try:
            self.conn.send(encode(RankError(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:],
                                            loop=loop)))
        except Exception:
            pass

    def close(self) -> None:
        self.stopping = True
        self.telemetry.close()
        self.trainer.close_data()
        if self.collective is not None:
            self.collective.close()
        self.conn.close()
        self.ended.set()
