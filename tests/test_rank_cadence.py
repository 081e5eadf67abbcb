"""A rank's clocks stretch with the world so the coordinator's frames stay within budget (rank/cadence.py)."""
from __future__ import annotations

import pytest

from flodl_exp.rank.cadence import (
    HEARTBEAT_S,
    MAX_COALESCE_S,
    PULSE_FRAMES_PER_S,
    REPORT_FRAMES_PER_S,
    TELEMETRY_S,
    rank_cadence,
)


@pytest.mark.parametrize("world", [1, 2, 3, 64, 204])
def test_small_worlds_keep_the_configured_clocks(world: int) -> None:
    c = rank_cadence(world, 50.0, 30.0)
    assert (c.report_coalesce_s, c.heartbeat_s, c.telemetry_s) == (0.05, HEARTBEAT_S, TELEMETRY_S)
    assert not c.stretched


@pytest.mark.parametrize("world", [512, 1024, 2048])
def test_large_worlds_stay_within_the_coordinators_frame_budget(world: int) -> None:
    c = rank_cadence(world, 50.0, 30.0)
    assert c.stretched
    assert world / c.report_coalesce_s <= REPORT_FRAMES_PER_S + 1e-6
    assert world / c.heartbeat_s <= PULSE_FRAMES_PER_S + 1e-6 or c.heartbeat_s == 30.0 / 5  # liveness first
    assert world / c.telemetry_s <= PULSE_FRAMES_PER_S + 1e-6
    assert c.report_coalesce_s == pytest.approx(world / REPORT_FRAMES_PER_S)


def test_1024_ranks() -> None:
    c = rank_cadence(1024, 50.0, 30.0)
    assert (c.report_coalesce_s, c.heartbeat_s, c.telemetry_s) == (0.25, 4.0, 4.0)
    assert "250 ms" in c.describe() and "4.0 s" in c.describe()


def test_a_longer_configured_interval_is_kept() -> None:
    assert rank_cadence(1024, 800.0, 30.0).report_coalesce_s == 0.8


def test_coalescing_off_stays_off() -> None:
    assert rank_cadence(4096, 0.0, 30.0).report_coalesce_s == 0.0


def test_the_report_interval_has_a_ceiling() -> None:
    assert rank_cadence(100_000, 50.0, 30.0).report_coalesce_s == MAX_COALESCE_S


def test_the_heartbeat_stays_well_inside_its_timeout() -> None:
    assert rank_cadence(4096, 50.0, 30.0).heartbeat_s == 6.0  # 30 s / 5 beats; 16 s by the budget
    assert rank_cadence(4096, 50.0, 2.0).heartbeat_s == HEARTBEAT_S  # never below the small worlds' beat
    assert rank_cadence(4096, 50.0, 30.0).telemetry_s == 16.0  # telemetry is no liveness signal
