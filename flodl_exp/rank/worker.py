"""The rank process's I/O shell: build the replica, dial the coordinator, run the threads.

:class:`RankWorker` does what needs a process and a socket: it loads the run's config, picks the device,
builds the experiment and its trainer, dials and handshakes, then hands everything else to
:class:`~flodl_exp.rank.control.RankControl` (the rank's control state and message handlers, and the
managed loop): a reader thread feeds the coordinator's frames to its inbox, a heartbeat thread reports its
state, and :meth:`RankWorker.run` (the managed tier) or ``flodl_exp.worker()`` (the cooperative tier,
rank/cooperative.py) drives it. Leaving is here too: the last telemetry, Exiting with the replica's hash, or
the error that ended the rank, and the watchdogs that end a process whose main thread no longer reads control.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

import torch

from flodl_exp.averaging import float_buffers
from flodl_exp.config import RunShape, load_config
from flodl_exp.constants import FAULT_ENV, LOST_GRACE_S
from flodl_exp.experiment import build_experiment
from flodl_exp.job_spec import JobSpec
from flodl_exp.outer import make_outer
from flodl_exp.protocol import wire
from flodl_exp.protocol.codec import encode
from flodl_exp.protocol.hello import Hello
from flodl_exp.protocol.messages import Evict, Exiting, FormGroup, Heartbeat, LoopNotice, NodeGroup, Payload, RankError
from flodl_exp.rank.backends import CollectiveBackend, CoordinatorBackend, snapshot_nbytes
from flodl_exp.rank.cadence import rank_cadence
from flodl_exp.rank.control import RankControl
from flodl_exp.rank.fault_inject import parse_fault
from flodl_exp.rank.inbox import ControlInbox, CoordinatorLost
from flodl_exp.rank.node_relay import RELAY_TIMEOUT_S, NodeRelay, open_relay
from flodl_exp.rank.report_pacer import BatchReportPacer
from flodl_exp.rank.trainer import RankTrainer
from flodl_exp.store_names import pin_gloo_to_loopback
from flodl_exp.torch_version import check_torch_version

log = logging.getLogger("flodl_exp.rank")

EVICT_GRACE_S = 5.0
"""After an Evict, the main thread has this long to end the process before the reader thread does."""
EVICTED_EXIT = 75
COORDINATOR_LOST_EXIT = 76


def pick_device(device: str, local_rank: int) -> torch.device:
    """``cuda:<local_rank mod usable GPUs>`` (ranks beyond the GPU count share; the coordinator then
    averages through Gloo, devices.py), else the CPU.

    A GPU this torch build has no kernels for (its compute capability is not covered by
    ``torch.cuda.get_arch_list()``: an older card in a mixed box) would kill the rank at its first
    kernel, so it is skipped with a warning naming it, and the ranks share the usable GPUs. With none
    usable, ``cluster.device=cuda`` is refused in one line (the GPUs, their capabilities, the build's
    architectures) and ``auto`` trains on CPU, with a warning saying why."""
    if device == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        from flodl_exp.devices import arch_runs_on

        arch = list(torch.cuda.get_arch_list())
        usable: list[int] = []
        skipped: list[str] = []
        for i in range(torch.cuda.device_count()):
            cap = tuple(torch.cuda.get_device_capability(i)) if arch else (0, 0)  # no list: nothing to judge by
            if not arch or arch_runs_on((int(cap[0]), int(cap[1])), arch):
                usable.append(i)
            else:
                skipped.append(f"cuda:{i} ({torch.cuda.get_device_name(i)}, compute capability {cap[0]}.{cap[1]})")
        why = (f"this torch build ({torch.__version__}) has no kernels for {', '.join(skipped)}: it is built for "
               f"{' '.join(arch) or 'no CUDA architecture'}")
        if usable:
            if skipped:
                log.warning("%s; skipped, the ranks share %s", why, ", ".join(f"cuda:{i}" for i in usable))
            return torch.device(f"cuda:{usable[local_rank % len(usable)]}")
        if device == "cuda":
            raise RuntimeError(f"cluster.device=cuda but {why} (install a torch wheel built for it, or hide it "
                               "with CUDA_VISIBLE_DEVICES)")
        log.warning("cluster.device=auto: %s; training on CPU", why)
        return torch.device("cpu")
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
    """The physical device's UUID (one GPU or MIG slice, whatever CUDA_VISIBLE_DEVICES renumbered), None on CPU.

    A MIG slice's carries NVML's ``MIG-`` prefix (torch reports the bare UUID; the slice shows in the device's
    name, ``... MIG 1g.10gb``, or in its CUDA_VISIBLE_DEVICES entry): the coordinator then averages through
    Gloo, NCCL does not run on MIG (devices.py)."""
    if device.type != "cuda":
        return None
    try:
        props = torch.cuda.get_device_properties(device)
        uuid = str(props.uuid)
    except Exception:  # an old driver without UUIDs: the coordinator falls back to host + device name
        return None
    if not uuid or uuid.upper().startswith(("GPU-", "MIG-")):
        return uuid or None
    entries = [e.strip() for e in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    index = device.index if device.index is not None else torch.cuda.current_device()
    entry = entries[index] if 0 <= index < len(entries) else ""
    mig = " MIG " in f" {getattr(props, 'name', '')} " or entry.upper().startswith("MIG-")
    return f"MIG-{uuid}" if mig else uuid


def cuda_device_score(device: torch.device) -> Optional[float]:
    """The spec prior's score of this rank's GPU (devices.device_score); None on CPU or a failed query."""
    if device.type != "cuda":
        return None
    try:
        from flodl_exp.devices import device_score

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
    """One rank of a run: the replica built, the coordinator dialled, the threads running; see the module docstring.

    ``rendezvous``: the coordinator's address, or a wait for it, called once the replica, its optimizer and its
    data set are built (their imports and set-up, seconds, overlap the coordinator's start-up).
    ``owns_process``: the rank is its process's only job, so a stuck main thread may be ended by exiting
    (task 0 trains rank 0 on a thread beside the coordinator's keeper, which decides instead)."""

    def __init__(self, spec: JobSpec, rank: int, local_rank: int,
                 rendezvous: dict[str, Any] | Callable[[], dict[str, Any]], owns_process: bool = True) -> None:
        too_old = check_torch_version(torch.__version__)
        if too_old:
            raise RuntimeError(too_old)
        cfg = load_config(spec.config)
        self.owns_process = owns_process
        self.ended = threading.Event()
        """Set once run() has cleaned up: the reader thread's watchdogs wait on it."""
        self.cfg = cfg
        self.spec = spec
        self.rank = rank
        shape = RunShape.of(cfg)
        self.world_size = shape.world_size
        outer = make_outer(shape.outer) if shape.mode.is_nccl and shape.outer.stateful else None
        wanted, note = requested_device(cfg.cluster)
        if note and rank == 0:
            log.info("%s", note)
        self.device = pick_device(wanted, local_rank)
        use_device(self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(1)
        speeds = cfg.cluster.rank_speeds or [1.0] * self.world_size
        augment = max(1, cfg.data_plane.augment)
        exp = build_experiment(cfg.experiment, world_size=self.world_size, device=self.device, seed=cfg.seed, augment=augment,
                               rank=rank)  # replicas start equal, then each rank draws its own random stream
        self.trainer = RankTrainer(
            exp, device=self.device, world_size=self.world_size, seed=spec.shuffle_seed,
            augment=augment, batch_size=cfg.experiment.batch_size, speed=float(speeds[rank]),
            lr_scale_ratio=cfg.mode.lr_scale_ratio, max_grad_norm=cfg.mode.max_grad_norm,
        )
        inputs = self._describe_inputs(cfg, exp) if rank == 0 else []
        if callable(rendezvous):
            rendezvous = rendezvous()
        self.conn = wire.dial(rendezvous["host"], int(rendezvous["port"]), timeout=cfg.cluster.rendezvous_timeout_s)
        model_bytes = snapshot_nbytes(self.trainer.model)  # the wire's frame ceiling comes from it (both ends)
        hello = Hello(rank=rank, host=os.uname().nodename, pid=os.getpid(), device=str(self.device),
                      device_uuid=device_uuid(self.device), device_score=cuda_device_score(self.device),
                      model_bytes=model_bytes, samples=len(exp.train_data), inputs=tuple(inputs))
        self.welcome = wire.client_handshake(self.conn, rendezvous["token"], hello.to_dict(),
                                             timeout=cfg.cluster.rendezvous_timeout_s)
        self.conn.max_frame_bytes = wire.frame_ceiling(model_bytes)
        self.rendezvous = rendezvous
        self.loop_watch: Optional[Callable[[], Optional[LoopNotice]]] = None
        """The cooperative tier: asked every heartbeat whether the user's loop holds a batch too long."""
        self.inbox = ControlInbox(cfg.cluster.heartbeat_timeout_s, rank)
        fault = parse_fault(os.environ.get(FAULT_ENV), rank)
        self.cadence = rank_cadence(self.world_size, cfg.cluster.report_coalesce_ms, cfg.cluster.heartbeat_timeout_s)
        if rank == 0 and self.cadence.stretched:
            log.info("%d ranks: %s (the coordinator's frame budget, rank/cadence.py)", self.world_size,
                     self.cadence.describe())
        self.pacer = BatchReportPacer(self._send_now, self.cadence.report_coalesce_s).start()
        self.control = RankControl(
            self.send, self.inbox, self.trainer, rank=rank, world_size=self.world_size, device=self.device,
            gamma=cfg.mode.gamma, outer_spec=shape.outer, outer=outer, cpu=CoordinatorBackend(bf16_wire=cfg.mode.bf16_wire),
            join_group=self._join_group, pace=self.pacer.pace,
            fault=fault if fault is not None and fault[0] >= 0 else None,  # "connect" faults fire in the task
            open_relay=self._open_relay)
        self.control.resume_from(spec.resume)
        threading.Thread(target=self._reader, name="rank-reader", daemon=True).start()
        threading.Thread(target=self._heartbeat, name="rank-heartbeat", daemon=True).start()
        # Data plane (rank/data): prefetch + sample cache; control is drained while waiting on a batch.
        from flodl_exp.rank.data import build_pipeline
        from flodl_exp.rank.data.budget import ranks_sharing_device
        from flodl_exp.rank.telemetry import Telemetry

        sharing = (ranks_sharing_device(cfg.cluster.ranks_per_node, torch.cuda.device_count(), local_rank)
                   if self.device.type == "cuda" else 1)
        control = self.control
        self.trainer.attach_pipeline(
            build_pipeline(cfg.data_plane, exp.train_data, device=self.device, batch_size=cfg.experiment.batch_size,
                           augment=augment, seed=self.trainer.seed, ranks_per_node=cfg.cluster.ranks_per_node,
                           rank=rank, ranks_on_device=sharing),
            on_wait=control.drain, should_stop=lambda: control.stopping)
        self.telemetry = Telemetry(self.conn.send, self.device, rank=rank, report_s=self.cadence.telemetry_s).start()

    @staticmethod
    def _describe_inputs(cfg: Any, exp: Any) -> list[dict[str, Any]]:
        """Rank 0's data sets as MLflow inputs (name, digest, source), for the coordinator to log: computed here,
        from the data sets already built, while the coordinator starts."""
        from flodl_exp.experiment import _to_container
        from flodl_exp.model_export import dataset_input

        node = _to_container(cfg.experiment)
        out = []
        try:
            out.append(dataset_input("training", exp.train_data, node.get("train_data")))
            if exp.eval_data is not None:
                out.append(dataset_input("eval", exp.eval_data, node.get("eval_data")))
        except Exception as e:  # a description is a record, never a reason to fail the rank
            log.warning("data sets not described for MLflow: %s", e)
        return out

    def send(self, payload: Payload) -> None:
        """One payload to the coordinator (the main thread and the heartbeat thread both send), after any Batch
        reports the pacer holds; Batch reports themselves may wait there (rank/report_pacer.py)."""
        self.pacer.send(payload)

    def _send_now(self, payload: Payload) -> None:
        self.conn.send(encode(payload))

    def _join_group(self, m: FormGroup, poll: Callable[[], None]) -> CollectiveBackend:
        """The cohort's process group on the backend ``m`` names, at the coordinator's store (RankControl asks)."""
        c = self.cfg.cluster
        pin_gloo_to_loopback(self.rendezvous["host"])  # local runs: Gloo binds its pairs to the loopback interface
        return CollectiveBackend(
            host=self.rendezvous["host"], store_port=int(self.rendezvous["store_port"]), rank=self.rank,
            world_size=self.world_size, device=self.device, backend=m.backend, op_timeout_s=c.collective_timeout_s,
            store_timeout_s=c.rendezvous_timeout_s, poll=poll, token=self.rendezvous["token"])

    def _open_relay(self, m: NodeGroup, gamma: float) -> Optional[NodeRelay]:
        """``cluster.node_reduce``: this rank's end of its node's relay (rank/node_relay.py), authenticated with the
        job token, framed to the model's ceiling; its frames go to the inbox, as the coordinator's do."""
        return open_relay(m, rank=self.rank, token=self.rendezvous["token"], send=self.send, deliver=self.inbox.put,
                          gamma=gamma, timeout_s=min(float(self.cfg.cluster.rendezvous_timeout_s), RELAY_TIMEOUT_S),
                          max_frame_bytes=self.conn.max_frame_bytes)

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
            if not self.control.stopping and self.owns_process:
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
                  self.rank, grace_s, what, self.control.state)
        logging.shutdown()
        os._exit(code)

    def _heartbeat(self) -> None:
        while not self.control.stopping:
            time.sleep(self.cadence.heartbeat_s)
            try:
                self.send(Heartbeat(steps=self.trainer.step_count, state=self.control.state))
                watch = self.loop_watch  # close() may clear it meanwhile
                notice = watch() if watch is not None else None
                if notice is not None:
                    log.error("rank %d: %s", self.rank, notice.message)
                    self.send(notice)
            except Exception:
                return

    # -- running and leaving ------------------------------------------------
    def run(self) -> dict[str, Any]:
        """The managed tier: train every chunk the coordinator hands out until it says shutdown, then leave."""
        try:
            self.control.train()
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
        self.send(final)
        log.info("rank %d: %d batch reports in %d frames", self.rank, self.pacer.reports, self.pacer.frames)
        return dataclasses.asdict(final)

    def report_failure(self, e: BaseException, loop: bool = False) -> None:
        """Record why this rank fails (its own death record in the job folder) and tell the coordinator, before the
        connection drops (not a lost coordinator: the record alone then keeps the cause).
        ``loop``: the exception came out of the user's own training loop (the cooperative tier; cluster.loop_error)."""
        import traceback

        from flodl_exp.rendezvous import write_death_record

        error, tb = f"{type(e).__name__}: {e}", traceback.format_exc()[-4000:]
        write_death_record(self.spec.job_dir, self.rank, self.world_size, error, tb, attempt=self.spec.attempt)
        if isinstance(e, CoordinatorLost):
            return
        try:
            self.send(RankError(error=error, traceback=tb, loop=loop))
        except Exception:
            pass

    def close(self) -> None:
        self.control.stop()
        self.telemetry.close()
        self.pacer.close(flush=False)
        # an overlapped NCCL all-reduce pending on a dead peer would block the data plane's device synchronize for good:
        # given up first. (Leaving the whole group first changed what the peers and the coordinator saw of a failing
        # rank: its RankError raced its closed connection in two CI runs.)
        self.control.abandon_overlapped()
        self.trainer.close_data()
        self.control.close()
        self.conn.close()
        self.ended.set()
