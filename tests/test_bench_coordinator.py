"""The coordinator load test's machinery (experiments/bench_coordinator.py) at N=8: behaviour, not speed.

Also the non-blocking read path it drives on the coordinator's side (``wire.Connection.read_ready``):
frames split across reads, many frames in one read, and a tampered frame."""
from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
import torch

from flodl_exp.protocol import wire
from flodl_exp.protocol.wire import Message

ROOT = Path(__file__).resolve().parents[1]


def _session_pair() -> tuple[wire.Connection, wire.Connection]:
    a, b = socket.socketpair()
    client, server = wire.Connection(a), wire.Connection(b)
    for c, is_server in ((client, False), (server, True)):
        c._start_session("t" * 64, b"s" * 32, b"c" * 32, server=is_server)
    return client, server


def _read_all(conn: wire.Connection, scratch: memoryview, want: int) -> list[Message]:
    got: list[Message] = []
    for _ in range(10_000):
        got += conn.read_ready(scratch)
        if len(got) >= want:
            return got
    raise AssertionError(f"{len(got)} of {want} frames")


def test_read_ready_takes_many_frames_per_read_and_frames_split_across_reads():
    client, server = _session_pair()
    try:
        server.max_frame_bytes = wire.frame_ceiling(0)
        for i in range(50):
            client.send(Message("batch", {"ms": float(i), "chunk": i}))
        client.send(Message("snapshot", {"n": 3}, {"p0": torch.arange(10_000, dtype=torch.float32)}))
        small = memoryview(bytearray(1000))  # the 40 KB snapshot arrives in dozens of reads
        got = _read_all(server, small, 51)
        assert [m.fields["chunk"] for m in got[:50]] == list(range(50))
        assert got[50].kind == "snapshot" and torch.equal(got[50].tensors["p0"], torch.arange(10_000, dtype=torch.float32))
        assert server.read_ready(small) == []  # nothing more: no block, no frame
        server.send(Message("update", {"n": 1}))
        assert client.recv(timeout=5).fields == {"n": 1}  # the blocking path agrees on keys and sequence
    finally:
        client.close()
        server.close()


def test_read_ready_rejects_a_tampered_frame_and_reports_eof():
    client, server = _session_pair()
    try:
        frame = bytearray(wire.encode(Message("batch", {"ms": 1.0})))
        frame[:4] = wire.MAGIC_AUTH
        client.sock.sendall(bytes(frame) + b"\0" * wire.MAC_BYTES)
        with pytest.raises(wire.FrameAuthError):
            _read_all(server, memoryview(bytearray(4096)), 1)
    finally:
        client.close()
        server.close()
    a, b = socket.socketpair()
    conn = wire.Connection(b)
    a.close()
    with pytest.raises(wire.ConnectionClosed):
        conn.read_ready(memoryview(bytearray(64)))
    conn.close()


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_bench_at_8_ranks_handshakes_absorbs_every_batch_and_reduces(tmp_path):
    sys.path.insert(0, str(ROOT / "experiments"))
    try:
        from experiments import bench_coordinator as bench
    finally:
        sys.path.remove(str(ROOT / "experiments"))
    r = bench.run_once(8, batches=800, procs=2, timeout_s=90, workdir=str(tmp_path))
    assert r["errors"] == [] and r["status"] == "FINISHED", r
    assert r["handshaken"] == 8 and r["exited"] == 8
    assert r["sent"] == 800 and r["absorbed"] == r["sent"]  # every timing message reached the coordinator's ledger
    assert r["reduces"] >= 1 and r["snapshots"] >= 8 * r["reduces"] - 8 and r["updates"] >= 8
    assert r["turn_p50_ms"] == r["turn_p50_ms"] and r["trig_p50_ms"] == r["trig_p50_ms"]  # measured (not NaN)


def _bench():
    sys.path.insert(0, str(ROOT / "experiments"))
    try:
        from experiments import bench_coordinator as bench
    finally:
        sys.path.remove(str(ROOT / "experiments"))
    return bench


def test_a_paced_plan_sizes_each_run_by_ranks_pace_and_seconds():
    bench = _bench()
    plan = bench.load_plan(20.0, None, 0.0, 60_000)
    assert plan.rate == 20.0 and plan.seconds == bench.PACED_SECONDS
    assert plan.batches(1024) == 1024 * 20 * 60 and plan.batches(8) == 8 * 20 * 60
    assert plan.timeout_s >= 2 * 60  # bounded: the run stops by itself well before
    assert bench.load_plan(0.5, 10.0, 0.0, 0).batches(8) == 8 * 20  # at least 20 per rank
    unpaced = bench.load_plan(None, None, 5.0, 60_000)
    assert unpaced.rate == 5.0 and unpaced.batches(8) == 60_000 and unpaced.timeout_s == bench.DEFAULT_TIMEOUT_S
    for bad in ((0.0, None), (-1.0, None), (20.0, 0.0)):
        with pytest.raises(SystemExit):
            bench.load_plan(bad[0], bad[1], 0.0, 0)
    with pytest.raises(SystemExit):
        bench.load_plan(None, 60.0, 0.0, 0)  # --seconds without --pace


def test_the_paced_line_has_the_issues_form():
    bench = _bench()
    row = {"n": 1024, "trig_p99_ms": 41.26, "cpu_pct": 87.4, "reduce_sent_ms": 512.3, "rss_mb": 301.2}
    assert bench.paced_line(row) == "paced N=1024: trigger p99 41.3 ms, coordinator cpu 87 %, reduce 512 ms, rss 301 MB"
    assert "trigger p99 nan ms" in bench.paced_line({**row, "trig_p99_ms": float("nan")})


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_a_paced_run_holds_every_rank_to_its_pace(tmp_path):
    """8 ranks at 20 batches/s for 3 s: every batch arrives, and the run cannot end sooner than the pace allows
    (a lower bound: a faster machine cannot flip it)."""
    bench = _bench()
    plan = bench.load_plan(20.0, 3.0, 0.0, 0)
    r = bench.run_once(8, batches=plan.batches(8), procs=2, rate=plan.rate, timeout_s=plan.timeout_s,
                       workdir=str(tmp_path))
    assert r["errors"] == [] and r["status"] == "FINISHED", r
    assert r["sent"] == 8 * 60 and r["absorbed"] == r["sent"]
    # 60 batches per rank, one each 50 ms: 2.95 s; a rank resuming after an update sends its next batch at once (one
    # period early per reduce), so the bound is half that, still far above an unpaced run of 480 batches (~0.2 s)
    assert r["span_s"] >= (60 - 1) / 20.0 * 0.5, r["span_s"]
    assert r["queue_p99_ms"] == r["queue_p99_ms"] and len(r["trig_queue_ms"]) == r["reduces"]
    assert bench.paced_line(bench.median_row([r])).startswith("paced N=8: trigger p99 ")
