"""Dead and stuck ranks are the core's decision (issue 50, item 2): the shell reports heartbeats as
``HeartbeatFrom`` events and ticks; a core built with ``watch_liveness`` declares a silent rank dead and evicts one
whose steps stopped while its heartbeat goes on. The simulator's core (no heartbeats modelled) watches nothing."""
from __future__ import annotations

from typing import Any

from test_control_core import cfg_of

from flodl_exp.core.commands import HeartbeatFrom, RankJoined, Send, Tick, TrainingStarts
from flodl_exp.core.control_core import ControlCore
from flodl_exp.protocol.messages import Evict

HB = 30.0
PROGRESS = 100.0


def _core(watch: bool) -> ControlCore:
    timeouts: dict[str, Any] = {"cluster.heartbeat_timeout_s": HB, "cluster.progress_timeout_s": PROGRESS}
    cfg = cfg_of("cpu_cadence", 3, **timeouts)
    core = ControlCore.from_config(cfg, wall_clock=lambda: 0.0, start=0.0, watch_liveness=watch)
    for r in range(3):
        core.handle(RankJoined(r, 0.0))
    core.handle(TrainingStarts(960, None, 0.0))
    return core


def test_a_silent_rank_is_dead_after_the_heartbeat_timeout_and_a_beating_one_is_not() -> None:
    core = _core(watch=True)
    for t in (10.0, 20.0, 30.0):  # ranks 0 and 1 beat; rank 2 stays silent
        core.handle(HeartbeatFrom(0, "wait", None, t))
        core.handle(HeartbeatFrom(1, "wait", None, t))
        core.handle(Tick(t))
    assert all(core.view.alive(r) for r in range(3)), "30 s of silence is not yet more than the timeout"
    core.handle(HeartbeatFrom(0, "wait", None, HB + 1))
    core.handle(HeartbeatFrom(1, "wait", None, HB + 1))
    core.handle(Tick(HB + 1))
    assert [core.view.alive(r) for r in range(3)] == [True, True, False]
    assert "no heartbeat for 30s" in core.view.outcome()["deaths"][0]["reason"]


def test_a_rank_whose_steps_stop_while_it_trains_is_evicted_and_told() -> None:
    core = _core(watch=True)
    out = []
    for t in range(0, int(PROGRESS) + 20, 10):  # every rank beats; rank 1 trains at step 5 and never moves
        for r in range(3):
            core.handle(HeartbeatFrom(r, "train", 5 if r == 1 else t, float(t)))
        out += core.handle(Tick(float(t)))
    assert [core.view.alive(r) for r in range(3)] == [True, False, True]
    evicts = [(c.rank, c.payload) for c in out if isinstance(c, Send) and isinstance(c.payload, Evict)]
    assert [r for r, _ in evicts] == [1] and "cluster.progress_timeout_s" in evicts[0][1].reason


def test_a_core_that_does_not_watch_liveness_declares_nobody() -> None:
    core = _core(watch=False)
    core.handle(Tick(10 * PROGRESS))
    assert all(core.view.alive(r) for r in range(3))
