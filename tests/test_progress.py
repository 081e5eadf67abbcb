"""flodl_exp.progress.follow with a fake run handle: what plain mode prints and what the bar shows, per event
(no job, no scheduler)."""
from __future__ import annotations

import io
from types import SimpleNamespace
from typing import Any

from flodl_exp import progress

EVENTS: list[dict[str, Any]] = [
    {"event": "started", "world_size": 2},
    {"event": "epoch", "epoch": 0, "loss": 0.5, "samples_per_s": 100.0, "syncs": 3, "rank0/batch_share": 0.75,
     "rank1/batch_share": 0.25},
    {"event": "rank_dead", "rank": 1, "reason": "exit 9"},
    {"event": "preempt_requested", "stem": "b"},
    {"event": "preempted", "epoch": 0, "global_step": 7, "stem": "b"},
    {"event": "resumed", "attempt": 1, "stem": "b", "epoch": 0},
    {"event": "eval", "epoch": 1, "final": True, "eval/accuracy": 0.9},
]


class FakeHandle:
    on_slurm = False

    def __init__(self, batches: list[list[dict]]) -> None:
        self.cfg = SimpleNamespace(experiment=SimpleNamespace(epochs=2))
        self.batches = list(batches)

    def done(self) -> bool:
        return len(self.batches) <= 1  # done once the last batch is being read, as after the job's end

    def poll_events(self) -> list[dict]:
        return self.batches.pop(0) if self.batches else []


def test_plain_mode_prints_one_line_per_event(monkeypatch):
    monkeypatch.setattr(progress.time, "sleep", lambda s: None)
    out = io.StringIO()
    progress.follow(FakeHandle([EVENTS[:3], EVENTS[3:]]), mode="plain", out=out)  # type: ignore[arg-type]
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("started: 2 rank(s) after ")
    assert lines[1:] == [
        "epoch 1/2  loss 0.5000  100 samples/s  syncs 3  share r0=0.75 r1=0.25",
        "rank 1 died: exit 9",
        "time limit / preemption signal: saving bundle b",
        lines[4],
        "resumed (attempt 1) from b at epoch 1",
        "final eval (epoch 2): eval/accuracy=0.9000",
    ]
    assert lines[4].startswith("preempted at epoch 1 (global step 7): bundle b")


def test_queue_watch_restarts_on_preemption():
    q = progress._QueueWatch(FakeHandle([]))  # type: ignore[arg-type]
    q.last_state = "RUNNING"
    progress._note_start(q, "preempted")
    assert (q.started, q.last_state) == (False, "")
    progress._note_start(q, "resumed")
    assert q.started


class FakeBar:
    def __init__(self) -> None:
        self.updates: list[dict[str, Any]] = []
        self.console = SimpleNamespace(print=lambda text: self.updates.append({"print": text}))

    def update(self, task: Any, **kw: Any) -> None:
        self.updates.append(kw)


def test_the_bar_follows_start_epochs_and_requeues():
    bar = FakeBar()
    for ev in EVENTS[:2] + EVENTS[4:5]:
        progress._bar_update(bar, 0, ev)
    assert bar.updates[0] == {"description": "training"}
    assert bar.updates[1] == {"completed": 1, "info": "loss 0.5000 | 100/s | syncs 3 | share 0.75 0.25"}
    assert bar.updates[2]["print"].startswith("preempted at epoch 1") and bar.updates[3] == {"description": "requeued"}
