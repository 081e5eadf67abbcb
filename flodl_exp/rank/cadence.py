"""How often a rank writes to the coordinator, by world size: pure.

The coordinator reads every rank's frames on one read thread, and its cost is per frame (a system call, a MAC,
a decode, an event; issue 30, issue 52). A rank writes three kinds of frame on a clock of its own: its held
Batch reports (``cluster.report_coalesce_ms``, rank/report_pacer.py), a heartbeat (1 s) and a telemetry report
(1 s). At a handful of ranks that is nothing; at 1,024 ranks the clocks alone allow ~22,000 frames a second, more
than the coordinator needs, and the read thread falls behind the report that completes a count, which is the one
that triggers the reduce (experiments/bench_coordinator.py ``--pace``: measurements.md, "Fewer frames").

So the clocks stretch with the world: the ranks together send at most :data:`REPORT_FRAMES_PER_S` frames of
held reports and :data:`PULSE_FRAMES_PER_S` heartbeats (and as many telemetry reports) a second. The report that
completes a count never waits (the coordinator's ``ReportPace``), so a reduce is not triggered later; what
stretches is how stale the coordinator's progress line and a rank's CPU figures may be. Up to 204 ranks nothing
changes (256 for the heartbeat and telemetry). The heartbeat stays well inside ``cluster.heartbeat_timeout_s`` (:data:`BEATS_PER_TIMEOUT` a timeout).
"""
from __future__ import annotations

from dataclasses import dataclass

HEARTBEAT_S = 1.0
"""A rank's heartbeat period in a world of at most :data:`PULSE_FRAMES_PER_S` ranks."""
TELEMETRY_S = 1.0
"""A rank's telemetry report period there."""
REPORT_FRAMES_PER_S = 4096.0
"""Frames of coalesced Batch reports the ranks together send a second, at most (past the configured interval)."""
PULSE_FRAMES_PER_S = 256.0
"""Heartbeats the ranks together send a second at most; telemetry reports likewise."""
MAX_COALESCE_S = 1.0
"""The stretched report interval's ceiling (``cluster.report_coalesce_ms`` allows up to 1,000 ms)."""
BEATS_PER_TIMEOUT = 5.0
"""A rank beats at least this many times within ``cluster.heartbeat_timeout_s``."""


@dataclass(frozen=True)
class RankCadence:
    """A rank's three clocks, in seconds (``report_coalesce_s`` 0: every report at once)."""

    report_coalesce_s: float
    heartbeat_s: float
    telemetry_s: float

    @property
    def stretched(self) -> bool:
        return self.heartbeat_s > HEARTBEAT_S or self.telemetry_s > TELEMETRY_S

    def describe(self) -> str:
        return (f"Batch reports held up to {self.report_coalesce_s * 1e3:.0f} ms, a heartbeat every "
                f"{self.heartbeat_s:.1f} s, telemetry every {self.telemetry_s:.1f} s")


def rank_cadence(world_size: int, report_coalesce_ms: float, heartbeat_timeout_s: float) -> RankCadence:
    """Each rank's clocks in a world of ``world_size``: the configured (or default) ones, stretched so that the
    world's frames stay within the budgets above. ``report_coalesce_ms`` 0 keeps coalescing off (the user's
    choice; the coordinator then reads a frame per batch)."""
    n = max(1, int(world_size))
    coalesce = report_coalesce_ms / 1e3
    if coalesce > 0:
        coalesce = max(coalesce, min(MAX_COALESCE_S, n / REPORT_FRAMES_PER_S))
    pulse = n / PULSE_FRAMES_PER_S
    beat_ceiling = max(HEARTBEAT_S, heartbeat_timeout_s / BEATS_PER_TIMEOUT)
    return RankCadence(report_coalesce_s=coalesce, heartbeat_s=min(beat_ceiling, max(HEARTBEAT_S, pulse)),
                       telemetry_s=max(TELEMETRY_S, pulse))
