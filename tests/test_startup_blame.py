"""Whom a run that cannot start blames: the control core's decision (core/startup.py), driven through events."""
from __future__ import annotations

from test_control_core import cfg_of

from flodl_exp.core.commands import (
    AwaitingRanks,
    Broadcast,
    ClosedBeforeStart,
    LostBeforeJoin,
    RankJoined,
    StartupCheck,
)
from flodl_exp.core.control_core import recording_core
from flodl_exp.core.lifecycle import Phase, Status
from flodl_exp.core.startup import LOST_PEER_GRACE_S, StartupBlame
from flodl_exp.protocol.messages import Shutdown


def test_a_close_with_no_rank_missing_is_blamed_at_once() -> None:
    b = StartupBlame()
    assert b.on_close(1, "closed", missing=[], now=0.0) == "rank 1 failed before training started: closed"


def test_a_close_waits_the_grace_for_a_missing_rank_to_be_found_lost() -> None:
    b = StartupBlame()
    assert b.on_close(2, "closed", missing=[1], now=10.0) is None
    assert b.on_close(0, "RuntimeError: store timeout", missing=[1], now=10.5) is None
    assert b.check(missing=[1], now=10.0 + LOST_PEER_GRACE_S - 0.1) is None
    assert b.on_lost(1, "its process 7 on h exited before it connected", set_up_failed=False) == (
        "rank 1 was lost before training started: its process 7 on h exited before it connected; after it, rank 2 "
        "failed: closed; after it, rank 0 failed: RuntimeError: store timeout")
    assert b.check(missing=[1], now=10.0 + LOST_PEER_GRACE_S) == (
        "rank 2 failed before training started (ranks [1] never connected): closed; then rank 0 failed: "
        "RuntimeError: store timeout")
    assert b.check(missing=[], now=10.0) is not None, "every rank joined after all: the first close is blamed"


def test_a_setup_failure_names_its_cause_and_a_closed_rank_is_not_found_lost() -> None:
    b = StartupBlame()
    assert b.on_lost(1, "ValueError: bad data", set_up_failed=True) == "rank 1 could not set up: ValueError: bad data"
    b.on_close(0, "closed", missing=[1], now=0.0)
    assert b.on_lost(0, "gone", set_up_failed=False) is None


def test_the_connect_deadline_names_the_missing_ranks_only_without_a_close() -> None:
    b = StartupBlame()
    assert b.check(missing=[1], now=5.0) is None, "no deadline before the shell waits"
    b.awaiting(30.0, now=0.0)
    assert b.check(missing=[1], now=30.0) is None and b.check(missing=[], now=31.0) is None
    assert b.check(missing=[1, 2], now=30.5) == "ranks [1, 2] did not connect within 30s"


def test_the_core_fails_the_run_it_blames_and_tells_the_ranks() -> None:
    core, commands = recording_core(cfg_of("nccl_sync", 3))
    for event in (AwaitingRanks(600.0, 0.0), RankJoined(0, 0.0), RankJoined(2, 0.0)):
        core.handle(event)
    core.handle(ClosedBeforeStart(2, "closed", 1.0))
    assert core.handle(StartupCheck(1.0 + LOST_PEER_GRACE_S - 0.5)) == [] and core.view.is_(Phase.CONNECTING)
    out = core.handle(LostBeforeJoin(1, "its process 9 on h exited before it connected", False, 2.0))
    assert core.view.status is Status.FAILED and core.view.startup_failure == core.view.failure
    assert (core.view.failure or "").startswith("rank 1 was lost before training started")
    (shutdown,) = [c.payload for c in out if isinstance(c, Broadcast) and isinstance(c.payload, Shutdown)]
    assert isinstance(shutdown, Shutdown) and shutdown.reason == core.view.failure
    core.handle(StartupCheck(100.0))
    assert (core.view.failure or "").startswith("rank 1 was lost"), "the first verdict stands"
    assert commands == []
