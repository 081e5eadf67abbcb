"""The coordinator's invariants, driven with fakes: events in, messages out, an injected clock.

No process, socket or tracker: each test plays the ranks' side of the protocol and checks
what the coordinator sends, logs and decides.
"""
from __future__ import annotations

import json
import os
from typing import Any

import pytest
from control_fakes import BATCH, SAMPLES, Harness

from flodl_exp.core.lifecycle import Phase, Status
from flodl_exp.core.preemption import PREEMPT_SAVE_DEADLINE_S, TERM_GRACE_S, Stage
from flodl_exp.protocol.hello import Hello
from flodl_exp.protocol.messages import (
    EvalResult,
    ExecuteEval,
    Exiting,
    ExtendPartition,
    RankError,
    Regroup,
    RequestParams,
    RequestSession,
    Save,
    SaveResult,
    SessionReady,
    SetGlobalStep,
    Shutdown,
    StartEpoch,
    SyncAck,
    SyncNow,
    Telemetry,
    Update,
)
from flodl_exp.rendezvous import write_death_record


def _save_all(h: Harness, ranks: list[int]) -> None:
    for r, p in h.transport.take(Save):
        assert r in ranks
        h.msg(r, SaveResult(stem=p.stem))


def test_a_death_during_a_reduce_regroups_and_the_reduce_finishes_on_the_survivors(tmp_path):
    h = Harness(tmp_path, "nccl_sync", world=3)
    plans = h.start()
    assert sorted(plans) == [0, 1, 2] and sum(p[0].size for p in plans.values()) == SAMPLES
    for r in range(3):
        h.batches(r, plans[r][0].chunk, 1)
    h.tick()
    assert [r for r, _ in h.transport.take(SyncNow)] == [0, 1, 2]
    assert h.co.core.cycle.in_flight is not None
    h.ack_all([0, 1])
    assert h.co.core.cycle.in_flight is not None, "rank 2 has not answered"
    h.co.on_event(("closed", 2, "closed"))  # rank 2 dies inside the all_reduce
    sent = h.transport.take()
    # Regroup, step 1: the generator (equal step times: the lowest rank) makes the session id ...
    assert [(r, p) for r, p in sent if isinstance(p, RequestSession)] == [(0, RequestSession(generation=1))]
    h.msg(0, SessionReady(generation=1, session="s1"))
    # ... step 2: every survivor gets its new rank and the session.
    regroups = {r: p for r, p in h.transport.take(Regroup)}
    assert regroups == {0: Regroup(1, 0, 2, [0, 1], "s1"), 1: Regroup(1, 1, 2, [0, 1], "s1")}
    extends = [p for _, p in sent if isinstance(p, ExtendPartition)]
    # Rank 2 trained one batch that no reduce holds: the survivors retrain its whole plan.
    assert sum(p.size for p in extends) == plans[2][0].size
    assert min(p.offset for p in extends) == plans[2][0].offset
    # The reduce finished with the live members only: rank 2's unreduced step is not counted.
    assert h.co.core.cycle.in_flight is None and h.co.core.cycle.version == 1 and h.co.core.cycle.global_step == 2
    assert any(isinstance(p, SetGlobalStep) and p.global_step == 2 for _, p in sent)
    assert [d.rank for d in h.co.core.cohort.deaths] == [2] and h.sink.tags["regroups"] == 1
    assert h.co.core.life.phase is Phase.TRAINING and h.co.core.life.status is Status.RUNNING


def test_unrecoverable_loss_ends_with_shutdown_with_save(tmp_path):
    h = Harness(tmp_path, "nccl_sync", world=2)
    h.start()
    h.co.on_event(("closed", 1, "closed"))
    assert h.co.core.life.phase is Phase.SAVING and h.co.core.life.status is Status.FAILED
    assert h.co.core.life.failure is not None and h.co.core.life.failure.startswith("single_survivor: rank 1")
    saves = h.transport.take(Save)
    assert [(r, p.primary, p.model) for r, p in saves] == [(0, True, True)]
    stem = saves[0][1].stem
    assert stem.endswith("final_failure") and not os.path.exists(stem + ".meta.json"), "the meta is written last"
    h.msg(0, SaveResult(stem=stem))
    assert json.load(open(stem + ".meta.json"))["save_reason"] == "single_survivor"
    assert h.co.core.life.phase is Phase.SHUTDOWN
    assert [r for r, _ in h.transport.take(Shutdown)] == [0]
    h.msg(0, Exiting(rank=0, pid=100, hash="x", steps=0, global_step=0))
    h.tick()
    assert h.co.core.life.phase is Phase.DONE and h.co.result()["saved_stem"] == stem


def test_shutdown_with_save_gives_up_at_its_deadline(tmp_path):
    h = Harness(tmp_path, "cpu_sync", world=3, **{"cluster.max_failure": 1})
    h.start()
    h.co.on_event(("closed", 2, "closed"))
    assert h.co.core.life.phase is Phase.SAVING and (h.co.core.life.failure or "").startswith("max_failure_exceeded")
    h.pass_time(61, alive=[0, 1])
    h.tick()
    assert h.co.core.life.phase is Phase.SHUTDOWN and h.co.core.life.status is Status.FAILED


def test_preemption_in_progressive_modes_snapshots_coverage_at_the_next_reduce(tmp_path):
    h = Harness(tmp_path, "cpu_cadence", world=2, epochs=3)
    plans = h.start()
    h.co.core.preemption.request_preempt()
    h.tick()
    req = h.co.core.preemption.request
    assert req is not None and req.stage is Stage.ARMED and h.co.core.life.phase is Phase.TRAINING
    for r in (0, 1):  # one window: each rank's first chunk (equal split until ElChe has measured)
        h.finish_chunk(r, plans[r][0])
    h.tick()
    assert [r for r, _ in h.transport.take(RequestParams)] == [0, 1]
    h.snapshot(0, plans[0][0].size // BATCH, 1.0)
    h.snapshot(1, plans[1][0].size // BATCH, 3.0)
    assert req.stage is Stage.SAVING and h.co.core.life.phase is Phase.PREEMPTING
    sent = h.transport.take()
    assert not [p for _, p in sent if isinstance(p, StartEpoch)], "no chunk after the snapshot"
    assert [r for r, p in sent if isinstance(p, Save)] == [0, 1]
    lowest = req.coverage[0]
    trained = sum(plans[r][0].size for r in (0, 1) if plans[r][0].epoch == lowest["epoch"])
    uncovered = sum(size for _, size in lowest["uncovered_ranges"])
    assert uncovered == SAMPLES - trained, "what was trained and reduced is covered, the rest is not"
    assert req.epoch == lowest["epoch"] == h.co.core.dispatch.current_epoch()
    for r, p in sent:
        if isinstance(p, Save):
            h.msg(r, SaveResult(stem=p.stem))
    assert h.co.core.life.status is Status.PREEMPTED and h.co.core.life.phase is Phase.SHUTDOWN
    mark = json.load(open(os.path.join(h.job_dir, "preempted.json")))
    assert mark["stem"] == req.stem and mark["epoch"] == req.epoch
    meta = json.load(open(req.stem + ".meta.json"))
    assert meta["save_reason"] == "preempted" and meta["coverage"]["per_epoch"] == req.coverage


def test_preemption_without_progressive_dispatch_runs_one_consensus_reduce_first(tmp_path):
    h = Harness(tmp_path, "cpu_sync", world=2)
    plans = h.start()
    h.batches(0, plans[0][0].chunk, 1)
    h.co.core.preemption.request_preempt()
    h.tick()  # REQUESTED -> REDUCE; rank 1 has not stepped, so the sync gate is closed
    assert h.co.core.preemption.request is not None and h.co.core.preemption.request.stage is Stage.REDUCE
    h.tick()  # the consensus reduce
    reqs = h.transport.take(RequestParams)
    assert [r for r, _ in reqs] == [0, 1] and all(p.barrier for _, p in reqs)
    h.snapshot(0, 1, 2.0)
    h.snapshot(1, 0, 0.0)
    updates = h.transport.take(Update)
    assert [(r, p.alpha) for r, p in updates] == [(0, None), (1, None)]
    h.tick()
    assert h.co.core.life.phase is Phase.PREEMPTING
    _save_all(h, [0, 1])
    assert h.co.core.life.status is Status.PREEMPTED


def test_a_preemption_with_no_reduce_coming_fires_one_for_a_coverage_granular_bundle(tmp_path):
    """Both ranks wait mid-chunk (a gate, a slow read) when the time limit comes: no reduce would finish on its
    own. The coordinator fires one after PREEMPT_ARM_FALLBACK_S, so the bundle records what the open epoch
    trained; an epoch-granular bundle would retrain those picks on resume (CI: the SLURM time-limit test)."""
    from flodl_exp.core.preemption import PREEMPT_ARM_FALLBACK_S

    h = Harness(tmp_path, "cpu_cadence", world=2)
    plans = h.start()
    for r in (0, 1):
        h.batches(r, plans[r][0].chunk, 2)
    h.transport.take()
    h.co.core.preemption.request_preempt()
    h.tick()
    req = h.co.core.preemption.request
    assert req is not None and req.stage is Stage.ARMED
    h.pass_time(PREEMPT_ARM_FALLBACK_S + 1, alive=[0, 1])
    h.tick()
    assert h.co.core.life.phase is Phase.TRAINING and [r for r, _ in h.transport.take(RequestParams)] == [0, 1]
    h.snapshot(0, 2, 1.0)
    h.snapshot(1, 2, 3.0)
    assert h.co.core.life.phase is Phase.PREEMPTING
    _save_all(h, [0, 1])
    meta = json.load(open(h.co.core.preemption.request.stem + ".meta.json"))
    assert meta["save_reason"] == "preempted" and meta["coverage"]["per_epoch"], meta["coverage"]
    cov = meta["coverage"]["per_epoch"][0]
    assert cov["epoch"] == 0 and h.co.core.life.status is Status.PREEMPTED
    # the two batches each rank trained of its in-flight chunk are in the saved consensus: covered, not retrained
    for r in (0, 1):
        start = plans[r][0].offset
        assert not any(o <= start < o + s or o < start + 2 * BATCH <= o + s for o, s in cov["uncovered_ranges"]), cov
        assert any(o == start + 2 * BATCH for o, _ in cov["uncovered_ranges"]), "the rest of the chunk is uncovered"


def test_a_preemption_bundle_not_written_in_time_fails_the_run(tmp_path):
    h = Harness(tmp_path, "cpu_cadence", world=2)
    h.start()
    h.co.core.preemption.request_preempt()
    h.tick()
    h.pass_time(PREEMPT_SAVE_DEADLINE_S + 1, alive=[0, 1])  # no reduce finished, and the fallback save never completes
    h.tick()
    assert h.co.core.life.phase is Phase.PREEMPTING  # the 10 s fallback: an epoch-granular save went out
    h.transport.take()
    h.tick()
    assert h.co.core.life.status is Status.FAILED and h.co.core.life.end_reason == "time_limit"
    assert h.co.core.life.phase is Phase.SHUTDOWN


def test_sigterm_while_saving_ends_at_once_with_the_failure(tmp_path):
    slurm: dict[str, Any] = {"cluster.executor": "slurm"}
    h = Harness(tmp_path, "nccl_sync", world=2, **slurm)
    h.start()
    h.co.on_event(("closed", 1, "closed"))
    assert h.co.core.life.phase is Phase.SAVING
    h.co.core.preemption.request_terminate()
    h.tick()
    assert h.co.core.life.phase is Phase.DONE and h.co.core.life.status is Status.FAILED
    assert "then the job step was terminated: SIGTERM" in (h.co.core.life.failure or "")
    assert h.co.core.life.end_reason == "rank_failure"


def test_sigterm_without_a_failure_is_a_cancel_after_the_grace(tmp_path):
    h = Harness(tmp_path, "nccl_sync", world=2)
    h.start()
    h.co.core.preemption.request_terminate()
    h.tick()
    assert h.co.core.life.phase is Phase.TRAINING, "a preemption request may still follow"
    h.clock.advance(TERM_GRACE_S + 0.1)
    h.tick()
    assert h.co.core.life.phase is Phase.DONE and h.co.core.life.status is Status.KILLED and h.co.core.life.end_reason == "cancelled"


def test_epochs_aggregate_in_order_behind_a_straggler(tmp_path):
    h = Harness(tmp_path, "nccl_sync", world=2, epochs=2)
    plans = h.start()
    h.finish_chunk(0, plans[0][0], trained=0)
    h.tick()
    assert h.sink.epochs_logged() == [] and h.plans() == {}, "epoch 0 waits for rank 1"
    h.finish_chunk(1, plans[1][0], trained=0)
    h.tick()
    assert h.sink.epochs_logged() == [0]
    nxt = h.plans()
    assert sorted(nxt) == [0, 1] and all(p[0].epoch == 1 for p in nxt.values())
    assert h.co.core.dispatch.coverage[0] == [[plans[0][0].offset, 0], [plans[1][0].offset, 0]]


def test_the_run_ends_only_after_the_last_reduce_settles(tmp_path):
    h = Harness(tmp_path, "nccl_sync", world=2, epochs=1)
    plans = h.start()
    for r in (0, 1):
        h.finish_chunk(r, plans[r][0], trained=1)  # one step each, never reduced
    h.transport.take()
    h.tick()  # the sync gate fires (both stepped) and the epoch aggregates
    assert h.transport.take(SyncNow) and h.co.core.life.phase is Phase.DRAINING
    h.tick(3)
    assert h.co.core.life.phase is Phase.DRAINING and not h.transport.take(ExecuteEval), "no final eval before the reduce settles"
    h.ack_all([0, 1])
    h.tick()
    assert h.co.core.life.phase is Phase.FINISHING
    sent = h.transport.take()
    evals = [(r, p) for r, p in sent if isinstance(p, ExecuteEval)]
    assert len(evals) == 1 and evals[0][1].final
    saves = [(r, p) for r, p in sent if isinstance(p, Save)]
    assert sorted(r for r, _ in saves) == [0, 1] and sum(p.model for _, p in saves) == 1
    for r, p in saves:
        h.msg(r, SaveResult(stem=p.stem))
    assert h.co.core.life.phase is Phase.FINISHING, "the final eval is outstanding"
    h.msg(evals[0][0], EvalResult(epoch=0, metrics={"accuracy": 0.9}, final=True))
    assert h.co.core.life.status is Status.FINISHED and h.co.core.life.phase is Phase.SHUTDOWN
    assert json.load(open(h.co.core.writer.stem + ".meta.json"))["save_reason"] == "completed"
    for r in (0, 1):
        h.msg(r, Exiting(rank=r, pid=100 + r, hash="x", steps=1, global_step=2))
    h.tick()
    assert h.co.core.life.phase is Phase.DONE and h.co.result()["global_step"] == 2


def test_the_final_eval_moves_when_its_rank_dies(tmp_path):
    h = Harness(tmp_path, "cpu_sync", world=3, epochs=1)
    plans = h.start()
    for r in range(3):
        h.finish_chunk(r, plans[r][0], trained=0)
    h.transport.take()
    h.tick()
    h.tick()
    evals = h.transport.take(ExecuteEval)
    assert h.co.core.life.phase is Phase.FINISHING and len(evals) == 1
    cb = evals[0][0]
    h.co.on_event(("closed", cb, "closed"))
    moved = h.transport.take()
    new_cb = next(r for r, p in moved if isinstance(p, ExecuteEval))
    assert new_cb != cb and any(isinstance(p, Save) and p.model and r == new_cb for r, p in moved)


@pytest.mark.parametrize("kind", ["closed", "stale"])
def test_a_rank_lost_while_connecting_fails_the_run_naming_it(tmp_path, kind):
    from flodl_exp.core.lifecycle import RunFailure

    h = Harness(tmp_path, "nccl_sync", world=2)
    h.co.on_event(("join", 0, Hello(rank=0, samples=SAMPLES)))
    if kind == "closed":
        with pytest.raises(RunFailure, match="rank 1 failed before training started"):
            h.co.on_event(("closed", 1, "closed"))
    else:
        with pytest.raises(RunFailure, match=r"ranks \[1\] did not connect"):
            h.co.run(connect_timeout=-1.0)  # the fake clock never moves: a deadline already past


def test_batches_trained_after_a_cpu_snapshot_do_not_carry_into_the_next_window(tmp_path):
    """cpu_async streams on after its snapshot; the blended update keeps those batches at weight (1 - alpha),
    and the reference resets the window at adoption: they weigh nothing in the next reduce nor open its gate."""
    h = Harness(tmp_path, "cpu_async", world=2, epochs=3)
    plans = h.start(samples=480)
    h.play([0, 1], lambda: h.co.core.cycle.in_flight is not None, pending=[(r, p) for r, ps in plans.items() for p in ps])
    assert [r for r, _ in h.transport.take(RequestParams)] == [0, 1]
    n = [h.co.core.cycle.steps(r) for r in (0, 1)]
    h.snapshot(0, n[0], 1.0)
    h.batches(0, 999, 2)  # trained while the other snapshot is on the way (no barrier in cpu_async)
    h.snapshot(1, n[1], 3.0)
    assert h.co.core.cycle.in_flight is None and h.co.core.cycle.global_step == sum(n)
    assert [h.co.core.cycle.steps(r) for r in (0, 1)] == [0, 0]


def test_a_death_is_recorded_beside_the_bundle_and_logged(tmp_path):
    h = Harness(tmp_path, "cpu_sync", world=3)
    plans = h.start()
    h.batches(2, plans[2][0].chunk, 3)
    h.msg(2, RankError(error="RuntimeError: injected", traceback="Traceback ...\nRuntimeError: injected"))
    h.co.on_event(("closed", 2, "closed"))
    path = h.co.core.writer.stem + ".death.json"
    rec = json.load(open(path))["deaths"]
    assert [(d["rank"], d["last_step"], d["epoch"]) for d in rec] == [(2, 3, 0)]
    assert rec[0]["reason"] == "connection closed: RuntimeError: injected" and "Traceback" in rec[0]["traceback"]
    assert rec[0]["unix_time"] > 0 and (path, "deaths") in h.sink.artifacts
    assert h.co.core.life.phase is Phase.TRAINING, "one loss of three is recoverable on cpu"


@pytest.mark.parametrize(("attempt", "named"), [(0, True), (1, False)])
def test_a_rank_whose_error_frame_was_lost_is_named_from_its_death_record(tmp_path, attempt, named):
    """A failing rank's RankError can be lost with its connection (a reset: it closed with our frame unread); its death
    record of this incarnation, written before, stands in for it. A record of another incarnation does not."""
    h = Harness(tmp_path, "cpu_sync", world=3)
    plans = h.start()
    h.batches(2, plans[2][0].chunk, 3)
    write_death_record(h.job_dir, 2, 3, "RuntimeError: injected fault", "Traceback ...\nRuntimeError: injected fault",
                       attempt=attempt)
    h.co.on_event(("closed", 2, "closed"))
    rec = json.load(open(h.co.core.writer.stem + ".death.json"))["deaths"]
    if named:
        assert rec[0]["reason"] == "connection closed: RuntimeError: injected fault" and "Traceback" in rec[0]["traceback"]
    else:
        assert rec[0]["reason"] == "connection closed"


@pytest.mark.parametrize(("pct", "ends"), [(0.3, True), (0.5, False)])
def test_max_failure_as_a_share_of_the_world(tmp_path, pct, ends):
    """ceil(0.3 x 3) = 1 dead rank ends the run; ceil(0.5 x 3) = 2 tolerates one."""
    h = Harness(tmp_path, "cpu_sync", world=3, **{"cluster.max_failure_pct": pct})
    h.start()
    h.co.on_event(("closed", 1, "closed"))
    assert (h.co.core.life.phase is Phase.SAVING) is ends
    if ends:
        assert (h.co.core.life.failure or "").startswith("max_failure_exceeded")


def test_the_stall_watchdog_at_the_debug_interval_dumps_every_15_seconds_at_most_5_times(tmp_path, caplog):
    """``cluster.stall_dump_s=15`` (the reference's -vvv interval): a dump 15 s into a stall, again every 15 s
    while it lasts, at most 5 a run (then one line says the rest are suppressed); progress re-arms it."""
    debug: dict[str, Any] = {"cluster.stall_dump_s": 15.0}
    h = Harness(tmp_path, "nccl_sync", world=2, **debug)
    plans = h.start()
    h.batches(0, plans[0][0].chunk, 1)  # rank 1 never steps: the sync gate stays closed
    h.tick()
    h.pass_time(14, alive=[0, 1])
    h.tick()
    assert h.co.watchdog.paths == []
    h.pass_time(2, alive=[0, 1])
    h.tick()
    assert len(h.co.watchdog.paths) == 1
    dump = json.load(open(h.co.watchdog.paths[0]))
    assert dump["phase"] == "training" and dump["global_step"] == 0 and dump["idle_s"] >= 15
    assert [(r["rank"], r["batches"], r["window_steps"]) for r in dump["ranks"]] == [(0, 1, 1), (1, 0, 0)]
    h.pass_time(10, alive=[0, 1])
    h.tick()
    assert len(h.co.watchdog.paths) == 1
    h.pass_time(6, alive=[0, 1])
    h.tick()
    assert len(h.co.watchdog.paths) == 2, "again one interval later"
    with caplog.at_level("WARNING", logger="flodl_exp.coordinator"):
        for _ in range(10):
            h.pass_time(15, alive=[0, 1])
            h.tick()
    assert len(h.co.watchdog.paths) == 5, "at most 5 dumps a run"
    assert sorted(os.listdir(tmp_path)) == sorted(f for f in os.listdir(tmp_path) if not f.startswith("stall-")) + \
        [f"stall-{k}.json" for k in range(1, 6)]
    assert sum("further dumps are suppressed" in r.getMessage() for r in caplog.records) == 1
    h.batches(1, plans[1][0].chunk, 1)
    h.tick()  # the reduce fires; once it finishes the global step moves and the clock restarts
    h.ack_all([0, 1])
    h.pass_time(14, alive=[0, 1])
    h.tick()
    assert len(h.co.watchdog.paths) == 5


def test_healthy_30_second_windows_write_no_stall_dump_by_default(tmp_path):
    """Epoch-long healthy windows (the global step still for 30 s while every rank heartbeats and trains) are
    not stalls at the default (production) interval, 120 s: no stall file, no stall event."""
    h = Harness(tmp_path, "nccl_sync", world=2)
    assert h.co.watchdog.interval_s == 120.0
    plans = h.start()
    chunk = {r: plans[r][0].chunk for r in (0, 1)}
    windows = plans[0][0].size // BATCH
    for k in range(windows):
        h.batches(0, chunk[0], 1)
        for _ in range(3):  # 30 s of a window: both ranks alive, rank 1 still on its batch, no reduce yet
            h.pass_time(10, alive=[0, 1])
            h.tick()
        assert h.co.core.cycle.global_step == 2 * k
        h.batches(1, chunk[1], 1)
        h.tick()  # the reduce fires
        h.ack_all([0, 1])
        assert h.co.core.cycle.global_step == 2 * (k + 1)
    assert windows * 30 > 120, "longer, all told, than the interval"
    assert not [f for f in os.listdir(tmp_path) if f.startswith("stall-")] and h.co.watchdog.paths == []
    events = os.path.join(tmp_path, "events.jsonl")
    assert not [line for line in open(events) if json.loads(line).get("event") == "stall"]
    # the production interval still catches a real stall, one interval in
    h.tick()
    h.pass_time(121, alive=[0, 1])
    h.tick()
    assert len(h.co.watchdog.paths) == 1


def test_telemetry_after_the_last_epoch_is_logged_at_that_epoch(tmp_path):
    h = Harness(tmp_path, "cpu_sync", world=2, epochs=1)
    plans = h.start()
    h.msg(0, Telemetry(cpu_pct=80.0, rss_gb=0.5))  # epoch 0 is open: it goes into its means
    for r in (0, 1):
        h.finish_chunk(r, plans[r][0], trained=0)
    h.tick()
    assert h.sink.epochs_logged() == [0]
    step, logged = next((s, m) for s, m in h.sink.metrics if "loss" in m)
    assert logged["rank0/cpu_pct"] == 80.0 and "rank1/cpu_pct" not in logged
    h.msg(1, Telemetry(cpu_pct=40.0, rss_gb=0.25))  # the flush at rank 1's exit, after the epoch closed
    assert (0, {"rank1/cpu_pct": 40.0, "rank1/rss_gb": 0.25}) in h.sink.metrics


def _covered_once(ranges: list[list[int]], total: int) -> bool:
    marks = [0] * total
    for off, n in ranges:
        for i in range(off, off + n):
            marks[i] += 1
    return all(m == 1 for m in marks)


@pytest.mark.parametrize("mode", ["cpu_cadence", "nccl_cadence", "cpu_async"])
@pytest.mark.parametrize("finish_one", [False, True])
def test_a_dead_ranks_unreduced_batches_are_retrained_by_the_survivors(tmp_path, mode, finish_one):
    """Rank 2 dies mid-window: what it trained since its last reduce never reached the consensus, so it
    goes back to the pool (a finished chunk is reopened, the running one forfeited whole) and the epoch
    still covers every pick exactly once, with only rank 2's reduced work on its books."""
    samples = 960
    h = Harness(tmp_path, mode, world=3, epochs=1)
    plans = h.start(samples=samples)
    h.play([0, 1, 2], lambda: h.co.core.cycle.version >= 1, pending=[(r, p) for r, ps in plans.items() for p in ps])
    reduced = h.co.core.dispatch.accs[0].ranks[2].samples
    assert reduced > 0
    pending = h.transport.take()
    chunks2 = [p for r, p in pending if r == 2 and isinstance(p, StartEpoch)]
    assert chunks2, "rank 2 got its next chunk"
    if finish_one:
        h.finish_chunk(2, chunks2[0])  # a whole chunk finished and reported, then ...
        pending += h.transport.take()
        more = [p for r, p in pending if r == 2 and isinstance(p, StartEpoch) and p is not chunks2[0]]
        if more:
            h.batches(2, more[0].chunk, 1)  # ... one batch of the next
    else:
        h.batches(2, chunks2[0].chunk, 2)  # two batches of the running chunk
    unreduced = h.co.core.cycle.steps(2)
    assert unreduced > 0
    h.co.on_event(("closed", 2, "closed"))
    assert h.co.core.cohort.deaths[0].unreduced_steps == unreduced
    h.play([0, 1], lambda: 0 in h.sink.epochs_logged(), pending=[(r, p) for r, p in pending if r != 2])
    cov = h.co.core.dispatch.coverage[0]
    assert _covered_once(cov, samples), cov
    acc = h.co.core.dispatch.accs[0]
    assert acc.ranks[2].samples == reduced, "rank 2 keeps only what a reduce took in"
    assert acc.ranks[0].samples + acc.ranks[1].samples + reduced == samples
    assert h.co.core.dispatch.lost_picks == 0


def _play_to_the_end(h: Harness, ranks: list[int], samples: int = SAMPLES) -> list[tuple[int, Any]]:
    """Play well-behaved ranks through every epoch; returns every message the coordinator sent."""
    seen: list[tuple[int, Any]] = []
    plans = h.start(samples=samples)
    todo = [(r, p) for r, ps in plans.items() for p in ps]
    seen += todo
    for _ in range(2000):
        if h.co.core.life.phase is Phase.FINISHING:
            return seen + h.transport.take()
        batch = h.transport.take()
        seen += batch
        todo += batch
        for r, p in todo:
            h.answer(r, p)
        todo = []
        h.tick()
    raise AssertionError(f"the run did not reach FINISHING (phase {h.co.core.life.phase})")


def test_periodic_checkpoints_do_not_change_cpu_async_training(tmp_path):
    """checkpoint.every takes the bundle at a reduce finish from the state the ranks hold: no extra consensus
    reduce, no hold of the next epoch, and the EASGD blend stays on every training reduce."""
    h = Harness(tmp_path, "cpu_async", world=2, epochs=4, **{"checkpoint.every": 1})
    sent = _play_to_the_end(h, [0, 1], samples=480)
    assert Phase.CHECKPOINTING not in h.co.core.life.history
    barrier_versions = {p.version for _, p in sent if isinstance(p, RequestParams) and p.barrier}
    last = max(p.version for _, p in sent if isinstance(p, RequestParams))
    assert barrier_versions == {last}, "one consensus (barrier) reduce: the drain after the last epoch, none for the bundles"
    updates = [p for _, p in sent if isinstance(p, Update) and not p.skip]
    assert {p.alpha for p in updates[:-2]} == {0.5} and {p.alpha for p in updates[-2:]} == {None}, \
        "the blend on every training reduce; the full overwrite only at the end"
    for e in (1, 2, 3):
        meta = json.load(open(h.co.core.writer.stem_for("epoch", e) + ".meta.json"))
        assert meta["save_reason"] == "periodic" and meta["epoch"] <= e
        per = {p["epoch"]: p for p in meta["coverage"]["per_epoch"]}
        assert meta["epoch"] == min(per), "a coverage-granular bundle: the resume trains only what it lacked"
    saves = [p for _, p in sent if isinstance(p, Save)]
    assert all(p.consensus for p in saves), "cpu backend bundles hold the consensus, not a blended replica"


@pytest.mark.parametrize("mode", ["cpu_cadence", "cpu_async", "nccl_cadence"])
def test_at_epoch_bundle_lands_inside_the_epoch_asked_for(tmp_path, mode):
    """Epochs far shorter than a window: the bundle still records epoch 2 (held open until it is taken)."""
    h = Harness(tmp_path, mode, world=2, epochs=5, **{"checkpoint.at_epoch": 2})
    _play_to_the_end(h, [0, 1], samples=48)
    meta = json.load(open(h.co.core.writer.stem_for("at_epoch", 2) + ".meta.json"))
    per = {p["epoch"]: p for p in meta["coverage"]["per_epoch"]}
    assert meta["save_reason"] == "at_epoch" and meta["epoch"] == 2 and 2 in per, meta
    assert h.co.core.dispatch.epoch_ceiling is None and h.sink.epochs_logged() == [0, 1, 2, 3, 4]


def test_a_rank_lost_before_it_joined_is_named_at_once(tmp_path):
    """Its task wrote who runs it, then died before dialing in: the run fails naming that rank, without
    waiting for the connect timeout or for the joined ranks' process-group timeout."""
    import subprocess
    import sys

    from flodl_exp.core.lifecycle import RunFailure
    from flodl_exp.rendezvous import rank_marker_path, write_rank_marker

    h = Harness(tmp_path, "nccl_sync", world=2)
    h.co.on_event(("join", 0, Hello(rank=0, samples=SAMPLES)))
    write_rank_marker(h.job_dir, 1, 0)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    marker = json.load(open(rank_marker_path(h.job_dir, 1)))
    marker["pid"] = int(gone.stdout)
    json.dump(marker, open(rank_marker_path(h.job_dir, 1), "w"))
    with pytest.raises(RunFailure, match=rf"rank 1 was lost before training started: its process {marker['pid']} .* exited"):
        h.co.run(connect_timeout=600.0)
    # The core decided it (core/startup.py): a joined rank that then fails (its process-group setup timed out)
    # does not take the blame.
    h.co.on_event(("closed", 0, "closed"))
    assert h.co.view.status is Status.FAILED
    assert (h.co.view.failure or "").startswith("rank 1 was lost before training started")


def test_a_rank_lost_during_start_up_leads_the_error_before_a_collateral_close(tmp_path):
    """Rank 1 of 3 is SIGKILLed before it connects; rank 2 (joined, its setup waiting for rank 1) fails at once
    and its close arrives while rank 1's process is still unreaped (a zombie, as under the task manager's
    poll). The run fails naming rank 1 first (pid, host), rank 2's close after it; before, it ended with
    ``rank 2 failed before training started (ranks [1] never connected): closed``."""
    import signal
    import subprocess
    import sys

    from flodl_exp.core.lifecycle import RunFailure
    from flodl_exp.rendezvous import rank_marker_path, write_rank_marker

    h = Harness(tmp_path, "nccl_sync", world=3)
    for r in (0, 2):
        h.co.on_event(("join", r, Hello(rank=r, samples=SAMPLES)))
    task = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_rank_marker(h.job_dir, 1, 0)
        marker = json.load(open(rank_marker_path(h.job_dir, 1)))
        marker["pid"] = task.pid
        json.dump(marker, open(rank_marker_path(h.job_dir, 1), "w"))
        h.co.on_event(("closed", 2, "closed"))  # rank 1 still runs: the close is not blamed yet
        assert h.co.core.life.is_(Phase.CONNECTING)
        task.send_signal(signal.SIGKILL)  # ... and is never reaped here: a zombie, as in the race
        with pytest.raises(RunFailure) as err:
            h.co.run(connect_timeout=600.0)
        msg = str(err.value)
        assert msg.startswith(f"rank 1 was lost before training started: its process {task.pid} on "
                              f"{marker['host']} exited before it connected"), msg
        assert msg.endswith("; after it, rank 2 failed: closed"), msg
    finally:
        task.kill()
        task.wait()


def test_a_close_while_a_rank_is_missing_is_blamed_after_the_grace(tmp_path):
    """No rank found lost (its task on another host, say) within LOST_PEER_GRACE_S: the first close is blamed,
    the missing ranks named, later closes after it."""
    from flodl_exp.core.lifecycle import RunFailure
    from flodl_exp.core.startup import LOST_PEER_GRACE_S

    h = Harness(tmp_path, "nccl_sync", world=3)
    for r in (0, 2):
        h.co.on_event(("join", r, Hello(rank=r, samples=SAMPLES)))
    h.co.on_event(("closed", 2, "closed"))
    h.co.on_event(("closed", 0, "RuntimeError: store timeout"))
    h.clock.advance(LOST_PEER_GRACE_S - 0.5)
    h.co.check_startup()  # within the grace: still waiting for rank 1 to be found lost
    h.clock.advance(1.0)
    with pytest.raises(RunFailure, match=r"^rank 2 failed before training started \(ranks \[1\] never connected\): "
                       r"closed; then rank 0 failed: RuntimeError: store timeout$"):
        h.co.run(connect_timeout=600.0)


def test_a_failed_model_piece_is_written_by_another_live_rank(tmp_path):
    h = Harness(tmp_path, "cpu_sync", world=3, epochs=1)
    plans = h.start()
    for r in range(3):
        h.finish_chunk(r, plans[r][0], trained=0)
    h.transport.take()
    h.tick(2)
    sent = h.transport.take()
    evals = [(r, p) for r, p in sent if isinstance(p, ExecuteEval)]
    saves = [(r, p) for r, p in sent if isinstance(p, Save)]
    writer = next(r for r, p in saves if p.model)
    for r, p in saves:
        h.msg(r, SaveResult(stem=p.stem, error="OSError: [Errno 28] No space left on device" if r == writer else None))
    retry = h.transport.take(Save)
    assert len(retry) == 1 and retry[0][0] != writer and retry[0][1].model and retry[0][1].primary
    assert h.sink.tags[f"save_error.rank{writer}"].startswith("OSError")
    h.msg(evals[0][0], EvalResult(epoch=0, metrics={"accuracy": 0.9}, final=True))
    assert h.co.core.life.phase is Phase.FINISHING, "the retried piece is outstanding"
    h.msg(retry[0][0], SaveResult(stem=retry[0][1].stem))
    assert h.co.core.life.status is Status.FINISHED


def test_a_cpu_async_run_with_periodic_checkpoints_trains_exactly_like_one_without(tmp_path):
    """Driven by the same well-behaved ranks, the two runs send the same reduces (version, barrier), the same
    updates (alpha) and the same chunks, and end at the same global step: the bundles change nothing."""
    def trace(h: Harness) -> list[tuple[Any, ...]]:
        out: list[tuple[Any, ...]] = []
        for r, p in _play_to_the_end(h, [0, 1], samples=480):
            if isinstance(p, RequestParams):
                out.append(("reduce", r, p.version, p.barrier))
            elif isinstance(p, Update):
                out.append(("update", r, p.n, p.alpha, p.skip))
            elif isinstance(p, StartEpoch):
                out.append(("chunk", r, p.epoch, p.offset, p.size))
        return out

    (tmp_path / "plain").mkdir()
    (tmp_path / "ckpt").mkdir()
    plain = Harness(tmp_path / "plain", "cpu_async", world=2, epochs=4)
    ckpt = Harness(tmp_path / "ckpt", "cpu_async", world=2, epochs=4, **{"checkpoint.every": 1})
    assert trace(plain) == trace(ckpt)
    assert plain.co.core.cycle.global_step == ckpt.co.core.cycle.global_step and plain.co.core.cycle.version == ckpt.co.core.cycle.version
    assert os.path.exists(ckpt.co.core.writer.stem_for("epoch", 3) + ".meta.json")


def test_a_silent_or_dead_regroup_generator_is_passed_over(tmp_path):
    """algorithms.md 7.4: a generator that died or gave no session within 5 s is replaced by the next
    survivor; answers from a passed-over rank are ignored; no reduce fires while the regroup is pending."""
    from flodl_exp.core.faults import REGROUP_RETRY_S

    h = Harness(tmp_path, "nccl_cadence", world=4)
    h.start()
    h.transport.take()
    h.co.on_event(("closed", 3, "closed"))
    assert [r for r, _ in h.transport.take(RequestSession)] == [0]
    h.pass_time(REGROUP_RETRY_S + 0.5, alive=[0, 1, 2])
    h.tick()
    assert [r for r, _ in h.transport.take(RequestSession)] == [1], "rank 0 stayed silent: rank 1 is asked"
    h.co.on_event(("closed", 1, "closed"))  # the new generator dies too
    h.tick()
    assert [r for r, _ in h.transport.take(RequestSession)] == [2]
    h.msg(0, SessionReady(generation=1, session="late"))  # passed over: ignored
    assert h.transport.take(Regroup) == [] and h.co.core.faults.regroup is not None
    h.msg(2, SessionReady(generation=1, session="s"))
    regroups = {r: p for r, p in h.transport.take(Regroup)}
    assert regroups == {0: Regroup(1, 0, 2, [0, 2], "s"), 2: Regroup(1, 1, 2, [0, 2], "s")}
    assert h.co.core.faults.regroup is None


def test_the_regroup_generator_is_the_lowest_live_rank_on_the_coordinators_host(tmp_path):
    """algorithms.md 7.4, tier 1: the lowest live rank co-located with the coordinator, however fast its
    co-located peers are; tier 2 (none co-located): the smallest per-batch compute wall, ties to the lower
    rank. Retries walk the same order."""
    from flodl_exp.core.faults import REGROUP_RETRY_S, generator_order
    from flodl_exp.protocol.messages import Batch

    assert generator_order([0, 1, 2, 4], [False, True, True, False, True], [1.0, 9.0, 2.0, None, 0.5]) == [1, 2, 4, 0]
    assert generator_order([0, 1, 2], [False] * 3, [3.0, None, 2.0]) == [2, 0, 1]
    assert generator_order([0, 1, 2], [False] * 3, [2.0, 2.0, 2.0]) == [0, 1, 2]

    h = Harness(tmp_path, "nccl_cadence", world=4)
    here = os.uname().nodename
    hosts = {0: "elsewhere", 1: here, 2: here, 3: here}
    for r in range(4):
        h.co.on_event(("join", r, Hello(rank=r, samples=SAMPLES, host=hosts[r], pid=100 + r)))
    h.co.start()
    plans = h.plans()
    for r, ms in ((0, 1.0), (1, 9.0), (2, 2.0), (3, 3.0)):  # rank 2 is the fastest co-located rank
        h.msg(r, Batch(ms=ms, data_ms=0.1, chunk=plans[r][0].chunk, loss=1.0, lr=0.1))
    h.transport.take()
    h.co.on_event(("closed", 3, "closed"))
    assert [r for r, _ in h.transport.take(RequestSession)] == [1], "the lowest co-located rank, not the fastest"
    h.pass_time(REGROUP_RETRY_S + 0.5, alive=[0, 1, 2])
    h.tick()
    assert [r for r, _ in h.transport.take(RequestSession)] == [2], "then the next co-located rank"
    h.pass_time(REGROUP_RETRY_S + 0.5, alive=[0, 1, 2])
    h.tick()
    assert [r for r, _ in h.transport.take(RequestSession)] == [0], "then the ranks elsewhere"


def test_no_generator_left_ends_the_run_with_a_bundle(tmp_path):
    from flodl_exp.core.faults import REGROUP_RETRY_S

    h = Harness(tmp_path, "nccl_cadence", world=3)
    h.start()
    h.co.on_event(("closed", 2, "closed"))
    for _ in range(2):
        h.pass_time(REGROUP_RETRY_S + 0.5, alive=[0, 1])
        h.tick()
    assert h.co.core.life.phase is Phase.SAVING and (h.co.core.life.failure or "").startswith("single_survivor: no survivor produced")


@pytest.mark.parametrize(("mode", "barrier"), [("cpu_cadence", True), ("cpu_sync", True), ("cpu_async", False)])
def test_cpu_ranks_wait_for_the_update_unless_it_is_blended(tmp_path, mode, barrier):
    """Under a full overwrite a batch trained after the snapshot would be trained and in no consensus: the
    ranks wait for the update. Only EASGD (cpu_async) streams on, its extra batches kept at (1 - alpha)."""
    h = Harness(tmp_path, mode, world=2, epochs=3)
    plans = h.start(samples=480)
    h.play([0, 1], lambda: h.co.core.cycle.in_flight is not None, pending=[(r, p) for r, ps in plans.items() for p in ps])
    reqs = h.transport.take(RequestParams)
    assert reqs and {p.barrier for _, p in reqs} == {barrier}


def test_batches_trained_after_an_nccl_ack_count_toward_the_next_reduce(tmp_path):
    """A rank that acked trains on while its peer finishes the collective: those batches are in no
    consensus, so they must keep the final reduce due (it was skipped, leaving replicas apart)."""
    from flodl_exp.protocol.messages import SyncAck

    h = Harness(tmp_path, "nccl_sync", world=2)
    plans = h.start()
    for r in range(2):
        h.batches(r, plans[r][0].chunk, 1)
    h.tick()
    assert h.transport.take(SyncNow)
    h.msg(0, SyncAck(n=1, d=0.0, pre=1.0, post=1.0))
    h.batches(0, plans[0][0].chunk, 1)  # trained after its collective, before rank 1's ack
    h.msg(1, SyncAck(n=1, d=0.0, pre=1.0, post=1.0))
    h.tick()
    assert h.co.core.cycle.in_flight is None
    assert h.co.core.cycle.steps(0) == 1 and h.co.core.cycle.steps(1) == 0
    assert h.co.core.cycle.any_steps([0, 1])


def test_a_dead_ranks_forfeit_in_an_epoch_the_survivors_left_is_trained_first(tmp_path):
    """cpu_async streams ahead: survivors may be epochs past the one a stuck rank held a chunk of. When it dies,
    its forfeit reopens that older pool, and the survivors must take it before anything newer, else that
    epoch never completes (the run stalled at a fixed global step, seen in CI)."""
    from flodl_exp.core.chunk_pool import ChunkPool

    h = Harness(tmp_path, "cpu_async", world=3, epochs=4)
    plans = h.start(samples=480)
    d = h.co.core.dispatch
    for r in (0, 2):
        h.finish_chunk(r, plans[r][0])
    h.transport.take()
    for cid in [c for c, ch in d.chunks.items() if ch.rank != 1]:  # 0 and 2: nothing in flight, a reduce behind
        del d.chunks[cid]
    for r in (0, 2):
        h.co.core.cycle.ledger[r].steps = 0
    for e in (0, 1):  # ranks 0 and 2 drained epoch 0's pool and all of epoch 1's
        if e not in d.pools:
            d.pools[e] = ChunkPool(e, d.total, d.bs, [1, 1, 1])
        pool = d.pools[e]
        while pool.remaining() > 0:
            for r in (0, 2):
                got = pool.take_chunk(d.bs, r)
                if got is not None:
                    pool.mark_completed(r, got[1])
    for r in (0, 2):
        d.rank_epoch[r] = 1
    assert d.pools[0].remaining() == 0 and any(c.rank == 1 and c.epoch == 0 for c in d.chunks.values())
    h.co.declare_dead(1, "stuck")
    handed = [(r, p.epoch) for r, p in h.transport.take(StartEpoch)]
    assert any(e == 0 for _, e in handed), f"the survivors were handed {handed}, not rank 1's epoch-0 remainder"
    assert d.pools[0].remaining() < plans[1][0].size


@pytest.mark.parametrize("mode", ["nccl_cadence", "cpu_cadence", "cpu_async"])
def test_a_cold_start_probe_hands_the_fast_rank_the_rest_of_a_window_sized_by_speed(tmp_path, mode):
    """Before any reduce, the first window is [anchor] * W: on a 3:1 rig the fast rank would idle through two
    thirds of it. Once every rank has timed its first steps, ElChe re-sizes the window in progress and the
    fast rank is handed the rest of its (larger) share; the reduce waits for it."""
    from flodl_exp.protocol.messages import Batch, ChunkMetrics

    h = Harness(tmp_path, mode, world=2, epochs=2)
    plans = h.start(samples=960)  # 120 batches of 8
    first = {r: plans[r][0] for r in (0, 1)}

    def step(r: int, ms: float) -> None:
        h.msg(r, Batch(ms=ms, data_ms=0.1, chunk=first[r].chunk, loss=1.0, lr=0.1))

    n0 = first[0].size // BATCH
    for _ in range(n0):  # the fast rank trains its whole first chunk at 5 ms a step
        step(0, 5.0)
    h.msg(0, ChunkMetrics(epoch=0, chunk=first[0].chunk, avg_loss=1.0, batches=n0, samples=n0 * BATCH, epoch_ms=5.0 * n0,
                          share_complete_ms=5.0 * n0, compute_only_ms=5.0 * n0, data_starve_ms=0.0,
                          ranges=[[first[0].offset, n0 * BATCH]]))
    for ms in (40.0, 15.0, 15.0):  # the slow rank's first steps: a slow warm-up step, then 3x the fast one
        step(1, ms)
    probe = [e for e in _events(h) if e["event"] == "probe"]
    assert probe and probe[0]["ms_per_batch"] == [5.0, 15.0] and probe[0]["counts"] == [30, 10]
    for _ in range(10):  # the fast rank trains what it is handed, as long as it is handed work
        got = h.transport.take(StartEpoch, rank=0)
        if not got:
            break
        for _, p in got:
            h.finish_chunk(0, p)
    assert h.co.core.cycle.in_flight is None, "no reduce before the slow rank ran its count"
    if mode == "cpu_async":  # streams to its budget: count + overshoot
        assert h.co.core.cycle.steps(0) >= 30
    else:  # exactly the rest of its window
        assert h.co.core.cycle.steps(0) == 30


@pytest.mark.parametrize("mode", ["nccl_cadence", "cpu_cadence", "cpu_async"])
def test_a_fast_rank_does_not_idle_while_the_probe_waits_for_the_slow_rank(tmp_path, mode):
    """Issue 30 (cold start): the fast rank reaches its count of the first window before the slow rank has timed
    its probe steps. It is handed more work at once (it used to idle until the probe landed); once the probe
    sizes the window it trains exactly its share (cadence) and the reduce still waits for the slow rank's count.
    With no probe coming, the extra work stops after PROBE_EXTRA_WINDOWS windows' worth."""
    from flodl_exp.core.dispatch import PROBE_EXTRA_WINDOWS
    from flodl_exp.protocol.messages import Batch

    h = Harness(tmp_path, mode, world=2, epochs=2)
    plans = h.start(samples=1920)  # 240 batches of 8
    count = h.co.core.cycle.counts[0]
    h.finish_chunk(0, plans[0][0])
    handed = h.transport.take(StartEpoch, rank=0)
    assert handed, "the fast rank idled at its count while the probe was open"
    trained = h.co.core.cycle.steps(0)
    biggest = 0
    for _ in range(40):  # the probe never lands: the extra work is bounded
        got = h.transport.take(StartEpoch, rank=0) or handed
        handed = []
        for _, p in got:
            biggest = max(biggest, p.size // BATCH)
            h.finish_chunk(0, p)
        if not got:
            break
    else:
        raise AssertionError("the fast rank was handed work without end while the probe was open")
    budget = count + (h.co.core.dispatch.overshoot.value if mode == "cpu_async" else 0)
    if mode == "cpu_async":  # an uncalibrated async chunk is not cut at the budget: one chunk per extension
        assert budget < h.co.core.cycle.steps(0) <= budget + biggest + PROBE_EXTRA_WINDOWS * max(count, biggest)
    else:  # a cadence chunk stops at the extended count
        assert budget < h.co.core.cycle.steps(0) == budget + PROBE_EXTRA_WINDOWS * count
    assert h.co.core.cycle.in_flight is None and trained >= count
    for ms in (40.0, 15.0, 15.0):  # the slow rank's probe steps (3x slower after its warm-up): counts [30, 10]
        h.msg(1, Batch(ms=ms, data_ms=0.1, chunk=plans[1][0].chunk, loss=1.0, lr=0.1))
    assert [e for e in _events(h) if e["event"] == "probe"][0]["counts"] == [30, 10]
    assert h.co.core.dispatch._counts() == h.co.core.cycle.counts_view  # the extra is gone with the probe
    assert h.co.core.cycle.in_flight is None, "no reduce before the slow rank ran its count"


def _events(h: Harness) -> list[dict[str, Any]]:
    with open(os.path.join(h.job_dir, "events.jsonl")) as fh:
        return [json.loads(line) for line in fh if line.strip()]


# ---------------------------------------------------------------- issue 26: nothing waits on the dead, nothing is dropped
def test_a_death_during_a_periodic_bundle_does_not_hold_it(tmp_path):
    """cpu_sync, checkpoint.every=1: rank 1 dies before it writes its piece of the epoch-0 bundle. The bundle
    completes from the survivors (rank 1's piece forfeit) and training goes on; it used to wait in
    'checkpointing' for the dead rank's save_result forever."""
    h = Harness(tmp_path, "cpu_sync", world=3, epochs=3, **{"checkpoint.every": 1})
    plans = h.start()
    h.play([0, 1, 2], lambda: h.co.core.life.is_(Phase.CHECKPOINTING) and h.co.core.checkpoints.periodic is not None
           and h.co.core.checkpoints.periodic.saving, pending=[(r, p) for r, ps in plans.items() for p in ps])
    saves = h.transport.take(Save)
    assert sorted(r for r, _ in saves) == [0, 1, 2]
    for r, p in saves:
        if r != 1:
            h.msg(r, SaveResult(stem=p.stem))
    assert h.co.core.writer.pending == [1] and h.co.core.life.is_(Phase.CHECKPOINTING)
    h.co.on_event(("closed", 1, "closed"))
    h.tick()
    assert h.co.core.life.is_(Phase.TRAINING), h.co.stall_state()
    stem = next(p.stem for _, p in saves)
    meta = json.loads(open(stem + ".meta.json").read()) if os.path.exists(stem + ".meta.json") else None
    assert meta is not None and meta["save_reason"] == "periodic"


def test_the_model_piece_a_dead_rank_owed_moves_to_a_survivor(tmp_path):
    h = Harness(tmp_path, "cpu_sync", world=3, epochs=3, **{"checkpoint.every": 1})
    plans = h.start()
    h.play([0, 1, 2], lambda: h.co.core.checkpoints.periodic is not None and h.co.core.checkpoints.periodic.saving,
           pending=[(r, p) for r, ps in plans.items() for p in ps])
    saves = dict(h.transport.take(Save))
    model_rank = next(r for r, p in saves.items() if p.model)
    for r, p in saves.items():
        if r != model_rank:
            h.msg(r, SaveResult(stem=p.stem))
    h.co.on_event(("closed", model_rank, "closed"))
    moved = h.transport.take(Save)
    assert len(moved) == 1 and moved[0][0] != model_rank and moved[0][1].model and moved[0][1].primary
    h.msg(moved[0][0], SaveResult(stem=moved[0][1].stem))
    h.tick()
    assert h.co.core.life.is_(Phase.TRAINING) and not h.co.core.writer.failed


def test_picks_of_an_aggregated_epoch_in_no_reduce_are_retrained_not_lost(tmp_path):
    """cpu_cadence: rank 2 finished its last chunk of epoch 0, the epoch aggregated, and rank 2 died before the
    next reduce took those batches in. They used to be logged as lost (the run finished short of its global
    step while the epoch's metrics counted them): now the survivors train them again as a chunk of epoch 0."""
    h = Harness(tmp_path, "cpu_cadence", world=3, epochs=2)
    plans = h.start()
    h.play([0, 1, 2], lambda: h.co.core.dispatch.last_aggregated >= 0 and h.co.core.cycle.steps(2) > 0,
           pending=[(r, p) for r, ps in plans.items() for p in ps], rounds=2000)
    unreduced = h.co.core.cycle.steps(2)
    pending = h.transport.take()
    h.co.on_event(("closed", 2, "closed"))
    pending += h.transport.take()
    retrain = [(r, p) for r, p in pending if isinstance(p, (ExtendPartition, StartEpoch)) and p.epoch == 0]
    assert retrain and {r for r, _ in retrain} <= {0, 1}
    assert h.co.core.dispatch.retrained_picks >= BATCH and h.co.core.dispatch.lost_picks == 0
    assert sum(p.size for _, p in retrain) >= h.co.core.dispatch.retrained_picks
    assert unreduced * BATCH >= h.co.core.dispatch.retrained_picks
    h.play([0, 1], lambda: h.co.core.life.is_(Phase.FINISHING), pending=[(r, p) for r, p in pending if r != 2], rounds=2000)
    assert h.co.core.cycle.global_step == 2 * (SAMPLES // BATCH), "every batch in exactly one reduce"


@pytest.mark.parametrize(("same_generation", "counted"), [(True, True), (False, False)])
def test_an_answer_of_a_rank_that_died_counts_only_if_the_survivors_completed_its_collective(tmp_path, same_generation,
                                                                                           counted):
    h = Harness(tmp_path, "nccl_sync", world=3)
    plans = h.start()
    for r in range(3):
        h.batches(r, plans[r][0].chunk, 1)
    h.tick()
    h.transport.take()
    h.msg(2, SyncAck(n=1, d=0.01, pre=1.0, post=1.0, generation=0))  # rank 2 completed generation 0 ...
    h.co.on_event(("closed", 2, "closed"))  # ... and died
    assert h.co.core.cohort.deaths[0].acked_steps == 1 and h.co.core.cohort.deaths[0].unreduced_steps == 0
    h.msg(0, SessionReady(generation=1, session="s1"))
    gen = 0 if same_generation else 1  # the survivors completed the same collective, or redid it regrouped
    for r in (0, 1):
        h.msg(r, SyncAck(n=1, d=0.01, pre=1.0, post=1.0, generation=gen))
    assert h.co.core.cycle.in_flight is None
    assert h.co.core.cycle.global_step == (3 if counted else 2)
    extends = [p for _, p in h.transport.take(ExtendPartition)]
    if counted:
        assert not h.co.core.dispatch.held
    else:  # rank 2's answered batch goes back to the survivors with the rest of its plan
        assert sum(p.size for p in extends) == plans[2][0].size


def _paced_play(h: Harness, speeds: list[int], samples: int, ticks: int = 1000) -> tuple[list[tuple[str, int, int, int]], int]:
    """Ranks that train ``speeds[r]`` batches a tick and obey like the real ones: a Throttle holds a rank until
    the next Update, a barrier RequestParams too; every chunk is trained whole and reported. Returns the
    throttles sent (``("throttle", rank, steps, count)``) and the ticks taken; stops at the run's end."""
    from collections import deque

    from flodl_exp.protocol.messages import Batch, ChunkMetrics, Throttle

    w = len(speeds)
    chunks: dict[int, deque[list[int]]] = {r: deque() for r in range(w)}
    held = [False] * w
    seen: list[tuple[str, int, int, int]] = []
    todo = [(r, p) for r, ps in h.start(samples=samples).items() for p in ps]
    for t in range(ticks):
        for r, p in todo:
            if isinstance(p, (StartEpoch, ExtendPartition)):
                chunks[r].append([p.epoch, p.offset, p.size // BATCH, p.chunk, 0])
            elif isinstance(p, Throttle):
                held[r] = True
                seen.append(("throttle", r, h.co.core.cycle.steps(r), h.co.core.cycle.counts[r]))
            elif isinstance(p, RequestParams):
                h.snapshot(r, h.co.core.cycle.steps(r), float(r))
                held[r] = held[r] or p.barrier
            elif isinstance(p, Update):
                held[r] = False
            elif isinstance(p, ExecuteEval):
                h.msg(r, EvalResult(epoch=p.epoch, metrics={"accuracy": 0.5}, final=p.final))
            elif isinstance(p, Save):
                h.msg(r, SaveResult(stem=p.stem))
        if h.co.core.life.status is not Status.RUNNING:
            return seen, t
        for r in range(w):
            n = speeds[r]
            while n > 0 and chunks[r] and not held[r]:
                c = chunks[r][0]
                h.msg(r, Batch(ms=10.0 / speeds[r], data_ms=0.1, chunk=c[3], loss=1.0, lr=0.1))
                c[4] += 1
                n -= 1
                if c[4] == c[2]:
                    chunks[r].popleft()
                    h.msg(r, ChunkMetrics(epoch=c[0], chunk=c[3], avg_loss=1.0, batches=c[2], samples=c[2] * BATCH,
                                          epoch_ms=1.0, share_complete_ms=1.0, compute_only_ms=1.0, data_starve_ms=0.0,
                                          ranges=[[c[1], c[2] * BATCH]]))
        h.tick()
        todo = h.transport.take()
    return seen, ticks


@pytest.mark.parametrize("mode", ["cpu_sync", "cpu_cadence", "cpu_async"])
def test_max_batch_diff_holds_the_fast_rank_and_the_run_still_finishes(tmp_path, mode):
    """cpu backend, ``mode.max_batch_diff=2``, one rank 3x faster: throttles are sent and the run still trains
    every batch of both epochs and finishes. cpu_sync wedged before (global step 80 of 240): the fast rank done
    with its epoch share at 0 steps this window, the slow one held at 3 steps with its share unfinished, the
    sync gate waiting for a step of the fast rank. The throttle now measures the lead against the ranks that
    still have a chunk in flight."""
    h = Harness(tmp_path, mode, world=2, epochs=2, **{"mode.max_batch_diff": 2})
    throttles, _ = _paced_play(h, [3, 1], samples=960)
    assert throttles, "the throttle took part"
    assert h.co.core.life.status is Status.FINISHED, (h.co.core.life.phase, h.co.core.cycle.global_step, h.co.stall_state())
    assert h.co.core.cycle.global_step == 2 * 960 // BATCH


@pytest.mark.parametrize("mode", ["cpu_cadence", "cpu_async"])
def test_the_references_gate_wedges_on_a_throttled_rank_short_of_its_count(tmp_path, mode, monkeypatch):
    """Why a throttled rank counts as arrived at the reduce gate (README, "Differences from flodl 0.7.0"):
    with the reference's rule (algorithms.md 3.3: the count, or a quiesced rank in progressive modes) the
    run above never reduces. A Throttle holds a rank until the next update, so the fast rank held short of
    its count can never reach it, and the slow rank, stepping on, gets held too once it leads the frozen one:
    both held below their counts with a chunk in flight (not quiesced), the gate shut for good."""
    from flodl_exp.core.cycle import AveragingCycle

    def reference_gate(self: AveragingCycle, alive: list[int], quiesced: Any, working: Any = None) -> bool:
        if self.world_size < 2 or self.in_flight is not None:
            return False
        any_mover = False
        for r in alive:
            s = self.ledger[r].steps
            any_mover = any_mover or s > 0
            hit = s >= 1 if self.policy == "sync" else s >= self.counts[r]
            if not (hit or (self.progressive and quiesced(r))):
                return False
        return any_mover

    monkeypatch.setattr(AveragingCycle, "should_average", reference_gate)
    h = Harness(tmp_path, mode, world=2, epochs=2, **{"mode.max_batch_diff": 2})
    throttles, ticks = _paced_play(h, [3, 1], samples=960, ticks=300)
    assert ticks == 300 and h.co.core.life.is_(Phase.TRAINING) and h.co.core.cycle.global_step == 0, "wedged"
    assert sorted(r for _, r, _, _ in throttles) == [0, 1]
    assert all(h.co.core.cycle.ledger[r].throttled and h.co.core.cycle.steps(r) < h.co.core.cycle.counts[r] for r in (0, 1))
    assert all(h.co.core.dispatch.in_flight(r) and not h.co.core.dispatch.quiesced(r) for r in (0, 1))


def test_batches_of_an_extension_appended_to_a_running_chunk_are_booked_on_the_extension(tmp_path):
    """A rank appends an ExtendPartition to its running chunk and reports its batches under that chunk's id.
    Booked there, they were clamped to the chunk's size, so when the rank died too its extension went back to
    the survivors whole, reduced batches included (nccl_sync, two ranks killed: global step 221 of 220)."""
    h = Harness(tmp_path, "nccl_sync", world=4)
    plans = h.start()
    h.co.on_event(("closed", 2, "closed"))  # rank 2 dies untrained: its plan goes to ranks 0, 1 and 3
    h.msg(0, SessionReady(generation=1, session="s1"))
    ext0 = next(p for r, p in h.transport.take(ExtendPartition) if r == 0)
    own = plans[0][0].size // BATCH
    h.batches(0, plans[0][0].chunk, own + 1)  # its whole plan, then one batch of the extension, under the plan's id
    assert h.co.core.dispatch.progress[0].get(ext0.chunk) == 1
    for r in (1, 3):
        h.batches(r, plans[r][0].chunk, 1)
    h.tick()
    h.transport.take()
    for r in (0, 1, 3):
        h.msg(r, SyncAck(n=h.co.core.cycle.steps(r), d=0.01, pre=1.0, post=1.0, generation=1))
    assert h.co.core.cycle.in_flight is None and h.co.core.cycle.steps(0) == 0
    h.co.on_event(("closed", 0, "closed"))  # every batch rank 0 trained is in the consensus
    back = [p for r, p in h.transport.take(ExtendPartition) if r in (1, 3)]
    assert sum(p.size for p in back) == ext0.size - BATCH, "only the extension's untrained rest goes back"
