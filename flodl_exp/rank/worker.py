"""The rank process: dial the coordinator, then run the managed loop.

    wait for plan -> begin_epoch -> (next_batch -> train_step -> after_step)* -> end_epoch

Control messages arrive on a reader thread and are handled between batches
(never while a collective could deadlock): start_epoch, extend_partition,
sync_now, request_params, update, set_global_step, throttle, execute_eval,
save, shutdown. The rank is mode-agnostic: policies live in the coordinator.
"""
from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from collections import deque
from typing import Any, Optional

import torch

from .. import wire
from ..constants import FAULT_ENV
from ..averaging import float_buffers
from ..experiment import build_experiment
from ..wire import Message
from .backends import CollectiveBackend, CoordinatorBackend
from .fault_inject import inject_fault, parse_fault
from .trainer import EpochState, RankTrainer

log = logging.getLogger("flodl_exp.rank")

HEARTBEAT_S = 1.0


class CoordinatorLost(RuntimeError):
    """The coordinator closed the connection or went silent past the deadline."""


def pick_device(device: str, local_rank: int) -> torch.device:
    if device == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.device(f"cuda:{local_rank % torch.cuda.device_count()}")
    if device == "cuda":
        raise RuntimeError("cluster.device=cuda but this rank sees no CUDA device")
    return torch.device("cpu")


def state_hash(model: torch.nn.Module) -> str:
    """sha256 over parameters and float buffers: equal hashes = identical replicas."""
    h = hashlib.sha256()
    with torch.no_grad():
        for t in list(model.parameters()) + float_buffers(model):
            h.update(t.detach().to("cpu").float().contiguous().numpy().tobytes())
    return h.hexdigest()


class RankWorker:
    def __init__(self, spec: dict, rank: int, local_rank: int, rendezvous: dict) -> None:
        cfg = spec["config"]
        self.cfg = cfg
        self.spec = spec
        self.rank = rank
        self.world_size = int(cfg["cluster"]["nodes"]) * int(cfg["cluster"]["ranks_per_node"])
        self.device = pick_device(cfg["cluster"]["device"], local_rank)
        if self.device.type == "cpu":
            torch.set_num_threads(1)
        speeds = cfg["cluster"].get("rank_speeds") or [1.0] * self.world_size
        exp_cfg = cfg["experiment"]
        augment = max(1, int(cfg["data_plane"]["augment"]))
        exp = build_experiment(exp_cfg, world_size=self.world_size, device=self.device, seed=int(cfg["seed"]), augment=augment)
        self.trainer = RankTrainer(
            exp, device=self.device, world_size=self.world_size, seed=int(spec.get("shuffle_seed", cfg["seed"])),
            augment=augment, batch_size=int(exp_cfg["batch_size"]), speed=float(speeds[rank]),
            lr_scale_ratio=float(cfg["mode"]["lr_scale_ratio"]), max_grad_norm=cfg["mode"]["max_grad_norm"],
        )
        self.gamma = float(cfg["mode"]["gamma"])
        self.backend_kind = cfg["mode"]["backend"]
        self.coord_timeout = float(cfg["cluster"]["heartbeat_timeout_s"])
        self.conn = wire.dial(rendezvous["host"], int(rendezvous["port"]), timeout=float(cfg["cluster"]["rendezvous_timeout_s"]))
        model_bytes = sum(p.numel() * p.element_size() for p in self.trainer.model.parameters())
        self.welcome = wire.client_handshake(
            self.conn, rendezvous["token"],
            {"rank": rank, "host": os.uname().nodename, "pid": os.getpid(), "device": str(self.device),
             "model_bytes": model_bytes, "samples": len(exp.train_data)},
            timeout=float(cfg["cluster"]["rendezvous_timeout_s"]),
        )
        self.conn.max_frame_bytes = wire.frame_ceiling(model_bytes)
        self.collective: Optional[CollectiveBackend] = None
        if self.backend_kind == "nccl" and self.world_size > 1:
            self.collective = CollectiveBackend(
                host=rendezvous["host"], store_port=int(rendezvous["store_port"]), rank=rank,
                world_size=self.world_size, device=self.device,
                timeout_s=float(cfg["cluster"]["heartbeat_timeout_s"]),
            )
        self.cpu = CoordinatorBackend(bf16_wire=bool(cfg["mode"]["bf16_wire"]))
        self.inbox: "queue.Queue[Message | BaseException]" = queue.Queue()
        self.plans: deque[Message] = deque()
        self.stopping = False
        self.throttled = False
        self.awaiting_update = False
        self.snapshot_n = 0
        self.last_coord = time.monotonic()
        self.chunk: Optional[EpochState] = None
        self.fault = parse_fault(os.environ.get(FAULT_ENV), rank)
        self.deferred: deque[Message] = deque()
        self.in_regroup_wait = False
        self.chunk_extra: list[int] = []
        self.resume_from(spec)
        threading.Thread(target=self._reader, name="rank-reader", daemon=True).start()
        threading.Thread(target=self._heartbeat, name="rank-heartbeat", daemon=True).start()
        # Data plane (rank/data): prefetch + sample cache; control is drained while waiting on a batch.
        from .data import build_pipeline
        from .telemetry import Telemetry

        self.trainer.attach_pipeline(
            build_pipeline(cfg["data_plane"], exp.train_data, device=self.device, batch_size=int(exp_cfg["batch_size"]),
                           augment=augment, seed=self.trainer.seed, ranks_per_node=int(cfg["cluster"]["ranks_per_node"]),
                           rank=rank),
            on_wait=self.drain, should_stop=lambda: self.stopping)
        self.telemetry = Telemetry(self.conn.send, self.device, rank=rank).start()

    def resume_from(self, spec: dict) -> None:
        """Load model and optimizer state from the resume bundle (validated by the launcher)."""
        resume = spec.get("resume")
        if not resume:
            return
        from ..checkpoint import load_model_state, optim_path

        stem = resume["stem"]
        self.trainer.model.load_state_dict(load_model_state(stem, map_location=str(self.device)))
        for path in (optim_path(stem, self.rank, primary=False), optim_path(stem, self.rank, primary=True)):
            if os.path.exists(path):
                self.trainer.optimizer.load_state_dict(torch.load(path, map_location=str(self.device), weights_only=True))
                break
        self.trainer.global_step = int(resume["meta"]["global_step"])

    # -- threads --------------------------------------------------------
    def _reader(self) -> None:
        try:
            while True:
                self.inbox.put(self.conn.recv())
        except BaseException as e:  # closed or broken: hand the reason to the main loop
            self.inbox.put(e)

    def _heartbeat(self) -> None:
        while not self.stopping:
            time.sleep(HEARTBEAT_S)
            try:
                self.conn.send(Message("heartbeat", {"s": self.trainer.step_count}))
            except Exception:
                return

    # -- control --------------------------------------------------------
    def _next(self, block: bool) -> Optional[Message]:
        if self.deferred and not self.in_regroup_wait:
            return self.deferred.popleft()
        try:
            item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            if time.monotonic() - self.last_coord > self.coord_timeout:
                raise CoordinatorLost(f"no word from the coordinator for {self.coord_timeout:.0f}s")
            return None
        if isinstance(item, BaseException):
            if self.stopping:
                return None
            raise CoordinatorLost(f"coordinator connection lost: {item}")
        self.last_coord = time.monotonic()
        return item

    def drain(self) -> None:
        """Handle every control message already queued (between batches)."""
        while not self.stopping:
            msg = self._next(block=False)
            if msg is None:
                return
            self.handle(msg)

    def wait_until(self, done) -> None:
        """Block handling control messages until ``done()`` (throttle, barrier, idle)."""
        while not self.stopping and not done():
            msg = self._next(block=True)
            if msg is not None:
                self.handle(msg)

    def handle(self, msg: Message) -> None:
        k, f = msg.kind, msg.fields
        if k == "start_epoch":
            self.plans.append(msg)
        elif k == "extend_partition":
            # Survivors take over a dead rank's remainder: append it to the running chunk of
            # that epoch, or run it as a chunk of its own when none is running.
            if self.chunk is not None and self.chunk.epoch == int(f["epoch"]):
                self.chunk.extend(int(f["offset"]), self._picks(int(f["epoch"]), int(f["offset"]), int(f["size"])))
                self.chunk_extra.append(int(f["chunk"]))
            else:
                self.plans.append(Message("start_epoch", dict(f)))
        elif k == "regroup":
            self._regroup(f)
        elif k == "sync_now":
            self._sync_collective(bool(f.get("divergence", True)))
        elif k == "request_params":
            n = self.trainer.steps_since_avg
            self.snapshot_n = n
            self.conn.send(self.cpu.snapshot(self.trainer.model, n, int(f.get("version", 0))))
            if f.get("barrier"):
                self.awaiting_update = True
                self.wait_until(lambda: not self.awaiting_update)
        elif k == "update":
            alpha = f.get("alpha")
            if not f.get("skip"):
                self.cpu.adopt_update(self.trainer.model, msg, None if alpha is None else float(alpha))
            self.trainer.steps_since_avg = max(0, self.trainer.steps_since_avg - int(f.get("n", self.snapshot_n)))
            self.awaiting_update = False
            self.throttled = False
            if "next_plan" in f:
                self.plans.append(Message("start_epoch", f["next_plan"]))
        elif k == "set_global_step":
            self.trainer.global_step = int(f["global_step"])
        elif k == "throttle":
            if not self.throttled:
                self.throttled = True
                self.wait_until(lambda: not self.throttled)
        elif k == "execute_eval":
            t0 = time.perf_counter()
            try:
                res, err = self.trainer.evaluate(), None
            except Exception as e:  # a broken eval must not kill training
                res, err = {}, f"{type(e).__name__}: {e}"
            self.conn.send(Message("eval_result", {"epoch": f["epoch"], "metrics": res, "error": err,
                                                   "final": bool(f.get("final")),
                                                   "elapsed_ms": (time.perf_counter() - t0) * 1e3}))
        elif k == "save":
            self._save(f)
        elif k == "shutdown":
            self.stopping = True
        elif k == "coord_heartbeat":
            pass
        else:
            log.warning("rank %d: unknown control message %r ignored", self.rank, k)

    def _picks(self, epoch: int, offset: int, size: int):
        from ..partition import make_partition

        return make_partition(offset, size, self.trainer.total_picks, epoch, self.trainer.seed)

    def _regroup(self, f: dict) -> None:
        """Re-form the process group with the survivors (fresh store prefix, renumbered ranks)."""
        if self.collective is None:
            return
        self.collective.rebuild(int(f["generation"]), int(f["new_rank"]), int(f["world_size"]))
        log.info("rank %d: regrouped as %d/%d (generation %d)", self.rank, f["new_rank"], f["world_size"], f["generation"])

    def _await_regroup(self, deadline_s: float = 60.0) -> bool:
        """After a failed collective: wait for the coordinator's regroup (other work is deferred)."""
        end = time.monotonic() + deadline_s
        self.in_regroup_wait = True
        try:
            while not self.stopping and time.monotonic() < end:
                msg = self._next(block=True)
                if msg is None:
                    continue
                if msg.kind == "regroup":
                    try:
                        self._regroup(msg.fields)
                        return True
                    except Exception as e:  # a member vanished during init: wait for the next generation
                        log.warning("rank %d: regroup failed: %s", self.rank, e)
                        continue
                if msg.kind in ("shutdown", "save", "coord_heartbeat", "set_global_step"):
                    self.handle(msg)
                else:
                    self.deferred.append(msg)
            return False
        finally:
            self.in_regroup_wait = False

    def _sync_collective(self, with_div: bool) -> None:
        n = self.trainer.steps_since_avg
        t0 = time.perf_counter()
        d, post, pre = 0.0, None, None
        if self.collective is not None:
            model = self.trainer.model
            scratch = [t.detach().clone() for t in list(model.parameters()) + float_buffers(model)]
            for attempt in range(32):
                try:
                    d, post, pre = self.collective.sync(model, n, self.gamma, with_div)
                    break
                except Exception as e:  # a peer died mid-collective: restore, regroup, retry
                    with torch.no_grad():
                        for t, saved in zip(list(model.parameters()) + float_buffers(model), scratch):
                            t.copy_(saved)
                    log.warning("rank %d: collective failed (attempt %d): %s", self.rank, attempt + 1, str(e).splitlines()[0])
                    if not self._await_regroup() or self.stopping:
                        if not self.stopping:
                            raise RuntimeError("collective failed and no regroup arrived") from e
                        return
        self.trainer.steps_since_avg = 0
        self.trainer.step_count += 1
        self.conn.send(Message("sync_ack", {"s": self.trainer.step_count, "n": n, "d": d, "post": post, "pre": pre,
                                            "ms": (time.perf_counter() - t0) * 1e3}))

    def _save(self, f: dict) -> None:
        """Write this rank's bundle pieces atomically (temp file + rename)."""
        from ..checkpoint import save_rank_pieces

        err = None
        try:
            save_rank_pieces(f["stem"], self.trainer.model, self.trainer.optimizer, rank=self.rank,
                             primary=bool(f.get("primary")), write_model=bool(f.get("model")))
        except Exception as e:  # save errors are reported, never fatal
            err = f"{type(e).__name__}: {e}"
        self.conn.send(Message("save_result", {"stem": f["stem"], "error": err, "model": bool(f.get("model"))}))

    # -- the managed loop ---------------------------------------------
    def run_chunk(self, plan: Message) -> None:
        f = plan.fields
        tr = self.trainer
        st = tr.begin_epoch(int(f["epoch"]), int(f["offset"]), int(f["size"]))
        self.chunk = st
        while True:
            if st.cursor + tr.batch_size > len(st.picks):
                # Done: report the chunk before handling control, so a reduce that follows never
                # sees this chunk as still in flight (coverage snapshots count in-flight as uncovered).
                break
            self.drain()
            if self.stopping:
                break
            batch = tr.next_batch(st)
            if batch is None:
                break
            loss, ms = tr.train_step(batch)
            tr.after_step(st, batch, loss, ms)
            if self.fault is not None and tr.step_count >= self.fault[0]:
                inject_fault(self.fault[1], self.rank, tr.step_count)
            fields = {"s": tr.step_count, "ms": ms, "d": batch.data_ms, "loss": loss, "e": st.epoch,
                      "c": int(f.get("chunk", 0)), "lr": tr.current_lr()}
            if tr.steps_since_avg % 10 == 0:
                fields["pn"] = tr.param_norm()  # periodic parameter norm (cheap, every 10th batch)
            self.conn.send(Message("batch", fields))
        self.chunk = None
        m = tr.end_epoch(st)
        fields = m.to_fields()
        fields["chunk"] = int(f.get("chunk", 0))
        fields["extra_chunks"], self.chunk_extra = self.chunk_extra, []
        self.conn.send(Message("metrics", fields))

    def run(self) -> dict[str, Any]:
        try:
            while not self.stopping:
                if self.plans:
                    self.run_chunk(self.plans.popleft())
                    continue
                self.wait_until(lambda: bool(self.plans))
            final = {"rank": self.rank, "pid": os.getpid(), "hash": state_hash(self.trainer.model), "steps": self.trainer.step_count,
                     "global_step": self.trainer.global_step}
            self.conn.send(Message("exiting", final))
            return final
        except BaseException as e:
            if not isinstance(e, CoordinatorLost):
                import traceback

                try:  # tell the coordinator why, before the connection drops
                    self.conn.send(Message("error", {"error": f"{type(e).__name__}: {e}",
                                                     "traceback": traceback.format_exc()[-4000:]}))
                except Exception:
                    pass
            raise
        finally:
            self.stopping = True
            self.telemetry.close()
            self.trainer.close_data()
            if self.collective is not None:
                self.collective.close()
            self.conn.close()
