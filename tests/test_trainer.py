"""The rank's training primitives without any process or socket, and record_scalar."""
from __future__ import annotations

import threading

import pytest
import torch

from flodl_exp import record_scalar
from flodl_exp.experiment import build_experiment
from flodl_exp.rank.trainer import RankTrainer
from flodl_exp.scalars import drain_scalars

EXP = {
    "name": "t", "model": {"_target_": "experiments.digits.MLP", "hidden": 16},
    "optimizer": {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1},
    "scheduler": None, "train_data": {"_target_": "experiments.digits.DigitsDataset", "split": "train"},
    "eval_data": {"_target_": "experiments.digits.DigitsDataset", "split": "test"},
    "train_step": "experiments.digits.train_step_recording", "eval_fn": "experiments.digits.evaluate",
    "batch_size": 32, "epochs": 1,
}


def _trainer(**kw) -> RankTrainer:
    exp = build_experiment(EXP, world_size=kw.get("world_size", 1), device=torch.device("cpu"), seed=0)
    return RankTrainer(exp, device=torch.device("cpu"), batch_size=32, **kw)


def test_record_scalar_is_a_per_thread_sum_and_count():
    drain_scalars()
    record_scalar("a", 1.0)
    record_scalar("a", 3.0)
    record_scalar("b", 2)
    seen = {}
    t = threading.Thread(target=lambda: (record_scalar("a", 100.0), seen.update(drain_scalars())))
    t.start()
    t.join()
    assert seen == {"a": (100.0, 1)}
    assert drain_scalars() == {"a": (4.0, 2), "b": (2.0, 1)}
    assert drain_scalars() == {}


def test_epoch_primitives_train_the_plan_and_report_its_coverage():
    tr = _trainer()
    st = tr.begin_epoch(epoch=0, offset=64, size=320)
    losses = []
    while (b := tr.next_batch(st)) is not None:
        loss, ms = tr.train_step(b)
        tr.after_step(st, b, loss, ms)
        losses.append(loss)
    m = tr.end_epoch(st)
    assert m.batches == 10 and m.samples == 320 and m.ranges == [[64, 320]]
    assert losses[-1] < losses[0]
    assert m.share_complete_ms == pytest.approx(m.compute_only_ms + m.data_starve_ms)
    assert m.scalars["ones"] == [10.0, 10.0]
    assert tr.steps_since_avg == 10 and tr.step_count == 10


def test_linear_lr_scaling_and_simulated_speed(monkeypatch):
    tr = _trainer(world_size=3, lr_scale_ratio=0.5)
    assert tr.current_lr() == pytest.approx(0.1 * 2.0)
    slow = _trainer(speed=0.25)
    st = slow.begin_epoch(0, 0, 64)
    b = slow.next_batch(st)

    class Clock:  # the step "computes" for 4 ms, and sleeping moves the clock by exactly what was asked
        t = 100.0

    calls: list[float] = []

    def perf_counter() -> float:
        calls.append(Clock.t)
        if len(calls) == 2:  # the read after the optimizer step: 4 ms of compute
            Clock.t += 0.004
            calls[-1] = Clock.t
        return Clock.t

    def sleep(s: float) -> None:
        Clock.t += s

    import flodl_exp.rank.trainer as trainer_mod

    monkeypatch.setattr(trainer_mod, "time", type("T", (), {"perf_counter": staticmethod(perf_counter),
                                                          "sleep": staticmethod(sleep)}))
    _, ms = slow.train_step(b)
    # A quarter-speed rank waits 3x its step time inside the step: 4 ms of compute + 12 ms of waiting.
    assert ms == pytest.approx(16.0)


def test_eval_and_extend_partition():
    tr = _trainer()
    st = tr.begin_epoch(0, 0, 64)
    from flodl_exp.partition import make_partition

    st.extend(1000, make_partition(1000, 64, tr.total_picks, 0, tr.seed))
    n = 0
    while (b := tr.next_batch(st)) is not None:
        tr.after_step(st, b, *tr.train_step(b))
        n += 1
    assert n == 4 and tr.end_epoch(st).ranges == [[0, 64], [1000, 64]]
    assert 0.0 <= tr.evaluate()["accuracy"] <= 1.0
