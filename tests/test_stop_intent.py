"""``w.request_stop()`` (issue 29): a cooperative loop ends the run early, on the core with scripted ranks (no
processes). The furthest epoch started is the last, trained whole; the run then ends as at its planned end."""
from __future__ import annotations

import pytest
from test_control_core import Bare, FakeClock, Ranks, cfg_of, emitted, play

from flodl_exp.core.lifecycle import Status
from flodl_exp.protocol.messages import ExecuteEval, Intent, StartEpoch

EPOCHS = 6


@pytest.mark.parametrize("mode", ["cpu_sync", "nccl_cadence", "cpu_async"])
def test_a_stop_intent_makes_the_furthest_started_epoch_the_last(mode: str) -> None:
    clock = FakeClock()
    w = Bare(cfg_of(mode, 2, epochs=EPOCHS, **{"eval.every": 1}), clock)
    ranks = Ranks(2, eval_ms=20.0)
    play(w, ranks, clock, until=lambda: w.core.dispatch.last_aggregated >= 0)
    started = max(w.core.dispatch.accs)
    w.send(1, Intent(kind="stop", epoch=1))
    w.send(0, Intent(kind="stop", epoch=1))  # every rank may ask: one stop
    play(w, ranks, clock)
    last = max(1, started)
    assert w.core.life.status is Status.FINISHED
    assert w.core.epochs == last + 1 < EPOCHS
    (stop,) = emitted(w.log, "stop")
    assert stop == {"event": "stop", "rank": 1, "asked_epoch": 1, "last_epoch": last}
    chunks = [c.payload for c in w.log if hasattr(c, "payload") and isinstance(c.payload, StartEpoch)]
    assert max(p.epoch for p in chunks) == last, "no chunk of an epoch after the last"
    assert w.core.dispatch.last_aggregated == last
    for e in range(last + 1):
        covered = sum(size for _, size in w.core.dispatch.coverage[e])
        assert covered == w.core.dispatch.total, f"epoch {e} not trained whole"
    finals = [c.payload for c in w.log if hasattr(c, "payload") and isinstance(c.payload, ExecuteEval) and c.payload.final]
    assert [p.epoch for p in finals] == [last]
    assert w.store.metas["bundle"].epoch == last + 1, "the final bundle resumes where the run stopped"


def test_a_stop_asked_in_the_last_epoch_changes_nothing() -> None:
    clock = FakeClock()
    w = Bare(cfg_of("cpu_sync", 2, epochs=2), clock)
    ranks = Ranks(2)
    play(w, ranks, clock, until=lambda: w.core.dispatch.last_aggregated >= 0)
    w.send(0, Intent(kind="stop", epoch=1))
    play(w, ranks, clock)
    assert w.core.life.status is Status.FINISHED and w.core.epochs == 2
    assert not emitted(w.log, "stop")
