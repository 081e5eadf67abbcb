"""The averaging gate and throttle of the coordinator's cycle, driven without processes."""
from __future__ import annotations

from typing import Any

from flodl_exp.core.cycle import AveragingCycle, CycleSettings, Ledger
from flodl_exp.policy.guards import build_guard
from flodl_exp.policy.mode import Mode
from flodl_exp.protocol.messages import Throttle


class _Out:
    def __init__(self) -> None:
        self.sent: list[tuple[int, Any]] = []

    def send(self, r: int, p: Any) -> bool:
        self.sent.append((r, p))
        return True

    def broadcast(self, p: Any) -> None:
        self.sent.append((-1, p))


class _FixedCounts(AveragingCycle):
    """ElChe's counts pinned by the test."""

    fixed: list[int] = []

    @property
    def counts(self) -> list[int]:
        return self.fixed


def _cycle(policy: str, steps: list[int], counts: list[int], throttled: list[bool], max_batch_diff: Any = None) -> _FixedCounts:
    c = _FixedCounts(settings=CycleSettings(world_size=len(steps), mode=Mode.parse(policy, "cpu"), gamma=1.0, alpha=None,
                                            progressive=False, max_batch_diff=max_batch_diff),
                     elche=None, guard=build_guard("none"), meta=None, outbox=_Out(), clock=lambda: 0.0)  # type: ignore[arg-type]
    c.fixed = counts
    c._ledger = [Ledger(steps=s, throttled=t) for s, t in zip(steps, throttled)]
    return c


def _gate(policy: str, steps: list[int], counts: list[int], throttled: list[bool]) -> bool:
    return _cycle(policy, steps, counts, throttled).should_average(list(range(len(steps))), lambda r: False)


def test_cadence_gate_waits_for_every_count():
    assert not _gate("cadence", [29, 10], [30, 10], [False, False])
    assert _gate("cadence", [30, 10], [30, 10], [False, False])
    assert _gate("sync", [1, 3], [30, 10], [False, False])
    assert not _gate("sync", [0, 3], [30, 10], [False, False])


def test_a_throttled_rank_counts_as_arrived():
    """max_batch_diff holds the fast rank short of its count until the reduce: the gate must not wait for it
    (a deviation from the reference's gate, which wedges there: test_control_coordinator.py,
    test_the_references_gate_wedges_on_a_throttled_rank_short_of_its_count)."""
    assert _gate("cadence", [13, 10], [30, 10], [True, False])
    assert not _gate("cadence", [13, 9], [30, 10], [True, False])


def test_throttle_holds_ranks_ahead_of_the_slowest_once():
    c = _cycle("cadence", [13, 10], [30, 10], [False, False], max_batch_diff=2)
    c.throttle([0, 1])
    c.throttle([0, 1])
    out = c._out.sent  # type: ignore[attr-defined]
    assert [(r, type(p)) for r, p in out] == [(0, Throttle)] and c.ledger[0].throttled


def test_the_throttle_measures_the_lead_against_ranks_with_work_in_flight():
    """cpu_sync's epoch tail: rank 0 finished its share (0 steps this window, nothing in flight), rank 1 trains
    on. Held behind rank 0, rank 1 could never finish the epoch that would give rank 0 work again."""
    c = _cycle("sync", [0, 3], [1, 1], [False, False], max_batch_diff=2)
    c.throttle([0, 1], working=lambda r: r == 1)
    assert c._out.sent == [] and not c.ledger[1].throttled  # type: ignore[attr-defined]
    c.throttle([0, 1], working=lambda r: True)  # both still training: the reference's rule
    assert [(r, type(p)) for r, p in c._out.sent] == [(1, Throttle)]  # type: ignore[attr-defined]
