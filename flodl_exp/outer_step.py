"""What one outer step did (outer.py): a plain record, so the coordinator reads the ranks' reports and keeps
its metrics without importing torch, which only the optimizer's arithmetic needs."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OuterStep:
    """What one outer step did, for the metrics."""

    step_norm: float
    """||prev - new||: the change the window made to the global model (0 on a seeding window)."""
    momentum_norm: float
    """||v|| after the step."""
    seeded: bool
    """The first window (or a parameter-count change): a no-op that seeded the momentum at zero."""
