"""Fault injection for tests (the torchft habit: ``fail_at(rank, step)``).

``FLODL_FAULT_INJECT="<rank>:<step>:<kind>[,...]"`` makes a rank fail on purpose
after its ``step``-th batch, the way a real crash, OOM kill or hung device would.
"""
from __future__ import annotations

import logging
import os
import signal
from typing import Optional

log = logging.getLogger("flodl_exp.rank")


def parse_fault(spec: Optional[str], rank: int) -> Optional[tuple[int, str]]:
    """``FLODL_FAULT_INJECT="<rank>:<step>:<kind>[,...]"`` (kind: raise | exit | kill | hang) -> (step, kind) for this rank.

    The test hook for failure paths: a rank fails on purpose after its
    ``step``-th batch, the way a real crash, OOM kill or hung device would.
    """
    for item in (spec or "").split(","):
        parts = item.strip().split(":")
        if len(parts) == 3 and parts[0].isdigit() and int(parts[0]) == rank:
            return int(parts[1]), parts[2]
    return None


def inject_fault(kind: str, rank: int, step: int) -> None:
    log.error("rank %d: injected fault %r at step %d", rank, kind, step)
    if kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step}")
    if kind == "exit":
        os._exit(3)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
