"""Convergence guards (algorithms.md 6.1-6.4): one test or more per rule."""
from __future__ import annotations

import math
from typing import Any, TypeVar

import pytest

from flodl_exp.policy.actions import STABLE, SUPPRESS_GROWTH, nudge_down
from flodl_exp.policy.guards import (
    DivergenceReport,
    LambdaEstimator,
    MsfGuard,
    NoGuard,
    TrendGuard,
    build_guard,
)

G = TypeVar("G")


def rep(*deltas: float | None) -> DivergenceReport:
    """A report with these deltas; None (a rank's missing reading, never sent by the cycle) must read as 0."""
    return DivergenceReport(deltas=list(deltas))  # type: ignore[arg-type]


def feed(guard, values, k_used=8, k_max=4):
    return [guard.report(rep(v), k_used, k_max) for v in values]


# --- DivergenceReport -------------------------------------------------------

def test_max_delta_picks_worst_rank():
    assert rep(0.01, 0.05, 0.03).max_relative_delta() == pytest.approx(0.05)


def test_max_delta_empty_and_missing_rank_read_as_zero():
    assert rep().max_relative_delta() == 0.0
    assert rep(None, None).max_relative_delta() == 0.0
    assert rep(None, 0.02).max_relative_delta() == pytest.approx(0.02)
    assert rep(float("nan"), 0.02).max_relative_delta() == pytest.approx(0.02)


def test_max_delta_is_never_negative():
    assert rep(-0.5, -0.1).max_relative_delta() == 0.0


def test_readouts_none_without_norms():
    assert rep(0.01).cosine_similarities() is None
    assert rep(0.01).magnitude_shifts() is None
    only_pre = DivergenceReport([0.01], pre_norms=[1.0])
    assert only_pre.cosine_similarities() is None and only_pre.magnitude_shifts() is None
    only_post = DivergenceReport([0.01], post_norm=1.0)
    assert only_post.cosine_similarities() is None and only_post.magnitude_shifts() is None


def test_cosine_formula_matches_vectors():
    # pre = (3, 4), post = (4, 3): |pre| = |post| = 5, |pre - post| = sqrt(2).
    delta = math.sqrt(2.0) / 5.0
    cos = DivergenceReport([delta], [5.0], 5.0).cosine_similarities()
    assert cos == [pytest.approx(24.0 / 25.0)]


def test_cosine_near_one_for_small_delta():
    cos = DivergenceReport([0.001], [10.0], 10.0).cosine_similarities()
    assert cos is not None and cos[0] > 0.999


def test_cosine_clamped_to_unit_interval():
    # Inconsistent norms (rounding in the wild) would overshoot the law of cosines.
    cos = DivergenceReport([0.0, 10.0], [1.0, 1.0], 1.0).cosine_similarities()
    assert cos is not None and cos[0] == 1.0
    assert cos[1] == -1.0
    big = DivergenceReport([0.0], [1.0], 1.0 + 1e-15).cosine_similarities()
    assert big is not None and big[0] <= 1.0


def test_cosine_thresholds_1e_10():
    assert DivergenceReport([0.1], [1.0], 1e-11).cosine_similarities() is None
    assert DivergenceReport([0.1], [1.0], 1e-10).cosine_similarities() is not None
    cos = DivergenceReport([0.1, 0.1], [1e-11, 1.0], 1.0).cosine_similarities()
    assert cos is not None and cos[0] == 0.0 and cos[1] != 0.0


def test_cosine_missing_delta_reads_as_zero():
    cos = DivergenceReport([None], [2.0], 2.0).cosine_similarities()  # type: ignore[list-item]
    assert cos == [pytest.approx(1.0)]


def test_magnitude_shifts():
    shifts = DivergenceReport([0.01, 0.02], [10.5, 9.8], 10.0).magnitude_shifts()
    assert shifts == [pytest.approx(0.5), pytest.approx(-0.2)]


# --- NoGuard ----------------------------------------------------------------

def test_no_guard_always_stable_and_silent():
    g = NoGuard()
    assert all(a == STABLE for a in feed(g, [0.5, 0.6, 0.7, 0.8, 0.9]))
    assert g.telemetry() == []
    g.reset()
    assert g.state_dict() == {}


# --- TrendGuard -------------------------------------------------------------

def test_trend_three_strict_rises_above_threshold_suppress():
    assert feed(TrendGuard(0.01), [0.02, 0.03, 0.04]) == [STABLE, STABLE, SUPPRESS_GROWTH]


def test_trend_default_threshold_is_reference_0_01():
    assert TrendGuard().threshold == 0.01


def test_trend_not_strictly_rising_is_stable():
    assert feed(TrendGuard(0.01), [0.05, 0.04, 0.06])[-1] == STABLE
    assert feed(TrendGuard(0.01), [0.05, 0.05, 0.06])[-1] == STABLE  # equal is not a rise


def test_trend_below_or_at_threshold_is_stable():
    assert feed(TrendGuard(0.10), [0.01, 0.02, 0.03])[-1] == STABLE
    assert feed(TrendGuard(0.03), [0.01, 0.02, 0.03])[-1] == STABLE  # must be strictly above


def test_trend_keeps_firing_while_rising_and_never_nudges():
    acts = feed(TrendGuard(0.01), [0.02 * i for i in range(1, 10)])
    assert acts[2:] == [SUPPRESS_GROWTH] * 7
    assert all(a.kind != "nudge_down" for a in acts)


def test_trend_ring_of_five():
    g = TrendGuard(0.01)
    feed(g, [i * 0.01 for i in range(10)])
    assert g.history == pytest.approx([0.05, 0.06, 0.07, 0.08, 0.09])


def test_trend_telemetry_d_history_last():
    g = TrendGuard(0.01)
    assert g.telemetry() == []
    feed(g, [0.02, 0.07])
    assert g.telemetry() == [("d_history_last", pytest.approx(0.07))]


def test_trend_reset_clears_ring():
    g = TrendGuard(0.01)
    feed(g, [0.02, 0.03])
    g.reset()
    assert g.history == [] and g.telemetry() == []
    assert feed(g, [0.04])[0] == STABLE  # the old rises no longer count


def test_trend_state_round_trip_keeps_detection_across_resume():
    g = TrendGuard(0.01)
    feed(g, [0.02, 0.03])
    state = g.state_dict()
    assert state == {"trend_history": [pytest.approx(0.02), pytest.approx(0.03)]}
    resumed = TrendGuard(0.01)
    resumed.load_state_dict(state)
    assert resumed.history == g.history
    assert feed(resumed, [0.04]) == [SUPPRESS_GROWTH]  # not blind for 3 cycles


def test_trend_load_null_history_and_overlong_history():
    g = TrendGuard(0.01, history=[0.1])
    g.load_state_dict({"trend_history": None})
    assert g.history == []
    g.load_state_dict({"trend_history": [1, 2, 3, 4, 5, 6, 7]})
    assert g.history == [3.0, 4.0, 5.0, 6.0, 7.0]
    with pytest.raises(ValueError, match="trend_history"):
        g.load_state_dict({"trend_history": ["x"]})


# --- LambdaEstimator --------------------------------------------------------

def test_lambda_first_event_has_no_rate():
    s = LambdaEstimator().observe(0.05, 8, 4)
    assert s.lam is None and s.lam_ema is None
    assert (s.d, s.k_used, s.k_max) == (0.05, 8, 4)


def test_lambda_uses_k_max_not_k_used():
    e = LambdaEstimator()
    e.observe(0.01, 8, 4)
    s = e.observe(0.02, 1000, 4)
    assert s.lam == pytest.approx(math.log(2.0) / 4.0)
    e2 = LambdaEstimator()
    e2.observe(0.01, 12, 4)
    assert e2.observe(0.02, 12, 4).lam == pytest.approx(s.lam)  # world size independent


def test_lambda_bias_correction_recovers_first_value_exactly():
    e = LambdaEstimator(alpha=0.9)
    e.observe(1.0, 1, 1)
    s = e.observe(math.e, 1, 1)
    assert s.lam == pytest.approx(1.0)
    assert s.lam_ema == pytest.approx(1.0)  # raw EMA is 0.1, corrected by 1 - 0.9
    s = e.observe(1.0, 1, 1)  # lam = -1
    raw = 0.9 * 0.1 + 0.1 * -1.0
    assert s.lam_ema == pytest.approx(raw / (1 - 0.9 ** 2))


def test_lambda_noise_floor_breaks_the_chain_but_keeps_ema():
    e = LambdaEstimator()
    e.observe(0.01, 1, 1)
    ema = e.observe(0.02, 1, 1).lam_ema
    s = e.observe(1e-9, 1, 1)  # below the floor: no rate
    assert s.lam is None and s.lam_ema == pytest.approx(ema)
    assert e.observe(0.05, 1, 1).lam is None  # no previous D after the floor
    assert e.observe(0.10, 1, 1).lam == pytest.approx(math.log(2.0))


def test_lambda_zero_k_max_gives_no_rate():
    e = LambdaEstimator()
    e.observe(0.01, 0, 0)
    assert e.observe(0.02, 0, 0).lam is None


def test_lambda_rejects_bad_alpha():
    with pytest.raises(ValueError, match="alpha"):
        LambdaEstimator(alpha=1.5)


# --- MsfGuard ---------------------------------------------------------------

def growing(n: int, rate: float, k_max: int = 1, d0: float = 0.01):
    """D values growing at ``rate`` per batch with ``k_max`` batches per event."""
    return [d0 * math.exp(rate * k_max * i) for i in range(n)]


def test_msf_defaults():
    g = MsfGuard()
    assert (g.suppress_threshold, g.suppress_sustain) == (1e-3, 3)
    assert (g.nudge_threshold, g.nudge_sustain, g.nudge_factor) == (1e-2, 3, 0.5)
    assert g.estimator.alpha == 0.9 and g.estimator.noise_floor == 1e-8


def test_msf_suppress_after_three_sustained_events():
    # rate 5e-3: above suppress (1e-3), below nudge (1e-2). Event 0 has no rate.
    acts = feed(MsfGuard(), growing(7, 5e-3), k_max=1)
    assert acts == [STABLE, STABLE, STABLE, SUPPRESS_GROWTH, STABLE, STABLE, SUPPRESS_GROWTH]


def test_msf_nudge_wins_over_suppress():
    acts = feed(MsfGuard(), growing(4, 0.05), k_max=1)
    assert acts == [STABLE, STABLE, STABLE, nudge_down(0.5)]


def test_msf_streaks_reset_independently():
    g = MsfGuard()
    acts = feed(g, growing(4, 0.05), k_max=1)
    assert acts[-1].kind == "nudge_down"
    # The nudge reset only its own streak: suppress is still armed at 3.
    assert (g.nudge_streak, g.suppress_streak) == (0, 3)
    # Next sustained event: suppress (streak 4 >= 3) fires, nudge counts 1.
    assert feed(g, [growing(5, 0.05)[-1]], k_max=1) == [SUPPRESS_GROWTH]
    assert (g.nudge_streak, g.suppress_streak) == (1, 0)


def test_msf_k_max_sets_the_time_axis():
    # The same D sequence spread over 100 batches per event is a slow rate.
    values = growing(6, 0.05, k_max=1)
    assert all(a == STABLE for a in feed(MsfGuard(), values, k_used=400, k_max=100))
    assert nudge_down(0.5) in feed(MsfGuard(), values, k_used=400, k_max=1)


def test_msf_decaying_or_flat_signal_stays_stable():
    assert all(a == STABLE for a in feed(MsfGuard(), growing(10, -0.05)))
    assert all(a == STABLE for a in feed(MsfGuard(), [0.05] * 10))


def test_msf_without_nudge_only_suppresses():
    g = MsfGuard().without_nudge()
    assert math.isinf(g.nudge_threshold)
    acts = feed(g, growing(10, 0.05), k_max=1)
    assert all(a.kind != "nudge_down" for a in acts)
    assert SUPPRESS_GROWTH in acts


def test_msf_builders_chain_and_validate():
    g = MsfGuard().with_alpha(0.5).with_suppress(2e-3, 2).with_nudge(5e-2, 4, 0.25)
    assert g.estimator.alpha == 0.5
    assert (g.suppress_threshold, g.suppress_sustain) == (2e-3, 2)
    assert (g.nudge_threshold, g.nudge_sustain, g.nudge_factor) == (5e-2, 4, 0.25)
    with pytest.raises(ValueError, match="sustain"):
        MsfGuard(suppress_sustain=0)
    with pytest.raises(ValueError, match="nudge_factor"):
        MsfGuard(nudge_factor=1.5)


def test_msf_telemetry_and_reset():
    g = MsfGuard()
    assert g.telemetry() == []
    feed(g, [0.01])
    assert g.telemetry() == []  # no rate yet
    feed(g, [0.02])
    names = [n for n, _ in g.telemetry()]
    assert names == ["lambda_raw", "lambda_ema"]
    g.reset()
    assert g.telemetry() == [] and g.estimator.prev_d is None and g.estimator.t == 0
    assert feed(g, [0.04]) == [STABLE]


def test_msf_state_round_trip():
    g = MsfGuard()
    values = growing(6, 5e-3)
    feed(g, values[:2])
    resumed = MsfGuard()
    resumed.load_state_dict(g.state_dict())
    assert feed(resumed, values[2:]) == feed(g, values[2:])


# --- build_guard ------------------------------------------------------------

def test_build_guard_none():
    assert isinstance(build_guard("none"), NoGuard)
    # no_divergence_guard wins over a threshold (6.4): accepted, unused.
    assert isinstance(build_guard("none", threshold=0.05, easgd_alpha=0.5), NoGuard)


def _built(cls: type[G], kind: str, **kw: Any) -> G:
    g = build_guard(kind, **kw)
    assert isinstance(g, cls), g
    return g


def test_build_guard_trend_defaults_overwrite_and_easgd():
    assert _built(TrendGuard, "trend").threshold == 0.05
    assert _built(TrendGuard, "trend", easgd_alpha=0.5).threshold == 0.3
    assert _built(TrendGuard, "trend", threshold=0.2, easgd_alpha=0.5).threshold == 0.2
    assert _built(TrendGuard, " Trend ", threshold=0.0).threshold == 0.0


def test_build_guard_trend_seeded_from_checkpoint():
    g = _built(TrendGuard, "trend", threshold=0.01, trend_history=[0.02, 0.03])
    assert g.history == [0.02, 0.03]
    assert feed(g, [0.04]) == [SUPPRESS_GROWTH]


def test_build_guard_msf_defaults_and_options():
    assert _built(MsfGuard, "msf").nudge_threshold == 1e-2
    g = _built(MsfGuard, "msf", msf_alpha=0.8, msf_suppress_threshold=2e-3, msf_nudge_factor=0.3)
    assert (g.estimator.alpha, g.suppress_threshold, g.nudge_factor) == (0.8, 2e-3, 0.3)
    assert math.isinf(_built(MsfGuard, "msf", msf_nudge=False).nudge_threshold)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(kind="bogus"), "unknown 'bogus'"),
        (dict(kind="trend", threshold=-1.0), "threshold"),
        (dict(kind="trend", threshold=float("nan")), "threshold"),
        (dict(kind="msf", threshold=0.05), "msf_suppress_threshold"),
        (dict(kind="trend", msf_alpha=0.5), "msf_alpha"),
        (dict(kind="none", msf_nudge=False), "msf_nudge"),
    ],
)
def test_build_guard_errors_are_one_line(kwargs, match):
    with pytest.raises(ValueError, match=match) as exc:
        build_guard(**kwargs)
    assert "\n" not in str(exc.value)
