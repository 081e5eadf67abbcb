"""The summary's ``predicted`` line (issue 49, item 5): shown only over a training wall long enough for the comparison
to mean something, with the measured figure on the prediction's basis and the wall it covers; its sync count and
mode=auto's line (item 6)."""
from __future__ import annotations

from flodl_exp.progress import PREDICTION_MIN_WALL_S, prediction_line

PRED = {"predicted/samples_per_s": 8000.0, "measured/samples_per_s": 9000.0, "predicted/error_pct": 12.5}


def test_a_long_enough_run_shows_both_figures_and_the_wall_they_cover() -> None:
    line = prediction_line({**PRED, "measured/wall_s": PREDICTION_MIN_WALL_S + 2.25})
    assert line == "  predicted   8000 samples/s on the measured rig; measured 9000 over 7.2s of training (+12.5%)"


def test_a_short_run_says_nothing() -> None:
    assert prediction_line({**PRED, "measured/wall_s": PREDICTION_MIN_WALL_S - 0.01}) is None
    assert prediction_line({**PRED, "measured/wall_s": float("nan")}) is None


def test_no_prediction_or_no_measured_wall_says_nothing() -> None:
    assert prediction_line(None) is None
    assert prediction_line({}) is None
    assert prediction_line(PRED) is None  # a result.json from before measured/wall_s: no basis to show


def test_the_summary_counts_syncs_as_the_console_and_the_report_do() -> None:
    from flodl_exp.progress import sync_count

    epochs = [{"event": "epoch", "syncs": 0.0}, {"event": "epoch", "syncs": 2.0}, {"event": "epoch", "syncs": 1.0}]
    assert sync_count(epochs, 4) == "3 during the epochs, +1 after the last (the final consensus)"  # the syncs tag's 4
    assert sync_count(epochs, 3) == "3"
    assert sync_count(epochs, 6) == "3 during the epochs, +3 between or after them (the final consensus included)"
    assert sync_count([], None) == "0"


def test_mode_auto_says_its_choice_as_training_starts() -> None:
    from flodl_exp.progress import _plain_lines

    ev = {"event": "auto_mode", "mode": "cpu_async", "reason": "cpu_async: predicted 17258 samples/s", "candidates": []}
    assert _plain_lines(ev, 3, 0.0) == ["mode=auto chose cpu_async: predicted 17258 samples/s"]
