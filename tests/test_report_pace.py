"""Batch reports several to a frame (issue 30, item 2): the rank's pacer, the coordinator's pace, and the
property that matters: the core decides exactly as it did with every report sent at once, so the reduce is
triggered by the same report and nothing waits on a held one."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Optional

import pytest
from control_fakes import FakeClock
from test_control_core import AsCoordinator, Bare, Ranks, cfg_of, play, sent

from flodl_exp.core.report_pace import flush_index, pace_enabled
from flodl_exp.policy.mode import Mode
from flodl_exp.protocol.codec import decode, encode
from flodl_exp.protocol.messages import Batch, Batches, ChunkMetrics, Heartbeat, Payload, ReportPace
from flodl_exp.rank.report_pacer import MAX_HELD, BatchReportPacer


def _b(i: int) -> Batch:
    return Batch(ms=float(i), data_ms=0.5, chunk=3, loss=0.25 * i, lr=0.1)


def _pacer(interval_s: float, flush_at: int) -> tuple[FakeClock, list[Payload], BatchReportPacer]:
    """A pacer on a fake clock sending into a list, already paced to hold reports until the ``flush_at``-th."""
    clock, out = FakeClock(), list[Payload]()
    p = BatchReportPacer(out.append, interval_s=interval_s, clock=clock)
    p.pace(flush_at)
    return clock, out, p


def _records(sent_: list[Payload]) -> list[float]:
    """The reports' ``ms`` in the order the coordinator would book them."""
    out: list[float] = []
    for p in sent_:
        if isinstance(p, Batch):
            out.append(p.ms)
        elif isinstance(p, Batches):
            out += p.ms
    return out


# -- the rank's pacer --------------------------------------------------------------------------
def test_without_a_pace_every_report_goes_at_once() -> None:
    out: list[Payload] = []
    p = BatchReportPacer(out.append, interval_s=0.05, clock=FakeClock())
    for i in range(3):
        p.send(_b(i))
    assert out == [_b(0), _b(1), _b(2)]


def test_reports_before_the_paced_one_wait_and_leave_with_it_in_one_frame() -> None:
    clock, out, p = _pacer(10.0, 4)  # the 4th report completes the count
    for i in range(1, 4):
        p.send(_b(i))
        clock.advance(0.002)
    assert out == [], "three reports held: none completes the count"
    p.send(_b(4))
    (frame,) = out
    assert isinstance(frame, Batches) and frame.ms == [1.0, 2.0, 3.0, 4.0]
    assert frame.age_ms == pytest.approx([6.0, 4.0, 2.0, 0.0]), "each report's age when the frame left"
    first = frame.records()[0]
    assert (first.ms, first.data_ms, first.chunk, first.loss, first.lr) == (1.0, 0.5, 3, 0.25, 0.1)
    assert first.age_ms == pytest.approx(6.0)
    p.send(_b(5))
    assert out[-1] == _b(5), "past the count every report goes at once"
    assert p.frames == 2 and p.reports == 5


def test_any_other_message_sends_the_held_reports_first() -> None:
    _, out, p = _pacer(10.0, 100)
    p.send(_b(1))
    p.send(_b(2))
    hb = Heartbeat(steps=2, state="train")
    p.send(hb)
    assert _records(out) == [1.0, 2.0] and out[-1] == hb, "the coordinator books every batch before what follows"


def test_a_held_report_leaves_when_its_interval_is_up() -> None:
    clock, out, p = _pacer(0.05, 100)
    p.send(_b(1))
    clock.advance(0.02)
    p.send(_b(2))
    p.flush_if_due()
    assert out == [] and p.due() == pytest.approx(clock.t + 0.03)
    clock.advance(0.03)
    p.flush_if_due()
    assert _records(out) == [1.0, 2.0] and p.due() is None


def test_a_pace_already_reached_sends_what_is_held() -> None:
    _, out, p = _pacer(10.0, 100)
    for i in range(1, 4):
        p.send(_b(i))
    assert out == []
    p.pace(2)  # the counts fell (ElChe, a death): the 2nd report already completed them
    assert _records(out) == [1.0, 2.0, 3.0]


def test_an_interval_of_zero_turns_coalescing_off() -> None:
    _, out, p = _pacer(0.0, 100)
    p.send(_b(1))
    assert out == [_b(1)]


def test_the_timer_thread_sends_a_held_report_without_another_send() -> None:
    got = threading.Event()
    out: list[Payload] = []

    def send(x: Payload) -> None:
        out.append(x)
        got.set()

    p = BatchReportPacer(send, interval_s=0.01).start()
    try:
        p.pace(100)
        p.send(_b(1))
        assert got.wait(30.0), "the held report never left"  # a deadline, not a timing: it must leave at all
        assert _records(out) == [1.0]
    finally:
        p.close()
    p.send(_b(2))
    assert _records(out) == [1.0, 2.0], "closed: every report at once"


def test_batches_travel_and_unequal_columns_are_refused() -> None:
    frame = Batches.of([_b(1), _b(2)], [3.0, 0.0])
    assert decode(encode(frame)) == frame
    bad = encode(frame)
    bad.fields["chunk"] = [3]
    with pytest.raises(Exception, match="columns of unequal length"):
        decode(bad)


# -- the coordinator's pace ------------------------------------------------------------------------
def test_the_flush_index_is_the_report_that_completes_the_count() -> None:
    assert flush_index(received=10, count=5, steps=2) == 13  # 3 more reports: the 13th completes it
    assert flush_index(received=10, count=5, steps=7) == 10  # reached: every report at once


@pytest.mark.parametrize("mode,coalesce,mbd,world,on", [
    ("nccl_cadence", 50.0, None, 2, True), ("cpu_async", 50.0, None, 3, True),
    ("nccl_sync", 50.0, None, 2, False), ("cpu_sync", 50.0, None, 2, False),
    ("cpu_cadence", 50.0, 2, 2, False), ("nccl_cadence", 50.0, 2, 2, True),  # max_batch_diff throttles the cpu backend only
    ("nccl_cadence", 0.0, None, 2, False), ("nccl_cadence", 50.0, None, 1, False)])
def test_which_runs_are_paced(mode: str, coalesce: float, mbd: Optional[int], world: int, on: bool) -> None:
    m = Mode.of(cfg_of(mode, max(world, 2)))
    assert pace_enabled(m, coalesce, mbd, world) is on


class PacedRanks(Ranks):
    """The scripted ranks of test_control_core, each sending its reports through a pacer that only the pace
    and other messages flush (an interval the script never reaches): if the core waited on a held report,
    the script would stall with reports held."""

    def __init__(self, world: int, slow: Optional[dict[int, int]] = None) -> None:
        super().__init__(world, slow=slow)
        self.out: list[tuple[int, Payload]] = []
        self.pacers = [BatchReportPacer(self._sender(r), interval_s=1e9, clock=FakeClock()) for r in range(world)]
        self.paces: list[tuple[int, int]] = []

    def _sender(self, r: int) -> Callable[[Payload], None]:
        return lambda p: self.out.append((r, p))

    def hear(self, out: list[tuple[int, Payload]]) -> list[tuple[int, Payload]]:
        for r, p in out:
            if isinstance(p, ReportPace) and r not in self.dead:
                self.paces.append((r, p.flush_at))
                self.pacers[r].pace(p.flush_at)
        answers = super().hear(out)
        for r, p in answers:  # an answer (ack, snapshot) is another message: what is held goes first
            self.pacers[r].send(p)
        got, self.out = self.out, []
        return got

    def next(self) -> Optional[tuple[int, Payload]]:
        for _ in range(100_000):
            if self.out:
                return self.out.pop(0)
            msg = super().next()
            if msg is None:
                held = {r: len(p._held) for r, p in enumerate(self.pacers) if p._held}
                assert not held, f"nothing moves while reports are held {held}: the core waits on a held report"
                return None
            self.pacers[msg[0]].send(msg[1])
        raise AssertionError("the pacers never let a report out")


def _decisions(log: list[tuple[int, Payload]]) -> list[tuple[int, str]]:
    return [(r, type(p).__name__) for r, p in log if not isinstance(p, ReportPace)]


class _Logging:
    """A wiring whose every output is kept, in order, for the comparison."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.core = inner, inner.core
        self.log: list[tuple[int, Payload]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def take(self) -> list[tuple[int, Payload]]:
        out = self.inner.take()
        self.log += out
        return out


@pytest.mark.parametrize("mode,wiring", [("nccl_cadence", "bare"), ("cpu_cadence", "bare"), ("cpu_async", "bare"),
                                         ("nccl_cadence", "coordinator")])  # the coordinator's: Batches decoded off a frame
def test_a_paced_run_decides_exactly_as_an_unpaced_one(mode: str, wiring: str, tmp_path: Any) -> None:
    """The same scripted rig (rank 1 three times slower), 3 epochs, with and without pacing: the core sends the
    ranks the same messages in the same order (ReportPace aside) and ends with the same books, while the paced
    ranks sent far fewer frames."""
    results = []
    for coalesce in (0.0, 50.0):
        clock = FakeClock()
        cfg = cfg_of(mode, 2, epochs=3, **{"cluster.report_coalesce_ms": coalesce})
        (tmp_path / f"c{coalesce}").mkdir()
        inner = Bare(cfg, clock) if wiring == "bare" else AsCoordinator(cfg, clock, tmp_path / f"c{coalesce}")
        w = _Logging(inner)
        ranks = PacedRanks(2, slow={1: 3})
        play(w, ranks, clock, samples=960, max_steps=20_000)
        results.append((w, ranks))
    (plain, plain_ranks), (paced, paced_ranks) = results
    assert plain_ranks.paces == [] and paced_ranks.paces, "pacing only where the config asks for it"
    assert _decisions(paced.log) == _decisions(plain.log)
    a, b = plain.core.outcome(), paced.core.outcome()
    assert a["status"] == b["status"] == "FINISHED"
    assert (a["syncs"], a["global_step"], a["coverage"]) == (b["syncs"], b["global_step"], b["coverage"])
    reports = sum(p.reports for p in paced_ranks.pacers)
    frames = sum(p.frames for p in paced_ranks.pacers)
    assert reports == a["global_step"] or reports >= 100
    assert frames < reports / 2, f"{reports} reports in {frames} frames"


def test_the_pace_names_the_report_that_completes_each_ranks_count() -> None:
    clock = FakeClock()
    w = Bare(cfg_of("nccl_cadence", 2, epochs=3), clock)
    ranks = PacedRanks(2, slow={1: 3})
    checked: list[int] = []

    def check() -> bool:
        core = w.core
        for r, at in ranks.paces[len(checked):]:
            checked.append(r)
            count, steps = core.cycle.counts_view[r], core.cycle.steps(r)
            assert at == core.pacing.received[r] + count - steps, (r, at)
        return False

    play(w, ranks, clock, samples=960, max_steps=20_000, until=check)
    assert len(checked) >= 4 and sent(w.log, ReportPace)
    assert w.core.life.status.value == "FINISHED"


def test_a_real_rank_loop_and_the_pacer_thread_hold_no_report_past_a_chunk() -> None:
    """The pacer the rank worker uses, its timer thread started, under concurrent sends from two threads: every
    report arrives once, in order, and a chunk's metrics never overtake its batches."""
    out: list[Payload] = []
    lock = threading.Lock()

    def send(p: Payload) -> None:
        with lock:
            out.append(p)

    p = BatchReportPacer(send, interval_s=0.001).start()
    p.pace(10_000)
    stop = threading.Event()

    def heartbeats() -> None:
        while not stop.is_set():
            p.send(Heartbeat(steps=0, state="train"))
            time.sleep(0.0005)

    t = threading.Thread(target=heartbeats)
    t.start()
    try:
        for chunk in range(20):
            for i in range(25):
                p.send(Batch(ms=float(chunk * 25 + i), data_ms=0.0, chunk=chunk))
            p.send(ChunkMetrics(epoch=0, chunk=chunk, avg_loss=0.0, batches=25, samples=25, epoch_ms=1.0,
                                share_complete_ms=1.0, compute_only_ms=1.0, data_starve_ms=0.0, ranges=[],
                                loss_batches=0))
    finally:
        stop.set()
        t.join(30)
        p.close()
    assert _records(out) == [float(i) for i in range(500)]
    seen = 0
    for x in out:
        if isinstance(x, (Batch, Batches)):
            seen += 1 if isinstance(x, Batch) else len(x.ms)
        elif isinstance(x, ChunkMetrics):
            assert seen == (x.chunk + 1) * 25, "a chunk's metrics came before its last batch"


def test_a_lone_held_report_keeps_its_age_and_a_full_buffer_leaves() -> None:
    clock, out, p = _pacer(10.0, 10_000)
    p.send(_b(1))
    clock.advance(0.03)
    p.flush()
    (alone,) = out
    assert isinstance(alone, Batch) and alone.age_ms == pytest.approx(30.0), "the timeline places it when it ended"
    out.clear()
    for i in range(MAX_HELD):
        p.send(_b(i))
    assert len(_records(out)) == MAX_HELD and p._held == [], "at most MAX_HELD reports wait, whatever the interval"


def test_a_reduce_asked_for_and_a_fault_send_what_the_rank_holds() -> None:
    """RankControl resets the pace when a reduce is asked for (the old window's pace must not hold the next
    window's first reports until the new pace comes) and before an injected fault fires (the coordinator has
    every report first, as without coalescing)."""
    from flodl_exp.rank.control import RankControl

    _, out, p = _pacer(10.0, 100)
    p.send(_b(1))
    ctl = RankControl.__new__(RankControl)
    ctl._pace = p.pace
    ctl.send_held_reports()
    assert _records(out) == [1.0] and p.flush_at == 0
    p.send(_b(2))
    assert _records(out) == [1.0, 2.0], "until the next pace every report goes at once"
