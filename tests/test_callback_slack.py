"""Callback slack (algorithms.md 3.15): the eval's expected time, staged before the window it runs in, lowers
the callback rank's count so its peers do not wait for it at that window's reduce."""
from __future__ import annotations

import contextlib
import math

import pytest
import torch

from flodl_exp.core.callback_slack import EWMA_ALPHA, CallbackSlack
from flodl_exp.core.cycle import AveragingCycle, CycleSettings
from flodl_exp.policy.elche import ElChe
from flodl_exp.policy.guards import build_guard
from flodl_exp.policy.mode import Mode
from flodl_exp.protocol.messages import Batch, Snapshot
from flodl_exp.torch_averager import TorchAverager


def test_the_ewma_follows_the_measured_evals():
    s = CallbackSlack(enabled=True, eval_every=1, epochs=10)
    s.on_elapsed(0, 400.0)
    assert s.ewma_ms[0] == 400.0
    s.on_elapsed(0, 200.0)
    assert s.ewma_ms[0] == pytest.approx(EWMA_ALPHA * 200 + (1 - EWMA_ALPHA) * 400)
    for bad in (None, math.nan, -1.0):
        s.on_elapsed(0, bad)
    assert s.ewma_ms[0] == pytest.approx(300.0)


def test_slack_is_staged_once_per_eval_epoch_for_the_callback_rank():
    s = CallbackSlack(enabled=True, eval_every=2, epochs=6)
    assert s.due(1, 0) == {}, "no eval measured on rank 0 yet"
    s.on_elapsed(0, 250.0)
    assert s.due(None, 0) == {} and s.due(0, 0) == {}, "no closing epoch / no eval after epoch 0 (every=2)"
    assert s.due(1, 0) == {0: 250.0}
    assert s.due(1, 0) == {}, "once per epoch"
    assert s.due(3, 1) == {}, "the callback rank moved to one without a measured eval"
    assert s.due(5, 0) == {}, "the last epoch has the final eval, after training"
    assert CallbackSlack(enabled=False, eval_every=1, epochs=6).due(1, 0) == {}


class _Outbox:
    def send(self, r, msg):
        pass

    def broadcast(self, msg):
        pass

    def sharing_tensors(self):
        return contextlib.nullcontext()


MS = (10.0, 30.0)
"""ms per batch: rank 0 (the fastest, so the callback rank) three times faster than rank 1."""
EVAL_MS = 400.0


def _calibrated_cycle() -> AveragingCycle:
    elche = ElChe(2, 10, overhead_target=0.05, max_anchor=1000, min_anchor=None, max_batch_diff=None,
                  window_growth_applicable=True)
    cycle = AveragingCycle(settings=CycleSettings(world_size=2, mode=Mode.parse("cadence", "cpu"), gamma=1.0, alpha=None,
                                                  progressive=True),
                           elche=elche, guard=build_guard("none"), meta=None,
                           outbox=_Outbox(), clock=lambda: 0.0, averager=TorchAverager())  # type: ignore[arg-type]
    for _ in range(40):
        if elche.is_calibrated:
            break
        _window(cycle)
    assert elche.is_calibrated
    return cycle


def _window(cycle: AveragingCycle) -> None:
    """Each rank trains its count at its speed, then the reduce finishes (ElChe sizes the next window)."""
    counts = list(cycle.counts)
    for r in (0, 1):
        for _ in range(counts[r]):
            cycle.on_batch(r, Batch(ms=MS[r], data_ms=0.0, chunk=0), speaks_for_lr=False)
    cycle.trigger([0, 1])
    for r in (0, 1):
        cycle.on_snapshot(r, Snapshot(n=counts[r], tensors={"p0": torch.zeros(2)}))
    assert cycle.try_finish(lambda r: True) is not None


def _idle_of_rank1(counts: list[int]) -> float:
    """Rank 0 trains its count and runs the eval; rank 1 trains its count: rank 1 then waits at the reduce."""
    done0 = counts[0] * MS[0] + EVAL_MS
    done1 = counts[1] * MS[1]
    return max(0.0, done0 - done1)


def test_slack_shrinks_the_wait_of_the_other_ranks_at_the_reduce_after_an_eval():
    slack = CallbackSlack(enabled=True, eval_every=1, epochs=10)
    slack.on_elapsed(0, EVAL_MS)
    idle = {}
    for enabled in (False, True):
        cycle = _calibrated_cycle()
        slack.enabled = enabled
        cycle.stage_slack_from(lambda: slack.due(3, 0))  # epoch 3's last chunk is out; an eval on rank 0 follows
        before = list(cycle.counts)
        _window(cycle)  # the reduce that sizes the window in which the eval runs
        during = list(cycle.counts)
        idle[enabled] = _idle_of_rank1(during)
        if enabled:
            assert during[0] == max(before[0] - math.ceil(EVAL_MS / MS[0]), 1), (before, during)
            assert during[1] == before[1]
        slack._staged.clear()
    assert idle[True] < idle[False], idle
    assert idle[False] == pytest.approx(EVAL_MS, abs=2 * MS[1]), "without slack rank 1 waits about the whole eval"
