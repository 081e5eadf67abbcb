"""A rank whose main thread is stuck while its heartbeat beats on is declared dead and evicted
(issue 14, item 5); the cpu frame ceiling counts float buffers (item 10)."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from control_fakes import Harness

from flodl_exp.core.cohort import ProgressWatch
from flodl_exp.protocol import wire
from flodl_exp.protocol.codec import encode
from flodl_exp.protocol.messages import Evict, Heartbeat
from flodl_exp.rank import fault_inject
from flodl_exp.rank.backends import CoordinatorBackend, snapshot_nbytes


def test_a_rank_training_with_frozen_steps_is_stuck_and_other_states_are_not():
    w = ProgressWatch(30.0)
    w.on_heartbeat(0, "train", 5, now=0.0)
    w.on_heartbeat(1, "train", 5, now=0.0)
    w.on_heartbeat(2, "collective", 5, now=0.0)
    for t in range(1, 40):
        w.on_heartbeat(0, "train", 5 + t, now=float(t))      # steps move: progress
        w.on_heartbeat(1, "train", 5, now=float(t))          # frozen in a chunk: stuck
        w.on_heartbeat(2, "collective", 5, now=float(t))     # waiting on peers: not its fault
    assert [r for r, _ in w.stuck(40.0)] == [1]
    w.on_heartbeat(1, "eval", 5, now=41.0)
    assert w.stuck(42.0) == [], "an eval restarts the clock"
    assert ProgressWatch(0).stuck(1e9) == [], "0 turns the watch off"


def _heartbeats(h: Harness, seconds: int, states: dict[int, tuple[str, int]]) -> None:
    for _ in range(seconds):
        h.clock.advance(1.0)
        for r, (state, steps) in states.items():
            h.msg(r, Heartbeat(steps=steps, state=state))
        h.tick()


@pytest.mark.parametrize("mode", ["nccl_cadence", "cpu_async"])
def test_the_coordinator_evicts_a_stuck_rank_and_recovers(tmp_path, mode):
    timeouts: dict[str, Any] = {"cluster.progress_timeout_s": 20.0, "cluster.heartbeat_timeout_s": 30.0}
    h = Harness(tmp_path, mode, 3, **timeouts)
    h.start()
    _heartbeats(h, 15, {0: ("train", 3), 1: ("train", 3), 2: ("train", 3)})
    assert h.co.core.cohort.alive_ranks() == [0, 1, 2], "15 s without a step is within the timeout"
    _heartbeats(h, 10, {0: ("collective", 9), 1: ("train", 3), 2: ("wait", 9)})
    assert h.co.core.cohort.alive_ranks() == [0, 2]
    death = h.co.core.cohort.deaths[0]
    assert death.rank == 1 and "no training step" in death.reason and "progress_timeout_s" in death.reason
    assert [r for r, _ in h.transport.take(Evict)] == [1], "the stuck rank is told to go"


def test_an_evicted_rank_would_have_been_missed_without_the_watch(tmp_path):
    no_watch: dict[str, Any] = {"cluster.progress_timeout_s": 0.0}
    h = Harness(tmp_path, "nccl_cadence", 2, **no_watch)
    h.start()
    _heartbeats(h, 60, {0: ("train", 3), 1: ("train", 3)})
    assert h.co.core.cohort.alive_ranks() == [0, 1], "heartbeats alone keep a stuck rank alive"


def test_a_stall_stops_only_the_calling_thread(monkeypatch):
    import threading

    monkeypatch.setattr(fault_inject, "STALL_MAX_S", 0.3)
    beats = []
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            beats.append(1)
            stop.wait(0.02)

    t = threading.Thread(target=beat)
    t.start()
    fault_inject.inject_fault("stall", 1, 3)
    stop.set()
    t.join(5)
    assert len(beats) >= 2, "the heartbeat thread ran during the stall"


def test_the_frame_ceiling_covers_a_snapshot_with_large_float_buffers():
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(512, 512)                  # ~1 MiB of parameters
            self.register_buffer("table", torch.zeros(5_000_000))  # a 20 MB float buffer

    model = Model()
    frame = encode(CoordinatorBackend().snapshot(model, 1))
    size = sum(len(b) for b in wire.encode_buffers(frame))
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert size > wire.frame_ceiling(param_bytes), "sized from parameters alone, the snapshot is refused"
    assert size <= wire.frame_ceiling(snapshot_nbytes(model))


def test_heartbeats_without_state_still_decode():
    from flodl_exp.protocol.codec import decode

    assert decode(encode(Heartbeat())) == Heartbeat()
    assert decode(encode(Evict(reason="x"))) == Evict(reason="x")
