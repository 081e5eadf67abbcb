"""The averaging gate of the coordinator, driven without processes."""
from __future__ import annotations

from types import SimpleNamespace

from flodl_exp.control.cycle import AveragingCycle, Ledger


def _coordinator(policy: str, steps: list[int], counts: list[int], throttled: list[bool]):
    ledger = [Ledger(steps=s, throttled=t) for s, t in zip(steps, throttled)]
    return SimpleNamespace(W=len(steps), cycle=None, policy=policy, progressive=False, counts=counts, ledger=ledger,
                           alive_ranks=lambda: list(range(len(steps))), dispatch=None)


def test_cadence_gate_waits_for_every_count():
    assert not AveragingCycle._should_average(_coordinator("cadence", [29, 10], [30, 10], [False, False]))
    assert AveragingCycle._should_average(_coordinator("cadence", [30, 10], [30, 10], [False, False]))
    assert AveragingCycle._should_average(_coordinator("sync", [1, 3], [30, 10], [False, False]))
    assert not AveragingCycle._should_average(_coordinator("sync", [0, 3], [30, 10], [False, False]))


def test_a_throttled_rank_counts_as_arrived():
    """max_batch_diff holds the fast rank short of its count until the reduce: the gate must not wait for it."""
    assert AveragingCycle._should_average(_coordinator("cadence", [13, 10], [30, 10], [True, False]))
    assert not AveragingCycle._should_average(_coordinator("cadence", [13, 9], [30, 10], [True, False]))
