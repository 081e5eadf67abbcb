"""Issue 14: the coordinator's rank server and TCPStore under hostile or broken peers. Loopback only."""
from __future__ import annotations

import errno
import logging
import os
import queue
import socket
import struct
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from flodl_exp.coordinator.server import MAX_HANDSHAKES, RankServer
from flodl_exp.jobs.collective_store import start_store
from flodl_exp.protocol import wire
from flodl_exp.protocol.codec import encode
from flodl_exp.protocol.hello import Hello
from flodl_exp.protocol.messages import CoordHeartbeat, RankError
from flodl_exp.protocol.wire import Message
from flodl_exp.store_names import group_prefix, is_loopback_host, loopback_ifname, pin_gloo_to_loopback

pytestmark = pytest.mark.timeout(60)
HOST = "127.0.0.1"
TOKEN = wire.new_token()


def _next_event(events: queue.Queue, kind: str, timeout: float = 10.0) -> tuple:
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"no {kind!r} event within {timeout}s"
        ev = events.get(timeout=left)
        if ev[0] == kind:
            return ev


def _join(port: int, rank: int, sock: socket.socket | None = None) -> wire.Connection:
    if sock is None:
        conn = wire.dial(HOST, port, timeout=5)
    else:
        sock.connect((HOST, port))
        conn = wire.Connection(sock)
    wire.client_handshake(conn, TOKEN, {"rank": rank, "model_bytes": 1000}, timeout=10)
    conn.max_frame_bytes = wire.frame_ceiling(64 * 2**20)
    return conn


@pytest.fixture
def server():
    servers: list[RankServer] = []

    def make(**kw) -> RankServer:
        srv = RankServer(HOST, TOKEN, kw.pop("world_size", 2), queue.Queue(), **kw)
        servers.append(srv)
        return srv
    yield make
    for s in servers:
        s.close()


# ---------------------------------------------------------------- the TCPStore
def _listeners(port: int) -> list[str]:
    """Local addresses of the LISTEN sockets on ``port`` (from /proc/net/tcp and tcp6)."""
    out = []
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        if not os.path.exists(path):
            continue
        with open(path) as fh:
            next(fh)
            for line in fh:
                cols = line.split()
                addr, port_hex = cols[1].split(":")
                if cols[3] != "0A" or int(port_hex, 16) != port:
                    continue
                raw = bytes.fromhex(addr)
                words = b"".join(struct.pack("<I", struct.unpack(">I", raw[i:i + 4])[0]) for i in range(0, len(raw), 4))
                out.append(socket.inet_ntop(family, words))
    return out


def test_store_listens_on_the_coordinator_address_only():  # hosted by task 0, on the coordinator's host
    handle = start_store(HOST)
    try:
        assert _listeners(handle.port) == [HOST]  # torch alone listened on every interface (*:port)
        dup = socket.socket(fileno=os.dup(handle.fd))
        try:
            assert dup.getsockname() == (HOST, handle.port)
        finally:
            dup.close()
        client = torch.distributed.TCPStore(HOST, handle.port, is_master=False, timeout=timedelta(seconds=10))
        client.set("k", "v")
        assert handle.store.get("k") == b"v"
    finally:
        del handle


def test_group_prefix_is_keyed_by_the_token():
    other = wire.new_token()
    p = group_prefix(TOKEN, 3, "abcd")
    assert p == group_prefix(TOKEN, 3, "abcd")  # pure: every rank derives the same name
    names = {p, group_prefix(other, 3, "abcd"), group_prefix(TOKEN, 4, "abcd"), group_prefix(TOKEN, 3, ""),
             group_prefix(TOKEN, 3, "abce")}
    assert len(names) == 5
    assert "gen" not in p and "3" not in p[:1] and len(p) == 33 and all(c in "0123456789abcdef" for c in p[1:])


def test_collective_backend_names_its_groups_by_the_token():
    from flodl_exp.rank.backends import CollectiveBackend

    seen = []

    def prefix_store(prefix: str, store: object) -> tuple[str, object]:
        seen.append(prefix)
        return prefix, store

    fake = SimpleNamespace(PrefixStore=prefix_store, init_process_group=lambda *a, **k: None, ProcessGroupGloo=lambda *a: object())
    cb = object.__new__(CollectiveBackend)
    cb.dist = fake  # type: ignore[assignment]  # a fake torch.distributed that records the prefixes
    cb.store = object()  # type: ignore[assignment]  # never dialled: the fake's PrefixStore only holds it
    cb.token, cb.device, cb.backend, cb.timeout = TOKEN, torch.device("cpu"), "gloo", timedelta(seconds=30)
    cb._init(2, 0, 2)
    cb._init(3, 1, 2, session="beef")
    assert seen == [group_prefix(TOKEN, 2), group_prefix(TOKEN, 3, "beef")]


def test_gloo_is_pinned_to_loopback_for_local_runs():
    assert is_loopback_host("127.0.0.1") and is_loopback_host("::1") and is_loopback_host("localhost")
    assert not is_loopback_host("10.0.0.5") and not is_loopback_host("node12")
    lo = loopback_ifname()
    assert lo is not None and lo in {n for _, n in socket.if_nameindex()}
    env: dict[str, str] = {}
    assert pin_gloo_to_loopback(HOST, env) == lo and env == {"GLOO_SOCKET_IFNAME": lo}
    env = {}
    assert pin_gloo_to_loopback("10.0.0.5", env) is None and env == {}
    env = {"GLOO_SOCKET_IFNAME": "ib0"}
    assert pin_gloo_to_loopback(HOST, env) == "ib0"  # an explicit choice is kept


# ---------------------------------------------------------------- frames after the handshake
def test_unauthenticated_frame_on_a_rank_connection_closes_it_with_one_log_line(server, caplog):
    srv = server()
    conn = _join(srv.port, 0)
    _next_event(srv.events, "join")
    conn.send(Message("batch", {"ms": 1}))
    assert _next_event(srv.events, "msg")[2].kind == "batch"
    caplog.set_level(logging.WARNING, logger="flodl_exp.coordinator")
    conn.sock.sendall(wire.encode(Message("save", {"path": "/tmp/evil"})))  # injected into the stream, no MAC
    ev = _next_event(srv.events, "closed")
    assert ev[1] == 0 and "FrameAuthError" in ev[2]
    lines = [r for r in caplog.records if "rank 0" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert srv.events.empty()  # the forged frame never reached the event loop, and one "closed" only
    conn.close()


# ---------------------------------------------------------------- connection caps and rank claims
def _hold_unauthenticated(port: int) -> socket.socket:
    """A socket that reads the challenge (so the server is serving it) and never answers."""
    s = socket.create_connection((HOST, port), timeout=10)
    prefix = s.recv(12, socket.MSG_WAITALL)
    assert len(prefix) == 12 and prefix[:4] == b"FDL1"
    return s


def test_excess_unauthenticated_connections_are_closed_at_once(server, caplog):
    srv = server(handshake_timeout=50)
    held = [_hold_unauthenticated(srv.port) for _ in range(MAX_HANDSHAKES)]
    try:
        caplog.set_level(logging.WARNING, logger="flodl_exp.coordinator")
        extra = socket.create_connection((HOST, srv.port), timeout=10)
        assert extra.recv(12) == b""  # closed at once: no challenge
        extra.close()
        assert any("unauthenticated connections" in r.getMessage() for r in caplog.records)
        held.pop().close()  # a slot frees when a pending handshake ends
        deadline = time.monotonic() + 20
        while True:
            try:
                conn = _join(srv.port, 1)
                break
            except wire.AuthError:
                assert time.monotonic() < deadline, "the freed slot never served a rank"
        assert _next_event(srv.events, "join")[1] == 1
        conn.close()
    finally:
        for s in held:
            s.close()


def test_a_rank_claimed_by_a_pending_handshake_cannot_be_claimed_again(server):
    srv = server()
    entered, release = threading.Event(), threading.Event()
    calls = []

    def hook(rank: int) -> None:
        calls.append(rank)
        if len(calls) == 1:  # hold the first claim between its reservation and its welcome
            entered.set()
            assert release.wait(20)
    srv.before_welcome = hook
    first: dict = {}
    t = threading.Thread(target=lambda: first.update(conn=_join(srv.port, 0)))
    t.start()
    try:
        assert entered.wait(10), "the first handshake never reached the welcome"
        with pytest.raises(wire.AuthError, match="rank 0 already claimed"):
            _join(srv.port, 0)
    finally:
        release.set()
        t.join(10)
    assert "conn" in first and _next_event(srv.events, "join")[1] == 0
    with pytest.raises(wire.AuthError, match="rank 0 already"):  # ... and once joined
        _join(srv.port, 0)
    first["conn"].close()


# ---------------------------------------------------------------- a peer that stops reading
def test_a_peer_that_stops_reading_does_not_stop_beacons_to_the_others(server):
    srv = server(send_stall_timeout=1.0)
    sleeper = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sleeper.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stuck = _join(srv.port, 0, sleeper)  # authenticated, then never reads again
    good = _join(srv.port, 1)
    for _ in range(2):
        _next_event(srv.events, "join")
    beacons: queue.Queue[float] = queue.Queue()

    def read_beacons() -> None:
        try:
            while True:
                if good.recv().kind == "coord_heartbeat":
                    beacons.put(time.monotonic())
        except wire.WireError:
            pass
    threading.Thread(target=read_beacons, daemon=True).start()
    stop = threading.Event()
    update = Message("update", {}, {"w": torch.zeros(4 * 2**20)})  # 16 MiB: never fits the buffers

    def event_loop() -> None:  # what the coordinator does: its full-model update, then beacons to all
        to_stuck = True
        while not stop.is_set():
            if to_stuck:
                to_stuck = srv.send(0, update)
            for r in (0, 1):
                srv.send(r, encode(CoordHeartbeat()))
            stop.wait(0.02)
    loop = threading.Thread(target=event_loop, daemon=True)
    loop.start()
    try:
        ev = _next_event(srv.events, "closed", timeout=30)
        assert ev[1] == 0 and "stall" in ev[2], ev
        after = time.monotonic()
        deadline = after + 30
        got = 0
        while got < 5:  # rank 1 keeps hearing the coordinator after the stalled rank is dropped
            t = beacons.get(timeout=max(0.01, deadline - time.monotonic()))
            got += t > after
    finally:
        stop.set()
        loop.join(10)
    assert not loop.is_alive()
    assert all(e[0] != "closed" or e[1] != 0 for e in list(srv.events.queue))  # reported once
    stuck.close()
    good.close()


# ---------------------------------------------------------------- issue 26: frames before a bad one
def test_a_ranks_report_sent_just_before_a_bad_frame_reaches_the_event_loop_first(server):
    srv = server()
    conn = _join(srv.port, 0)
    _next_event(srv.events, "join")
    captured = bytearray()
    with pytest.MonkeyPatch.context() as mp:  # MAC the report with its real sequence number ...
        mp.setattr(conn, "_sendall", captured.extend)
        conn.send(encode(RankError(error="CUDA out of memory")))
    forged = wire.MAGIC_AUTH + wire.encode(Message("save", {"path": "/tmp/x"}))[4:] + os.urandom(32)
    conn.sock.sendall(bytes(captured) + forged)  # ... and send it with a bad frame in one write: one read
    ev = _next_event(srv.events, "msg")
    assert ev[1] == 0 and ev[2].kind == "error" and ev[2].fields["error"] == "CUDA out of memory"
    closed = _next_event(srv.events, "closed")
    assert closed[1] == 0 and "FrameAuthError" in closed[2]
    conn.close()


# ---------------------------------------------------------------- issue 26: the accept thread outlives a failed accept
def test_accept_goes_on_after_descriptor_exhaustion(server, monkeypatch, caplog):
    real = wire.accept
    failed: list[float] = []

    def exhausted_then_fine(listener, timeout=None):
        if len(failed) < 3:
            failed.append(time.monotonic())
            raise OSError(errno.EMFILE, "Too many open files")
        return real(listener, timeout)
    monkeypatch.setattr(wire, "accept", exhausted_then_fine)
    caplog.set_level(logging.WARNING, logger="flodl_exp.coordinator")
    srv = server()
    conn = wire.dial(HOST, srv.port, timeout=5)  # waits in the backlog while accept fails
    wire.client_handshake(conn, TOKEN, {"rank": 0, "model_bytes": 1000}, timeout=8)
    assert _next_event(srv.events, "join")[1] == 0
    assert len(failed) == 3 and failed[2] - failed[0] >= 0.1  # backed off between failures, not spun
    lines = [r.getMessage() for r in caplog.records if "accepting rank connections" in r.getMessage()]
    assert len(lines) == 2 and "Too many open files" in lines[0] and "again after 3" in lines[1], lines
    conn.close()


def test_a_closing_server_ends_its_accept_thread_even_while_accept_fails(server, monkeypatch):
    def always_exhausted(listener, timeout=None):
        raise OSError(errno.ENFILE, "Too many open files in system")
    monkeypatch.setattr(wire, "accept", always_exhausted)
    srv = server()
    time.sleep(0.3)
    assert srv._acceptor.is_alive()  # still trying
    t0 = time.monotonic()
    srv.close()
    srv._acceptor.join(5)
    assert not srv._acceptor.is_alive() and time.monotonic() - t0 < 3


# ---------------------------------------------------------------- issue 26: dropped connections and hello values
def test_a_dropped_connection_leaves_conns_with_its_partial_frame(server):
    srv = server()
    conn = _join(srv.port, 0)
    _next_event(srv.events, "join")
    held = srv.conns[0]
    frame = bytearray()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(conn, "_sendall", frame.extend)
        conn.send(Message("snapshot", {"n": 1}, {"p0": torch.zeros(200_000)}))  # 800 KB
    conn.sock.sendall(bytes(frame[:500_000]))  # part of it, then the rank dies
    deadline = time.monotonic() + 10
    while held.buffered < 500_000:
        assert time.monotonic() < deadline, f"the read thread holds {held.buffered} bytes"
        time.sleep(0.02)
    conn.sock.close()
    ev = _next_event(srv.events, "closed")
    assert ev[1] == 0
    assert 0 not in srv.conns and held.closed and held.buffered == 0
    assert srv.send(0, encode(CoordHeartbeat())) is False


@pytest.mark.parametrize(("hello", "reason"), [
    pytest.param({"rank": 1.9, "model_bytes": 10}, "hello rank 1.9 is not an int in [0, 2)", id="rank-float"),
    pytest.param({"rank": True}, "hello rank True", id="rank-bool"),
    pytest.param({"rank": "0"}, "hello rank '0'", id="rank-str"),
    pytest.param({"model_bytes": 10}, "hello rank is missing", id="rank-missing"),
    pytest.param({"rank": 2}, "hello rank 2 is not an int in [0, 2)", id="rank-out-of-range"),
    pytest.param({"rank": -1}, "hello rank -1", id="rank-negative"),
    pytest.param({"rank": 0, "model_bytes": 1e300}, "hello model_bytes 1e+300", id="model-bytes-huge-float"),
    pytest.param({"rank": 0, "model_bytes": -1}, "hello model_bytes -1", id="model-bytes-negative"),
    pytest.param({"rank": 0, "model_bytes": 2**40 + 1}, "is not an int in [0, 2**40]", id="model-bytes-over-max"),
    pytest.param({"rank": 0, "model_bytes": 10**400}, "an int of 1329 bits", id="model-bytes-400-digits"),
    pytest.param({"rank": 0, "samples": "many"}, "hello samples 'many' is not a non-negative int", id="samples-str"),
    pytest.param({"rank": 0, "pid": -5}, "hello pid -5", id="pid-negative"),
    pytest.param({"rank": 0, "device_score": float("nan")}, "hello device_score nan", id="score-nan"),
    pytest.param({"rank": 0, "host": 3}, "hello host 3 is not a str", id="host-int"),
    pytest.param({"rank": 0, "inputs": ["x"]}, "hello inputs", id="inputs-not-objects"),
])
def test_a_hello_with_bad_values_is_refused_with_its_reason(server, hello, reason, caplog):
    srv = server()
    caplog.set_level(logging.WARNING, logger="flodl_exp.coordinator")
    conn = wire.dial(HOST, srv.port, timeout=5)
    with pytest.raises(wire.AuthError, match="rejected us") as ei:
        wire.client_handshake(conn, TOKEN, hello, timeout=10)
    assert reason in str(ei.value)
    conn.close()
    deadline = time.monotonic() + 5
    while not any(reason in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, "no log line names the reason"
        time.sleep(0.02)
    assert srv.rejected == 1 and srv.conns == {} and srv.events.empty()
    good = _join(srv.port, 0)  # nothing was reserved: rank 0 can still join
    joined = _next_event(srv.events, "join")
    assert joined[1] == 0 and srv.conns[0].max_frame_bytes == wire.frame_ceiling(1000)
    assert joined[2] == Hello(rank=0, model_bytes=1000)  # the event loop gets the checked, typed hello
    good.close()


def test_a_valid_full_hello_joins():
    full = {"rank": 1, "host": "n1", "pid": 42, "device": "cuda:0", "device_uuid": "GPU-1", "device_score": 2.5,
            "model_bytes": 4 * 10**9, "samples": 60000, "inputs": [{"name": "train"}], "added_later": object()}
    assert Hello.from_dict(full, 2) == Hello(rank=1, host="n1", pid=42, device="cuda:0", device_uuid="GPU-1",
                                             device_score=2.5, model_bytes=4 * 10**9, samples=60000,
                                             inputs=({"name": "train"},))
    assert Hello.from_dict({"rank": 0, "device_uuid": None, "device_score": None}, 1) == Hello(rank=0)
