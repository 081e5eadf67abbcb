"""FLODL_FAULT_INJECT parsing and the kinds a rank can be told to do, the gate included (no processes, no clocks trusted)."""
from __future__ import annotations

import logging
import threading

import pytest

from flodl_exp.rank import fault_inject
from flodl_exp.rank.fault_inject import inject_fault, parse_fault, split_kind, wait_gate


def _faulting(done: threading.Event, kind: str, rank: int, step: int, max_wait_s: float) -> threading.Thread:
    """A daemon thread that does the fault, then sets ``done`` (unstarted)."""

    def body() -> None:
        inject_fault(kind, rank, step, max_wait_s=max_wait_s)
        done.set()

    return threading.Thread(target=body, daemon=True)


@pytest.fixture(autouse=True)
def _fresh_gates():
    fault_inject._gates_done.clear()
    yield
    fault_inject._gates_done.clear()


@pytest.mark.parametrize("kind", ["raise", "exit", "kill", "hang", "stall"])
def test_parse_keeps_the_classic_kinds(kind):
    assert parse_fault(f"1:25:{kind}", 1) == (25, kind)
    assert parse_fault(f"1:25:{kind}", 0) is None


def test_parse_picks_this_ranks_entry_and_keeps_the_gate_path_in_the_kind():
    spec = "0:3:gate:/tmp/a:b/open, 1:7:raise"
    assert parse_fault(spec, 0) == (3, "gate:/tmp/a:b/open")
    assert parse_fault(spec, 1) == (7, "raise")
    assert parse_fault(spec, 2) is None
    assert split_kind("gate:/tmp/a:b/open") == ("gate", "/tmp/a:b/open")
    assert split_kind("kill") == ("kill", None)


@pytest.mark.parametrize("spec", [None, "", "1:x:raise", "1:5", "1:5:gate", "1:5:gate:", "1:5:explode", "x:5:raise"])
def test_parse_ignores_malformed_entries(spec):
    assert parse_fault(spec, 1) is None


def test_raise_kind_raises():
    with pytest.raises(RuntimeError, match="injected fault on rank 1 at step 4"):
        inject_fault("raise", 1, 4)


def test_gate_that_is_open_does_not_block(tmp_path):
    gate = tmp_path / "open"
    gate.touch()
    done = threading.Event()
    t = _faulting(done, f"gate:{gate}", 0, 3, max_wait_s=60)
    t.start()
    t.join(timeout=30)
    assert done.is_set()


def test_gate_blocks_until_the_file_exists_then_releases(tmp_path):
    gate = tmp_path / "gate"
    started, done = threading.Event(), threading.Event()

    def rank_step():
        started.set()
        inject_fault(f"gate:{gate}", 0, 3, max_wait_s=120)
        done.set()

    t = threading.Thread(target=rank_step, daemon=True)
    t.start()
    assert started.wait(timeout=30)
    # The file does not exist, so the gate cannot have opened: waiting here only gives it the chance to misbehave.
    assert not done.wait(timeout=0.3)
    assert t.is_alive()
    gate.touch()
    t.join(timeout=30)
    assert done.is_set() and not t.is_alive()
    # Later steps pass at once even if the file goes away again (the gate opened once).
    gate.unlink()
    inject_fault(f"gate:{gate}", 0, 4, max_wait_s=120)


def test_gate_gives_up_at_its_bound_with_a_log_line(tmp_path, caplog):
    """A fake clock: the bound is reached after exactly max_wait_s / poll_s polls, whatever the machine's speed."""
    now = [0.0]
    sleeps: list[float] = []

    def sleep(dt):
        sleeps.append(dt)
        now[0] += dt

    with caplog.at_level(logging.WARNING, logger="flodl_exp.rank"):
        opened = wait_gate(str(tmp_path / "never"), 2, 9, max_wait_s=1.0, poll_s=0.05, clock=lambda: now[0], sleep=sleep)
    assert opened is False
    assert now[0] == pytest.approx(1.0, abs=0.051)
    assert len(sleeps) == pytest.approx(20, abs=1)
    assert any("did not open within" in r.getMessage() and "rank 2" in r.getMessage() for r in caplog.records)


def test_gate_gives_up_for_real_with_a_short_bound_and_then_never_waits_again(tmp_path, caplog):
    gate = str(tmp_path / "never")
    done = threading.Event()
    with caplog.at_level(logging.WARNING, logger="flodl_exp.rank"):
        t = _faulting(done, f"gate:{gate}", 1, 5, max_wait_s=0.2)
        t.start()
        t.join(timeout=30)
    assert done.is_set()
    assert any("did not open within" in r.getMessage() for r in caplog.records)
    # A gate that gave up does not stall every later step for another bound.
    again = threading.Event()
    t = _faulting(again, f"gate:{gate}", 1, 6, max_wait_s=60)
    t.start()
    t.join(timeout=30)
    assert again.is_set()


def test_gate_poll_loop_is_bounded_in_count_even_if_the_clock_stands_still(tmp_path):
    sleeps: list[float] = []
    opened = wait_gate(str(tmp_path / "never"), 0, 1, max_wait_s=0.5, poll_s=0.05, clock=lambda: 0.0, sleep=sleeps.append)
    assert opened is False
    assert len(sleeps) <= int(0.5 / 0.05) + 2


def test_a_gated_rank_serves_control_and_a_stop_ends_the_wait(tmp_path):
    """The gate calls ``serve`` at every poll (the rank reads control there); its True (stopping) ends the wait."""
    calls: list[int] = []

    def serve() -> bool:
        calls.append(1)
        return len(calls) >= 3

    opened = wait_gate(str(tmp_path / "never"), 0, 1, max_wait_s=60, poll_s=0.01, serve=serve)
    assert opened is False and len(calls) == 3


def test_a_serve_error_propagates_out_of_the_gate(tmp_path):
    """A lost coordinator raised by ``serve`` ends the gate at once (the rank must not wait out the bound)."""

    def serve() -> bool:
        raise ConnectionError("coordinator gone")

    with pytest.raises(ConnectionError):
        inject_fault(f"gate:{tmp_path / 'never2'}", 0, 1, max_wait_s=60, serve=serve)
