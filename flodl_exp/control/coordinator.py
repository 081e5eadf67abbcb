"""The coordinator: one event loop that paces N rank processes.

It owns the window ledger, the averaging cycle, epoch dispatch (``Dispatcher``),
ElChe, the convergence guard, metrics aggregation, liveness and the end of the
run. Each tick: drain rank events, heartbeat, check liveness, fire a reduce
when the policy's gate says so, aggregate finished epochs, advance or shut down.

The averaging cycle lives in ``cycle.py``, dead ranks in ``faults.py``, bundles
in ``checkpointing.py``: mixins of this class, each owning one concern.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import time
from typing import Any, Optional

from ..config import effective_easgd_alpha, is_progressive, parse_callback_rank
from ..wire import Message
from .checkpointing import Checkpointing
from .dispatch import Dispatcher
from .elche import ElChe
from .epoch_metrics import EpochAccumulator
from .cycle import AveragingCycle, Cycle, Ledger
from .faults import FaultHandling
from .guards import build_guard
from .meta import LrEventMeta
from .records import RecordLog, WindowReporter
from .server import RankServer

log = logging.getLogger("flodl_exp.coordinator")

COORD_HEARTBEAT_S = 1.0


class RunFailure(RuntimeError):
    pass


class Coordinator(AveragingCycle, FaultHandling, Checkpointing):
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
        self.roles_elected = False
        self.phase = "connecting"
        self.final_pending: set[str] = set()
        self.final_eval: dict[str, float] = {}
        self.status = "RUNNING"
        self.failure: Optional[str] = None
        self.t_start = time.monotonic()
        self.last_hb_out = 0.0
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
            if "lr" in f and not any(self.alive[q] for q in range(r)):  # the lowest live rank speaks for LR
                self.lr_seen = float(f["lr"])
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
