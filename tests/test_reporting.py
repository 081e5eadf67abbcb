"""flodl_exp.reporting: the one best-mode rule of both reports (right for negative metrics in both
directions), the markdown table and the number formats."""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import pytest

from flodl_exp import reporting as rp


class Row(NamedTuple):
    name: str
    score: Optional[float]
    seconds: float


def _rule(rows: list[Row], higher_better: bool, bar: Optional[float] = None) -> tuple[str, Optional[str]]:
    out = rp.best_and_fastest(rows, lambda r: r.score, lambda r: r.seconds, higher_better, bar=bar)
    assert out is not None
    best, fast = out
    return best.name, (fast.name if fast is not None else None)


def test_higher_is_better_positive():
    rows = [Row("best", 0.90, 10.0), Row("near", 0.883, 5.0), Row("far", 0.85, 1.0)]
    assert _rule(rows, True) == ("best", "near")  # 0.883 >= 0.90 - 0.018 = 0.882


def test_lower_is_better_positive():
    rows = [Row("best", 0.50, 10.0), Row("near", 0.509, 3.0), Row("far", 0.6, 1.0)]
    assert _rule(rows, False) == ("best", "near")  # 0.509 <= 0.51


def test_higher_is_better_negative_metric():
    # e.g. a log-likelihood: -1.00 is best; the bound is -1.00 - 0.02 = -1.02 (bar * 0.98 = -0.98 would exclude the best)
    rows = [Row("best", -1.00, 10.0), Row("near", -1.015, 4.0), Row("far", -1.03, 1.0)]
    assert _rule(rows, True) == ("best", "near")


def test_lower_is_better_negative_metric():
    # e.g. a negative loss: -2.00 is best; the bound is -2.00 + 0.04 = -1.96 (bar * 1.02 = -2.04 would exclude the best)
    rows = [Row("best", -2.00, 10.0), Row("near", -1.97, 4.0), Row("far", -1.95, 1.0)]
    assert _rule(rows, False) == ("best", "near")


@pytest.mark.parametrize("higher_better", [True, False])
def test_the_best_row_always_qualifies_against_its_own_bar(higher_better):
    for v in (-3.0, -1e-9, 0.0, 1e-9, 3.0):
        assert _rule([Row("only", v, 5.0)], higher_better) == ("only", "only")


def test_a_reference_bar_in_both_directions_with_negative_values():
    rows = [Row("ref", -1.00, 10.0), Row("better", -0.90, 8.0), Row("near", -1.01, 3.0), Row("far", -1.05, 1.0)]
    assert _rule(rows, True, bar=-1.00) == ("better", "near")
    rows = [Row("ref", -1.00, 10.0), Row("better", -1.10, 8.0), Row("near", -0.99, 3.0), Row("far", -0.95, 1.0)]
    assert _rule(rows, False, bar=-1.00) == ("better", "near")


def test_no_row_reaches_a_reference_bar():
    assert _rule([Row("a", 0.5, 1.0)], True, bar=0.9) == ("a", None)


def test_rows_without_a_finite_score_take_no_part():
    rows = [Row("none", None, 0.1), Row("nan", math.nan, 0.1), Row("inf", math.inf, 0.1), Row("ok", 0.5, 9.0)]
    assert _rule(rows, True) == ("ok", "ok")
    assert rp.best_and_fastest([Row("nan", math.nan, 1.0)], lambda r: r.score, lambda r: r.seconds, True) is None
    assert rp.best_and_fastest([], lambda r: r.score, lambda r: r.seconds, False) is None


def test_good_enough_on_the_magnitude():
    assert rp.good_enough(-1.02, -1.0, True) and not rp.good_enough(-1.021, -1.0, True)
    assert rp.good_enough(-0.98, -1.0, False) and not rp.good_enough(-0.979, -1.0, False)
    assert rp.good_enough(0.0, 0.0, True) and not rp.good_enough(-1e-12, 0.0, True)


def test_formats_and_table():
    assert rp.fmt(None) == rp.fmt(math.nan) == rp.fmt(math.inf) == "—"
    assert rp.fmt(1.23456) == "1.2346" and rp.fmt(3, "{:d}") == "3"
    assert (rp.secs(9.876), rp.secs(12.34), rp.secs(None)) == ("9.88", "12.3", "—")
    assert (rp.fmt_eval(0.9512, True), rp.fmt_eval(0.5, False)) == ("95.12%", "0.5000")
    assert (rp.fmt_delta(0.005, True), rp.fmt_delta(-0.25, False), rp.fmt_delta(None, True)) == ("+0.50 pp", "-0.2500", "—")
    assert rp.table(["a", "b|c"], [["1", 2]]) == ["| a | b\\|c |", "|---|---|", "| 1 | 2 |"]
    assert rp.sampled(3) == [0, 1, 2] and rp.sampled(100, 5) == [0, 25, 50, 74, 99]
