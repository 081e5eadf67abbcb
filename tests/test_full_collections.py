"""The coordinator's full collections run just after a reduce, bounded both ways (coordinator/full_collections.py)."""
from __future__ import annotations

import gc

from control_fakes import FakeClock

from flodl_exp.coordinator.full_collections import BACKSTOP_S, MIN_INTERVAL_S, NEVER, FullCollections


def _pacer() -> tuple[FakeClock, list[int], FullCollections]:
    clock, calls = FakeClock(), []
    return clock, calls, FullCollections(clock, collect=lambda g: calls.append(g) or 0)


def test_a_full_collection_follows_a_reduce_at_most_every_min_interval() -> None:
    clock, calls, fc = _pacer()
    assert not fc.tick() and calls == [], "no reduce yet"
    fc.after_reduce()
    assert not fc.tick(), "too soon after the last one (the start counts as one)"
    clock.advance(MIN_INTERVAL_S)
    assert fc.tick() and calls == [2]
    assert not fc.tick(), "one per reduce"
    clock.advance(1.0)
    fc.after_reduce()
    assert not fc.tick(), "a sync mode reduces every step: at most one every MIN_INTERVAL_S"
    clock.advance(MIN_INTERVAL_S)
    assert fc.tick() and calls == [2, 2] and fc.collections == 2


def test_without_reduces_the_backstop_still_collects() -> None:
    clock, calls, fc = _pacer()
    clock.advance(BACKSTOP_S - 0.1)
    assert not fc.tick()
    clock.advance(0.1)
    assert fc.tick() and calls == [2]


def test_install_turns_only_pythons_automatic_full_collections_off() -> None:
    before = gc.get_threshold()
    try:
        FullCollections(FakeClock()).install()
        assert gc.get_threshold() == (before[0], before[1], NEVER)
    finally:
        gc.set_threshold(*before)


def test_a_hosted_coordinator_leaves_its_hosts_collections_alone(tmp_path) -> None:
    from control_fakes import Harness

    before = gc.get_threshold()
    h = Harness(tmp_path, "cpu_cadence", 2, epochs=1)
    h.start()
    assert h.co.full_collections is None and gc.get_threshold() == before
