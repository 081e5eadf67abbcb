"""ElChe (cadence balancer) rules, one block per rule of algorithms.md section 2."""
from __future__ import annotations

import json
import math

import pytest

from flodl_exp.policy.actions import STABLE, SUPPRESS_GROWTH, nudge_down
from flodl_exp.policy.elche import (
    GROWTH_REARM_STABLE,
    MAX_SPEED_RATIO,
    ElChe,
    Phase,
    WindowReport,
)


def run(e: ElChe, ms_per_batch: list[float], sync_ms: float = 0.0, n: int = 1) -> None:
    """Simulated rig: each rank runs its scheduled count at a fixed ms/batch."""
    for _ in range(n):
        counts = e.batch_counts
        e.report_timing([c * m for c, m in zip(counts, ms_per_batch)], counts, sync_ms)


RIG_3_TO_1 = [10.0, 30.0]  # rank 0 is 3x faster than rank 1


# ---------------------------------------------------------------- construction
def test_initial_counts_and_defaults() -> None:
    e = ElChe(3, 7)
    assert e.batch_counts == [7, 7, 7]
    assert e.anchor == 7 and e.anchor_rank is None and e.phase is Phase.PROBE
    assert not e.is_calibrated and e.calibration_count == 0 and not e.has_speed_hint()
    assert e.knobs()["min_anchor"] == 7 and e.knobs()["max_anchor"] == 1000
    assert e.knobs()["overhead_target"] == 0.05
    assert e.smoothed_ms(0) == 0.0 and e.smoothed_ms_per_batch(0) is None
    assert e.anchor_wall_ms() == 0.0
    assert e.recent_batch_share() == pytest.approx([1 / 3] * 3)


@pytest.mark.parametrize("w,a", [(1, 10), (0, 10), (2, 0)])
def test_constructor_rejects_bad_sizes(w: int, a: int) -> None:
    with pytest.raises(ValueError):
        ElChe(w, a)


def test_overhead_target_clamped() -> None:
    assert ElChe(2).with_overhead_target(0.9).knobs()["overhead_target"] == 0.50
    assert ElChe(2, overhead_target=0.0).knobs()["overhead_target"] == 0.01


def test_speed_hint() -> None:
    e = ElChe(3, 10).with_speed_ratio(1, 2.3)
    assert e.batch_counts == [23, 10, 23] and e.anchor_rank == 1 and e.has_speed_hint()
    assert ElChe(2, 10).with_speed_ratio(0, 0.5).batch_counts == [10, 10]  # ratio floored at 1
    with pytest.raises(ValueError):
        ElChe(2).with_speed_ratio(2, 2.0)


def test_min_max_anchor_clamps() -> None:
    e = ElChe(2, 10, max_anchor=5)  # min (= initial anchor) is lowered to the ceiling
    assert (e.anchor, e.knobs()["min_anchor"], e.batch_counts) == (5, 5, [5, 5])
    e = ElChe(2, 10, min_anchor=20)  # the floor lifts the anchor
    assert (e.anchor, e.batch_counts) == (20, [20, 20])
    e = ElChe(2, 10).with_min_anchor(5000)  # floor capped at max_anchor
    assert e.knobs()["min_anchor"] == 1000 and e.anchor == 1000
    assert ElChe(2, 10).with_max_anchor(0).knobs()["max_anchor"] == 1
    e = ElChe(2, 10).with_min_anchor(3)  # a lower floor never lowers the anchor
    assert e.anchor == 10 and e.knobs()["min_anchor"] == 3


# ---------------------------------------------------------------- smoothing
def test_three_to_one_rig_converges_to_three_to_one() -> None:
    e = ElChe(2, 10)
    run(e, RIG_3_TO_1, sync_ms=1.0)
    assert e.batch_counts == [30, 10] and e.anchor_rank == 1
    run(e, RIG_3_TO_1, sync_ms=1.0, n=30)
    assert e.batch_counts == [30, 10] and e.anchor == 10
    assert e.recent_batch_share() == pytest.approx([0.75, 0.25])
    assert e.anchor_wall_ms() == pytest.approx(300.0)


def test_trust_window_is_mean_of_last_five() -> None:
    e = ElChe(2, 10)
    for ms in [10, 20, 30, 40, 50, 60]:
        e.report_timing([ms * 10.0, 100.0], [10, 10], 0.0)
    assert e.smoothed_ms(0) == pytest.approx(40.0)  # mean(20..60), the 10 fell out
    assert e.smoothed_ms_all() == pytest.approx([40.0, 10.0])


def test_trust_window_reset_after_five_zero_reports() -> None:
    e = ElChe(2, 10)
    run(e, RIG_3_TO_1, n=3)
    for i in range(4):
        e.report_timing([300.0, 0.0], [30, 0], 0.0)  # rank 1 idle / absent
        assert e.smoothed_ms(1) == pytest.approx(30.0), i
    e.report_timing([300.0, float("nan")], [30, 10], 0.0)  # invalid counts as zero too
    assert e.smoothed_ms(1) == 0.0 and e.smoothed_ms_per_batch(1) is None


def test_pinned_anchor_that_never_reports_is_replaced_after_five_misses() -> None:
    e = ElChe(2, 10).with_initial_anchor(1)
    for _ in range(4):
        e.report_timing([100.0, 0.0], [10, 0], 0.0)
    assert not e.is_calibrated and e.anchor_rank == 1  # pinned anchor has no data: bail
    e.report_timing([100.0, 0.0], [10, 0], 0.0)
    assert e.is_calibrated and e.anchor_rank == 0


# ---------------------------------------------------------------- anchor election
def test_election_cohort_band_picks_lowest_index_member() -> None:
    # max 30 -> band threshold 25.5: ranks 1 (26) and 2 (30) are the cohort; with no
    # sitting anchor the lowest index wins, and rank 0 (10 ms) is never a candidate.
    e = ElChe(3, 10)
    run(e, [10.0, 26.0, 30.0])
    assert e.anchor_rank == 1
    assert e.batch_counts == [26, 10, 9]  # round(10*26/30) = 9


def test_election_dominance_margin_and_phase_gate() -> None:
    e = ElChe(3, 10)
    run(e, [10.0, 26.0, 27.0], n=6)  # 27 < 1.1 * 26: sticky even once Stable
    assert e.phase is Phase.STABLE and e.anchor_rank == 1
    run(e, [10.0, 26.0, 40.0])  # rank 2 window mean 29.6 > 28.6: challenger wins
    assert e.anchor_rank == 2


def test_pin_is_held_through_warmup_then_measurements_win() -> None:
    e = ElChe(2, 10).with_initial_anchor(0)  # wrong guess: rank 0 is the fast one
    run(e, RIG_3_TO_1, n=5)
    assert e.phase is Phase.STABLE and e.anchor_rank == 0
    assert e.batch_counts == [10, 3]
    run(e, RIG_3_TO_1)  # first Stable report may elect
    assert e.anchor_rank == 1 and e.batch_counts == [30, 10]


def test_challenger_tie_goes_to_last_maximal_rank() -> None:
    e = ElChe(3, 10).with_initial_anchor(0)
    run(e, [20.0, 30.0, 30.0], n=6)  # cohort {1, 2} (0 is out: 20 < 25.5) -> lowest = 1
    assert e.anchor_rank == 1
    e = ElChe(3, 10).with_initial_anchor(0)
    run(e, [26.0, 30.0, 30.0], n=6)  # 0 in cohort; equal challengers: Rust max_by -> 2
    assert e.anchor_rank == 2


# ---------------------------------------------------------------- schedule
def test_schedule_rounds_half_away_from_zero() -> None:
    e = ElChe(2, 5)
    run(e, [10.0, 25.0])
    assert e.batch_counts == [13, 5]  # 12.5 -> 13 (Python's round() would give 12)


def test_speed_ratio_capped_at_max_speed_ratio() -> None:
    e = ElChe(2, 10)
    run(e, [0.1, 100.0])  # 1000x measured
    assert e.batch_counts == [int(10 * MAX_SPEED_RATIO), 10]


def test_dead_zone_ignores_changes_within_five_percent() -> None:
    e = ElChe(2, 10)
    run(e, RIG_3_TO_1)
    e.report_timing([315.0, 300.0], [30, 10], 0.0)  # rank 0 mean 10.25 -> target 29
    assert e.batch_counts == [30, 10]
    e.report_timing([420.0, 300.0], [30, 10], 0.0)  # mean 11.5 -> 26, > 5% of 30
    assert e.batch_counts == [26, 10]


def test_max_batch_diff_limits_change_per_update() -> None:
    e = ElChe(2, 10, max_batch_diff=5)
    run(e, RIG_3_TO_1)
    assert e.batch_counts == [30, 10]  # first calibration is never clamped
    e.report_timing([30.0, 300.0], [30, 10], 0.0)  # rank 0 -> 1 ms: mean 5.5, target 55
    assert e.batch_counts == [35, 10]
    e = ElChe(2, 10, max_batch_diff=5)
    run(e, [1.0, 30.0])  # [300, 10]
    run(e, [100.0, 30.0])  # mean 50.5 -> target 6: down by at most 5
    assert e.batch_counts == [295, 10]
    e = ElChe(2, 10, max_batch_diff=0)  # lockstep: frozen after calibration
    run(e, [10.0, 10.0])
    run(e, RIG_3_TO_1, n=5)
    assert e.batch_counts == [10, 10]


def test_window_cap_scales_down_and_gives_remainder_to_fastest() -> None:
    e = ElChe(2, 10)
    e.set_max_total_batches(23)
    run(e, RIG_3_TO_1)  # [30, 10] * 0.575 -> [17, 5], +1 to the largest
    assert e.batch_counts == [18, 5] and e.window_cap_binding
    e.set_max_total_batches(0)  # 0 removes the cap
    assert e.knobs()["max_total_batches"] is None


def test_window_cap_tie_goes_to_last_maximal_and_floor_wins_when_w_exceeds_cap() -> None:
    e = ElChe(3, 10)
    e.set_max_total_batches(16)
    run(e, [10.0, 10.0, 10.0])  # [10]*3 * 16/30 -> [5, 5, 5] + 1 on the LAST maximal
    assert e.batch_counts == [5, 5, 6]
    e = ElChe(3, 10)
    e.set_max_total_batches(2)
    run(e, [10.0, 10.0, 10.0])
    assert e.batch_counts == [1, 1, 1]


def test_callback_slack_lowers_count_once_bypassing_dead_zone() -> None:
    e = ElChe(2, 10)
    run(e, RIG_3_TO_1)
    e.stage_callback_slack(0, 5.0)  # ceil(5 / 10) = 1 batch: inside the dead zone
    run(e, RIG_3_TO_1)
    assert e.batch_counts == [29, 10]
    assert e.staged()["callback_slack_ms"] == [0.0, 0.0]  # consumed
    e.stage_callback_slack(1, 95.0)  # ceil(95 / 30) = 4 -> 6
    run(e, RIG_3_TO_1)
    assert e.batch_counts[1] == 6
    e.stage_callback_slack(1, 1e6)  # floored at one batch
    run(e, RIG_3_TO_1)
    assert e.batch_counts[1] == 1


# ---------------------------------------------------------------- growth proposal
def test_first_report_never_proposes_and_second_proposes_capped_growth() -> None:
    e = ElChe(2, 10)
    run(e, [100.0, 100.0], sync_ms=5000.0)  # overhead 0.83, but a reading is not a trend
    assert e.proposed_anchor is None
    run(e, [100.0, 100.0], sync_ms=5000.0)
    assert e.phase is Phase.WARMUP and e.proposed_anchor == 20  # x2 step cap
    assert e.anchor == 10  # proposals are never applied by report_timing


def test_growth_applies_only_on_stable_verdict() -> None:
    e = ElChe(2, 10)
    run(e, RIG_3_TO_1, sync_ms=5000.0, n=2)
    assert e.proposed_anchor == 20
    e.apply_verdict(STABLE)
    assert e.anchor == 20 and e.batch_counts == [60, 20] and e.proposed_anchor is None


def test_suppress_growth_vetoes_and_latches_until_five_stables() -> None:
    e = ElChe(2, 10)
    run(e, [100.0, 100.0], sync_ms=5000.0, n=2)
    e.apply_verdict(SUPPRESS_GROWTH)
    assert e.anchor == 10 and not e.growth_enabled and e.proposed_anchor is None
    for _ in range(GROWTH_REARM_STABLE - 1):
        run(e, [100.0, 100.0], sync_ms=5000.0)
        assert e.proposed_anchor is None  # latched off: no proposal while disarmed
        e.apply_verdict(STABLE)
        assert not e.growth_enabled
    run(e, [100.0, 100.0], sync_ms=5000.0)
    e.apply_verdict(STABLE)  # 5th consecutive Stable re-arms
    assert e.growth_enabled and e.anchor == 10
    run(e, [100.0, 100.0], sync_ms=5000.0)
    assert e.proposed_anchor == 20


def test_nudge_down_verdict_discards_proposal_first() -> None:
    e = ElChe(2, 10)
    run(e, RIG_3_TO_1, sync_ms=5000.0, n=2)
    assert e.proposed_anchor == 20
    e.apply_verdict(nudge_down(0.5))
    assert e.anchor == 5 and e.batch_counts == [15, 5] and not e.growth_enabled
    e.apply_verdict(STABLE)  # nothing stale left to overwrite the nudge
    assert e.anchor == 5


def test_warmup_needs_twice_the_target_then_stable_fires_at_target() -> None:
    e = ElChe(2, 10, overhead_target=0.10)
    for _ in range(5):  # overhead 150 / 1150 = 0.13: above target, below 2x target
        run(e, [100.0, 100.0], sync_ms=150.0)
        assert e.proposed_anchor is None
    assert e.phase is Phase.STABLE
    run(e, [100.0, 100.0], sync_ms=150.0)
    assert e.proposed_anchor == 14  # ceil(10 * 0.1304 / 0.10)


def test_fill_counts_as_fixed_overhead_and_is_consumed() -> None:
    e = ElChe(2, 10)
    rep = WindowReport([1000.0, 1000.0], [10, 10], [0.0, 0.0], [0, 0], [0.0, 5000.0], 0.0, False)
    e.report_window(rep)
    e.report_window(rep)  # anchor rank 0 has no fill: nothing to amortise
    assert e.proposed_anchor is None
    e2 = ElChe(2, 10).with_initial_anchor(1)
    e2.report_window(rep)
    e2.report_window(rep)  # anchor rank 1: fill 5000 vs window 1000
    assert e2.proposed_anchor == 20 and e2.staged()["fill_ms"] == [0.0, 0.0]


def test_growth_clamped_to_max_and_off_when_inapplicable_or_cap_binding() -> None:
    e = ElChe(2, 10, max_anchor=15)
    run(e, [100.0, 100.0], sync_ms=5000.0, n=2)
    assert e.proposed_anchor == 15
    e = ElChe(2, 10, window_growth_applicable=False)  # Sync: no window to amortise
    run(e, [100.0, 100.0], sync_ms=5000.0, n=6)
    assert e.proposed_anchor is None
    e = ElChe(2, 10)
    e.set_max_total_batches(15)
    run(e, [100.0, 100.0], sync_ms=5000.0, n=2)
    assert e.window_cap_binding and e.proposed_anchor is None


# ---------------------------------------------------------------- anchor movers
def test_nudge_anchor_down_clamps_and_bypasses_min_anchor() -> None:
    e = ElChe(2, 10)  # min_anchor = 10
    e.nudge_anchor_down(0.5)
    assert e.anchor == 5
    e.nudge_anchor_down(2.0)  # factor clamped to 1: never grows
    assert e.anchor == 5
    e.nudge_anchor_down(float("nan"))
    assert e.anchor == 5
    e = ElChe(2, 10)
    e.nudge_anchor_down(0.0)  # factor clamped to 0.1 -> ceil(1.0)
    assert e.anchor == 1
    e.nudge_anchor_down(0.5)  # floor 1
    assert e.anchor == 1


def test_relax_anchor_up() -> None:
    e = ElChe(2, 10)
    run(e, RIG_3_TO_1)
    e.apply_verdict(STABLE, relax_up=True)
    assert e.anchor == 11 and e.batch_counts == [33, 11]
    e.apply_verdict(STABLE)  # without relax_up the anchor holds
    assert e.anchor == 11
    e = ElChe(2, 10, max_anchor=10)
    e.relax_anchor_up()
    assert e.anchor == 10
    e = ElChe(2, 10, max_batch_diff=20)
    run(e, RIG_3_TO_1)
    e.relax_anchor_up()  # projected [33, 11]: spread 22 > 20
    assert e.anchor == 10
    e.with_max_batch_diff(22).relax_anchor_up()
    assert e.anchor == 11


# ---------------------------------------------------------------- phases
def test_phases_probe_warmup_stable_mature() -> None:
    e = ElChe(2, 10)
    seen = []
    for _ in range(21):
        run(e, RIG_3_TO_1)
        seen.append(e.phase)
    assert seen[0] is Phase.WARMUP and seen[3] is Phase.WARMUP
    assert seen[4] is Phase.STABLE and seen[18] is Phase.STABLE  # 5th report
    assert seen[19] is Phase.MATURE and e.calibration_count == 21
    assert [p.value for p in Phase] == ["probe", "warmup", "stable", "mature"]


# ---------------------------------------------------------------- report_window
def _rep(wall, steps, dms, db, coherent) -> WindowReport:
    return WindowReport(wall, steps, dms, db, [0.0] * len(wall), 1.0, coherent)


def test_report_window_scale_selection_never_mixes() -> None:
    e = ElChe(2, 4)
    e.report_window(_rep([40.0, 100.0], [4, 4], [80.0, 220.0], [4, 4], True))
    assert e.smoothed_ms_all() == pytest.approx([20.0, 55.0])  # delivered scale
    e = ElChe(2, 4)
    e.report_window(_rep([40.0, 100.0], [4, 4], [80.0, 220.0], [4, 4], False))
    assert e.smoothed_ms_all() == pytest.approx([10.0, 25.0])  # compute scale for all
    e = ElChe(2, 4)
    e.report_window(_rep([40.0, 100.0], [4, 4], [80.0, 0.0], [4, 0], True))
    assert e.smoothed_ms_all() == pytest.approx([20.0, 25.0])  # non-mover: its own pair


def test_all_zero_window_reports_nothing() -> None:
    e = ElChe(2, 4)
    e.report_window(_rep([0.0, 0.0], [0, 0], [0.0, 0.0], [0, 0], True))
    assert not e.is_calibrated and e.calibration_count == 0


def test_report_timing_rejects_wrong_length() -> None:
    with pytest.raises(ValueError):
        ElChe(2).report_timing([1.0], [1], 0.0)


# ---------------------------------------------------------------- read-outs, state
def test_recent_batch_share_averages_last_ten_snapshots() -> None:
    e = ElChe(2, 10)
    assert e.recent_batch_share() == [0.5, 0.5]
    run(e, [10.0, 10.0], n=10)  # ten [10, 10] snapshots
    run(e, RIG_3_TO_1)  # rank 1 window mean (10,10,10,10,30) = 14 -> schedule [14, 10]
    assert e.batch_counts == [14, 10]
    # nine surviving [10, 10] snapshots + [14, 10]; the oldest one fell out (cap 10)
    assert e.recent_batch_share() == pytest.approx([104 / 204, 100 / 204])


def test_state_dict_round_trip() -> None:
    e = ElChe(2, 10)
    run(e, RIG_3_TO_1, n=6)
    d = json.loads(json.dumps(e.state_dict()))
    assert set(d) == {"anchor", "anchor_rank", "smoothed_ms_per_batch", "phase", "calibration_count"}
    f = ElChe(2, 3, max_anchor=500)
    f.load_state_dict(d)
    assert (f.anchor, f.anchor_rank, f.phase, f.calibration_count) == (10, 1, Phase.STABLE, 6)
    assert f.smoothed_ms_all() == pytest.approx(RIG_3_TO_1) and f.is_calibrated
    assert f.batch_counts == [30, 10]
    assert f.knobs()["max_anchor"] == 500  # knobs come from the new config
    with pytest.raises(ValueError):
        ElChe(3, 10).load_state_dict(d)


def test_state_dict_of_uncalibrated_balancer() -> None:
    d = ElChe(2, 10).state_dict()
    assert d["anchor_rank"] is None and d["phase"] == "probe"
    f = ElChe(2, 10)
    f.load_state_dict(d)
    assert not f.is_calibrated and f.batch_counts == [10, 10]
    assert all(math.isfinite(x) for x in d["smoothed_ms_per_batch"])


def test_a_cold_start_probe_sizes_the_first_window_and_leaves_calibration_to_the_reduces() -> None:
    e = ElChe(3, anchor=10)
    assert e.seed_from_probe([10.0, 30.0, 20.0])
    assert e.batch_counts == [30, 10, 15]
    # nothing else moved: the first reduce's report calibrates by the reference's rules
    assert not e.is_calibrated and e.phase is Phase.PROBE and e.anchor_rank is None and e.smoothed_ms(0) == 0.0
    assert not e.seed_from_probe([10.0, 10.0, 10.0]), "once: the probed counts stand like a hint"
    e.report_timing([100.0, 200.0, 200.0], [10, 10, 10], 1.0)
    assert e.is_calibrated and e.batch_counts == [20, 10, 10]
    assert not e.seed_from_probe([10.0, 30.0, 20.0]), "a calibrated schedule is not re-seeded"


@pytest.mark.parametrize("ms", [[10.0, 0.0], [10.0, math.nan], [10.0, math.inf], [10.0]])
def test_a_probe_without_a_positive_reading_for_every_rank_is_refused(ms: list[float]) -> None:
    e = ElChe(2, anchor=10)
    assert not e.seed_from_probe(ms)
    assert e.batch_counts == [10, 10]


def test_a_probe_keeps_the_users_speed_hint_and_the_window_cap() -> None:
    hinted = ElChe(2, anchor=10).with_speed_ratio(1, 2.0)
    assert not hinted.seed_from_probe([10.0, 50.0])
    assert hinted.batch_counts == [20, 10]
    capped = ElChe(2, anchor=10)
    capped.set_max_total_batches(24)
    assert capped.seed_from_probe([10.0, 50.0])
    assert sum(capped.batch_counts) == 24 and capped.window_cap_binding


def test_the_window_cap_spreads_its_remainder_one_batch_a_rank() -> None:
    """The flooring of the window<=epoch cap leaves fewer batches than ranks; the reference hands all of them to
    the fastest rank, which at 1,024 ranks made one rank run ~500 batches more than its peers (every other rank
    waited for it at each reduce). One each to the fastest, ties to the highest rank: the same when one is left."""
    e = ElChe(5, anchor=10)
    e.set_max_total_batches(38)
    assert e.seed_from_probe([10.0, 10.0, 10.0, 10.0, 20.0])
    assert e.batch_counts == [8, 8, 9, 9, 4] and sum(e.batch_counts) == 38
    one = ElChe(2, anchor=10)
    one.set_max_total_batches(29)
    assert one.seed_from_probe([10.0, 20.0])
    assert one.batch_counts == [20, 9]  # floors [19, 9], the one left to the fastest
