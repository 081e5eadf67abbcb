"""The rank's hold clock (rank/hold_clock.py): what averaging held a rank's training, summed between answers."""
from __future__ import annotations

import pytest

from flodl_exp.rank.hold_clock import HoldClock


def test_held_blocks_add_up_nested_ones_once_and_the_take_starts_over() -> None:
    now = [0.0]
    clock = HoldClock(lambda: now[0])
    with clock.holding():
        now[0] += 0.002
        with clock.holding():  # a landing inside a launch: counted once
            now[0] += 0.003
    now[0] += 1.0  # training: not held
    with clock.holding():
        now[0] += 0.001
    assert clock.take_ms() == pytest.approx(6.0)
    assert clock.take_ms() == 0.0


def test_a_take_inside_a_block_counts_it_up_to_now_and_the_rest_for_the_next() -> None:
    now = [0.0]
    clock = HoldClock(lambda: now[0])
    with clock.holding():
        now[0] += 0.004
        assert clock.take_ms() == pytest.approx(4.0)  # the answer goes out mid-block
        now[0] += 0.002
    assert clock.take_ms() == pytest.approx(2.0)


def test_a_block_that_raises_is_still_counted() -> None:
    now = [0.0]
    clock = HoldClock(lambda: now[0])
    with pytest.raises(RuntimeError), clock.holding():
        now[0] += 0.005
        raise RuntimeError("a peer died mid-collective")
    assert clock.take_ms() == pytest.approx(5.0)
