"""Issue 14 item 8: the MLflow sink keeps what the store refused and retries (bounded buffer, drop oldest,
loss counted), and close never waits past its budget."""
from __future__ import annotations

import sqlite3
import threading
import time
from typing import Any

import pytest

from flodl_exp import tracking
from flodl_exp.tracking import MlflowSink

MLFLOW_SQLITE_BUSY_TIMEOUT_S = 20.0
"""mlflow/store/db/utils.py: ``PRAGMA busy_timeout = 20000`` on every session of the SQL store."""


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.mark.e2e  # real SQLite store, a lock held past its 20 s busy timeout: slow by nature
@pytest.mark.timeout(180)
def test_a_sqlite_lock_held_past_mlflows_busy_timeout_loses_no_epoch(tmp_path):
    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    run_id = tracking.create_run(uri, "retry", str(tmp_path / "art"), "r", {"a": 1}, {})
    sink = MlflowSink(uri, run_id)
    sink.log_metrics({"loss": 9.0}, step=-1)  # the client is up and the store answers
    _wait(lambda: sink.delivered >= 1, 60, "the first delivery")
    con = sqlite3.connect(str(db), isolation_level=None, timeout=60)
    con.execute("BEGIN EXCLUSIVE")  # held until the sink has failed at least once (> MLflow's 20 s busy timeout)
    t_locked = time.monotonic()
    try:
        for epoch in range(3):
            sink.log_metrics({"loss": 1.0 / (epoch + 1), "epoch_time_s": 1.0}, step=epoch)
        _wait(lambda: sink.errors >= 1, 120, "the sink to fail on the locked store")
        assert time.monotonic() - t_locked >= MLFLOW_SQLITE_BUSY_TIMEOUT_S - 1
        sink.log_metrics({"loss": 0.2, "epoch_time_s": 1.0}, step=3)  # logging never blocks meanwhile
    finally:
        con.rollback()
        con.close()
    sink.close("FINISHED", timeout=120)
    assert sink.lost == 0 and sink.errors >= 1
    c = tracking.client(uri)
    assert sorted(m.step for m in c.get_metric_history(run_id, "loss")) == [-1, 0, 1, 2, 3]
    assert sorted(m.step for m in c.get_metric_history(run_id, "epoch_time_s")) == [0, 1, 2, 3]
    run = c.get_run(run_id)
    assert run.info.status == "FINISHED" and "tracking_lost_records" not in run.data.tags


class _Store:
    """A fake MlflowClient: fails while ``down`` is set, else records; ``gate`` holds a call in flight."""

    def __init__(self) -> None:
        self.down = threading.Event()
        self.gate = threading.Event()
        self.gate.set()
        self.calls = 0
        self.points: list[Any] = []
        self.tags: dict[str, str] = {}
        self.status: Any = None

    def log_batch(self, run_id: str, metrics: Any = (), tags: Any = ()) -> None:
        self.calls += 1
        self.gate.wait(30)
        if self.down.is_set():
            raise ConnectionError("tracking server down")
        self.points += list(metrics)
        self.tags.update({t.key: t.value for t in tags})

    def set_tag(self, run_id: str, k: str, v: str) -> None:
        if self.down.is_set():
            raise ConnectionError("tracking server down")
        self.tags[k] = v

    def set_terminated(self, run_id: str, status: str) -> None:
        if self.down.is_set():
            raise ConnectionError("tracking server down")
        self.status = status


@pytest.fixture
def store(monkeypatch):
    s = _Store()
    monkeypatch.setattr(tracking, "client", lambda uri: s)
    monkeypatch.setattr(MlflowSink, "RETRY_MIN_S", 0.01)
    monkeypatch.setattr(MlflowSink, "RETRY_MAX_S", 0.05)
    return s


def test_a_server_that_comes_back_gets_everything(store):
    store.down.set()
    sink = MlflowSink("http://h", "r")
    for e in range(5):
        sink.log_metrics({"loss": float(e)}, step=e)
    sink.set_tags({"k": "v"})
    _wait(lambda: sink.errors >= 3, 30, "retries")
    store.down.clear()
    sink.close("FINISHED", timeout=30)
    assert sorted(p.step for p in store.points) == [0, 1, 2, 3, 4] and store.tags["k"] == "v"
    assert sink.lost == 0 and store.status == "FINISHED"


def test_close_with_the_server_down_counts_the_loss_within_its_budget(store):
    store.down.set()
    sink = MlflowSink("http://h", "r")
    for e in range(4):
        sink.log_metrics({"loss": float(e), "x": 1.0}, step=e)
    _wait(lambda: sink.errors >= 1, 30, "a failure")
    t0 = time.monotonic()
    sink.close("FINISHED", timeout=0.5)
    assert time.monotonic() - t0 < 5.0
    assert sink.lost == 8 and store.points == []
    store.down.clear()  # the loss tag goes to the store when it takes it (here: a later sink)


def test_a_full_buffer_drops_the_oldest_and_counts_them(store):
    store.gate.clear()  # the first delivery hangs in the store
    sink = MlflowSink("http://h", "r", max_records=3)
    sink.log_metrics({"loss": 0.0}, step=0)
    _wait(lambda: store.calls >= 1, 30, "the first call")
    for e in range(1, 6):
        sink.log_metrics({"loss": float(e)}, step=e)
    assert sink.lost == 2  # steps 1 and 2 went; 3, 4, 5 are kept
    store.gate.set()
    sink.close(None, timeout=30)
    assert sorted(p.step for p in store.points) == [0, 3, 4, 5]
    assert sink.lost == 2 and store.tags["tracking_lost_records"] == "2"

