"""Wire protocol: framing, validation, Connection, handshake. All on 127.0.0.1 / socketpair."""
from __future__ import annotations

import json
import os
import pickle
import re
import socket
import struct
import threading
import time
import tracemalloc
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from flodl_exp.protocol import wire
from flodl_exp.protocol.wire import (
    HANDSHAKE_MAX_FRAME,
    AuthError,
    Connection,
    ConnectionClosed,
    FrameTooLarge,
    Message,
    WireError,
    accept,
    client_handshake,
    decode,
    dial,
    encode,
    frame_ceiling,
    listen,
    new_token,
    server_accept,
    server_handshake,
    server_reject,
)

MiB = 2**20
TOKEN = bytes.fromhex(new_token())
pytestmark = pytest.mark.timeout(20)


def raw_frame(header: object, payload: bytes = b"", header_len: int | None = None,
              payload_len: int | None = None, magic: bytes = b"FDL1") -> bytes:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    hl = len(h) if header_len is None else header_len
    pl = len(payload) if payload_len is None else payload_len
    return struct.pack(">4sII", magic, hl, pl) + h + payload


def desc(name="t", dtype="float32", shape=(2,), nbytes=8) -> dict:
    return {"name": name, "dtype": dtype, "shape": list(shape), "nbytes": nbytes}


def sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype is torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=torch.float32).to(dtype)
    return torch.randint(0, 200, shape, dtype=dtype)


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    ca, cb = Connection(a, max_frame_bytes=64 * MiB), Connection(b, max_frame_bytes=64 * MiB)
    yield ca, cb
    ca.close()
    cb.close()


# ------------------------------------------------------------------ round trips
@pytest.mark.parametrize("dtype", list(wire.dtypes().values()), ids=list(wire.dtypes()))
def test_round_trip_every_dtype(dtype):
    tensors = {"mat": sample(dtype, (3, 5)), "scalar": sample(dtype, ()),
               "empty": sample(dtype, (0,)), "empty2d": sample(dtype, (4, 0)),
               "strided": sample(dtype, (6, 4)).t()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = decode(encode(Message("params", {"step": 3}, tensors)), 16 * MiB)
    assert list(out.tensors) == list(tensors)  # header order preserved
    for name, t in tensors.items():
        got = out.tensors[name]
        assert got.dtype == dtype and got.shape == t.shape and torch.equal(got, t), name
        assert got.is_contiguous()
    out.tensors["mat"].zero_()  # owns writable memory
    assert out.tensors["scalar"].dim() == 0


def test_the_torch_free_header_check_knows_each_dtypes_size():
    # a header is checked against ITEMSIZES without torch (wire.dtypes loads it with the first tensor)
    assert {name: dt.itemsize for name, dt in wire.dtypes().items()} == wire.ITEMSIZES


def test_fields_nested_json_and_grad_tensor():
    fields = {"a": [1, 2.5, None, True, "é✓"], "nested": {"x": {"y": [[], {}]}}, "neg": -7}
    w = torch.randn(4, requires_grad=True)
    out = decode(encode(Message("k", fields, {"w": w})), MiB)
    assert out.kind == "k" and out.fields == fields
    assert torch.equal(out.tensors["w"], w.detach()) and not out.tensors["w"].requires_grad


def test_frame_layout_matches_spec():
    frame = encode(Message("x", {"a": 1}, {"t": torch.arange(3, dtype=torch.int32)}))
    magic, hl, pl = struct.unpack(">4sII", frame[:12])
    assert magic == b"FDL1" and pl == 12 and len(frame) == 12 + hl + pl
    header = json.loads(frame[12:12 + hl])
    assert header == {"kind": "x", "fields": {"a": 1},
                      "tensors": [{"name": "t", "dtype": "int32", "shape": [3], "nbytes": 12}]}
    assert frame[12 + hl:] == torch.arange(3, dtype=torch.int32).numpy().tobytes()


def test_one_consensus_to_many_ranks_shares_its_tensor_encoding():
    """The cpu backend's fan-out: frames of one tensors dict share one TensorPart and are the bytes a frame
    encoded on its own would be (the descriptors spliced into the header, in the same key order)."""
    tensors = {"p0": torch.randn(3, 2), "b0": torch.arange(4), "e": torch.zeros(0)}
    parts: wire.SharedParts = {}
    shared = [Message("update", {"n": n, "plan": [0, n, "é"]}, tensors).sharing(parts) for n in range(3)]
    assert len(parts) == 1 and shared[0].tensor_part is shared[2].tensor_part
    for n, msg in enumerate(shared):
        alone = Message("update", {"n": n, "plan": [0, n, "é"]}, tensors)
        assert alone.tensor_part is None and encode(msg) == encode(alone)
        out = decode(encode(msg), MiB)
        assert out.fields["n"] == n and torch.equal(out.tensors["p0"], tensors["p0"])
    other = Message("update", {}, {"p0": torch.ones(1)}).sharing(parts)
    assert len(parts) == 2 and other.tensor_part is not shared[0].tensor_part
    assert Message("beat", {"x": 1}).sharing(parts).tensor_part is None and len(parts) == 2  # no tensors, no part
    assert json.loads(encode(Message("beat", {"x": 1}))[12:])["tensors"] == []


def test_a_lone_surrogate_is_a_wire_error():
    with pytest.raises(WireError):
        encode(Message("x", {"path": "a\udcff"}))
    with pytest.raises(WireError):
        encode(Message("x", {}, {"t\udcff": torch.zeros(1)}))


def test_encode_rejects_bad_messages():
    for msg in (Message(""), Message("x", {"f": object()}), Message("x", fields=[1]),  # type: ignore[arg-type]
                Message("x", {}, {"c": torch.zeros(2, dtype=torch.complex64)}),
                Message("x", {}, {"s": torch.zeros(2, 2).to_sparse()})):
        with pytest.raises(WireError):
            encode(msg)


# ------------------------------------------------------------------ decode rejects
GOOD_PAYLOAD = b"\0" * 8


@pytest.mark.parametrize("frame", [
    pytest.param(raw_frame({"kind": "x", "fields": {}, "tensors": []}, magic=b"FDL2"), id="bad-magic"),
    pytest.param(b"FDL1\0\0", id="truncated-prefix"),
    pytest.param(raw_frame({"kind": "x", "fields": {}, "tensors": [desc()]}, GOOD_PAYLOAD)[:-1],
                 id="truncated-payload"),
    pytest.param(raw_frame({"kind": "x", "fields": {}, "tensors": []}) + b"!", id="trailing-bytes"),
    pytest.param(raw_frame(b"{not json"), id="header-not-json"),
    pytest.param(raw_frame(b"\xff\xfe{}"), id="header-not-utf8"),
    pytest.param(raw_frame(b"[" * 200_000 + b"]" * 200_000), id="header-deep-nesting"),
    pytest.param(raw_frame(b"", header_len=0), id="header-empty"),
    pytest.param(raw_frame([1, 2]), id="header-not-object"),
    pytest.param(raw_frame({"kind": "x", "fields": {}}), id="missing-key"),
    pytest.param(raw_frame({"kind": "x", "fields": {}, "tensors": [], "more": 1}), id="extra-key"),
    pytest.param(raw_frame({"kind": 3, "fields": {}, "tensors": []}), id="kind-not-str"),
    pytest.param(raw_frame({"kind": "", "fields": {}, "tensors": []}), id="kind-empty"),
    pytest.param(raw_frame({"kind": "x", "fields": [], "tensors": []}), id="fields-not-dict"),
    pytest.param(raw_frame({"kind": "x", "fields": {}, "tensors": {}}), id="tensors-not-list"),
    pytest.param(raw_frame({"kind": "x", "fields": {}, "tensors": ["t"]}), id="desc-not-dict"),
    pytest.param(raw_frame({"kind": "x", "fields": {}, "tensors": [{"name": "t", "dtype": "float32"}]}),
                 id="desc-missing-keys"),
    pytest.param(raw_frame({"kind": "x", "fields": {}, "tensors": [desc(name=1)]}, GOOD_PAYLOAD),
                 id="name-not-str"),
    pytest.param(raw_frame({"kind": "x", "fields": {}, "tensors": [desc(), desc()]}, GOOD_PAYLOAD * 2),
                 id="duplicate-name"),
    pytest.param(raw_frame({"kind": "x", "fields": {}, "tensors": [desc(dtype="complex64", nbytes=16)]},
                           b"\0" * 16), id="unknown-dtype"),
    pytest.param(raw_frame({"kind": "x", "fields": {}, "tensors": [desc(dtype="object")]}, GOOD_PAYLOAD),
                 id="object-dtype"),
    pytest.param(raw_frame({"kind": "x", "fields": {}, "tensors": [desc(shape=(-2,), nbytes=-8)]}),
                 id="negative-shape"),
    pytest.param(raw_frame({"kind": "x", "fields": {}, "tensors": [desc(shape=(2.0,))]}, GOOD_PAYLOAD),
                 id="float-shape"),
    pytest.param(raw_frame({"kind": "x", "fields": {}, "tensors": [desc(shape=(True, 2))]}, GOOD_PAYLOAD),
                 id="bool-shape"),
    pytest.param(raw_frame({"kind": "x", "fields": {}, "tensors": [desc(shape=(0, 2**70), nbytes=0)]}),
                 id="huge-dim"),
    pytest.param(raw_frame({"kind": "x", "fields": {}, "tensors": [desc(nbytes=4)]}, b"\0" * 4),
                 id="nbytes-mismatch"),
    pytest.param(raw_frame({"kind": "x", "fields": {}, "tensors": [desc()]}, GOOD_PAYLOAD * 2),
                 id="payload-longer-than-tensors"),
    pytest.param(raw_frame({"kind": "x", "fields": {}, "tensors": [desc(dtype="bool", shape=(2,), nbytes=2)]},
                           b"\x01\x07"), id="bool-not-0-1"),
    pytest.param(raw_frame(b'{"kind":"x","fields":{"s":"\\ud800"},"tensors":[]}'), id="lone-surrogate"),
    pytest.param(raw_frame(b'{"kind":"x","fields":{"\\udfff":1},"tensors":[]}'), id="lone-surrogate-key"),
])
def test_decode_rejects(frame):
    with pytest.raises(WireError):
        decode(frame, MiB)


def test_a_header_that_spells_a_surrogate_pair_is_text_and_re_encodes():
    frame = raw_frame(b'{"kind":"x","fields":{"s":"\\ud83d\\ude00 \\u00e9"},"tensors":[]}')
    msg = decode(frame, MiB)
    assert msg.fields == {"s": "\U0001f600 \u00e9"} and decode(encode(msg), MiB) == msg


def test_decode_oversize_from_prefix_alone():
    prefix = struct.pack(">4sII", b"FDL1", 100, 2**32 - 1)
    with pytest.raises(FrameTooLarge):
        decode(prefix, 16 * MiB)  # no body at all: the ceiling is checked first
    ok = encode(Message("x", {}, {"t": torch.zeros(1000)}))
    assert decode(ok, len(ok) - 12).kind == "x"
    with pytest.raises(FrameTooLarge):
        decode(ok, len(ok) - 13)


# ------------------------------------------------------------------ no pickle
def test_pickle_payload_is_rejected():
    blob = pickle.dumps({"kind": "x", "tensors": torch.zeros(3)})
    with pytest.raises(WireError):
        decode(blob, MiB)  # a raw pickle stream: bad magic
    with pytest.raises(WireError):
        decode(raw_frame(blob), MiB)  # a pickle where the JSON header should be


def test_wire_never_imports_or_calls_pickle(monkeypatch):
    src = Path(wire.__file__).read_text()
    assert not re.search(r"^\s*(import|from)\s+(pickle|cPickle|dill|marshal|shelve)\b", src, re.M)
    assert "pickle" not in src.replace("No pickle", "").replace("Unpickling", "").replace("no pickle", "")
    assert "torch.load" not in src and "torch.save" not in src

    def boom(*a, **k):
        raise AssertionError("pickle used")
    for name in ("loads", "load", "dumps", "dump"):
        monkeypatch.setattr(pickle, name, boom)
    msg = Message("x", {"a": 1}, {"t": torch.randn(3, dtype=torch.bfloat16)})
    assert torch.equal(decode(encode(msg), MiB).tensors["t"], msg.tensors["t"])


# ------------------------------------------------------------------ Connection
def test_connection_send_recv(pair):
    a, b = pair
    a.send(Message("hello", {"n": 1}, {"w": torch.arange(10.0)}))
    a.send(Message("empty"))
    got = b.recv(timeout=5)
    assert got.kind == "hello" and got.fields == {"n": 1} and torch.equal(got.tensors["w"], torch.arange(10.0))
    assert b.recv(timeout=5) == Message("empty")
    t = threading.Thread(target=b.send, args=(Message("back", {}, {"big": torch.ones(2 * MiB)}),))
    t.start()  # 8 MiB: bigger than the socket buffer, so the reader must run concurrently
    assert torch.equal(a.recv(timeout=5).tensors["big"], torch.ones(2 * MiB))
    t.join(5)


def test_recv_timeout_keeps_stream_usable(pair):
    a, b = pair
    t0 = time.monotonic()
    with pytest.raises(socket.timeout):
        b.recv(timeout=0.1)
    assert time.monotonic() - t0 < 2
    with pytest.raises(TimeoutError):
        b.recv(timeout=0)
    a.send(Message("after"))
    assert b.recv(timeout=5).kind == "after"


def test_stall_mid_frame_breaks_stream():
    s, r = socket.socketpair()
    conn = Connection(r, max_frame_bytes=MiB, stall_timeout=0.2)
    frame = encode(Message("x", {}, {"t": torch.zeros(100)}))
    s.sendall(frame[:30])
    with pytest.raises(WireError) as ei:
        conn.recv(timeout=5)
    assert not isinstance(ei.value, ConnectionClosed)
    s.sendall(frame[30:])
    with pytest.raises(WireError):  # stays unusable: the stream position is lost
        conn.recv(timeout=1)
    s.close()
    conn.close()


def test_eof_raises_connection_closed(pair):
    a, b = pair
    a.close()
    with pytest.raises(ConnectionClosed):
        b.recv(timeout=5)
    with pytest.raises(ConnectionClosed):
        a.send(Message("x"))


def test_eof_mid_frame():
    s, r = socket.socketpair()
    conn = Connection(r, max_frame_bytes=MiB)
    s.sendall(encode(Message("x", {}, {"t": torch.zeros(100)}))[:50])
    s.close()
    with pytest.raises(ConnectionClosed):
        conn.recv(timeout=5)
    conn.close()


def test_close_wakes_blocked_recv(pair):
    a, b = pair
    errors: list[BaseException] = []

    def reader():
        try:
            b.recv(timeout=10)
        except BaseException as e:
            errors.append(e)
    t = threading.Thread(target=reader)
    t.start()
    time.sleep(0.1)
    b.close()
    t.join(5)
    assert not t.is_alive() and len(errors) == 1 and isinstance(errors[0], ConnectionClosed)


def test_oversize_rejected_from_prefix_without_allocation():
    s, r = socket.socketpair()
    conn = Connection(r, max_frame_bytes=MiB)
    s.sendall(struct.pack(">4sII", b"FDL1", 2**32 - 1, 2**32 - 1))  # claims 8 GiB, sends nothing more
    tracemalloc.start()
    try:
        with pytest.raises(FrameTooLarge):
            conn.recv(timeout=5)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MiB
    s.close()
    conn.close()


def test_max_frame_bytes_is_settable(pair):
    a, b = pair
    b.max_frame_bytes = 1000
    msg = Message("p", {}, {"t": torch.zeros(1000)})
    a.send(msg)
    with pytest.raises(FrameTooLarge):
        b.recv(timeout=5)
    s, r = socket.socketpair()
    c2 = Connection(r)
    assert c2.max_frame_bytes == HANDSHAKE_MAX_FRAME
    c2.max_frame_bytes = frame_ceiling(4000)
    Connection(s).send(msg)
    assert torch.equal(c2.recv(timeout=5).tensors["t"], torch.zeros(1000))
    s.close()
    c2.close()


def test_concurrent_sends_do_not_interleave(pair):
    a, b = pair
    n_per, size = 40, 100_000  # 400 kB frames: sendall is split into many writes
    received: list[Message] = []

    def reader():
        for _ in range(2 * n_per):
            received.append(b.recv(timeout=10))

    def writer(wid: int):
        for i in range(n_per):
            a.send(Message("chunk", {"w": wid, "i": i}, {"t": torch.full((size,), float(wid * 1000 + i))}))
    threads = [threading.Thread(target=reader)] + [threading.Thread(target=writer, args=(w,)) for w in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert not any(t.is_alive() for t in threads)
    assert len(received) == 2 * n_per
    for m in received:
        got = m.tensors["t"]
        assert got.shape == (size,) and bool((got == m.fields["w"] * 1000 + m.fields["i"]).all())
    for wid in (1, 2):  # per-writer order is preserved
        assert [m.fields["i"] for m in received if m.fields["w"] == wid] == list(range(n_per))


# ------------------------------------------------------------------ handshake (TCP)
class Server:
    """Accepts one connection on 127.0.0.1 and runs ``fn(conn)`` in a thread."""

    def __init__(self, fn):
        self.listener = listen("127.0.0.1", 0)
        self.port = self.listener.getsockname()[1]
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,))
        self.thread.start()

    def _run(self, fn):
        try:
            conn = accept(self.listener, timeout=10)
            try:
                self.result = fn(conn)
            finally:
                conn.close()
        except BaseException as e:
            self.error = e
        finally:
            self.listener.close()

    def join(self):
        self.thread.join(10)
        assert not self.thread.is_alive()
        return self


def test_listen_and_dial():
    srv = Server(lambda conn: (conn.recv(timeout=5).fields, conn.sock.getsockopt(
        socket.IPPROTO_TCP, socket.TCP_NODELAY)))
    assert srv.port > 0
    assert srv.listener.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
    with dial("127.0.0.1", srv.port, timeout=5) as c:
        assert c.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        assert c.peer == f"127.0.0.1:{srv.port}"
        c.send(Message("ping", {"x": 1}))
        srv.join()
    assert srv.error is None and srv.result[0] == {"x": 1} and srv.result[1]


def test_handshake_right_token():
    def serve(conn):
        hello = server_handshake(conn, TOKEN, timeout=5)
        server_accept(conn, {"config": {"lr": 0.1}, "world": 2})
        conn.max_frame_bytes = frame_ceiling(4 * MiB)
        return hello, conn.recv(timeout=5)
    srv = Server(serve)
    with dial("127.0.0.1", srv.port, timeout=5) as c:
        welcome = client_handshake(c, TOKEN, {"rank": 1, "host": "n1", "tags": [1, 2]}, timeout=5)
        assert welcome == {"config": {"lr": 0.1}, "world": 2}
        c.send(Message("params", {}, {"w": torch.ones(MiB)}))  # 4 MiB: beyond the handshake ceiling
        srv.join()
    assert srv.error is None
    hello, params = srv.result
    assert hello == {"rank": 1, "host": "n1", "tags": [1, 2]}
    assert torch.equal(params.tensors["w"], torch.ones(MiB))


def test_handshake_token_may_be_str():
    tok = new_token()
    def serve(conn: Connection) -> dict[str, Any]:
        hello = server_handshake(conn, tok, 5)
        server_accept(conn)
        return hello

    srv = Server(serve)
    with dial("127.0.0.1", srv.port, timeout=5) as c:
        assert client_handshake(c, tok, {"rank": 0}, timeout=5) == {}
        srv.join()
    assert srv.error is None and srv.result == {"rank": 0}


def test_handshake_wrong_token():
    srv = Server(lambda conn: server_handshake(conn, TOKEN, timeout=5))
    with dial("127.0.0.1", srv.port, timeout=5) as c:
        with pytest.raises(AuthError, match="rejected"):
            client_handshake(c, b"wrong", {"rank": 0}, timeout=5)
        srv.join()
    assert isinstance(srv.error, AuthError)


def test_client_rejects_impostor_server():
    def impostor(conn):
        server_handshake(conn, TOKEN, timeout=5)  # passes: the client has the real token ...
        conn._auth = (b"not the token", *conn._auth[1:])  # ... but the server cannot prove it has it
        server_accept(conn, {"evil": True})
    srv = Server(impostor)
    with dial("127.0.0.1", srv.port, timeout=5) as c:
        with pytest.raises(AuthError, match="welcome"):
            client_handshake(c, TOKEN, {"rank": 0}, timeout=5)
        srv.join()


def test_replayed_hello_is_rejected():
    captured: list[Message] = []

    def serve(conn):
        fields = server_handshake(conn, TOKEN, timeout=5)
        server_accept(conn)
        return fields
    srv = Server(serve)
    with dial("127.0.0.1", srv.port, timeout=5) as c, pytest.MonkeyPatch.context() as mp:
        orig = c.send

        def kept(m: Message) -> None:
            captured.append(m)
            orig(m)

        mp.setattr(c, "send", kept)
        client_handshake(c, TOKEN, {"rank": 0}, timeout=5)
        srv.join()
    srv2 = Server(lambda conn: server_handshake(conn, TOKEN, timeout=5))
    with dial("127.0.0.1", srv2.port, timeout=5) as c:
        c.recv(timeout=5)  # fresh challenge, different nonce
        c.send(captured[0])
        assert c.recv(timeout=5).kind == "reject"
        srv2.join()
    assert isinstance(srv2.error, AuthError)


@pytest.mark.parametrize("garbage", [
    pytest.param(os.urandom(4096), id="random-bytes"),
    pytest.param(struct.pack(">4sII", b"FDL1", 16, 2**31), id="oversized-first-frame"),
    pytest.param(raw_frame({"kind": "x", "fields": {}, "tensors": []}, header_len=HANDSHAKE_MAX_FRAME + 1),
                 id="just-over-handshake-ceiling"),
])
def test_server_handshake_rejects_garbage_without_allocating(garbage):
    def serve(conn):
        conn.max_frame_bytes = frame_ceiling(10**9)  # even a raised ceiling is ignored while unauthenticated
        tracemalloc.start()
        try:
            with pytest.raises(WireError):
                server_handshake(conn, TOKEN, timeout=5)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    srv = Server(serve)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        s.sendall(garbage)
        srv.join()
    assert srv.error is None and srv.result < MiB


def test_server_handshake_wrong_message_and_silence():
    srv = Server(lambda conn: server_handshake(conn, TOKEN, timeout=5))
    with dial("127.0.0.1", srv.port, timeout=5) as c:
        c.recv(timeout=5)
        c.send(Message("params", {"mac": "00" * 32}))
        srv.join()
    assert isinstance(srv.error, AuthError)

    srv = Server(lambda conn: server_handshake(conn, TOKEN, timeout=0.3))
    t0 = time.monotonic()
    with dial("127.0.0.1", srv.port, timeout=5):
        srv.join()
    assert isinstance(srv.error, AuthError) and time.monotonic() - t0 < 5


def test_server_handshake_slow_peer_bounded_by_timeout():
    """A peer that starts a frame and then trickles is cut off at the handshake timeout,
    not at the (much longer) stall timeout."""
    srv = Server(lambda conn: server_handshake(conn, TOKEN, timeout=0.5))
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        s.sendall(raw_frame({"kind": "hello", "fields": {}, "tensors": []})[:20])
        srv.join()
    assert isinstance(srv.error, WireError) and time.monotonic() - t0 < 3


@pytest.mark.parametrize("mac", ["zz" * 32, "é" * 64, 42, None, "00"])
def test_server_handshake_malformed_mac(mac):
    srv = Server(lambda conn: server_handshake(conn, TOKEN, timeout=5))
    with dial("127.0.0.1", srv.port, timeout=5) as c:
        c.recv(timeout=5)
        c.send(Message("hello", {"mac": mac, "nonce": "00" * 32}))
        srv.join()
    assert isinstance(srv.error, AuthError)


def test_client_handshake_server_closes_or_rejects():
    srv = Server(lambda conn: None)  # accepts, then closes without a challenge
    with dial("127.0.0.1", srv.port, timeout=5) as c:
        with pytest.raises(AuthError):
            client_handshake(c, TOKEN, {"rank": 0}, timeout=5)
        srv.join()

    def serve(conn):
        server_handshake(conn, TOKEN, timeout=5)
        server_reject(conn, "rank 0 already connected")
    srv = Server(serve)
    with dial("127.0.0.1", srv.port, timeout=5) as c:
        with pytest.raises(AuthError, match="already connected"):
            client_handshake(c, TOKEN, {"rank": 0}, timeout=5)
        srv.join()
    assert srv.error is None


def test_handshake_misuse():
    s, r = socket.socketpair()
    with Connection(s) as a, Connection(r):
        with pytest.raises(ValueError):
            client_handshake(a, TOKEN, {"mac": "x"}, timeout=1)
        with pytest.raises(WireError):
            server_accept(a, {})


# ------------------------------------------------------------------ helpers
def test_frame_ceiling():
    assert frame_ceiling(0) == 16 * MiB
    assert frame_ceiling(MiB) == 16 * MiB
    assert frame_ceiling(100 * MiB) == 400 * MiB
    assert frame_ceiling(100 * MiB, headroom=2.5) == 250 * MiB
    assert frame_ceiling(10, headroom=1.0, floor=0) == 10
    assert frame_ceiling(3, headroom=1.5, floor=0) == 5  # rounds up
    for bad in ((-1,), (10, 0.5), (10, 2.0, -1)):
        with pytest.raises(ValueError):
            frame_ceiling(*bad)


def test_new_token():
    toks = {new_token() for _ in range(8)}
    assert len(toks) == 8 and all(len(t) == 64 and bytes.fromhex(t) for t in toks)


# ------------------------------------------------------------------ session MACs (issue 14)
class Mitm:
    """client <-> relay <-> server over two socketpairs: the relay records client->server bytes,
    can hold them back instead of forwarding, and can inject bytes towards the server."""

    def __init__(self):
        c, self.ca = socket.socketpair()
        self.sb, s = socket.socketpair()
        self.client = Connection(c, max_frame_bytes=64 * MiB)
        self.server = Connection(s, max_frame_bytes=64 * MiB)
        self.log = bytearray()
        self.s2c_log = bytearray()
        self.held = bytearray()
        self.hold = False
        self.cond = threading.Condition()
        for src, fn in ((self.ca, self._c2s), (self.sb, self._s2c)):
            threading.Thread(target=fn, args=(src,), daemon=True).start()

    def _c2s(self, src):
        while data := _recv_or_eof(src):
            with self.cond:
                if self.hold:
                    self.held += data
                else:
                    self.log += data
                    self.sb.sendall(data)
                self.cond.notify_all()

    def _s2c(self, src):
        while data := _recv_or_eof(src):
            with self.cond:
                self.s2c_log += data
            self.ca.sendall(data)

    def inject(self, data: bytes) -> None:
        with self.cond:
            self.sb.sendall(data)

    def wait_held(self, n: int, timeout: float = 10) -> bytes:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.held) >= n, timeout), f"held {len(self.held)} of {n}"
            out = bytes(self.held)
            self.held.clear()
            return out

    def handshake(self):
        out: dict[str, Any] = {}

        def serve() -> None:
            out["hello"] = server_handshake(self.server, TOKEN, timeout=5)
            server_accept(self.server, {"w": 2})

        t = threading.Thread(target=serve)
        t.start()
        assert client_handshake(self.client, TOKEN, {"rank": 0}, timeout=5) == {"w": 2}
        t.join(5)
        assert out["hello"] == {"rank": 0}
        with self.cond:
            self.log.clear()
            self.s2c_log.clear()
        return self

    def close(self):
        for conn in (self.client, self.server):
            conn.close()
        for s in (self.ca, self.sb):
            s.close()


def _recv_or_eof(s: socket.socket) -> bytes:
    try:
        return s.recv(1 << 20)
    except OSError:
        return b""


@pytest.fixture
def mitm():
    m = Mitm().handshake()
    yield m
    m.close()


def _framed_len(msg: Message) -> int:
    return len(encode(msg)) + wire.MAC_BYTES


def test_session_frames_are_maced_and_flow_both_ways(mitm):
    assert mitm.client.authenticated and mitm.server.authenticated
    big = torch.randn(4 * MiB)  # 16 MiB: a model-sized update, bigger than any socket buffer
    t = threading.Thread(target=mitm.server.send, args=(Message("update", {"v": 3}, {"w": big}),))
    t.start()
    got = mitm.client.recv(timeout=10)
    t.join(10)
    assert got.kind == "update" and got.fields == {"v": 3} and torch.equal(got.tensors["w"], big)
    for i in range(3):
        mitm.client.send(Message("batch", {"i": i}, {"g": torch.arange(5.0)}))
        back = mitm.server.recv(timeout=5)
        assert back.fields == {"i": i} and torch.equal(back.tensors["g"], torch.arange(5.0))
    frame = bytes(mitm.log[:_framed_len(Message("batch", {"i": 0}, {"g": torch.arange(5.0)}))])
    assert frame[:4] == wire.MAGIC_AUTH  # on the wire: authenticated magic and a 32-byte trailer
    assert frame[:-32] == wire.MAGIC_AUTH + encode(Message("batch", {"i": 0}, {"g": torch.arange(5.0)}))[4:]


def _expect_frame_auth_error(conn: Connection) -> None:
    with pytest.raises(wire.FrameAuthError):
        conn.recv(timeout=5)
    with pytest.raises(WireError):  # the connection is unusable from then on
        conn.recv(timeout=0)


def test_injected_unmaced_frame_closes_the_connection(mitm):
    mitm.inject(encode(Message("save", {"path": "/tmp/x"})))
    _expect_frame_auth_error(mitm.server)


def test_forged_frame_with_a_made_up_mac_is_rejected(mitm):
    mitm.inject(wire.MAGIC_AUTH + encode(Message("save", {"path": "/tmp/x"}))[4:] + os.urandom(32))
    _expect_frame_auth_error(mitm.server)


def test_tampered_frame_is_rejected(mitm):
    mitm.hold = True
    msg = Message("update", {"v": 1}, {"w": torch.zeros(1000)})
    mitm.client.send(msg)
    frame = bytearray(mitm.wait_held(_framed_len(msg)))
    frame[-40] ^= 0x01  # one bit of the tensor bytes
    mitm.inject(bytes(frame))
    _expect_frame_auth_error(mitm.server)


def test_replayed_frame_is_rejected(mitm):
    msg = Message("save", {"path": "/tmp/x"})
    mitm.client.send(msg)
    assert mitm.server.recv(timeout=5) == msg
    with mitm.cond:
        captured = bytes(mitm.log)
    assert len(captured) == _framed_len(msg)
    mitm.inject(captured)  # a byte-exact copy of a frame the server already accepted
    _expect_frame_auth_error(mitm.server)


def test_reordered_frames_are_rejected(mitm):
    mitm.hold = True
    first, second = Message("a", {"n": 1}), Message("b", {"n": 2})
    mitm.client.send(first)
    f1 = mitm.wait_held(_framed_len(first))
    mitm.client.send(second)
    f2 = mitm.wait_held(_framed_len(second))
    mitm.inject(f2 + f1)
    _expect_frame_auth_error(mitm.server)


def test_a_frame_cannot_be_reflected_to_its_sender(mitm):
    # the server's own frame sent back to it: the directions have different keys
    mitm.server.send(Message("beacon"))
    assert mitm.client.recv(timeout=5).kind == "beacon"
    with mitm.cond:
        reflected = bytes(mitm.s2c_log)
    assert len(reflected) == _framed_len(Message("beacon"))
    mitm.inject(reflected)
    _expect_frame_auth_error(mitm.server)


def test_header_is_capped_from_the_prefix_without_allocation():
    s, r = socket.socketpair()
    conn = Connection(r, max_frame_bytes=64 * MiB, stall_timeout=2)  # the frame ceiling alone would allow it
    # A header 16 times the cap: were it allocated, the peak would be 16 MiB, far from the 4 MiB asserted (the
    # cap itself is 1 MiB; tracemalloc counts other threads' allocations too, so a bound at the cap was flaky).
    s.sendall(struct.pack(">4sII", b"FDL1", 16 * wire.MAX_HEADER_BYTES, 0))  # sends no header
    tracemalloc.start()
    try:
        with pytest.raises(FrameTooLarge, match="header"):
            conn.recv(timeout=5)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * MiB
    with pytest.raises(FrameTooLarge):
        encode(Message("x", {"s": "a" * wire.MAX_HEADER_BYTES}))
    s.close()
    conn.close()


def test_send_stall_deadline_breaks_the_connection():
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    conn = Connection(a, send_stall_timeout=0.2)
    t0 = time.monotonic()
    with pytest.raises(wire.SendStalled):
        conn.send(Message("update", {}, {"w": torch.zeros(4 * MiB)}))  # b never reads
    assert time.monotonic() - t0 < 10
    with pytest.raises(WireError):
        conn.send(Message("more"))
    conn.close()
    b.close()


# ------------------------------------------------------------------ issue 26: allocation before the MAC, frames before a bad one
def _session_pair(ceiling: int = 64 * MiB, stall: float | None = 0.3) -> tuple[Connection, Connection]:
    a, b = socket.socketpair()
    client = Connection(a, max_frame_bytes=ceiling)
    server = Connection(b, max_frame_bytes=ceiling, stall_timeout=stall)
    for c, is_server in ((client, False), (server, True)):
        c._start_session(TOKEN, b"s" * 32, b"c" * 32, server=is_server)
    return client, server


@pytest.mark.parametrize("authenticated", [True, False], ids=["session", "handshake"])
def test_recv_allocates_as_bytes_arrive_not_as_the_prefix_claims(authenticated):
    """A forged prefix and header claiming a payload near the ceiling, then silence: recv holds what arrived
    plus one growth step (wire.RECV_STEP), not the claim, until the stall timeout drops it."""
    claim = 48 * MiB
    if authenticated:
        client, conn = _session_pair()
        header = json.dumps({"kind": "update", "fields": {}, "tensors": []}).encode()
        magic = wire.MAGIC_AUTH
    else:
        a, b = socket.socketpair()
        client, conn = Connection(a), Connection(b, max_frame_bytes=64 * MiB, stall_timeout=0.3)
        header = json.dumps({"kind": "x", "fields": {}, "tensors": [desc(shape=(claim // 4,), nbytes=claim)]}).encode()
        magic = wire.MAGIC
    sent = struct.pack(">4sII", magic, len(header), claim) + header + b"\0" * 1000
    client.sock.sendall(sent)
    tracemalloc.start()
    try:
        with pytest.raises(WireError, match="stalled"):
            conn.recv(timeout=5)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < wire.recv_allocation_bound(len(sent)) + 256 * 1024 < 2 * MiB, peak
    client.close()
    conn.close()


def test_recv_still_takes_frames_larger_than_one_growth_step():
    client, server = _session_pair(stall=5)
    big = torch.randn(3 * wire.RECV_STEP // 4 + 12345)  # ~3 steps and a bit: the buffer grows several times
    t = threading.Thread(target=client.send, args=(Message("update", {"v": 1}, {"w": big, "e": torch.zeros(0)}),))
    t.start()
    got = server.recv(timeout=10)
    t.join(10)
    assert got.fields == {"v": 1} and torch.equal(got.tensors["w"], big) and got.tensors["e"].numel() == 0
    client.send(Message("after"))
    assert server.recv(timeout=5).kind == "after"  # the sequence numbers still agree
    client.close()
    server.close()


def test_read_ready_delivers_the_frames_before_a_bad_one_then_raises():
    """A rank's genuine report followed, in the same read, by a bad frame: the report is delivered (its
    sequence number was spent on it), and the error is raised by the next call."""
    client, server = _session_pair()
    report = Message("error", {"error": "CUDA out of memory"})
    wire_bytes = bytearray()
    with pytest.MonkeyPatch.context() as mp:  # capture the MACed frames, send them below
        mp.setattr(client, "_sendall", wire_bytes.extend)
        client.send(report)
        client.send(Message("batch", {"ms": 1.0}))
    forged = wire.MAGIC_AUTH + encode(Message("save", {"path": "/tmp/x"}))[4:] + os.urandom(32)
    client.sock.sendall(bytes(wire_bytes) + forged)
    scratch = memoryview(bytearray(64 * 1024))
    got = server.read_ready(scratch)
    assert [m.kind for m in got] == ["error", "batch"] and got[0].fields == report.fields
    assert isinstance(server.read_error, wire.FrameAuthError)
    assert server.buffered == 0  # the rest of the stream is dropped with the connection
    for _ in range(2):  # and stays the cause, however often it is asked
        with pytest.raises(wire.FrameAuthError):
            server.read_ready(scratch)
    with pytest.raises(WireError):
        server.send(Message("x"))
    client.close()
    server.close()


def test_read_ready_frees_its_partial_frame_on_a_failure_and_on_close():
    client, server = _session_pair()
    frame = bytearray()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(client, "_sendall", frame.extend)
        client.send(Message("snapshot", {"n": 1}, {"p0": torch.zeros(50_000)}))
    client.sock.sendall(bytes(frame[:100_000]))  # half a snapshot
    scratch = memoryview(bytearray(256 * 1024))
    deadline = time.monotonic() + 5
    while server.buffered < 100_000 and time.monotonic() < deadline:
        assert server.read_ready(scratch) == []
    assert server.buffered == 100_000
    client.close()  # EOF mid-frame
    with pytest.raises(ConnectionClosed, match="mid-frame"):
        server.read_ready(scratch)
    assert server.buffered == 0
    _, other = _session_pair()
    other._rbuf += b"\0" * 1000  # part of a frame held when the owner closes it
    other.close()
    assert other.buffered == 0
    server.close()


def test_accept_closes_the_socket_when_tuning_it_fails(monkeypatch):
    listener = listen("127.0.0.1", 0)
    taken: list[socket.socket] = []

    def broken_tune(sock: socket.socket) -> socket.socket:
        taken.append(sock)
        raise OSError(22, "Invalid argument")
    monkeypatch.setattr(wire, "_tune", broken_tune)
    with socket.create_connection(listener.getsockname(), timeout=5):
        with pytest.raises(OSError):
            accept(listener, timeout=5)
    assert len(taken) == 1 and taken[0].fileno() == -1  # closed, not leaked
    listener.close()
