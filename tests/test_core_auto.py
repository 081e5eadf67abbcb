"""mode=auto's choice is the core's (issue 50, item 2): the probe's books, its timeout, the configured mode kept when a
rank could not be measured, and the pick among the shell's predictions, all through ``handle`` on a bare core."""
from __future__ import annotations

from typing import Any

from test_control_core import cfg_of

from flodl_exp.core.auto_choice import (
    KEEP_MARGIN,
    PROBE_STEPS,
    PROBE_TIMEOUT_S,
    AutoProbeStarts,
    Candidate,
    ModeChosen,
    ModesPredicted,
    PredictModes,
    pick_mode,
)
from flodl_exp.core.commands import Broadcast, RankJoined, RankMessage, StartupCheck
from flodl_exp.core.control_core import recording_core
from flodl_exp.protocol.messages import Probe, ProbeResult


def _core(mode: str = "cpu_cadence") -> tuple[Any, list[Any]]:
    core, _ = recording_core(cfg_of(mode, 2, **{"mode.auto": True}))
    for r in range(2):
        core.handle(RankJoined(r, 0.0))
    return core, _


def _answer(r: int, ms: float, error: str | None = None) -> ProbeResult:
    return ProbeResult(step_ms=[] if error else [40.0] + [ms] * (PROBE_STEPS - 1), data_ms=[0.0] * PROBE_STEPS,
                       model_bytes=1000 + r, error=error)


def test_the_core_sends_the_probe_and_asks_for_predictions_once_every_rank_answered() -> None:
    core, _ = _core()
    out = core.handle(AutoProbeStarts(1.0))
    assert [c.payload for c in out if isinstance(c, Broadcast)] == [Probe(steps=PROBE_STEPS)]
    assert not [c for c in core.handle(RankMessage(0, _answer(0, 4.0), 2.0)) if isinstance(c, (PredictModes, ModeChosen))]
    asked = [c for c in core.handle(RankMessage(1, _answer(1, 12.0), 3.0)) if isinstance(c, PredictModes)]
    assert len(asked) == 1
    m = asked[0].measured
    assert m.step_ms[1][1:] == [12.0] * (PROBE_STEPS - 1) and m.model_bytes == 1001
    candidates = (Candidate("cpu_cadence", 100.0), Candidate("cpu_async", 150.0), Candidate("nccl_sync", 999.0, eligible=False))
    chosen = [c for c in core.handle(ModesPredicted(candidates, 4.0, note="step ms 4.0, 12.0")) if isinstance(c, ModeChosen)]
    assert len(chosen) == 1 and chosen[0].mode == "cpu_async" and chosen[0].probe_s == 2.0
    assert "step ms 4.0, 12.0" in chosen[0].reason and chosen[0].candidates == candidates
    assert not core.handle(ModesPredicted(candidates, 5.0)), "one verdict per run"


def test_a_rank_that_never_answers_keeps_the_configured_mode_at_the_probe_timeout() -> None:
    core, _ = _core("cpu_async")
    core.handle(AutoProbeStarts(10.0))
    core.handle(RankMessage(0, _answer(0, 4.0), 11.0))
    assert not [c for c in core.handle(StartupCheck(10.0 + PROBE_TIMEOUT_S - 1)) if isinstance(c, ModeChosen)]
    chosen = [c for c in core.handle(StartupCheck(10.0 + PROBE_TIMEOUT_S + 1)) if isinstance(c, ModeChosen)]
    assert len(chosen) == 1 and chosen[0].mode == "cpu_async" and "ranks [1] did not answer" in chosen[0].reason


def test_a_failed_probe_or_prediction_keeps_the_configured_mode() -> None:
    core, _ = _core()
    core.handle(AutoProbeStarts(0.0))
    core.handle(RankMessage(0, _answer(0, 4.0), 1.0))
    out = core.handle(RankMessage(1, _answer(1, 0.0, error="RuntimeError: no step"), 1.0))
    assert [c.mode for c in out if isinstance(c, ModeChosen)] == ["cpu_cadence"]
    assert "rank 1: RuntimeError: no step" in next(c for c in out if isinstance(c, ModeChosen)).reason
    core, _ = _core()
    core.handle(AutoProbeStarts(0.0))
    core.handle(RankMessage(0, _answer(0, 4.0), 1.0))
    core.handle(RankMessage(1, _answer(1, 9.0), 1.0))
    chosen = [c for c in core.handle(ModesPredicted((), 2.0, error="ValueError: no rig")) if isinstance(c, ModeChosen)]
    assert chosen[0].mode == "cpu_cadence" and "ValueError: no rig" in chosen[0].reason


def test_the_configured_mode_is_kept_within_the_margin() -> None:
    near = [Candidate("cpu_cadence", 100.0), Candidate("cpu_async", 100.0 * (1 + KEEP_MARGIN) - 0.5)]
    assert pick_mode(near, "cpu_cadence")[0] == "cpu_cadence"
    far = [Candidate("cpu_cadence", 100.0), Candidate("cpu_async", 100.0 * (1 + KEEP_MARGIN) + 0.5)]
    assert pick_mode(far, "cpu_cadence")[0] == "cpu_async"
    assert pick_mode([Candidate("cpu_async", 0.0)], "cpu_cadence")[0] == "cpu_cadence", "nothing eligible"


def test_a_run_without_auto_ignores_probe_answers() -> None:
    core, _ = recording_core(cfg_of("cpu_cadence", 2))
    core.handle(RankJoined(0, 0.0))
    assert not [c for c in core.handle(RankMessage(0, _answer(0, 4.0), 1.0)) if isinstance(c, (PredictModes, ModeChosen))]
