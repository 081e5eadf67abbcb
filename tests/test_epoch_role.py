"""Callback roles (algorithms.md 3.15): the epoch-role rank runs experiment.epoch_fn once per epoch before training
it, every rank hears EpochAggregated, and a pinned callback rank keeps its eval and epoch roles when it dies
while the checkpoint role fails over."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from control_fakes import Harness
from rank_fakes import rank_control

from flodl_exp.core.cohort import Cohort
from flodl_exp.protocol.hello import Hello
from flodl_exp.protocol.messages import EpochAggregated, EpochFnResult, SetEpochRole


def _rank(fn, rank: int = 1):
    trainer = SimpleNamespace(exp=SimpleNamespace(epoch_fn=fn), model="the model")
    return rank_control(trainer, rank=rank)


EPOCH_PROBE: dict[str, Any] = {"experiment.epoch_fn": "flodl_exp.zoo.digits.epoch_probe"}


def test_the_epoch_role_rank_runs_the_hook_once_per_epoch_with_the_last_aggregate():
    calls: list = []

    def hook(e: int, m: Any, last: dict[str, float]) -> dict[str, Any]:
        calls.append((e, m, last))
        return {"x": 2, "flag": True, "name": "skip"}

    w, sent = _rank(hook)
    w._maybe_epoch_fn(0)
    assert calls == [] and sent == [], "not the epoch-role rank yet"
    w.handle(SetEpochRole(rank=1))
    w.handle(EpochAggregated(epoch=0, metrics={"loss": 0.5}))
    w._maybe_epoch_fn(1)
    w._maybe_epoch_fn(1)  # a second chunk of the same epoch
    assert calls == [(1, "the model", {"loss": 0.5})]
    (res,) = sent
    assert isinstance(res, EpochFnResult) and res.epoch == 1 and res.metrics == {"x": 2.0} and res.error is None
    assert res.elapsed_ms >= 0 and w.callback_ms >= res.elapsed_ms


def test_a_failing_hook_is_reported_not_fatal():
    def boom(e, m, last):
        raise ValueError("bad hook")

    w, sent = _rank(boom, rank=0)
    w.handle(SetEpochRole(rank=0))
    w._maybe_epoch_fn(3)
    (res,) = sent
    assert res.error == "ValueError: bad hook" and res.metrics == {}


def test_the_coordinator_names_the_epoch_role_and_tells_every_rank_each_aggregate(tmp_path):
    h = Harness(tmp_path, "cpu_cadence", world=2, epochs=2, **EPOCH_PROBE)
    for r in range(2):
        h.co.on_event(("join", r, Hello(rank=r, samples=96, host="h", pid=100 + r)))
    h.co.start()
    sent = h.transport.take()
    roles = [(r, p.rank) for r, p in sent if isinstance(p, SetEpochRole)]
    assert sorted(roles) == [(0, 0), (1, 0)]
    first_chunk = next(i for i, (_, p) in enumerate(sent) if type(p).__name__ == "StartEpoch")
    assert max(i for i, (_, p) in enumerate(sent) if isinstance(p, SetEpochRole)) < first_chunk, "the role comes first"
    h.msg(0, EpochFnResult(epoch=0, elapsed_ms=12.5, metrics={"weight_norm": 3.0}))
    logged = [(step, m) for step, m in h.sink.metrics if "epoch_fn/weight_norm" in m]
    assert logged == [(0, {"epoch_fn/elapsed_ms": 12.5, "epoch_fn/weight_norm": 3.0})]
    assert h.co.core.slack.ewma[(0, "epoch_fn")] == 12.5


def test_a_pinned_callback_rank_keeps_its_roles_dead_and_the_checkpoint_role_fails_over():
    c = Cohort(3, fixed_callback=1, now=0.0)
    for r in range(3):
        c.join(r, 0.0)
    c.mark_dead(1, "killed", epoch=0, global_step=0)
    c.elect_callback(None, force=True)
    assert c.callback_rank == 1 and c.primary() == 0


def test_a_role_that_moves_mid_run_starts_after_the_newest_epoch_begun(tmp_path):
    calls: list = []
    w, _ = _rank(lambda e, m, last: calls.append(e))
    w.handle(SetEpochRole(rank=1, from_epoch=2))
    w._maybe_epoch_fn(1)  # the old holder may have run epoch 1's hook: never twice
    w._maybe_epoch_fn(2)
    assert calls == [2]
    h = Harness(tmp_path, "cpu_cadence", world=2, epochs=4, **EPOCH_PROBE)
    h.start(samples=960)
    h.co.core.dispatch.rank_epoch[0] = 1  # rank 0 began epoch 1
    h.co.core.cohort._callback_rank = 1  # the election moved the role (set as the election would)
    h.co.core.push_epoch_role()
    (moved,) = {p.from_epoch for _, p in h.transport.take(SetEpochRole)}
    assert moved == 2
