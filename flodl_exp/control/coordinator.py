"""The coordinator: one event loop that paces N rank processes.

It owns the window ledger, the averaging cycle, epoch dispatch (``Dispatcher``),
ElChe, the convergence guard, metrics aggregation, liveness and the end of the
run. Each tick: drain rank events, heartbeat, check liveness, fire a reduce
when the policy's gate says so, aggregate finished epochs, advance or shut down.

Averaging cycle (both backends finish when every live member answered):
* nccl: broadcast ``sync_now``; ranks all_reduce in place and ``sync_ack``.
* cpu: broadcast ``request_params``; ranks send ``snapshot``; the coordinator
  averages (work weights ``n^gamma``), sends ``update`` to each rank.
"""
from __future__ import annotations

import json
import logging
import math
import os
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..averaging import divergence, weighted_average
from ..config import effective_easgd_alpha, is_progressive, parse_callback_rank
from ..wire import Message
from .actions import STABLE, ConvergenceAction
from .checkpointing import Checkpointing
from .dispatch import Dispatcher
from .elche import ElChe, WindowReport
from .epoch_metrics import EpochAccumulator
from .faults import FaultHandling
from .guards import DivergenceReport, build_guard
from .meta import LrEventMeta
from .records import RecordLog, WindowReporter
from .server import RankServer

log = logging.getLogger("flodl_exp.coordinator")

COORD_HEARTBEAT_S = 1.0


class RunFailure(RuntimeError):
    pass


@dataclass
class Cycle:
    backend: str
    started: float
    members: set[int]
    final: bool = False
    acks: dict[int, dict] = field(default_factory=dict)
    snapshots: dict[int, Message] = field(default_factory=dict)


@dataclass
class Ledger:
    """Per-rank window ledger since the last finished reduce (algorithms.md 3.2)."""

    steps: int = 0
    wall_ms: float = 0.0
    first_ms: Optional[float] = None
    delivered_ms: float = 0.0
    delivered_batches: int = 0
    window_batches: int = 0
    loss_sum: float = 0.0
    loss_count: int = 0

    def add(self, batch_ms: float, data_ms: float, loss: Optional[float] = None) -> None:
        if loss is not None and math.isfinite(loss):
            self.loss_sum += loss
            self.loss_count += 1
        self.steps += 1
        self.window_batches += 1
        self.wall_ms += batch_ms
        if self.first_ms is None:
            self.first_ms = batch_ms + data_ms
        else:
            self.delivered_ms += batch_ms + data_ms
            self.delivered_batches += 1

    def fill_excess(self) -> float:
        if self.first_ms is None or self.delivered_batches == 0:
            return 0.0
        return max(self.first_ms - self.delivered_ms / self.delivered_batches, 0.0)

    def reset_timing(self) -> None:
        self.wall_ms, self.first_ms, self.delivered_ms, self.delivered_batches, self.window_batches = 0.0, None, 0.0, 0, 0
        self.loss_sum, self.loss_count = 0.0, 0


class Coordinator(FaultHandling, Checkpointing):
    def __init__(self, spec: dict, server: RankServer, events: "queue.Queue[tuple]", sink: Any, job_dir: str) -> None:
        cfg = spec["config"]
        self.cfg = cfg
        self.spec = spec
        self.server = server
        self.events = events
        self.sink = sink
        self.job_dir = job_dir
        m = cfg["mode"]
        self.W = int(cfg["cluster"]["nodes"]) * int(cfg["cluster"]["ranks_per_node"])
        self.policy, self.backend = m["policy"], m["backend"]
        self.gamma = float(m["gamma"])
        self.alpha = effective_easgd_alpha(_Dot(cfg))
        self.epochs = int(cfg["experiment"]["epochs"])
        self.batch_size = int(cfg["experiment"]["batch_size"])
        self.hb_timeout = float(cfg["cluster"]["heartbeat_timeout_s"])
        self.stall_ceiling = max(10 * self.hb_timeout, 300.0)
        self.eval_every = int(cfg["eval"]["every"])
        self.fixed_callback = parse_callback_rank(cfg["eval"]["callback_rank"])
        self.callback_rank = self.fixed_callback if self.fixed_callback is not None else 0
        self.alive = [False] * self.W
        self.exited = [False] * self.W
        self.finals: dict[int, dict] = {}
        self.last_seen = [time.monotonic()] * self.W
        self.ledger = [Ledger() for _ in range(self.W)]
        self.elche: Optional[ElChe] = self._build_elche(m) if self.W >= 2 else None
        self.guard = build_guard(
            cfg["guard"]["kind"], threshold=cfg["guard"]["threshold"], easgd_alpha=self.alpha,
            **({"msf_alpha": cfg["guard"]["msf_alpha"], "msf_suppress_threshold": cfg["guard"]["suppress_threshold"],
                "msf_suppress_sustain": cfg["guard"]["suppress_sustain"], "msf_nudge_threshold": cfg["guard"]["nudge_threshold"],
                "msf_nudge_sustain": cfg["guard"]["nudge_sustain"], "msf_nudge_factor": cfg["guard"]["nudge_factor"],
                "msf_nudge": cfg["guard"]["nudge"]} if cfg["guard"]["kind"] == "msf" else {}),
        )
        self.meta = LrEventMeta() if (m["meta_controller"] and self.elche is not None) else None
        self.lr_seen: Optional[float] = None
        self.progressive = is_progressive(_Dot(cfg)) and self.W >= 2
        self.total_picks = 0
        self.dispatch: Optional[Dispatcher] = None
        self.cycle: Optional[Cycle] = None
        self.global_step = 0
        self.version = 0
        self.accs: dict[int, EpochAccumulator] = {}
        self.coverage: dict[int, list[list[int]]] = {}
        self.last_action: ConvergenceAction = STABLE
        self.phase = "connecting"
        self.final_pending: set[str] = set()
        self.final_eval: dict[str, float] = {}
        self.status = "RUNNING"
        self.failure: Optional[str] = None
        self.t_start = time.monotonic()
        self.last_hb_out = 0.0
        self.last_progress = time.monotonic()
        self.eval_history: list[dict] = []
        self.stem = spec["checkpoint_stem"]
        self.shuffle_seed = int(spec.get("shuffle_seed", cfg["seed"]))
        self.errors: dict[int, dict] = {}
        self.deaths: list[dict] = []
        self.chunk_progress: list[dict[int, int]] = [{} for _ in range(self.W)]
        self.generation = 0
        self.save_dispatched = False
        self.saved_stem: Optional[str] = None
        self.save_deadline = 0.0
        self.ckpt: Optional[dict] = None
        self.pending_meta: Optional[tuple] = None
        self.at_epoch_done = False
        rl = cfg.get("record_log") or {}
        self.records = RecordLog(os.path.abspath(rl["dir"]) if rl.get("dir") else None, int(rl.get("max_bytes", 4 << 20)))
        self.scalar_reductions: dict[str, str] = dict(cfg.get("scalar_reductions") or {})
        self.windows = WindowReporter(0, 1)
        self.last_window_loss = float("nan")
        self.final_overwrite_done = False
        self.resume = spec.get("resume")
        if self.resume:
            self._restore(self.resume["meta"])

    def _restore(self, meta: dict) -> None:
        """Seed the trajectory from a bundle's meta: step counters, ElChe, guard history."""
        self.global_step = int(meta["global_step"])
        self.version = int(meta["sync_round"])
        if self.elche is not None and meta.get("elche_state"):
            st = dict(meta["elche_state"])
            st.pop("trend_history", None)
            self.elche.load_state_dict(st)
        if meta.get("guard_state") and meta.get("guard_kind") == self.cfg["guard"]["kind"]:
            self.guard.load_state_dict(meta["guard_state"])

    # -- construction helpers -----------------------------------------
    def _build_elche(self, m: dict) -> ElChe:
        e = ElChe(self.W, int(m["anchor"]), overhead_target=float(m["overhead_target"]), max_anchor=int(m["max_anchor"]),
                  min_anchor=m["min_anchor"], max_batch_diff=m["max_batch_diff"],
                  window_growth_applicable=m["policy"] != "sync")
        if m.get("speed_hint_rank") is not None:
            e.with_speed_ratio(int(m["speed_hint_rank"]), float(m["speed_hint_ratio"]))
        ratios = m.get("partition_ratios")
        if ratios:
            e.with_initial_anchor(min(range(self.W), key=lambda r: ratios[r]))
        return e

    @property
    def counts(self) -> list[int]:
        return self.elche.batch_counts if self.elche is not None else [1] * self.W

    def alive_ranks(self) -> list[int]:
        return [r for r in range(self.W) if self.alive[r]]

    def send(self, r: int, msg: Message) -> bool:
        return self.server.send(r, msg)

    def broadcast(self, msg: Message) -> None:
        for r in self.alive_ranks():
            self.send(r, msg)

    def emit(self, event: dict) -> None:
        """Append a progress event for the launcher (job folder, shared storage on SLURM)."""
        event = dict(event, t=round(time.monotonic() - self.t_start, 3))
        with open(os.path.join(self.job_dir, "events.jsonl"), "a") as fh:
            fh.write(json.dumps(event) + "\n")
        self.records.root(event.get("event", "event"), {k: v for k, v in event.items() if k != "event"})

    # -- main loop ------------------------------------------------------
    def run(self, connect_timeout: float) -> str:
        deadline = time.monotonic() + connect_timeout
        while self.phase == "connecting":
            self._pump(0.1)
            if all(self.alive):
                self._start()
            elif time.monotonic() > deadline:
                missing = [r for r in range(self.W) if not self.alive[r]]
                raise RunFailure(f"ranks {missing} did not connect within {connect_timeout:.0f}s")
        while self.phase != "done":
            self._pump(0.02)
            self._tick()
        return self.status

    def _pump(self, timeout: float) -> None:
        try:
            ev = self.events.get(timeout=timeout)
        except queue.Empty:
            return
        self._on_event(ev)
        while True:
            try:
                ev = self.events.get_nowait()
            except queue.Empty:
                return
            self._on_event(ev)

    def _on_event(self, ev: tuple) -> None:
        kind, rank = ev[0], ev[1]
        if kind == "join":
            hello = ev[2]
            self.alive[rank] = True
            self.last_seen[rank] = time.monotonic()
            self.records.hosts[rank] = str(hello.get("host", "unknown"))
            self.total_picks = int(hello.get("samples", 0)) * max(1, int(self.cfg["data_plane"]["augment"]))
            log.info("rank %d joined from %s (%s)", rank, hello.get("host"), hello.get("device"))
            self.emit({"event": "joined", "rank": rank, "pid": hello.get("pid"), "host": hello.get("host"),
                       "device": hello.get("device")})
        elif kind == "msg":
            self.last_seen[rank] = time.monotonic()
            self._on_msg(rank, ev[2])
        elif kind == "closed":
            if self.phase == "connecting" and not self.exited[rank]:
                self.errors.setdefault(rank, {"error": ev[2]})
                raise RunFailure(f"rank {rank} failed before training started: {self.errors[rank].get('error')}")
            self.declare_dead(rank, "connection closed" if ev[2] == "closed" else ev[2])

    def _tick(self) -> None:
        now = time.monotonic()
        if now - self.last_hb_out >= COORD_HEARTBEAT_S:
            self.last_hb_out = now
            self.broadcast(Message("coord_heartbeat", {"t": now}))
        for r in self.alive_ranks():
            if not self.exited[r] and now - self.last_seen[r] > self.hb_timeout:
                self.declare_dead(r, f"no heartbeat for {self.hb_timeout:.0f}s")
        self.tick_signals()  # preemption (SIGUSR1) / SIGTERM: checkpointing.py
        if self.phase == "shutdown":
            if not [r for r in self.alive_ranks() if not self.exited[r]] or now - self.shutdown_at > 30:
                self.phase = "done"
            return
        if self.phase == "saving":
            if now > self.save_deadline:
                log.error("ShutdownWithSave: saves still pending after the deadline: %s", sorted(self.final_pending))
                self._shutdown()
            return
        if self.phase == "checkpointing":
            self.tick_checkpoint()
        if self.cycle is not None and now - self.cycle.started > self.stall_ceiling:
            self.shutdown_with_save("reduce_stall", f"a reduce waited {self.stall_ceiling:.0f}s with the cohort alive")
            return
        if self.phase in ("training", "checkpointing"):
            self._check_throttle()
            if self._should_average():
                self._trigger()
            self.dispatch.aggregate_ready()
            if self.dispatch.all_aggregated():
                self.phase = "draining"
        if self.phase == "draining" and self.cycle is None:
            blended = self.alpha is not None and not self.final_overwrite_done
            if self.W > 1 and (blended or any(self.ledger[r].steps > 0 for r in self.alive_ranks())):
                self.final_overwrite_done = True
                self._trigger(final=True)
            else:
                self._finish_run()

    # -- messages -------------------------------------------------------
    def _on_msg(self, r: int, msg: Message) -> None:
        k, f = msg.kind, msg.fields
        if k == "batch":
            self.ledger[r].add(float(f["ms"]), float(f["d"]), f.get("loss"))
            cid = int(f.get("c", -1))
            self.chunk_progress[r][cid] = self.chunk_progress[r].get(cid, 0) + 1
            if "lr" in f and r == min(self.alive_ranks(), default=r):
                self.lr_seen = float(f["lr"])
            self.last_progress = time.monotonic()
        elif k == "sync_ack":
            if self.cycle is not None and self.cycle.backend == "nccl" and r in self.cycle.members:
                self.cycle.acks[r] = f
                self._maybe_finish()
        elif k == "snapshot":
            if self.cycle is not None and self.cycle.backend == "cpu" and r in self.cycle.members:
                self.cycle.snapshots[r] = msg
                self._maybe_finish()
        elif k == "metrics":
            self.records.rank(r, "chunk", {key: v for key, v in f.items() if key != "ranges"})
            self.dispatch.on_metrics(r, f)
        elif k == "eval_result":
            self._on_eval(r, f)
        elif k == "save_result":
            self.on_save_result(r, f)
        elif k == "error":
            self.errors[r] = f
            log.error("rank %d reported: %s", r, f.get("error"))
        elif k == "exiting":
            self.exited[r] = True
            self.finals[r] = f
        elif k == "telemetry":
            if self.dispatch is not None:
                self.dispatch.on_telemetry(r, f)
        elif k == "heartbeat":
            pass
        else:
            log.warning("unknown message %r from rank %d ignored", k, r)

    # -- the averaging gate and cycle -----------------------------------
    def _should_average(self) -> bool:
        if self.W < 2 or self.cycle is not None:
            return False
        any_mover = False
        counts = self.counts
        for r in self.alive_ranks():
            s = self.ledger[r].steps
            if s > 0:
                any_mover = True
            hit = s >= 1 if self.policy == "sync" else s >= counts[r]
            if not (hit or (self.progressive and self.dispatch.quiesced(r))):
                return False
        return any_mover

    def _check_throttle(self) -> None:
        mbd = self.cfg["mode"]["max_batch_diff"]
        if self.backend != "cpu" or mbd is None or len(self.alive_ranks()) < self.W or self.W < 2:
            return
        low = min(self.ledger[r].steps for r in self.alive_ranks())
        for r in self.alive_ranks():
            if self.ledger[r].steps > low + int(mbd) and not getattr(self.ledger[r], "throttled", False):
                self.ledger[r].throttled = True  # type: ignore[attr-defined]
                self.send(r, Message("throttle", {}))

    def _trigger(self, final: bool = False) -> None:
        members = set(self.alive_ranks())
        self.cycle = Cycle(self.backend, time.monotonic(), members, final=final)
        if self.backend == "nccl":
            self.broadcast(Message("sync_now", {"version": self.version, "divergence": True}))
        else:
            barrier = final or not self.progressive
            self.broadcast(Message("request_params", {"version": self.version, "barrier": barrier}))

    def _maybe_finish(self) -> None:
        c = self.cycle
        live = {r for r in c.members if self.alive[r]}
        if c.backend == "nccl":
            if not live.issubset(c.acks):
                return
            n = {r: int(c.acks[r]["n"]) for r in live}
            div = {r: c.acks[r].get("d") for r in live}
            pre = {r: c.acks[r].get("pre") for r in live}
            post = next((c.acks[r].get("post") for r in live if c.acks[r].get("post") is not None), None)
        else:
            if not live.issubset(c.snapshots):
                return
            n, div, pre, post = self._average_cpu(c, sorted(live))
        sync_ms = (time.monotonic() - c.started) * 1e3
        self._finish(c, n, div, pre, post, sync_ms)

    def _average_cpu(self, c: Cycle, ranks: list[int]):
        snaps = [c.snapshots[r] for r in ranks]
        n = {r: int(s.fields["n"]) for r, s in zip(ranks, snaps)}
        n_p = sum(1 for k in snaps[0].tensors if k.startswith("p"))
        n_b = sum(1 for k in snaps[0].tensors if k.startswith("b"))
        params = [[s.tensors[f"p{i}"].float() for i in range(n_p)] for s in snaps]
        bufs = [[s.tensors[f"b{j}"] for j in range(n_b)] for s in snaps]
        res = weighted_average([n[r] for r in ranks], params, bufs, self.gamma)
        if res is None and c.final and self.alpha is not None:
            # EASGD leaves replicas apart even when nobody stepped: the final consensus is their plain mean.
            res = weighted_average([1] * len(ranks), params, bufs, 1.0)
        div: dict[int, Optional[float]] = {}
        pre: dict[int, Optional[float]] = {}
        post = None
        alpha = None if c.final else self.alpha
        if res is None:  # nobody moved: everyone keeps its state
            for r in ranks:  # release barrier waits; each rank keeps its own state
                div[r], pre[r] = 0.0, None
                self.send(r, Message("update", {"n": n[r], "skip": True}, {}))
            return n, div, pre, post
        avg_p, avg_b = res
        flat_avg = torch.cat([t.reshape(-1).float() for t in avg_p])
        tensors = {f"p{i}": t for i, t in enumerate(avg_p)}
        tensors.update({f"b{j}": t for j, t in enumerate(avg_b)})
        for r, ps in zip(ranks, params):
            d, post, pre_n = divergence(torch.cat([t.reshape(-1) for t in ps]), flat_avg)
            div[r], pre[r] = d, pre_n
            self.send(r, Message("update", {"n": n[r], "alpha": alpha, "version": self.version}, tensors))
        return n, div, pre, post

    def _finish(self, c: Cycle, n: dict[int, int], div: dict, pre: dict, post: Optional[float], sync_ms: float) -> None:
        action = STABLE
        old_anchor = self.elche.anchor if self.elche else 0
        if self.elche is not None:
            alive = self.alive_ranks()
            led = self.ledger
            movers = [r for r in alive if led[r].window_batches > 0]
            capable = (self.backend == "cpu" and self.policy in ("cadence", "async")) or (self.backend == "nccl" and self.policy == "cadence")
            self.elche.report_window(WindowReport(
                wall_ms=[led[r].wall_ms if self.alive[r] else 0.0 for r in range(self.W)],
                steps=[led[r].window_batches if self.alive[r] else 0 for r in range(self.W)],
                delivered_ms=[led[r].delivered_ms for r in range(self.W)],
                delivered_batches=[led[r].delivered_batches for r in range(self.W)],
                fill_ms=[led[r].fill_excess() for r in range(self.W)],
                sync_ms=sync_ms,
                delivered_coherent=capable and bool(movers) and all(led[r].delivered_batches >= 1 for r in movers),
            ))
            if self.fixed_callback is None and self.elche.is_calibrated and not getattr(self, "_roles_elected", False):
                self._roles_elected = True  # sticky: re-elected only on death
                self.elect_callback_rank()
            deltas = [float(div.get(r) or 0.0) for r in range(self.W)]
            pres = [pre.get(r) for r in range(self.W)]
            report = DivergenceReport(deltas, pres if all(p is not None for p in pres) else None, post)
            k_used, k_max = sum(n.values()), max(n.values(), default=0)
            action = self.guard.report(report, k_used, k_max)
            if self.meta is not None and self.lr_seen is not None:
                meta_action = self.meta.observe(self.lr_seen, self.elche.anchor, action, self.elche.phase)
                if meta_action is not None:
                    self.elche.nudge_anchor_down(meta_action.factor)
                    self.elche.discard_proposed_anchor()
            self.elche.apply_verdict(action, relax_up=self.policy == "async" and bool(self.cfg["mode"]["relax_up"]))
            if self.dispatch is not None:
                self.dispatch.on_verdict(action)
        self.last_action = action
        self.version += 1
        k_used = sum(n.values())
        self.global_step += k_used
        self._window_record(n, k_used, sync_ms, div)
        for r, nr in n.items():
            self.ledger[r].steps = max(0, self.ledger[r].steps - nr)
        for led in self.ledger:
            led.reset_timing()
            if hasattr(led, "throttled"):
                led.throttled = False  # type: ignore[attr-defined]
        self.cycle = None
        self.window_t0 = time.monotonic()
        self.broadcast(Message("set_global_step", {"global_step": self.global_step}))
        d_max = max((float(v) for v in div.values() if v is not None), default=None)
        if self.dispatch is not None:
            self.dispatch.on_sync(sync_ms, d_max, action.code)
            if self.elche is not None and self.elche.anchor != old_anchor:
                log.info("anchor %d -> %d", old_anchor, self.elche.anchor)
            self.maybe_at_epoch_checkpoint()
            self.dispatch.after_finish()
        self.last_progress = time.monotonic()

    def _window_record(self, n: dict[int, int], k_used: int, sync_ms: float, div: dict, force_epoch: Optional[int] = None) -> None:
        """A sub-epoch report at this reduce boundary when it closes a slice of the epoch's work."""
        epoch = force_epoch if force_epoch is not None else (self.current_epoch() if self.dispatch else 0)
        if force_epoch is None and (epoch >= self.epochs or not self.windows.on_window(epoch, k_used)):
            return  # the drain reduce after the last epoch belongs to no epoch's slices
        now = time.monotonic()
        led = self.ledger
        loss_n = sum(led[r].loss_count for r in range(self.W))
        rec: dict[str, float] = {
            "window/loss": sum(led[r].loss_sum for r in range(self.W)) / loss_n if loss_n else float("nan"),
            "window/samples_per_s": k_used * self.batch_size / max(now - self.window_t0, 1e-6),
            "window/sync_ms": sync_ms,
            "window/epoch": float(epoch),
        }
        if self.elche is not None:
            rec["window/anchor"] = float(self.elche.anchor)
        d = [float(v) for v in div.values() if v is not None]
        if d:
            rec["window/divergence"] = max(d)
        for r in range(self.W):
            rec[f"window/rank{r}/share"] = n.get(r, 0) / k_used if k_used else 0.0
            rec[f"window/rank{r}/steps"] = float(n.get(r, 0))
        if rec["window/loss"] != rec["window/loss"]:  # a flushed slice with no batches: carry the last loss
            rec["window/loss"] = self.last_window_loss
        self.last_window_loss = rec["window/loss"]
        rec = {k: v for k, v in rec.items() if v == v}
        self.sink.log_metrics(rec, step=self.global_step)
        self.emit({"event": "window", "step": self.global_step, **{k[len("window/"):]: v for k, v in rec.items()}})
        for r in range(self.W):
            self.records.rank(r, "window", {"step": self.global_step, "steps": n.get(r, 0)})

    # -- epochs, eval, end ----------------------------------------------
    def _start(self) -> None:
        self.phase = "training"
        self.window_t0 = time.monotonic()
        self.windows = WindowReporter(int(self.cfg.get("reports_per_epoch") or 0), self.total_picks // self.batch_size)
        self.dispatch = Dispatcher(self)
        self.emit({"event": "started", "world_size": self.W, "epochs": self.epochs})
        self.dispatch.start()

    def on_epoch_aggregated(self, e: int, metrics: dict[str, float], ranges: list[list[int]]) -> None:
        """Called by the dispatcher, in epoch order."""
        metrics["global_step"] = float(self.global_step)
        metrics["alive_ranks"] = float(len(self.alive_ranks()))
        if self.elche is not None:
            metrics["anchor"] = float(self.elche.anchor)
        self.coverage[e] = ranges
        for _ in range(self.windows.owed(e)):
            self._window_record({r: 0 for r in range(self.W)}, 0, 0.0, {}, force_epoch=e)
        self.sink.log_metrics(metrics, step=e)
        self.emit({"event": "epoch", "epoch": e, **{k: v for k, v in metrics.items() if not k.startswith("rank") or k.endswith("batch_share")}})
        last = e == self.epochs - 1
        if not last and self.eval_every > 0 and (e + 1) % self.eval_every == 0 and self.alive[self.callback_rank]:
            self.send(self.callback_rank, Message("execute_eval", {"epoch": e}))
        if self.checkpoint_due(e):
            self.begin_epoch_checkpoint(e)

    def _on_eval(self, r: int, f: dict) -> None:
        if f.get("error"):
            log.warning("eval on rank %d failed: %s", r, f["error"])
            self.sink.set_tags({"eval_error": f["error"]})
        metrics = {f"eval/{k}": v for k, v in (f.get("metrics") or {}).items()}
        if metrics:
            self.sink.log_metrics(metrics, step=int(f["epoch"]))
        self.eval_history.append({"epoch": f["epoch"], **metrics})
        self.emit({"event": "eval", "epoch": f["epoch"], "final": bool(f.get("final")), **metrics})
        if f.get("final"):
            self.final_eval = metrics
            self.final_pending.discard("eval")
            self._maybe_shutdown()

    def _finish_run(self) -> None:
        """Every epoch aggregated and the last reduce settled: final eval and bundle, then shutdown."""
        self.phase = "finishing"
        cb = self.callback_rank if self.alive[self.callback_rank] else min(self.alive_ranks())
        self.final_pending = {"eval"} | {f"save{r}" for r in self.alive_ranks()}
        self.send(cb, Message("execute_eval", {"epoch": self.epochs - 1, "final": True}))
        for r in self.alive_ranks():
            self.send(r, Message("save", {"stem": self.stem, "primary": r == cb, "model": r == cb}))
        self.final_callback = cb

    def _maybe_shutdown(self) -> None:
        if self.phase == "finishing" and not self.final_pending:
            self.status = "FINISHED"
            self.write_meta("completed", self.stem, epoch=self.epochs)
            self._shutdown()

    def _shutdown(self) -> None:
        if self.phase in ("shutdown", "done"):
            return
        self.phase = "shutdown"
        self.shutdown_at = time.monotonic()
        self.broadcast(Message("shutdown", {"reason": self.failure or "completed"}))

    def result(self) -> dict:
        return {
            "status": self.status,
            "failure": self.failure,
            "world_size": self.W,
            "epochs": self.epochs,
            "global_step": self.global_step,
            "syncs": self.version,
            "final_eval": self.final_eval,
            "evals": self.eval_history,
            "finals": {str(r): v for r, v in self.finals.items()},
            "coverage": {str(e): v for e, v in self.coverage.items()},
            "total_picks": self.total_picks,
            "wall_s": time.monotonic() - self.t_start,
            "callback_rank": self.callback_rank,
            "stem": self.stem,
            "rejected_connections": self.server.rejected,
            "deaths": self.deaths,
            "errors": {str(r): v for r, v in self.errors.items()},
            "regroups": self.generation,
            "saved_stem": self.saved_stem,
            "resumed_from": (self.resume or {}).get("stem"),
        }


class _Dot(dict):
    """Attribute access over the plain config dict, for helpers written against the schema."""

    def __getattr__(self, k: str) -> Any:
        v = self[k]
        return _Dot(v) if isinstance(v, dict) else v
