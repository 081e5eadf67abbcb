"""The cooperative tier's rules and plumbing without processes: a real RankTrainer and RankControl's own
chunk iteration, control from a queued inbox (rank/cooperative.py), and the coordinator's side of intents
and loop errors (control_fakes.Harness). End to end: test_modes (conformance) and test_e2e_cooperative."""
from __future__ import annotations

import queue
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from rank_fakes import Sent, rank_control

from flodl_exp.experiment import Experiment
from flodl_exp.protocol.codec import decode, encode
from flodl_exp.protocol.messages import (
    Batch,
    ChunkMetrics,
    EpochAggregated,
    EvalBroadcast,
    Intent,
    LoopNotice,
    RankError,
    Shutdown,
    StartEpoch,
)
from flodl_exp.rank.control import RankControl
from flodl_exp.rank.cooperative import CooperativeWorker, LoopMisuse, worker
from flodl_exp.rank.trainer import OptimizerSet, RankTrainer

BATCH = 8


class Points:
    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=g)
        self.y = (self.x.sum(1) > 0).long()

    def __len__(self) -> int:
        return len(self.y)

    def get_batch(self, ids: Any) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(np.asarray(ids, dtype=np.int64))
        return self.x[idx], self.y[idx]


class Inbox(queue.Queue):
    """The coordinator's messages, queued; once they are all read, a rank that waits gets Shutdown."""

    def get(self, block: bool = True, timeout: Any = None) -> Any:
        if block and self.empty():
            return encode(Shutdown(reason="completed"))
        return super().get(block, timeout)


CFG = SimpleNamespace(cluster=SimpleNamespace(heartbeat_timeout_s=4.0))
"""The part of the rank's config the cooperative handle reads."""


def queued_control(plans: list[tuple[int, int, int]]) -> tuple[RankControl, Sent]:
    """A rank's control over a real RankTrainer, without sockets or threads: ``plans`` (epoch, offset, size) are
    queued, then a Shutdown. Returns it and what it sent."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    exp = Experiment(model, torch.optim.SGD(model.parameters(), lr=0.1), None, Points(), None, None, None)
    trainer = RankTrainer(exp, device=torch.device("cpu"), batch_size=BATCH)
    return rank_control(trainer, messages=[StartEpoch(epoch=e, offset=off, size=size, chunk=chunk)
                                           for chunk, (e, off, size) in enumerate(plans)], frames=Inbox())


def handle(plans: list[tuple[int, int, int]]) -> tuple[CooperativeWorker, RankControl, Sent]:
    """The loop's ``w`` over :func:`queued_control`'s control."""
    ctl, sent = queued_control(plans)
    return CooperativeWorker(ctl, CFG), ctl, sent


def replica(w: CooperativeWorker) -> torch.nn.Linear:
    """``w.model``: the Linear(4, 2) :func:`queued_control` built."""
    model = w.model
    assert isinstance(model, torch.nn.Linear)
    return model


TWO_EPOCHS = [(0, 0, 32), (0, 32, 32), (1, 0, 64)]
"""Epoch 0 in two chunks (the loop sees one epoch), epoch 1 in one."""


def test_a_loop_trains_every_pick_once_and_books_every_step():
    w, ctl, sent = handle(TWO_EPOCHS)
    before = replica(w).weight.detach().clone()
    seen = []
    for epoch in w.epochs():
        n = 0
        for x, y in w.batches():
            loss = torch.nn.functional.cross_entropy(w.model(x), y)
            loss.backward()
            w.step(w.optimizer, loss=loss)
            n += 1
        seen.append((epoch, n))
    w.check_finished()
    assert seen == [(0, 8), (1, 8)]
    chunks = sent.of(ChunkMetrics)
    assert [(m.epoch, m.chunk, m.batches) for m in chunks] == [(0, 0, 4), (0, 1, 4), (1, 2, 8)]
    assert sorted(tuple(r) for m in chunks[:2] for r in m.ranges) == [(0, 32), (32, 32)]
    assert all(m.avg_loss > 0 for m in chunks)
    assert len(sent.of(Batch)) == 16 and ctl.trainer.steps_since_avg == 16
    assert not torch.equal(before, replica(w).weight)


def test_a_step_without_a_loss_is_kept_out_of_the_mean_loss():
    w, ctl, sent = handle([(0, 0, 16)])
    for _ in w.epochs():
        for i, (x, y) in enumerate(w.batches()):
            loss = torch.nn.functional.cross_entropy(w.model(x), y)
            loss.backward()
            w.step(w.optimizer, loss=2.0 if i == 0 else None)
    assert sent.of(ChunkMetrics)[0].avg_loss == pytest.approx(2.0)


def test_a_missing_step_is_named_at_the_next_batch():
    w, _, _ = handle(TWO_EPOCHS)
    with pytest.raises(LoopMisuse, match=r"w\.step\(\) was not called"):
        for _ in w.epochs():
            for x, _y in w.batches():
                w.model(x).sum().backward()


def test_stepping_twice_is_named():
    w, _, _ = handle(TWO_EPOCHS)
    with pytest.raises(LoopMisuse, match="already called for this batch"):
        for _ in w.epochs():
            for _batch in w.batches():
                w.step()
                w.step()


def test_an_epoch_left_untrained_is_named():
    w, _, _ = handle(TWO_EPOCHS)
    with pytest.raises(LoopMisuse, match=r"without iterating w\.batches\(\) to its end"):
        for _ in w.epochs():
            for _batch in w.batches():
                w.step()
                break


def test_leaving_the_epochs_before_the_run_ends_is_named():
    w, _, _ = handle(TWO_EPOCHS)
    for _ in w.epochs():
        for _batch in w.batches():
            w.step()
        break
    with pytest.raises(LoopMisuse, match="before the coordinator ended the run"):
        w.check_finished()


def test_batches_outside_epochs_and_a_second_pass_are_named():
    w, _, _ = handle(TWO_EPOCHS)
    with pytest.raises(LoopMisuse, match=r"outside w\.epochs\(\)"):
        next(w.batches())
    for _ in w.epochs():
        for _batch in w.batches():
            w.step()
    with pytest.raises(LoopMisuse, match="already iterated"):
        next(w.epochs())


def test_optimizers_must_be_registered_and_hold_only_replica_parameters():
    w, _, _ = handle(TWO_EPOCHS)
    with pytest.raises(LoopMisuse, match="not parameters of w.model"):
        w.setup(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1))
    stray = torch.optim.SGD(w.model.parameters(), lr=0.1)
    with pytest.raises(LoopMisuse, match=r"w\.setup\(\) did not register"):
        for _ in w.epochs():
            for _batch in w.batches():
                w.step(stray)


def test_two_registered_optimizers_are_one_state_and_both_step():
    w, ctl, _ = handle([(0, 0, 16)])
    model = replica(w)
    a = torch.optim.Adam([model.weight], lr=0.01)
    b = torch.optim.SGD([model.bias], lr=0.1, momentum=0.9)
    w.setup(a, b)
    assert isinstance(w.optimizer, OptimizerSet) and len(w.optimizer.param_groups) == 2
    bias = model.bias.detach().clone()
    for _ in w.epochs():
        for x, y in w.batches():
            torch.nn.functional.cross_entropy(w.model(x), y).backward()
            w.step(a, b)
    assert not torch.equal(bias, model.bias) and a.state and b.state
    state = w.optimizer.state_dict()
    fresh = OptimizerSet([torch.optim.Adam([model.weight], lr=0.01), torch.optim.SGD([model.bias], lr=0.1, momentum=0.9)])
    fresh.load_state_dict(state)
    assert fresh.optimizers[1].state_dict()["state"][0]["momentum_buffer"].equal(b.state_dict()["state"][0]["momentum_buffer"])
    with pytest.raises(ValueError, match="holds 2 optimizer states"):
        OptimizerSet([a]).load_state_dict(state)
    ctl.trainer.reset_optimizer_state()  # DiLoCo: every registered optimizer forgets its moments (zeroed in place)
    assert a.state and b.state and all(float(v.abs().sum()) == 0.0 for o in (a, b) for st in o.state.values()
                                       for v in st.values() if isinstance(v, torch.Tensor))


def test_a_held_batch_is_reported_once_naming_the_missing_step():
    w, ctl, sent = handle(TWO_EPOCHS)
    w.hold_notice_s = 0.05
    epochs = w.epochs()
    next(epochs)
    batches = w.batches()
    next(batches)
    assert ctl.state == "loop"
    time.sleep(0.1)
    notice = w._watch()
    assert isinstance(notice, LoopNotice) and "has not called w.step() yet" in notice.message and notice.held_s >= 0.05
    assert w._watch() is None, "once per batch"
    w.step()
    assert w._watch() is None


def test_intents_go_to_the_coordinator_with_the_epoch():
    w, ctl, sent = handle(TWO_EPOCHS)
    w.request_checkpoint()
    for _ in w.epochs():
        for _batch in w.batches():
            w.step()
        w.request_eval()
    assert [(i.kind, i.epoch) for i in sent.of(Intent)] == [("checkpoint", -1), ("eval", 0), ("eval", 1)]


def test_worker_outside_a_rank_says_how_to_run_a_loop():
    with pytest.raises(LoopMisuse, match="experiment.loop"):
        with worker():
            pass


# -- the coordinator's side ------------------------------------------------------------
def test_an_eval_intent_is_folded_into_the_next_epoch_boundary(tmp_path, monkeypatch):
    from control_fakes import Harness

    from flodl_exp.protocol.wire import Message

    h = Harness(tmp_path, "cpu_sync", world=2, epochs=3)
    evals: list[Any] = []
    send = h.transport.send

    def send_keeping_evals(r: int, m: Message) -> bool:
        if m.kind == "execute_eval":
            evals.append(decode(m))
        return send(r, m)

    monkeypatch.setattr(h.transport, "send", send_keeping_evals)
    plans = h.start()
    h.msg(1, Intent(kind="eval", epoch=0))
    h.msg(1, Intent(kind="reboot", epoch=0))  # not an intent: ignored
    h.play([0, 1], until=lambda: h.co.core.dispatch.last_aggregated >= 1, pending=[(r, p[0]) for r, p in plans.items()])
    # no periodic eval (eval.every=0): epoch 0's comes from the intent, epoch 1 has none
    assert [(e.epoch, e.final) for e in evals] == [(0, False)], evals
    assert [e["kind"] for e in _events(h) if e.get("event") == "intent"] == ["eval"]


def test_a_checkpoint_intent_takes_a_bundle_at_the_next_boundary(tmp_path):
    from control_fakes import Harness

    h = Harness(tmp_path, "cpu_sync", world=2, epochs=3)
    plans = h.start()
    h.msg(0, Intent(kind="checkpoint", epoch=0))
    h.play([0, 1], until=lambda: h.co.core.dispatch.last_aggregated >= 1, pending=[(r, p[0]) for r, p in plans.items()])
    done = [e for e in _events(h) if e.get("event") == "checkpoint"]
    assert [e["epoch"] for e in done] == [1] and done[0]["stem"].endswith("_epoch1")


def test_a_checkpoint_intent_in_a_progressive_mode_bundles_at_the_next_reduce(tmp_path):
    from control_fakes import Harness

    h = Harness(tmp_path, "cpu_cadence", world=2, epochs=3)
    plans = h.start()
    h.msg(0, Intent(kind="checkpoint", epoch=0))
    h.msg(1, Intent(kind="checkpoint", epoch=0))  # every rank asks: one bundle
    h.play([0, 1], until=lambda: any(e.get("event") == "checkpoint" for e in _events(h)),
           pending=[(r, p[0]) for r, p in plans.items()])
    done = [e for e in _events(h) if e.get("event") == "checkpoint"]
    assert len(done) == 1 and done[0]["reason"] == "requested" and "_requested" in done[0]["stem"]
    h.msg(1, Intent(kind="checkpoint", epoch=0))  # a late duplicate: answered by that bundle
    assert "checkpoint" not in h.co.core.intents.pending


def test_a_late_eval_intent_runs_at_once_and_duplicates_are_dropped(tmp_path):
    """A sync loop asks after its epoch's boundary (w.batches() ends when the next plan is in): the eval runs
    at once for that epoch, and the other ranks' same intent does not run it again."""
    from control_fakes import Harness

    from flodl_exp.protocol.messages import ExecuteEval

    h = Harness(tmp_path, "cpu_sync", world=2, epochs=3)
    plans = h.start()
    h.play([0, 1], until=lambda: h.co.core.dispatch.last_aggregated >= 0, pending=[(r, p[0]) for r, p in plans.items()])
    h.transport.take()
    h.msg(0, Intent(kind="eval", epoch=0))
    h.msg(1, Intent(kind="eval", epoch=0))
    evals = [(r, p) for r, p in h.transport.take(ExecuteEval)]
    assert [(p.epoch, p.final) for _, p in evals] == [(0, False)], evals


def test_a_loop_error_ends_the_run_failed_with_its_traceback(tmp_path):
    from control_fakes import Harness

    from flodl_exp.core.lifecycle import Status

    fail: dict[str, Any] = {"cluster.loop_error": "fail"}
    h = Harness(tmp_path, "cpu_cadence", world=3, epochs=2, **fail)
    h.start()
    h.msg(2, RankError(error="ValueError: boom", traceback='File "loops.py", line 3, in main\nValueError: boom', loop=True))
    failure = h.co.core.life.failure
    assert h.co.core.life.status is Status.FAILED and failure is not None
    assert "loop_error" in failure and "loops.py" in failure
    assert "loops.py" in h.sink.tags["error"]


def test_a_loop_error_loses_the_rank_by_default_and_the_survivors_go_on(tmp_path):
    """cluster.loop_error=lose_rank (the default, the reference's): the loop's exception is reported, its rank's
    process exits, and its closed connection is a death the survivors recover from, as in the managed tier."""
    from control_fakes import Harness

    from flodl_exp.core.lifecycle import Phase, Status

    h = Harness(tmp_path, "cpu_cadence", world=3, epochs=2)
    h.start()
    h.msg(2, RankError(error="ValueError: boom", traceback='File "loops.py", line 3, in main\nValueError: boom', loop=True))
    assert h.co.core.life.status is Status.RUNNING and h.co.core.life.phase is Phase.TRAINING
    assert "loops.py" in h.sink.tags["loop_error.rank2"] and "error" not in h.sink.tags
    h.co.on_event(("closed", 2, "closed"))
    (death,) = h.co.core.cohort.deaths
    assert death.rank == 2 and "ValueError: boom" in death.reason
    assert h.co.core.life.status is Status.RUNNING and h.co.core.cohort.alive_ranks() == [0, 1]


def test_a_rank_error_outside_a_loop_is_a_lost_rank_as_before(tmp_path):
    from control_fakes import Harness

    h = Harness(tmp_path, "cpu_cadence", world=3, epochs=2)
    h.start()
    h.msg(2, RankError(error="RuntimeError: injected fault"))
    assert not h.co.core.life.ending and h.co.core.life.failure is None


def _events(h: Any) -> list[dict[str, Any]]:
    import json
    import os

    path = os.path.join(h.job_dir, "events.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def test_an_error_of_flodls_side_is_a_lost_rank_and_the_loops_own_fails_the_run(monkeypatch):
    from flodl_exp.rank.cooperative import is_loop_error

    w, ctl, sent = handle(TWO_EPOCHS)

    def broken_book(*a: Any, **k: Any) -> None:
        raise RuntimeError("collective failed and no regroup arrived")

    monkeypatch.setattr(ctl, "book_step", broken_book)
    with pytest.raises(RuntimeError) as ei:
        for _ in w.epochs():
            for _batch in w.batches():
                w.step()
    assert not is_loop_error(ei.value), "flodl's own failure: recovered as a lost rank"
    assert is_loop_error(ValueError("the user's bug")) and is_loop_error(LoopMisuse("a rule broken"))


def test_setup_scales_each_learning_rate_once():
    ctl, _ = queued_control(TWO_EPOCHS)
    model = ctl.trainer.model
    tr = RankTrainer(Experiment(model, torch.optim.SGD(model.parameters(), lr=0.1), None, Points(), None, None, None),
                     device=torch.device("cpu"), world_size=3, lr_scale_ratio=1.0, batch_size=BATCH)
    assert tr.optimizer.param_groups[0]["lr"] == pytest.approx(0.3)
    tr.use_optimizer(tr.optimizer)  # w.setup(w.optimizer): the same groups, scaled once
    tr.use_optimizer(OptimizerSet([tr.optimizer, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)]))
    assert [g["lr"] for g in tr.optimizer.param_groups] == pytest.approx([0.3, 3.0])
    assert tr.base_lrs == pytest.approx([0.1, 1.0])


def test_the_epoch_loss_counts_only_steps_with_a_loss():
    from flodl_exp.core.epoch_metrics import EpochAccumulator

    acc = EpochAccumulator(0, 2, started=0.0)
    acc.add_chunk(0, ChunkMetrics(epoch=0, chunk=0, avg_loss=2.0, batches=4, samples=32, epoch_ms=1, share_complete_ms=1,
                                  compute_only_ms=1, data_starve_ms=0, loss_batches=1))
    acc.add_chunk(1, ChunkMetrics(epoch=0, chunk=1, avg_loss=0.0, batches=4, samples=32, epoch_ms=1, share_complete_ms=1,
                                  compute_only_ms=1, data_starve_ms=0, loss_batches=0))
    m = acc.summary(1.0)
    assert m["loss"] == pytest.approx(2.0) and m["rank0/loss"] == pytest.approx(2.0) and "rank1/loss" not in m


def test_a_resumed_loop_gets_the_state_of_both_its_optimizers(tmp_path):
    """The bundle holds the OptimizerSet's state; a resume loads it once the loop registered its optimizers."""
    from flodl_exp.checkpoint import save_rank_pieces

    def two(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
        assert isinstance(model, torch.nn.Linear)
        return [torch.optim.Adam([model.weight], lr=0.01), torch.optim.SGD([model.bias], lr=0.1, momentum=0.9)]

    first, _, _ = handle([(0, 0, 16)])
    opts = two(first.model)
    first.setup(*opts)
    for _ in first.epochs():
        for x, y in first.batches():
            torch.nn.functional.cross_entropy(first.model(x), y).backward()
            first.step(*opts)
    stem = str(tmp_path / "b")
    save_rank_pieces(stem, first.model, first.optimizer, rank=0, primary=True, write_model=True)

    ctl, _ = queued_control([(0, 0, 16)])
    ctl.resume_stem = stem
    resumed = CooperativeWorker(ctl, CFG)
    fresh = two(resumed.model)
    resumed.setup(*fresh)
    assert not fresh[1].state
    next(resumed.epochs())
    assert fresh[1].state_dict()["state"][0]["momentum_buffer"].equal(opts[1].state_dict()["state"][0]["momentum_buffer"])
    assert ctl.resume_stem is None, "loaded once"


def test_the_loop_reads_the_cohorts_evals_and_epoch_metrics() -> None:
    """The reference's EvalBroadcast / EpochAggregated in the user's loop: ``w.poll_eval()`` hands out each eval once,
    oldest first; ``w.latest_metrics()`` is the latest aggregated epoch's metrics (None before the first)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    exp = Experiment(model, torch.optim.SGD(model.parameters(), lr=0.1), None, Points(), None, None, None)
    trainer = RankTrainer(exp, device=torch.device("cpu"), batch_size=BATCH)
    ctl, _ = rank_control(trainer, frames=Inbox(), messages=[
        StartEpoch(epoch=0, offset=0, size=2 * BATCH, chunk=0),
        EpochAggregated(epoch=0, metrics={"loss": 0.7, "global_step": 2.0}),
        EvalBroadcast(epoch=0, metrics={"accuracy": 0.8}),
        StartEpoch(epoch=1, offset=0, size=2 * BATCH, chunk=1)])
    w = CooperativeWorker(ctl, CFG)
    assert w.poll_eval() is None and w.latest_metrics() is None
    seen: list[tuple[int, object, object]] = []
    for epoch in w.epochs():
        for x, y in w.batches():
            w.step(w.optimizer, loss=torch.nn.functional.cross_entropy(w.model(x), y))
        seen.append((epoch, w.poll_eval(), w.latest_metrics()))
    w.check_finished()
    assert seen[-1][0] == 1
    assert [s[1] for s in seen if s[1] is not None] == [(0, {"eval/accuracy": 0.8})], "each eval handed out once"
    assert seen[-1][2] == (0, {"loss": 0.7, "global_step": 2.0})
