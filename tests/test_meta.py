"""LR-aware meta-controller (algorithms.md 6.6): one test or more per rule."""
from __future__ import annotations

import enum

import pytest

from flodl_exp.policy.actions import STABLE, SUPPRESS_GROWTH, nudge_down
from flodl_exp.policy.meta import LrEventMeta, LrEventMetaConfig

NUDGE = nudge_down(0.5)


class Phase(enum.Enum):
    """Stand-in for ElChe's Phase enum (string values)."""

    PROBE = "probe"
    WARMUP = "warmup"
    STABLE = "stable"
    MATURE = "mature"


def run(meta: LrEventMeta, phase, seq):
    """Feed ``(lr, anchor, verdict)`` triples; return every result."""
    return [meta.observe(lr, anchor, v, phase) for lr, anchor, v in seq]


def factor(action) -> float:
    assert action is not None and action.kind == "nudge_down", action
    return action.factor


def test_default_config():
    c = LrEventMetaConfig()
    assert (c.lr_window_cap, c.anchor_window_cap, c.guard_window_cap) == (3, 5, 5)
    assert c.sharp_drop_threshold == 0.3
    assert (c.effective_factor_min, c.effective_factor_max) == (0.1, 0.95)


def test_windows_are_capped_fifos():
    m = LrEventMeta()
    run(m, "stable", [(0.1 * i, 100 + i, STABLE) for i in range(8)])
    assert m.lr_window == pytest.approx((0.5, 0.6, 0.7))
    assert m.anchor_window == (103, 104, 105, 106, 107)
    assert len(m.guard_window) == 5


def test_single_observation_is_noop():
    assert LrEventMeta().observe(0.1, 100, STABLE, "stable") is None


def test_probe_is_always_noop_but_still_records():
    m = LrEventMeta()
    acts = run(m, "probe", [(0.1, 100, NUDGE), (0.01, 100, NUDGE), (0.001, 100, NUDGE)])
    assert acts == [None, None, None]
    assert len(m.lr_window) == 3
    # Leaving probe: the recorded history counts at once (cliff 0.001 -> 0.0001).
    assert m.observe(0.0001, 100, NUDGE, "mature") is not None


@pytest.mark.parametrize("phase", ["warmup", "stable", "mature", Phase.STABLE, Phase.MATURE])
def test_cliff_fires_on_sharp_drop_with_base_half(phase):
    m = LrEventMeta()
    m.observe(0.1, 100, STABLE, phase)
    assert factor(m.observe(0.01, 100, STABLE, phase)) == pytest.approx(0.5)


def test_cliff_threshold_is_strictly_above_30_percent():
    # (10 - 7) / 10 is exactly the float 0.3: the boundary itself does not fire.
    for lr_now, fires in [(7.5, False), (7.0, False), (6.9, True), (6.5, True)]:
        m = LrEventMeta()
        m.observe(10.0, 100, STABLE, "stable")
        assert (m.observe(lr_now, 100, STABLE, "stable") is not None) is fires, lr_now


def test_cliff_silent_on_rise_smooth_decay_and_zero_prev():
    m = LrEventMeta()
    assert run(m, "stable", [(0.001, 100, STABLE), (0.1, 100, STABLE)])[-1] is None
    m = LrEventMeta()
    assert all(a is None for a in run(m, "stable", [(0.1 * 0.98 ** i, 100, STABLE) for i in range(10)]))
    m = LrEventMeta()
    assert run(m, "stable", [(0.0, 100, STABLE), (0.0, 100, STABLE)])[-1] is None


def test_cliff_compares_only_the_last_two_lrs():
    # A gradual 3-step drop of 20% each never fires, though 0.1 -> 0.064 is 36%.
    m = LrEventMeta()
    acts = run(m, "stable", [(0.1, 100, STABLE), (0.08, 100, STABLE), (0.064, 100, STABLE)])
    assert acts == [None, None, None]


@pytest.mark.parametrize("phase, k, base", [("warmup", 5, 0.3), ("stable", 3, 0.5), ("mature", 2, 0.7)])
def test_convergence_streak_k_and_base_per_phase(phase, k, base):
    m = LrEventMeta()
    acts = run(m, phase, [(0.1, 100, SUPPRESS_GROWTH)] * k)
    assert acts[:-1] == [None] * (k - 1)  # k - 1 objections are not enough
    assert factor(acts[-1]) == pytest.approx(base)


def test_convergence_needs_the_last_k_all_objecting():
    m = LrEventMeta()
    seq = [(0.1, 100, STABLE), (0.1, 100, NUDGE), (0.1, 100, NUDGE)]
    assert run(m, "stable", seq)[-1] is None  # only 2 of the last 3
    m = LrEventMeta()
    seq = [(0.1, 100, NUDGE), (0.1, 100, NUDGE), (0.1, 100, STABLE)]
    assert run(m, "mature", seq)[-1] is None  # the newest is Stable


def test_convergence_counts_nudge_and_suppress_alike():
    m = LrEventMeta()
    acts = run(m, "stable", [(0.1, 100, SUPPRESS_GROWTH), (0.1, 100, NUDGE), (0.1, 100, SUPPRESS_GROWTH)])
    assert factor(acts[-1]) == pytest.approx(0.5)


def test_convergence_keeps_firing_while_sustained():
    m = LrEventMeta()
    acts = run(m, "mature", [(0.1, 100, NUDGE)] * 4)
    assert acts[0] is None and all(a is not None for a in acts[1:])


def test_anchor_trend_values():
    m = LrEventMeta()
    assert m.anchor_trend() == 0.0
    m.observe(0.1, 100, STABLE, "stable")
    assert m.anchor_trend() == 0.0  # one sample
    run(m, "stable", [(0.1, a, STABLE) for a in (110, 120, 130, 140)])
    assert m.anchor_trend() == pytest.approx((140 - 120) / 120)
    m = LrEventMeta()
    run(m, "stable", [(0.1, 0, STABLE), (0.1, 0, STABLE)])
    assert m.anchor_trend() == 0.0  # non-positive mean


def test_falling_anchor_dampens_the_nudge():
    m = LrEventMeta()
    run(m, "stable", [(0.1, 100, STABLE)] * 4)
    trend = (50 - 90) / 90  # window (100, 100, 100, 100, 50), mean 90
    f = factor(m.observe(0.01, 50, STABLE, "stable"))
    assert f == pytest.approx(0.5 - 0.5 * trend)
    assert 0.5 < f < 0.95


def test_rising_anchor_amplifies_the_nudge():
    m = LrEventMeta()
    run(m, "stable", [(0.1, a, STABLE) for a in (100, 110, 120, 130, 140)])
    trend = (140 - 128) / 128  # window (110, 120, 130, 140, 140)
    f = factor(m.observe(0.01, 140, STABLE, "stable"))
    assert f == pytest.approx(0.5 - 0.5 * trend)
    assert 0.1 < f < 0.5


def test_effective_factor_is_clamped():
    m = LrEventMeta()
    run(m, "stable", [(0.1, 1, STABLE)] * 4)
    assert factor(m.observe(0.01, 1000, STABLE, "stable")) == pytest.approx(0.1)
    m = LrEventMeta()
    run(m, "stable", [(0.1, 1000, STABLE)] * 4)
    assert factor(m.observe(0.01, 1, STABLE, "stable")) == pytest.approx(0.95)


def test_both_watchers_compound_as_a_product():
    m = LrEventMeta()
    run(m, "mature", [(0.1, 100, NUDGE)] * 2)
    assert factor(m.observe(0.01, 100, NUDGE, "mature")) == pytest.approx(0.5 * 0.7)


def test_compound_product_is_clamped_to_the_floor():
    m = LrEventMeta()
    run(m, "warmup", [(0.1, 100, NUDGE)] * 4)
    # Anchor trend (200 - 120) / 120: cliff 0.5 - 0.5*t = 0.167, warmup 0.3 - 0.7*t
    # clamps to 0.1, so the product 0.0167 clamps to the 0.1 floor.
    f = factor(m.observe(0.01, 200, NUDGE, "warmup"))
    assert f == pytest.approx(0.1)


def test_phase_enum_and_string_are_equivalent_and_unknown_rejected():
    a, b = LrEventMeta(), LrEventMeta()
    seq = [(0.1, 100, NUDGE), (0.1, 100, NUDGE), (0.01, 90, NUDGE)]
    assert run(a, Phase.MATURE, seq) == run(b, "mature", seq)
    assert LrEventMeta().observe(0.1, 100, STABLE, Phase.PROBE) is None
    with pytest.raises(ValueError, match="phase"):
        LrEventMeta().observe(0.1, 100, STABLE, "steady")


def test_reset_clears_windows():
    m = LrEventMeta()
    run(m, "mature", [(0.1, 100, NUDGE)])
    m.reset()
    assert m.lr_window == () and m.anchor_window == () and m.guard_window == ()
    assert m.observe(0.01, 100, NUDGE, "mature") is None


def test_config_validation():
    with pytest.raises(ValueError, match="lr_window_cap"):
        LrEventMetaConfig(lr_window_cap=0)
    with pytest.raises(ValueError, match="effective_factor"):
        LrEventMetaConfig(effective_factor_min=0.9, effective_factor_max=0.5)


def test_accepts_elche_phase_enum():
    from flodl_exp.policy.elche import Phase as ElChePhase

    m = LrEventMeta()
    assert m.observe(0.1, 100, NUDGE, ElChePhase.PROBE) is None
    m.observe(0.1, 100, NUDGE, ElChePhase.MATURE)
    assert factor(m.observe(0.1, 100, NUDGE, ElChePhase.MATURE)) == pytest.approx(0.7)
