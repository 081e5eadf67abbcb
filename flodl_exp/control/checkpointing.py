"""Checkpoint roles and bundles on the coordinator side (algorithms.md 8).

* ``checkpoint.every=N``: after epoch e with (e+1) % N == 0 is aggregated, the
  next epoch is held, a consensus reduce settles every live rank's steps, the
  callback rank writes the model and every rank its optimizer, then the meta
  is written and training resumes. The bundle is exactly the consensus at the
  epoch boundary.
* ``checkpoint.at_epoch=E`` (progressive modes): at the first reduce finish
  where a live rank has reached epoch E, the coverage of every open epoch is
  snapshotted (in-flight chunks count as uncovered) and the consensus is saved
  before any new chunk is handed out; resuming trains only the uncovered picks.
* The end of training writes the final bundle (see Coordinator._finish_run).
* Preemption / time limit (``SIGUSR1`` from task 0, see jobs/job.py): in
  progressive modes the coverage of every open epoch is snapshotted at the next
  reduce finish, exactly like ``at_epoch``; otherwise one consensus reduce, then
  an epoch-granular bundle (the open epoch restarts on resume). Every live rank
  saves, the meta is written, ``preempted.json`` tells task 0 where the bundle
  is, and the run stops with status PREEMPTED (MLflow run left RUNNING: the
  requeued job resumes into it).
* ``SIGTERM`` on SLURM (scancel, ``--kill-on-bad-exit`` after a rank failed, the
  time limit): the run ends at once with FAILED (a rank failed, or the time limit
  hit a bundle in progress) or KILLED (cancelled), before the cluster's SIGKILL.
"""
from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Optional

from ..constants import PREEMPT_MARK
from ..wire import Message

if TYPE_CHECKING:
    from .coordinator import Coordinator

log = logging.getLogger("flodl_exp.coordinator")

PREEMPT_ARM_FALLBACK_S = 10.0
"""Progressive modes wait this long for a reduce finish before saving an epoch-granular bundle."""
PREEMPT_SAVE_DEADLINE_S = 45.0
"""A preemption bundle not complete this long after the request fails the run (time limit)."""
TERM_GRACE_S = 2.0
"""After SIGTERM without a failure: how long a preemption request (SIGTERM, then USR2) may follow."""


class Checkpointing:
    """Mixin of :class:`Coordinator`."""

    def stem_for(self: "Coordinator", kind: str, epoch: Optional[int] = None) -> str:
        base = self.stem
        if kind == "final":
            return base
        if kind == "epoch":
            return f"{base}_epoch{epoch}"
        if kind == "at_epoch":
            return f"{base}_at{epoch}"
        return f"{base}_{kind}"

    def checkpoint_due(self: "Coordinator", e: int) -> bool:
        every = int(self.cfg["checkpoint"]["every"])
        return every > 0 and (e + 1) % every == 0 and e + 1 < self.epochs

    def begin_epoch_checkpoint(self: "Coordinator", e: int) -> None:
        """Hold dispatch of epoch e+1 until the consensus bundle of epoch e is written."""
        self.ckpt = {"kind": "epoch", "epoch": e + 1, "stage": "reduce", "stem": self.stem_for("epoch", e + 1)}
        self.phase = "checkpointing"

    def tick_checkpoint(self: "Coordinator") -> None:
        ck = self.ckpt
        if ck is None or self.cycle is not None:
            return
        if ck["stage"] == "reduce":
            if self.W > 1 and any(self.ledger[r].steps > 0 for r in self.alive_ranks()):
                self._trigger(final=True)
                return
            ck["stage"] = "save"
            self.send_saves(ck["stem"])
        elif ck["stage"] == "save" and not self.final_pending:
            self.write_meta("periodic", ck["stem"], epoch=ck["epoch"])
            self.log_bundle(ck["stem"], f"checkpoints/epoch{ck['epoch']}")
            self.emit({"event": "checkpoint", "stem": ck["stem"], "epoch": ck["epoch"]})
            self.ckpt = None
            self.phase = "training"
            self.dispatch.resume_after_checkpoint()

    def send_saves(self: "Coordinator", stem: str) -> None:
        alive = self.alive_ranks()
        primary = self.callback_rank if self.alive[self.callback_rank] else alive[0]
        self.final_pending = {f"save{r}" for r in alive}
        for r in alive:
            self.send(r, Message("save", {"stem": stem, "primary": r == primary, "model": r == primary}))

    def maybe_at_epoch_checkpoint(self: "Coordinator") -> None:
        """Called at a reduce finish, before any new chunk is dispatched."""
        p = getattr(self, "preempt", None)
        if p is not None and p["stage"] == "armed":
            self._preempt_save(p, coverage=True)
            return
        at = self.cfg["checkpoint"]["at_epoch"]
        if at is None or self.at_epoch_done or self.dispatch is None or not self.progressive:
            return
        if max((self.dispatch.rank_epoch[r] for r in self.alive_ranks()), default=-1) < int(at):
            return
        self.at_epoch_done = True
        stem = self.stem_for("at_epoch", int(at))
        per_epoch = [{"epoch": e, "total_samples": pool.total_samples,
                      "uncovered_ranges": [list(rg) for rg in pool.uncovered_ranges()]}
                     for e, pool in sorted(self.dispatch.pools.items()) if e > self.dispatch.last_aggregated]
        lowest = min((p["epoch"] for p in per_epoch), default=self.current_epoch())
        self.pending_meta = (stem, {"coverage_epochs": per_epoch, "epoch": lowest})
        self.send_saves(stem)
        self.emit({"event": "checkpoint_armed", "stem": stem, "epoch": int(at)})

    def on_save_result(self: "Coordinator", r: int, f: dict) -> None:
        if f.get("error"):
            log.warning("rank %d could not save %s: %s", r, f.get("stem"), f["error"])
            self.sink.set_tags({f"save_error.rank{r}": str(f["error"])[:2000]})
        self.final_pending.discard(f"save{r}")
        if self.pending_meta is not None and not self.final_pending:
            stem, extra = self.pending_meta
            self.pending_meta = None
            self.write_meta("at_epoch", stem, epoch=extra["epoch"], coverage_epochs=extra["coverage_epochs"])
            self.log_bundle(stem, "checkpoints/at_epoch")
            self.emit({"event": "checkpoint", "stem": stem, "epoch": extra["epoch"]})
        if self.phase == "saving" and not self.final_pending:
            self.log_bundle(self.saved_stem, "checkpoints/failure")
            self._shutdown()
        if self.phase == "preempting" and not self.final_pending:
            self._finish_preempt()
        self._maybe_shutdown()

    def log_bundle(self: "Coordinator", stem: str, artifact_path: str) -> None:
        d = os.path.dirname(stem)
        name = os.path.basename(stem)
        if not os.path.isdir(d):
            return
        for fn in sorted(os.listdir(d)):
            if fn.startswith(name + ".") and not fn.startswith(".tmp"):
                rest = fn[len(name):]
                if rest in (".pt", ".optim.pt", ".meta.json") or (rest.startswith(".optim.r") and rest.endswith(".pt")):
                    self.sink.log_artifact(os.path.join(d, fn), artifact_path)

    def write_meta(self: "Coordinator", reason: str, stem: Optional[str] = None, *, epoch: Optional[int] = None,
                   coverage_epochs: Optional[list] = None) -> None:
        from ..checkpoint import write_meta
        from ..partition import PERMUTATION_ALGORITHM

        trend = self.guard.state_dict().get("trend_history") or None
        write_meta(stem or self.stem, {
            "epoch": self.epochs if epoch is None else int(epoch),
            "global_step": self.global_step,
            "sync_round": self.version,
            "world_size_at_save": self.W,
            "save_reason": reason,
            "unix_time": time.time(),
            "experiment": self.cfg["experiment"]["name"],
            "total_picks": self.total_picks,
            "elche_state": dict(self.elche.state_dict(), trend_history=trend) if self.elche else None,
            "guard_kind": self.cfg["guard"]["kind"],
            "guard_state": self.guard.state_dict(),
            "coverage": {"seed": int(self.shuffle_seed), "algorithm": PERMUTATION_ALGORITHM,
                         "batch_size": self.batch_size, "per_epoch": coverage_epochs or []},
        })

    # -- preemption and termination (signals: control/main.py) -----------
    def request_preempt(self: "Coordinator") -> None:
        """SIGUSR1 handler: only records the request; the tick acts on it."""
        if getattr(self, "preempt", None) is None:
            self.preempt = {"stage": "requested", "t": time.monotonic()}

    def request_terminate(self: "Coordinator") -> None:
        """SIGTERM handler (SLURM): only records the time; the tick acts on it."""
        if getattr(self, "terminate_at", None) is None:
            self.terminate_at = time.monotonic()

    def tick_signals(self: "Coordinator") -> None:
        """Each tick: act on a pending termination or preemption request."""
        if (getattr(self, "kill_on_bad_exit", False) and self.deaths and not self.save_dispatched
                and self.phase in ("training", "checkpointing", "draining", "preempting")):
            # srun --kill-on-bad-exit=1 ends the whole step once the dead rank's task exits:
            # no recovery, the survivors save a bundle while they still can.
            d = self.deaths[0]
            self.shutdown_with_save("task_failed", f"rank {d['rank']} {d['reason']} (srun --kill-on-bad-exit=1 ends the job)")
            return
        if getattr(self, "terminate_at", None) is not None and not getattr(self, "terminated", False):
            self._tick_terminate()
            if self.phase == "done":
                return
        p = getattr(self, "preempt", None)
        if p is None:
            return
        now = time.monotonic()
        if p["stage"] == "requested":
            self._begin_preempt(p)
        elif p["stage"] == "armed" and self.cycle is None and now - p["armed_at"] > PREEMPT_ARM_FALLBACK_S:
            log.warning("preemption: no reduce finished within %.0fs: saving an epoch-granular bundle", PREEMPT_ARM_FALLBACK_S)
            self._preempt_save(p, coverage=False)
        elif p["stage"] == "reduce" and self.cycle is None:
            if not p.get("triggered") and self.W > 1 and any(self.ledger[r].steps > 0 for r in self.alive_ranks()):
                p["triggered"] = True
                self._trigger(final=True)
            else:
                self._preempt_save(p, coverage=False)
        elif p["stage"] in ("armed", "reduce", "saving") and now > p["deadline"]:
            pending = sorted(self.final_pending)
            self.failure = (f"time limit / preemption: the bundle {p['stem']} was not complete after "
                            f"{PREEMPT_SAVE_DEADLINE_S:.0f}s (pending {pending})")
            self.status = "FAILED"
            self.sink.set_tags({"end_reason": "time_limit"})
            p["stage"] = "failed"
            log.error(self.failure)
            self._shutdown()

    def _begin_preempt(self: "Coordinator", p: dict) -> None:
        if self.phase in ("draining", "finishing", "saving", "preempting", "shutdown", "done"):
            p["stage"] = "ignored"
            log.warning("preemption requested while the run is %s: it ends on its own", self.phase)
            self.emit({"event": "preempt_ignored", "phase": self.phase})
            return
        if self.dispatch is None or self.phase != "training" or self.ckpt is not None or self.pending_meta is not None:
            return  # not started yet, or a bundle is being written: act after it
        attempt = int(self.spec.get("attempt", 0))
        now = time.monotonic()
        p.update(stem=self.stem_for(f"preempt{attempt}"), deadline=now + PREEMPT_SAVE_DEADLINE_S, attempt=attempt)
        if self.progressive:
            p.update(stage="armed", armed_at=now)  # snapshot at the next reduce finish (maybe_at_epoch_checkpoint)
        else:
            p["stage"] = "reduce"
        log.warning("preemption requested: bundle %s (%s)", p["stem"],
                    "coverage at the next reduce" if self.progressive else "after one consensus reduce")
        self.emit({"event": "preempt_requested", "stem": p["stem"], "attempt": attempt})

    def _preempt_save(self: "Coordinator", p: dict, coverage: bool) -> None:
        d = self.dispatch
        per_epoch: list = []
        if coverage:
            per_epoch = [{"epoch": e, "total_samples": pool.total_samples,
                          "uncovered_ranges": [list(rg) for rg in pool.uncovered_ranges()]}
                         for e, pool in sorted(d.pools.items()) if e > d.last_aggregated]
        epoch = min((x["epoch"] for x in per_epoch), default=self.current_epoch())
        p.update(stage="saving", coverage=per_epoch, epoch=epoch)
        self.phase = "preempting"  # no dispatch, no reduce, no aggregation until the run stops
        if not self.alive_ranks():
            return
        self.send_saves(p["stem"])

    def _finish_preempt(self: "Coordinator") -> None:
        from ..checkpoint import atomic_json

        p = self.preempt
        if p.get("stage") != "saving":
            return
        self.write_meta("preempted", p["stem"], epoch=p["epoch"], coverage_epochs=p["coverage"])
        atomic_json({"attempt": p["attempt"], "stem": p["stem"], "epoch": p["epoch"], "global_step": self.global_step},
                    os.path.join(self.job_dir, PREEMPT_MARK))
        self.status, self.saved_stem, p["stage"] = "PREEMPTED", p["stem"], "done"
        self.sink.set_tags({"preemptions": p["attempt"] + 1, "preempt_stem": p["stem"]})
        self.emit({"event": "preempted", "stem": p["stem"], "epoch": p["epoch"], "attempt": p["attempt"],
                   "global_step": self.global_step})
        log.warning("preemption bundle %s complete (epoch %d, global step %d): stopping for requeue",
                    p["stem"], p["epoch"], self.global_step)
        self._shutdown()

    def _rank_failures(self: "Coordinator") -> str:
        if self.deaths:
            return "; ".join(f"rank {d['rank']} {d['reason']}" for d in self.deaths)
        return "; ".join(f"rank {r}: {e.get('error')}" for r, e in sorted(self.errors.items()))

    def _tick_terminate(self: "Coordinator") -> None:
        now = time.monotonic()
        p = getattr(self, "preempt", None)
        in_preempt = p is not None and p["stage"] in ("requested", "armed", "reduce", "saving")
        if p is not None and p["stage"] == "done":
            self.terminated = True  # PREEMPTED: the requeue is under way
            return
        if self.status == "FAILED" or self.deaths or self.errors:
            base = self.failure or self._rank_failures() or "a rank failed"
            status, failure, why = "FAILED", f"{base} (then the job step was terminated: SIGTERM)", "rank_failure"
        elif in_preempt and p["t"] <= self.terminate_at:
            status, why = "FAILED", "time_limit"
            failure = "time limit reached: the job was terminated before the preemption bundle was complete"
        elif in_preempt:
            self.terminated = True  # preemption sequence (SIGTERM, then USR2): the bundle goes on
            return
        elif now - self.terminate_at < TERM_GRACE_S:
            return  # a preemption request may still follow
        else:
            status, why = "KILLED", "cancelled"
            failure = "cancelled: the job was terminated (SIGTERM: scancel or the cluster)"
        self.terminated = True
        self.status, self.failure, self.end_reason = status, failure, why
        log.error("terminated: %s", failure)
        self.emit({"event": "terminated", "status": status, "reason": why})
        self.broadcast(Message("shutdown", {"reason": failure}))
        self.phase = "done"  # SIGKILL follows within KillWait: no waiting for the ranks
