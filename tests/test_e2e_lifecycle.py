"""Process lifecycle end to end: hostile peers on the coordinator's port, crashes, cancellation, no orphans."""
from __future__ import annotations

import json
import os
import socket
import struct
import time

import pytest
from mlflow.tracking import MlflowClient

from conftest import alive, launch_run, pids_of, read_events, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _launch(store, *overrides):
    return launch_run(store, "lifecycle", *overrides)


_wait_for = wait_for


def test_hostile_peers_are_dropped_and_the_run_finishes(store):
    h = _launch(store, "mode=cpu_sync", "experiment.epochs=6", "cluster.rank_speeds=[0.5,0.5]")
    rdv_path = os.path.join(h.job_dir, "rendezvous.json")
    _wait_for(lambda: os.path.exists(rdv_path), what="rendezvous.json")
    rdv = json.loads(open(rdv_path).read())
    assert oct(os.stat(rdv_path).st_mode & 0o777) == "0o600"
    _wait_for(lambda: any(e.get("event") == "started" for e in h.poll_events() + h.events), what="run start")
    from flodl_exp import wire

    # 1. random bytes
    s = socket.create_connection((rdv["host"], rdv["port"]), timeout=5)
    s.sendall(os.urandom(4096))
    s.settimeout(10)
    assert s.recv(65536) is not None  # the challenge, then EOF when we're dropped
    s.close()
    # 2. an oversized frame (claims 3 GiB)
    s = socket.create_connection((rdv["host"], rdv["port"]), timeout=5)
    s.sendall(struct.pack(">4sII", b"FDL1", 16, 3 * 2**30) + b"x" * 16)
    s.close()
    # 3. a wrong token
    conn = wire.dial(rdv["host"], rdv["port"], timeout=5)
    with pytest.raises(wire.WireError):
        wire.client_handshake(conn, "0" * 64, {"rank": 0, "model_bytes": 10}, timeout=5)
    conn.close()
    # 4. the right token for a rank that is already connected
    conn = wire.dial(rdv["host"], rdv["port"], timeout=5)
    with pytest.raises(wire.WireError):
        wire.client_handshake(conn, rdv["token"], {"rank": 1, "model_bytes": 10}, timeout=5)
    conn.close()
    res = h.wait()
    assert res["status"] == "FINISHED"
    assert res["rejected_connections"] >= 3
    assert MlflowClient(store["uri"]).get_run(h.run_id).info.status == "FINISHED"
    assert not any(alive(p) for p in pids_of(__import__("pathlib").Path(h.job_dir)))


@pytest.mark.parametrize("kind", ["raise", "kill"])
def test_crashed_rank_fails_the_run_with_its_error(store, kind, monkeypatch):
    monkeypatch.setenv("FLODL_FAULT_INJECT", f"1:10:{kind}")
    h = _launch(store, "mode=nccl_sync", "experiment.epochs=3", "cluster.heartbeat_timeout_s=10")
    from flodl_exp.jobs.launcher import RunFailed

    t0 = time.monotonic()
    with pytest.raises(RunFailed) as err:
        h.wait()
    assert time.monotonic() - t0 < 90
    msg = str(err.value)
    assert "rank 1" in msg
    if kind == "raise":
        assert "injected fault" in msg
    run = MlflowClient(store["uri"]).get_run(h.run_id)
    assert run.info.status == "FAILED"
    assert "rank 1" in run.data.tags.get("error", "")
    from pathlib import Path

    _wait_for(lambda: not any(alive(p) for p in pids_of(Path(h.job_dir))), timeout=30, what="every process to exit")


def test_cancel_leaves_no_process(store):
    h = _launch(store, "mode=cpu_cadence", "experiment.epochs=50", "cluster.rank_speeds=[0.3,0.3]")
    from pathlib import Path

    _wait_for(lambda: len([e for e in read_events(Path(h.job_dir)) if e.get("event") == "joined"]) == 2, what="ranks joined")
    pids = pids_of(Path(h.job_dir))
    assert len(pids) == 3
    h.shutdown()
    _wait_for(lambda: not any(alive(p) for p in pids), timeout=30, what="every process to exit after cancel")
    assert MlflowClient(store["uri"]).get_run(h.run_id).info.status == "KILLED"


def test_run_handle_streams_metrics_and_joins_the_consensus(store):
    h = _launch(store, "mode=nccl_sync", "experiment.epochs=3")
    seen = []
    while (m := h.next_metrics(timeout=240)) is not None:
        seen.append(m["epoch"])
    assert seen == [0, 1, 2]
    assert h.poll_metrics() == []
    state = h.join()
    assert set(state) == {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}
    import hashlib

    h_ = hashlib.sha256()
    for k in ("net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"):
        h_.update(state[k].float().contiguous().numpy().tobytes())
    assert {f["hash"] for f in h.result["finals"].values()} == {h_.hexdigest()}
