"""Dead ranks: declaration, recovery, elastic regroup and ShutdownWithSave (algorithms.md 7).

A rank is dead when its connection closes or its heartbeat goes stale
(``cluster.heartbeat_timeout_s``) without a clean ``exiting``. Recovery hands
its unprocessed picks to the survivors (the epoch still trains every pick
once), drops it from the gate and aggregation, re-elects callback roles and,
on the collective backend, re-forms a smaller process group on a fresh store
prefix. When the loss is unrecoverable (``cluster.max_failure`` reached, fewer
than 2 survivors on nccl, none on cpu) the run ends with ShutdownWithSave:
every survivor writes its bundle pieces, the coordinator the meta with the
reason, and the run ends FAILED.
"""
from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Optional

from ..wire import Message

if TYPE_CHECKING:
    from .coordinator import Coordinator

log = logging.getLogger("flodl_exp.coordinator")

SAVE_DEADLINE_S = 60.0


class FaultHandling:
    """Mixin of :class:`Coordinator`: everything that happens when a rank is lost."""

    def unrecoverable_reason(self: "Coordinator") -> Optional[str]:
        alive = len(self.alive_ranks())
        dead = self.W - alive - sum(1 for r in range(self.W) if self.exited[r])
        limit = self.cfg["cluster"]["max_failure"]
        if limit is not None and dead >= int(limit):
            return "max_failure_exceeded"
        if self.backend == "nccl" and self.W >= 2 and alive < 2:
            return "single_survivor"
        if alive == 0:
            return "all_ranks_lost"
        return None

    def declare_dead(self: "Coordinator", r: int, reason: str) -> None:
        if not self.alive[r]:
            return
        self.alive[r] = False
        if self.exited[r]:
            return
        err = (self.errors.get(r) or {}).get("error")
        why = f"{reason}: {err}" if err else reason
        self.deaths.append({"rank": r, "reason": why, "epoch": self.current_epoch(), "global_step": self.global_step})
        log.error("rank %d declared dead: %s", r, why)
        self.sink.set_tags({f"death.rank{r}": why[:4000], "deaths": len(self.deaths)})
        self.sink.log_metrics({"alive_ranks": len(self.alive_ranks()), "deaths": len(self.deaths)}, step=self.current_epoch())
        self.emit({"event": "rank_dead", "rank": r, "reason": why})
        self.ledger[r].steps = 0
        if self.phase in ("shutdown", "done"):
            return
        if self.phase in ("finishing", "saving"):
            self._drop_pending_of(r)
            return
        unrecoverable = self.unrecoverable_reason()
        if unrecoverable:
            self.shutdown_with_save(unrecoverable, f"rank {r} {why}")
            return
        if self.dispatch is not None:
            self.dispatch.on_rank_dead(r)
        if self.fixed_callback is None or self.callback_rank == r:
            self.elect_callback_rank(force=True)
        if self.backend == "nccl":
            self.regroup()
        if self.cycle is not None:
            self._maybe_finish()

    def current_epoch(self: "Coordinator") -> int:
        return (self.dispatch.last_aggregated + 1) if self.dispatch is not None else 0

    def elect_callback_rank(self: "Coordinator", force: bool = False) -> None:
        """Fastest calibrated live rank (sticky: only re-elected on death); else the lowest live one."""
        alive = self.alive_ranks()
        if not alive:
            return
        if self.fixed_callback is not None and self.alive[self.fixed_callback]:
            self.callback_rank = self.fixed_callback
            return
        if self.elche is not None and self.elche.is_calibrated:
            self.callback_rank = min(alive, key=lambda q: (self.elche.smoothed_ms(q) or math.inf, q))
        elif force or not self.alive[self.callback_rank]:
            self.callback_rank = alive[0]

    def regroup(self: "Coordinator") -> None:
        """Survivors re-form the process group: renumbered ranks, fresh store prefix."""
        survivors = self.alive_ranks()
        if len(survivors) < 2:
            return
        self.generation += 1
        for i, r in enumerate(survivors):
            self.send(r, Message("regroup", {"generation": self.generation, "new_rank": i,
                                             "world_size": len(survivors), "ranks": survivors}))
        self.emit({"event": "regroup", "generation": self.generation, "ranks": survivors})
        self.sink.set_tags({"regroups": self.generation})
        log.warning("regroup generation %d with ranks %s", self.generation, survivors)

    def shutdown_with_save(self: "Coordinator", reason: str, detail: str) -> None:
        """Unrecoverable: every survivor saves its bundle pieces, the meta records why, the run ends FAILED."""
        if self.save_dispatched:
            return
        self.save_dispatched = True
        self.failure = f"{reason}: {detail}"
        self.status = "FAILED"
        stem = self.stem_for("failure")
        self.saved_stem = stem
        self.sink.set_tags({"save_reason": reason})
        self.emit({"event": "shutdown_with_save", "reason": reason, "stem": stem})
        log.error("ShutdownWithSave (%s): %s", reason, detail)
        self.write_meta(reason, stem, epoch=self.current_epoch())
        alive = self.alive_ranks()
        if not alive:
            self._shutdown()
            return
        self.phase = "saving"
        self.save_deadline = time.monotonic() + SAVE_DEADLINE_S
        primary = self.callback_rank if self.alive[self.callback_rank] else alive[0]
        self.final_pending = {f"save{r}" for r in alive}
        for r in alive:
            self.send(r, Message("save", {"stem": stem, "primary": r == primary, "model": r == primary}))

    def _drop_pending_of(self: "Coordinator", r: int) -> None:
        self.final_pending.discard(f"save{r}")
        if self.phase == "finishing" and "eval" in self.final_pending and getattr(self, "final_callback", None) == r:
            alive = self.alive_ranks()
            if alive:  # the final eval and consensus model move to another survivor
                self.final_callback = alive[0]
                self.final_pending.add(f"save{alive[0]}")
                self.send(alive[0], Message("execute_eval", {"epoch": self.epochs - 1, "final": True}))
                self.send(alive[0], Message("save", {"stem": self.stem, "primary": True, "model": True}))
        self._maybe_shutdown()
