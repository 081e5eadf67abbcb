"""The rank's training primitives without any process or socket, and record_scalar."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from flodl_exp import record_scalar
from flodl_exp.experiment import build_experiment
from flodl_exp.rank.trainer import RankTrainer
from flodl_exp.scalars import drain_scalars

EXP = {
    "name": "t", "model": {"_target_": "flodl_exp.zoo.digits.MLP", "hidden": 16},
    "optimizer": {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1},
    "scheduler": None, "train_data": {"_target_": "flodl_exp.zoo.digits.DigitsDataset", "split": "train"},
    "eval_data": {"_target_": "flodl_exp.zoo.digits.DigitsDataset", "split": "test"},
    "train_step": "flodl_exp.zoo.digits.train_step_recording", "eval_fn": "flodl_exp.zoo.digits.evaluate",
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

    def other_thread() -> None:
        record_scalar("a", 100.0)
        seen.update(drain_scalars())

    t = threading.Thread(target=other_thread)
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
    assert b is not None

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


# -- the hot path: no host read per batch, one per chunk ------------------------------------------------

PLAIN = {**EXP, "train_step": "flodl_exp.zoo.digits.train_step"}  # no record_scalar: the user step reads nothing either


def _plain(**kw) -> RankTrainer:
    exp = build_experiment(PLAIN, world_size=1, device=torch.device("cpu"), seed=0)
    return RankTrainer(exp, device=torch.device("cpu"), batch_size=32, **kw)


class _HostReads:
    """Counts the Python-level ways a tensor's value reaches the host (item, float, int, bool, tolist, numpy)."""

    NAMES = ("item", "__float__", "__int__", "__bool__", "tolist", "numpy")

    def __init__(self, monkeypatch) -> None:
        self.calls: list[str] = []
        for name in self.NAMES:
            orig = getattr(torch.Tensor, name)

            def counted(t, *a, _orig=orig, _name=name, **k):
                self.calls.append(_name)
                return _orig(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)


def test_step_and_record_step_read_nothing_to_the_host_per_batch(monkeypatch):
    tr = _plain(max_grad_norm=1.0)
    st = tr.begin_epoch(0, 0, 320)
    batches = []
    while (b := tr.next_batch(st)) is not None:
        batches.append(b)
    reads = _HostReads(monkeypatch)
    steps = []
    for b in batches:
        s = tr.step(b)
        tr.record_step(st, b, s)
        steps.append(s)
    assert reads.calls == [], reads.calls
    assert isinstance(st.loss_acc, torch.Tensor) and st.loss_acc.dtype == torch.float64
    assert st.batches == 10 and tr.step_count == 10 and tr.steps_since_avg == 10
    m = tr.end_epoch(st)
    assert m.batches == 10
    assert reads.calls.count("__float__") + reads.calls.count("item") == 1, reads.calls  # the chunk's one loss read
    assert st.loss_acc is None and not st.pending


def test_record_step_reports_the_mean_of_the_per_batch_losses_like_train_step():
    """Same seed, same batches: the lazy path reports what the per-batch path reports."""
    lazy, eager = _plain(), _plain()
    st_l, st_e = lazy.begin_epoch(0, 64, 320), eager.begin_epoch(0, 64, 320)
    losses = []
    while (b := lazy.next_batch(st_l)) is not None:
        s = lazy.step(b)
        lazy.record_step(st_l, b, s)
        losses.append(float(s.loss))
        be = eager.next_batch(st_e)
        assert be is not None
        eager.after_step(st_e, be, *eager.train_step(be))
    ml, me = lazy.end_epoch(st_l), eager.end_epoch(st_e)
    assert ml.avg_loss == pytest.approx(sum(losses) / len(losses), rel=1e-12)
    assert ml.avg_loss == pytest.approx(me.avg_loss, rel=1e-9)
    assert lazy.last_loss == pytest.approx(losses[-1]) and eager.last_loss == pytest.approx(losses[-1], rel=1e-9)
    assert (ml.batches, ml.samples, ml.ranges) == (me.batches, me.samples, me.ranges) == (10, 320, [[64, 320]])
    assert ml.compute_only_ms > 0 and ml.share_complete_ms == pytest.approx(ml.compute_only_ms + ml.data_starve_ms)


def test_non_finite_losses_count_as_batches_but_not_in_the_sum():
    """As after_step: avg_loss = sum of the finite losses / all batches."""
    from flodl_exp.rank.trainer import Batch, EpochState, PendingStep

    tr = _plain()
    lazy = EpochState(epoch=0, offset=0, picks=np.arange(128), batch_size=32)
    eager = EpochState(epoch=0, offset=0, picks=np.arange(128), batch_size=32)
    b = Batch(data=None, data_ms=1.0, ids=np.arange(32))
    for v in (2.0, float("nan"), 4.0, float("inf")):
        tr.record_step(lazy, b, PendingStep(loss=torch.tensor(v, dtype=torch.float32), host_ms=3.0))
        tr.after_step(eager, b, v, 3.0)
    ml, me = tr.end_epoch(lazy), tr.end_epoch(eager)
    assert ml.avg_loss == me.avg_loss == pytest.approx(6.0 / 4)
    assert ml.compute_only_ms == me.compute_only_ms == pytest.approx(12.0)
    assert ml.data_starve_ms == me.data_starve_ms == pytest.approx(4.0)


class _FakeEvent:
    """A CUDA event stand-in: a timestamp on a fake device clock; complete once ``done`` says so."""

    def __init__(self, log: dict, t: float) -> None:
        self.log, self.t = log, t

    def query(self) -> bool:
        self.log["query"] += 1
        return self.log["done"]

    def synchronize(self) -> None:
        self.log["sync"] += 1

    def elapsed_time(self, end: _FakeEvent) -> float:
        self.log["elapsed"] += 1
        return end.t - self.t


def _event_timed(tr: RankTrainer, monkeypatch, *, done: bool, step_ms: float = 5.0) -> dict:
    """Time ``tr``'s steps with fake CUDA events: each step takes ``step_ms`` of device time."""
    log = {"query": 0, "sync": 0, "elapsed": 0, "done": done, "n": 0}

    def event():
        log["n"] += 1
        k, is_end = (log["n"] - 1) // 2, log["n"] % 2 == 0  # step k's start, then its end
        return _FakeEvent(log, k * 100.0 + (step_ms if is_end else 0.0))

    tr.device_timing = True
    monkeypatch.setattr(tr, "_cuda_event", event)
    return log


def test_device_timing_is_resolved_at_chunk_end_not_per_batch(monkeypatch):
    tr = _plain()
    log = _event_timed(tr, monkeypatch, done=False, step_ms=5.0)
    st = tr.begin_epoch(0, 0, 320)
    while (b := tr.next_batch(st)) is not None:
        tr.record_step(st, b, tr.step(b))
    assert log["sync"] == 0 and log["elapsed"] == 0 and len(st.pending) == 10  # nothing waited for per batch
    m = tr.end_epoch(st)
    assert log["elapsed"] == 10 and log["sync"] >= 1
    assert m.compute_only_ms == pytest.approx(50.0)  # the device time between each step's events
    assert m.share_complete_ms == pytest.approx(50.0 + m.data_starve_ms)


def test_completed_steps_are_folded_in_as_they_finish(monkeypatch):
    tr = _plain()
    log = _event_timed(tr, monkeypatch, done=True, step_ms=2.0)
    st = tr.begin_epoch(0, 0, 160)
    while (b := tr.next_batch(st)) is not None:
        tr.record_step(st, b, tr.step(b))
        assert not st.pending  # query() said done: folded at once, the queue stays empty
    assert st.compute_ms == pytest.approx(10.0) and log["elapsed"] == 5
    assert tr.end_epoch(st).compute_only_ms == pytest.approx(10.0)


def test_simulated_speed_on_device_timing(monkeypatch):
    """speed < 1 with events: the sleep is (1/s - 1) x the device time, added to it."""
    tr = _plain(speed=0.5)
    log = _event_timed(tr, monkeypatch, done=False, step_ms=4.0)
    st = tr.begin_epoch(0, 0, 64)
    b = tr.next_batch(st)
    assert b is not None

    class Clock:
        t = 100.0

    import flodl_exp.rank.trainer as trainer_mod

    def sleep(s: float) -> None:
        Clock.t += s

    monkeypatch.setattr(trainer_mod, "time", type("T", (), {"perf_counter": staticmethod(lambda: Clock.t),
                                                          "sleep": staticmethod(sleep)}))
    loss, ms = tr.train_step(b)
    assert ms == pytest.approx(8.0) and log["sync"] >= 1  # 4 ms on the device + 4 ms of simulated idle
    assert loss == loss  # a finite float


def test_the_digits_split_is_cached_identically_and_a_corrupt_cache_is_rebuilt(tmp_path, monkeypatch):
    import numpy as np

    from flodl_exp.zoo import digits

    monkeypatch.setenv(digits.CACHE_ENV, str(tmp_path))
    digits._split.cache_clear()
    try:
        built = digits._split()
        path = digits.split_cache_path()
        assert path is not None and os.path.exists(path)
        digits._split.cache_clear()
        cached = digits._split()
        assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(built, cached))
        with open(path, "wb") as fh:
            fh.write(b"not an npz")
        digits._split.cache_clear()
        again = digits._split()
        assert all(np.array_equal(a, b) for a, b in zip(built, again))
        with np.load(path) as z:
            assert z["y_tr"].shape == built[2].shape, "the corrupt file was replaced"
        np.savez(path, x_tr=built[0][:10], x_te=built[1], y_tr=built[2], y_te=built[3])  # readable, wrong shapes
        digits._split.cache_clear()
        assert len(digits._split()[0]) == len(built[0]), "a file that does not hold the split is rebuilt"
        assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")], "no temp file left"
    finally:
        digits._split.cache_clear()
