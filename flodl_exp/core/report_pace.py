"""Which of each rank's Batch reports the coordinator needs at once: the coordinator's half of coalescing.

A rank's reports between two reduces are booked (ElChe's timings, the ledger, the progress line) but decide
nothing until the one that brings the rank to its count for the window: the reduce gate
(``AveragingCycle.should_average``) fires on it. So when a window's counts are set (a reduce finished, ElChe
re-sized the window) the coordinator tells each rank the index of that report, counted from its first
(:class:`~flodl_exp.protocol.messages.ReportPace`); the rank may hold the ones before it and send them several to a
frame (flodl_exp/rank/report_pacer.py), which cuts the coordinator's per-frame cost, and sends that one at
once. The index is exact however many reports are in flight or held: the coordinator has booked
``received`` of them and needs ``counts[r] - steps`` more, so the one that completes the count is report
``received + counts[r] - steps``, whichever frame brings it.

No pace (every report at once, as before) where the reports decide more than the count: the sync policy (a
window is one step), the cpu backend's ``max_batch_diff`` throttle (it reads every rank's steps as they come),
and the cold-start probe (it re-sizes the first window as soon as every rank timed its first steps).
"""
from __future__ import annotations

from collections.abc import Sequence

from flodl_exp.core.cycle import AveragingCycle
from flodl_exp.core.outbox import Outbox
from flodl_exp.policy.mode import Mode
from flodl_exp.protocol.messages import ReportPace


def pace_enabled(mode: Mode, coalesce_ms: float, max_batch_diff: object, world_size: int) -> bool:
    """Whether this run's ranks are paced at all (see the module docstring)."""
    return (coalesce_ms > 0 and world_size >= 2 and mode.paces_reports
            and not (mode.is_cpu and max_batch_diff is not None))


def flush_index(received: int, count: int, steps: int) -> int:
    """The index (1-based, counted from a rank's first report) of the report that completes ``count`` when
    ``received`` reports were booked and ``steps`` of them count toward the window; at or below ``received``:
    the count is reached, every report is wanted at once."""
    return received + max(0, count - steps)


class ReportPacing:
    """Counts each rank's reports and sends a :class:`ReportPace` whenever the window's counts move."""

    def __init__(self, *, enabled: bool, world_size: int, cycle: AveragingCycle, outbox: Outbox) -> None:
        self.enabled = enabled
        self.received = [0] * world_size
        """Batch reports booked per rank since the run started (single or coalesced)."""
        self._sent = [0] * world_size
        self._cycle = cycle
        self._out = outbox
        self._seen: tuple[int, int] = (-1, -1)
        self._seen_counts: Sequence[int] = ()

    def on_report(self, r: int) -> None:
        self.received[r] += 1

    def tick(self, alive: Sequence[int]) -> None:
        """After a reduce finished, ElChe re-sized the window or a rank died: each live rank's new flush index,
        sent where it changed. O(1) on every other tick (the reduce version, the live count and the counts
        list's identity compared, not the counts: O(W) a tick at 1,024 ranks). ElChe changes its counts
        in place only when a reduce finishes (a new version anyway); were they changed in place otherwise, a
        rank would hold its completing report at most ``cluster.report_coalesce_ms``, never lose it."""
        cy = self._cycle
        if not self.enabled or cy.probing or cy.in_flight is not None:
            return
        counts = cy.counts_view
        key = (cy.version, len(alive))
        if key == self._seen and counts is self._seen_counts:
            return
        self._seen, self._seen_counts = key, counts
        for r in alive:
            at = flush_index(self.received[r], counts[r], cy.steps(r))
            if at > self.received[r] + 1 and at != self._sent[r]:
                self._sent[r] = at
                self._out.send(r, ReportPace(flush_at=at))
            elif self._sent[r] > self.received[r]:
                # counts fell to (or below) what was booked: the next report completes it, hold nothing more
                self._sent[r] = 0
                self._out.send(r, ReportPace(flush_at=0))
