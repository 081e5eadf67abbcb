"""What the coordinator knows of itself and every rank, as one dict: the stall dump's body (the shell's
:class:`~.watchdog.StallWatchdog` writes it to a file). Pure: the core builds it from its components' state."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flodl_exp.core.cohort import Cohort
    from flodl_exp.core.cycle import AveragingCycle
    from flodl_exp.core.dispatch import Dispatcher
    from flodl_exp.core.lifecycle import Lifecycle


def run_state(*, life: Lifecycle, cohort: Cohort, cycle: AveragingCycle, dispatch: Dispatcher,
              pending_saves: list[int], now: float) -> dict[str, Any]:
    """What the coordinator knows of itself and every rank (the stall dump)."""
    red = cycle.in_flight
    counts = cycle.counts
    w = cohort.world_size
    in_flight = {r: sorted(cid for cid, c in dispatch.chunks.items() if c.rank == r) for r in range(w)}
    return {
        "phase": life.phase.value, "global_step": cycle.global_step, "syncs": cycle.version,
        "epoch": dispatch.current_epoch(), "dispatch_gate": dispatch.gate.value,
        "reduce": None if red is None else {
            "backend": red.backend, "final": red.final, "age_s": round(now - red.started, 3),
            "members": sorted(red.members), "answered": sorted(red.answered())},
        "pending_saves": pending_saves,
        "ranks": [{"rank": r, "alive": cohort.alive(r), "exited": cohort.exited(r),
                   "silent_s": round(cohort.silent_for(r, now), 3), "batches": cohort.batches[r],
                   "window_steps": cycle.steps(r), "count": counts[r], "throttled": cycle.ledger[r].throttled,
                   "chunks_in_flight": in_flight[r], "epoch": dispatch.rank_epoch[r]} for r in range(w)],
    }
