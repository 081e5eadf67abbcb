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
"""
from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Optional

from ..wire import Message

if TYPE_CHECKING:
    from .coordinator import Coordinator

log = logging.getLogger("flodl_exp.coordinator")


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
