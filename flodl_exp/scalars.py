"""``record_scalar``: user metrics recorded inside a train step.

A per-thread accumulator of ``name -> (sum, count)``; the rank drains it into
each chunk's metrics, and the epoch value is ``sum / count`` (the mean of
everything recorded), rolled up across ranks by the coordinator.
"""
from __future__ import annotations

import threading

_local = threading.local()


def _acc() -> dict[str, list[float]]:
    acc = getattr(_local, "acc", None)
    if acc is None:
        acc = _local.acc = {}
    return acc


def record_scalar(name: str, value: float) -> None:
    """Add one observation of ``name`` to this thread's accumulator."""
    entry = _acc().setdefault(str(name), [0.0, 0])
    entry[0] += float(value)
    entry[1] += 1


def drain_scalars() -> dict[str, tuple[float, int]]:
    """Return and clear this thread's accumulator."""
    acc = _acc()
    out = {k: (float(v[0]), int(v[1])) for k, v in acc.items()}
    acc.clear()
    return out


