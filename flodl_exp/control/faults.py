"""Dead ranks: the rules of algorithms.md 7, as pure functions (the coordinator applies them).

A rank is dead when its connection closes or its heartbeat goes stale
(``cluster.heartbeat_timeout_s``) without a clean ``exiting``. Recovery hands its
unprocessed picks to the survivors (the epoch still trains every pick once), drops
it from the gate and aggregation, re-elects callback roles and, on the collective
backend, re-forms a smaller process group on a fresh store prefix. When the loss is
unrecoverable (``cluster.max_failure`` reached, fewer than 2 survivors on nccl, none
on cpu) the run ends with ShutdownWithSave: every survivor writes its bundle pieces,
the coordinator the meta with the reason, and the run ends FAILED.
"""
from __future__ import annotations

from typing import Optional

from ..protocol import Regroup

SAVE_DEADLINE_S = 60.0
"""ShutdownWithSave: how long the survivors get to write their pieces."""
SHUTDOWN_GRACE_S = 30.0
"""After the shutdown broadcast: how long ranks get to exit before the coordinator stops waiting."""


def unrecoverable_reason(*, world_size: int, alive: int, dead: int, max_failure: Optional[int],
                         backend: str) -> Optional[str]:
    """Why the run cannot go on after a death (the ShutdownWithSave reason), or None."""
    if max_failure is not None and dead >= max_failure:
        return "max_failure_exceeded"
    if backend == "nccl" and world_size >= 2 and alive < 2:
        return "single_survivor"
    if alive == 0:
        return "all_ranks_lost"
    return None


def regroup_plan(survivors: list[int], generation: int) -> dict[int, Regroup]:
    """Each survivor's place in the re-formed process group: renumbered in rank order."""
    return {r: Regroup(generation=generation, new_rank=i, world_size=len(survivors), ranks=list(survivors))
            for i, r in enumerate(survivors)}
