"""Pure pieces of the record stream: window slicing and the bounded ring log."""
from __future__ import annotations

import json
import os

from flodl_exp.coordinator.records import RecordLog, RingLog, WindowReporter
from flodl_exp.core.epoch_metrics import EpochAccumulator
from flodl_exp.protocol.messages import ChunkMetrics


def test_window_reporter_fires_once_per_slice_and_flushes_the_rest():
    w = WindowReporter(4, epoch_work=40)
    fired = [w.on_window(0, 5) for _ in range(8)]  # 8 windows of 5 batches
    assert sum(fired) == 4 and fired == [False, True, False, True, False, True, False, True]
    assert w.owed(0) == 0
    w2 = WindowReporter(4, epoch_work=40)
    assert w2.on_window(0, 40) is True  # at most one per window
    assert w2.owed(0) == 3 and w2.owed(0) == 0
    assert WindowReporter(0, 10).on_window(0, 10) is False


def test_ring_log_never_exceeds_its_cap_and_keeps_the_newest(tmp_path):
    p = tmp_path / "r.log"
    ring = RingLog(str(p), 1024)
    for i in range(500):
        ring.append({"i": i, "pad": "x" * (i % 17)})
        assert os.path.getsize(p) <= 1024
    lines = [json.loads(x) for x in p.read_text().splitlines()]
    assert lines[-1]["i"] == 499 and [x["i"] for x in lines] == sorted(x["i"] for x in lines)
    ring.append({"huge": "y" * 5000})  # larger than the ring: dropped whole
    assert os.path.getsize(p) <= 1024


def test_record_log_files_per_node(tmp_path):
    rl = RecordLog(str(tmp_path), 2048)
    rl.hosts[1] = "nodeA"
    rl.root("epoch", {"epoch": 0})
    rl.rank(1, "chunk", {"batches": 3})
    assert (tmp_path / "root.log").exists() and (tmp_path / "nodeA" / "rank1.log").exists()
    assert not RecordLog(None, 2048).enabled


def test_scalar_reductions():
    acc = EpochAccumulator(0, 2, 0.0)
    for r, v in ((0, 1.0), (1, 3.0)):
        acc.add_chunk(r, ChunkMetrics(epoch=0, chunk=r, batches=10, samples=320, avg_loss=1.0, epoch_ms=10, share_complete_ms=10,
                                      compute_only_ms=8, data_starve_ms=2, scalars={"s": [v * 10, 10], "m": [v * 10, 10]}))
    m = acc.summary(1.0, {"s": "sum"})
    assert m["s"] == 4.0 and m["m"] == 2.0 and m["rank1/s"] == 3.0
    assert acc.summary(1.0, {"s": "max"})["s"] == 3.0 and acc.summary(1.0, {"s": "min"})["s"] == 1.0
