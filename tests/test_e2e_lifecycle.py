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


def _recv_exact(s: socket.socket, n: int) -> bytes:
    """Exactly n bytes (the socket's timeout bounds each read), or AssertionError at EOF."""
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        assert chunk, f"EOF after {len(buf)} of {n} bytes"
        buf += chunk
    return buf


def _recv_until_eof(s: socket.socket, limit: int = 1 << 20) -> bytes:
    """Everything the peer sends until it closes (b"" read) or resets; bounded in bytes and by the socket timeout."""
    got = b""
    try:
        while len(got) < limit:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    except ConnectionResetError:  # closed with our garbage unread: RST instead of FIN, still a drop
        pass
    return got


def test_hostile_peers_are_dropped_and_the_run_finishes(store, tmp_path, monkeypatch):
    # Both ranks wait at their first batch until the gate opens: the run is in progress (rank 1 connected) for
    # every hostile peer below, however fast the machine; the gate opens once they are done.
    gate = tmp_path / "gate"
    monkeypatch.setenv("FLODL_FAULT_INJECT", f"0:1:gate:{gate},1:1:gate:{gate}")
    h = _launch(store, "mode=cpu_sync", "experiment.epochs=2")
    try:
        _hostile_peers(h)
    finally:
        gate.touch()
    res = h.wait()
    assert res["status"] == "FINISHED"
    assert res["rejected_connections"] >= 3
    assert MlflowClient(store["uri"]).get_run(h.run_id).info.status == "FINISHED"
    assert not any(alive(p) for p in pids_of(__import__("pathlib").Path(h.job_dir)))


def _hostile_peers(h) -> None:
    rdv_path = os.path.join(h.job_dir, "rendezvous.json")
    _wait_for(lambda: os.path.exists(rdv_path), what="rendezvous.json")
    rdv = json.loads(open(rdv_path).read())
    assert oct(os.stat(rdv_path).st_mode & 0o777) == "0o600"
    _wait_for(lambda: any(e.get("event") == "started" for e in h.poll_events() + h.events), what="run start")
    from flodl_exp.protocol import wire

    # 1. random bytes: the server speaks first (a challenge frame), then drops us on the garbage
    s = socket.create_connection((rdv["host"], rdv["port"]), timeout=5)
    s.settimeout(10)
    prefix = _recv_exact(s, 12)
    magic, header_len, payload_len = struct.unpack(">4sII", prefix)
    assert magic == b"FDL1" and 0 < header_len < 65536 and payload_len == 0, prefix
    challenge = wire.decode(prefix + _recv_exact(s, header_len), 65536)
    assert challenge.kind == "challenge" and not challenge.tensors
    assert len(bytes.fromhex(challenge.fields["nonce"])) == 32
    s.sendall(b"JUNK" + os.urandom(4092))  # never a valid magic
    assert _recv_until_eof(s) == b""  # nothing more, then EOF: dropped
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
    assert not any(e.get("event") == "end" for e in h.poll_events() + h.events), "the gate should hold the run open"


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


def test_a_rank_lost_during_rendezvous_is_named_and_the_job_ends(store, monkeypatch):
    """Rank 1's task dies before it dials in; ranks 0 and 2 joined and wait in process-group setup for it.
    The run fails naming rank 1 (not a peer that timed out later), and every process is gone within
    about the heartbeat timeout (the process-group setup's own timeout)."""
    from pathlib import Path

    from flodl_exp.jobs.launcher import RunFailed

    monkeypatch.setenv("FLODL_FAULT_INJECT", "1:connect:kill")
    h = _launch(store, "mode=nccl_cadence", "cluster.ranks_per_node=3", "experiment.epochs=2",
                "cluster.heartbeat_timeout_s=5")
    with pytest.raises(RunFailed) as err:
        h.wait()
    msg = str(err.value)
    assert "rank 1 was lost before training started" in msg and "exited before it connected" in msg, msg
    run = MlflowClient(store["uri"]).get_run(h.run_id)
    assert run.info.status == "FAILED" and "rank 1 was lost" in run.data.tags.get("error", "")
    job = Path(h.job_dir)
    pids = pids_of(job) + [json.loads(p.read_text())["pid"] for p in (job / "ranks").glob("rank*.json")]
    _wait_for(lambda: not any(alive(p) for p in pids), timeout=40, what="every process to exit")


def test_cancel_leaves_no_process(store, tmp_path, monkeypatch):
    # Both ranks block at their first batch until the gate file exists: the run is held open by a mechanism,
    # so the cancel always lands mid-run however fast the machine is. The gate is opened only after the cancel.
    gate = tmp_path / "gate"
    monkeypatch.setenv("FLODL_FAULT_INJECT", f"0:1:gate:{gate},1:1:gate:{gate}")
    h = _launch(store, "mode=nccl_cadence", "experiment.epochs=3")
    from pathlib import Path

    job = Path(h.job_dir)
    try:
        _wait_for(lambda: len([e for e in read_events(job) if e.get("event") == "joined"]) == 2, what="ranks joined")
        _wait_for(lambda: any(e.get("event") == "started" for e in read_events(job)), what="run start")
        pids = pids_of(job)
        assert len(pids) == 3
        # the collective's store is task 0's: the coordinator of a collective mode never loads torch
        coordinator = json.loads((job / "rendezvous.json").read_text())["pid"]
        assert not _maps_libtorch(coordinator), "the nccl coordinator imported torch"
        assert any(_maps_libtorch(p) for p in pids if p != coordinator), "a rank without torch: the check sees nothing"
        assert not any(e.get("event") in ("epoch", "end") for e in read_events(job)), "the gate should hold epoch 0 open"
        h.shutdown()
        _wait_for(lambda: not any(alive(p) for p in pids), timeout=30, what="every process to exit after cancel")
        assert not any(e.get("event") == "epoch" for e in read_events(job)), "no epoch can end while the gate is shut"
        assert MlflowClient(store["uri"]).get_run(h.run_id).info.status == "KILLED"
    finally:
        gate.touch()  # never leave a rank waiting on the gate (it would give up on its own after its bound)


def _maps_libtorch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as fh:
        return "libtorch" in fh.read()


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
