"""Per-rank timelines (coordinator/timeline.py, timeline_report.py): spans from a scripted sequence on a fake
clock, the bound, the idle classification rule, the three files, and the coordinator feeding its recorder."""
from __future__ import annotations

import json
import re

import pytest
from control_fakes import FakeClock, Harness

from flodl_exp.coordinator.timeline import CAUSES, TimelineRecorder
from flodl_exp.core.lifecycle import Phase
from flodl_exp.dashboard import render_dashboard
from flodl_exp.timeline_report import FILES, read_csv, render_html, timeline_data, write_timeline


def _rec(world: int = 2, **kw) -> tuple[TimelineRecorder, FakeClock]:
    clock = FakeClock()
    clock.t = 100.0
    rec = TimelineRecorder(world, clock, **kw)
    rec.on_start()
    return rec, clock


def _at(clock: FakeClock, t: float) -> None:
    clock.t = 100.0 + t


def _by_kind(rec: TimelineRecorder, rank: int, kind: str) -> list:
    return [s for s in rec.spans() if s.rank == rank and s.kind == kind]


def _assert_wall_identity(rec: TimelineRecorder) -> None:
    """compute + data wait + idle = the training wall, for every rank (totals never come from stored spans)."""
    ia = rec.idle_analysis()
    for v in ia["ranks"].values():
        assert v["compute_s"] + v["data_s"] + v["idle_s"] == pytest.approx(ia["wall_s"], abs=1e-9)
        assert sum(v["idle_by_cause_s"].values()) == pytest.approx(v["idle_s"], abs=1e-12)


def test_batches_coalesce_and_long_data_waits_split():
    rec, clock = _rec()
    _at(clock, 0.010)
    rec.on_batch(0, 8.0, 2.0, chunk=0, epoch=0, window=0)       # data [0, .002] merged, compute [.002, .010]
    _at(clock, 0.020)
    rec.on_batch(0, 9.0, 1.0, chunk=0, epoch=0, window=0)       # extends it
    _at(clock, 0.500)
    rec.on_batch(0, 10.0, 300.0, chunk=0, epoch=0, window=0)    # a 300 ms data wait: a data span of its own
    (c0, c1), (d,) = _by_kind(rec, 0, "compute"), _by_kind(rec, 0, "data")
    assert (c0.t0 - 100, c0.t1 - 100, c0.n, c0.epoch, c0.window) == pytest.approx((0.0, 0.020, 2, 0, 0))
    assert c0.busy_ms == pytest.approx(17.0) and c0.data_ms == pytest.approx(3.0)
    assert (d.t0 - 100, d.t1 - 100, d.busy_ms) == pytest.approx((0.190, 0.490, 300.0))
    assert (c1.t0 - 100, c1.t1 - 100, c1.n) == pytest.approx((0.490, 0.500, 1))
    ia = rec.idle_analysis()["ranks"]["0"]
    assert ia["compute_s"] == pytest.approx(0.027) and ia["data_s"] == pytest.approx(0.303)
    assert ia["idle_by_cause_s"]["unexplained"] == pytest.approx(0.170)   # .020 -> .190: short, no event near
    # another chunk starts a new compute span; a report taken in a burst is packed after the previous span
    _at(clock, 0.505)
    rec.on_batch(0, 10.0, 0.0, chunk=1, epoch=0, window=0)
    c2 = _by_kind(rec, 0, "compute")[2]
    assert (c2.t0 - 100, c2.t1 - 100) == pytest.approx((0.500, 0.510))
    ia = rec.idle_analysis()["ranks"]["0"]
    assert ia["late_s"] == pytest.approx(0.005) and ia["compute_s"] == pytest.approx(0.037)
    _assert_wall_identity(rec)


def test_reduce_eval_and_epoch_spans_and_the_idle_classification():
    rec, clock = _rec()
    _at(clock, 0.05)
    for r in (0, 1):
        rec.on_batch(r, 40.0, 10.0, chunk=r, epoch=0, window=0)
    # a cpu reduce fired at 0.05: rank 0 answers at 0.1, rank 1 at 1.2; averaging 1.2 -> 1.3
    _at(clock, 0.1)
    rec.on_answer(0, 100.05)
    _at(clock, 1.2)
    rec.on_answer(1, 100.05)
    _at(clock, 1.3)
    rec.on_reduce_finished(started=100.05, members=[0, 1], backend="cpu", window=0, averaging_from=101.2)
    (sync,), (avg,) = _by_kind(rec, 0, "sync"), _by_kind(rec, 0, "cpu_avg")
    assert (sync.t0 - 100, sync.t1 - 100, avg.t0 - 100, avg.t1 - 100) == pytest.approx((0.05, 1.2, 1.2, 1.3))
    _at(clock, 1.4)
    rec.on_batch(0, 50.0, 0.0, chunk=2, epoch=0, window=1)    # gap .05 -> 1.35: mostly the reduce's gathering
    (idle,) = _by_kind(rec, 0, "idle")
    assert idle.note == "sync" and idle.duration == pytest.approx(1.3)
    # an eval on rank 1 (1.3 -> 3.0): rank 1's gap and rank 0's gap during it are "eval"
    _at(clock, 1.3)
    rec.on_eval_sent(1, epoch=0)
    _at(clock, 3.0)
    rec.on_eval_result(1, epoch=0)
    _at(clock, 3.1)
    rec.on_batch(1, 100.0, 0.0, chunk=3, epoch=1, window=1)   # gap .05 -> 3.0
    rec.on_batch(0, 100.0, 0.0, chunk=2, epoch=0, window=1)   # gap 1.4 -> 3.0
    assert [s.note for s in _by_kind(rec, 1, "idle")] == ["eval"]
    assert [s.note for s in _by_kind(rec, 0, "idle")] == ["sync", "eval"]
    (ev,) = _by_kind(rec, 1, "eval")
    assert (ev.t0 - 100, ev.t1 - 100, ev.epoch) == pytest.approx((1.3, 3.0, 0))
    # an epoch aggregation inside a gap: the rank waited for the epoch to close
    _at(clock, 5.0)
    rec.on_epoch_aggregated(0, {"epoch_time_s": 5.0, "rank0/idle_frac": 0.9, "rank1/idle_frac": 0.9})
    _at(clock, 5.3)
    rec.on_batch(0, 100.0, 0.0, chunk=4, epoch=1, window=1)   # gap 3.1 -> 5.2
    assert _by_kind(rec, 0, "idle")[-1].note == "epoch_boundary"
    # nothing within near_s: unexplained; a reduce firing just after a gap ends explains it (the nearest event)
    _at(clock, 6.5)
    rec.on_batch(0, 1100.0, 0.0, chunk=4, epoch=1, window=1)  # busy 5.4 -> 6.5
    _at(clock, 10.0)
    rec.on_batch(0, 100.0, 0.0, chunk=4, epoch=1, window=1)   # gap 6.5 -> 9.9
    assert _by_kind(rec, 0, "idle")[-1].note == "unexplained"
    assert rec.classify(109.0, 110.0) == "unexplained"
    _at(clock, 10.5)
    rec.on_answer(1, 110.3)
    rec.on_reduce_finished(started=110.3, members=[0, 1], backend="nccl", window=1)
    assert rec.classify(109.0, 110.0) == "sync"
    assert rec.classify(109.0, 111.0) == "sync"
    ia = rec.idle_analysis()
    by = ia["ranks"]["0"]["idle_by_cause_s"]
    assert set(by) == set(CAUSES)
    assert by["sync"] == pytest.approx(1.3) and by["eval"] == pytest.approx(1.6)
    # epoch_boundary: the 3.1 -> 5.2 gap and the short 5.3 -> 5.4 one (0.3 s after the aggregation: within near_s)
    assert by["epoch_boundary"] == pytest.approx(2.2) and by["unexplained"] == pytest.approx(3.4)
    assert ia["ranks"]["0"]["run_idle_frac"] == pytest.approx(0.9)
    _assert_wall_identity(rec)


def test_the_span_count_is_bounded_and_the_totals_stay_exact():
    rec, clock = _rec(world=1, max_spans=64)
    n = 20_000
    for i in range(n):  # every batch its own span (a 200 ms gap breaks coalescing) and a reduce each
        clock.advance(0.21)
        rec.on_batch(0, 10.0, 0.0, chunk=0, epoch=0, window=i)
        rec.on_answer(0, clock.t)
        rec.on_reduce_finished(started=clock.t, members=[0], backend="nccl", window=i)
    ia = rec.idle_analysis()["ranks"]["0"]
    assert ia["spans_stored"] <= 64 and len(rec.spans()) == ia["spans_stored"] and ia["compactions"] > 0
    assert ia["compute_s"] == pytest.approx(n * 0.010)
    by = ia["idle_by_cause_s"]  # every 0.2 s gap follows a reduce: sync (the first one, before any reduce: unexplained)
    assert by["sync"] == pytest.approx((n - 1) * 0.2) and by["unexplained"] == pytest.approx(0.2)
    assert ia["sync_spans"] == n
    compute = _by_kind(rec, 0, "compute")
    assert sum(s.n for s in compute) == n and sum(s.busy_ms for s in compute) == pytest.approx(n * 10.0)
    assert compute[0].n > compute[-1].n, "older history is the coarser"
    _assert_wall_identity(rec)
    # one chunk trained back to back is one span
    rec2, clock2 = _rec(world=1)
    for _ in range(1000):
        clock2.advance(0.005)
        rec2.on_batch(0, 4.0, 1.0, chunk=7, epoch=0, window=0)
    (span,) = rec2.spans()
    assert span.n == 1000 and span.duration == pytest.approx(5.0)


def test_idle_totals_line_up_with_idle_frac():
    """Epoch walls and shares scripted like the ranks report them: the timeline's idle equals the run's."""
    rec, clock = _rec()
    for e in range(3):
        base = 2.0 * e
        for i in range(10):  # rank 0: 10 x 100 ms back to back then idle; rank 1: 10 x 150 ms
            _at(clock, base + 0.1 * (i + 1))
            rec.on_batch(0, 90.0, 10.0, chunk=2 * e, epoch=e, window=e)
        for i in range(10):
            _at(clock, base + 0.15 * (i + 1))
            rec.on_batch(1, 150.0, 0.0, chunk=2 * e + 1, epoch=e, window=e)
        _at(clock, base + 2.0)
        rec.on_epoch_aggregated(e, {"epoch_time_s": 2.0, "rank0/idle_frac": 0.5, "rank1/idle_frac": 0.25})
    ia = rec.idle_analysis()
    assert ia["wall_s"] == pytest.approx(6.0) and ia["epoch_walls_s"] == pytest.approx(6.0)
    for r, frac in (("0", 0.5), ("1", 0.25)):
        v = ia["ranks"][r]
        assert v["idle_frac"] == pytest.approx(frac) and v["run_idle_frac"] == pytest.approx(frac)
        assert v["idle_frac_epochs"] == pytest.approx(frac) and abs(v["diff"]) < 1e-9
    assert ia["ranks"]["0"]["idle_by_cause_s"]["epoch_boundary"] == pytest.approx(3.0)  # 1 s before each aggregation
    _assert_wall_identity(rec)


def test_overlapping_epoch_walls_are_the_one_term_between_the_two_idle_fracs():
    """async: the rank streams into epoch 1 before epoch 0 aggregates; each epoch counts its work on the other as
    idle, so the run's idle_frac is over a longer wall than the training wall, by the overlap."""
    rec, clock = _rec(world=1)
    for i in range(30):
        _at(clock, 0.1 * (i + 1))
        rec.on_batch(0, 100.0, 0.0, chunk=i // 15, epoch=i // 15, window=0)
        if i == 19:
            _at(clock, 2.0)
            rec.on_epoch_aggregated(0, {"epoch_time_s": 2.0, "rank0/idle_frac": 0.25})
    _at(clock, 3.5)
    rec.on_epoch_aggregated(1, {"epoch_time_s": 2.0, "rank0/idle_frac": 0.25})
    ia = rec.idle_analysis()
    v = ia["ranks"]["0"]
    assert (ia["wall_s"], ia["epoch_walls_s"], ia["epoch_overlap_s"]) == pytest.approx((3.5, 4.0, 0.5))
    assert v["idle_s"] == pytest.approx(0.5) and v["idle_frac"] == pytest.approx(0.5 / 3.5)
    assert v["idle_frac_epochs"] == pytest.approx(0.25) and v["run_idle_frac"] == pytest.approx(0.25)
    assert ia["epoch_walls_s"] - v["epoch_busy_s"] == pytest.approx(v["idle_s"] + ia["epoch_overlap_s"])


def _scripted() -> TimelineRecorder:
    rec, clock = _rec(world=3)
    for r in range(3):
        for i in range(5):
            _at(clock, 0.3 * i + 0.1 * r + 0.05)
            rec.on_batch(r, 30.0, 200.0 if i == 2 else 1.0, chunk=r, epoch=0, window=0)
    _at(clock, 2.0)
    rec.on_eval_sent(0, 0)
    _at(clock, 2.7)
    rec.on_eval_result(0, 0)
    rec.on_epoch_aggregated(0, {"epoch_time_s": 2.7, "rank0/idle_frac": 0.8, "rank1/idle_frac": 0.8,
                                "rank2/idle_frac": 0.8})
    return rec


def test_files_round_trip_and_the_page_is_self_contained(tmp_path):
    rec = _scripted()
    paths = write_timeline(str(tmp_path / "timeline"), rec, {"title": "job </script> & co", "mode": "cpu_async"})
    assert [p.rsplit("/", 1)[1] for p in paths] == list(FILES)
    data = json.loads((tmp_path / "timeline" / "timeline.json").read_text())
    assert data["world_size"] == 3 and data["spans"] and data == json.loads(json.dumps(timeline_data(rec, data["meta"])))
    assert read_csv(str(tmp_path / "timeline" / "timeline.csv")) == data["spans"]
    assert {row[1] for row in data["spans"]} >= {"compute", "data", "eval"}
    assert set(data["idle_analysis"]["ranks"]) == {"0", "1", "2"}
    page = (tmp_path / "timeline" / "timeline.html").read_text()
    low = page.lower()
    assert "http://" not in low and "https://" not in low and "src=" not in low and "<link" not in low
    assert "url(" not in low and "@import" not in low
    assert len(re.findall(r'<div class="lane" data-rank="\d+">', page)) == 3
    assert page.count("</script>") == 3, "the title cannot close the data's script element"
    embedded = page.split('<script type="application/json" id="timeline-data">')[1].split("</script>")[0]
    assert json.loads(embedded) == data
    assert 'id="idle-analysis"' in page and page.count('class="idle-row"') == 3
    assert render_html(data) == page
    assert data["epochs"][0]["epoch"] == 0  # the data keep the index (MLflow's step); the page counts from 1
    epochs = page.split('<table id="epochs">')[1].split("</table>")[0]
    assert re.findall(r"<tr><td>(\d+)</td>", epochs) == ["1"]


def test_the_dashboard_links_the_timeline():
    doc = render_dashboard("t", [], [], [], links=[("Timeline", "../timeline/timeline.html")])
    assert '<a href="../timeline/timeline.html">Timeline</a>' in doc
    assert "<a " not in render_dashboard("t", [], [], [])
    with pytest.raises(ValueError):
        render_dashboard("t", [], [], [], links=[("x", "https://example.org/")])


def test_the_coordinator_feeds_its_recorder(tmp_path):
    h = Harness(tmp_path, "cpu_cadence", world=2, epochs=2)
    tick = h.co.tick

    def slow_tick() -> None:  # each turn of the loop takes 20 ms of the fake clock
        h.clock.advance(0.02)
        tick()

    h.co.tick = slow_tick  # type: ignore[method-assign]
    plans = h.start()
    h.play([0, 1], until=lambda: h.co.core.life.phase in (Phase.FINISHING, Phase.SHUTDOWN, Phase.DONE),
           pending=[(r, p) for r, ps in plans.items() for p in ps])
    rec = h.co.timeline
    kinds = {(s.rank, s.kind) for s in rec.spans()}
    assert {(0, "compute"), (1, "compute"), (0, "sync"), (1, "sync")} <= kinds
    assert [w.epoch for w in rec.epochs] == [0, 1] and all(set(w.idle_frac) == {0, 1} for w in rec.epochs)
    assert {s.epoch for s in rec.spans() if s.kind == "compute"} == {0, 1}
    windows = [s.window for s in rec.spans() if s.kind == "sync"]
    numbered = [w for w in windows if w is not None]
    assert len(numbered) == len(windows) and max(numbered) == h.co.core.cycle.version - 1
    _assert_wall_identity(rec)
    paths = write_timeline(str(tmp_path / "tl"), rec, {"title": "harness"})
    assert len(paths) == 3


def test_a_short_per_step_wait_is_classified_and_the_sync_spans_are_counted():
    """nccl_sync's per-step wait (issue 30): gaps far under min_gap_s that a reduce holds are sync, not unclassified,
    and the table counts the rank's sync spans and their seconds."""
    rec, clock = _rec()
    for i in range(50):
        clock.advance(0.010)
        rec.on_batch(0, 10.0, 0.0, chunk=0, epoch=0, window=i)
        rec.on_batch(1, 10.0, 0.0, chunk=1, epoch=0, window=i)
        started = clock.t
        clock.advance(0.030)  # the step's reduce: 30 ms, both ranks wait in it
        rec.on_answer(0, started)
        rec.on_answer(1, started)
        rec.on_reduce_finished(started=started, members=[0, 1], backend="nccl", window=i)
    ia = rec.idle_analysis()
    for r in ("0", "1"):
        v = ia["ranks"][r]
        assert v["idle_by_cause_s"]["sync"] == pytest.approx(49 * 0.030, abs=1e-9)
        assert v["gaps_classified"] == 0  # all of them under min_gap_s: summed, not drawn
        assert v["sync_spans"] == 50 and v["sync_span_s"] == pytest.approx(50 * 0.030)
    _assert_wall_identity(rec)
