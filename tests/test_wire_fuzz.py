"""Property-based fuzzing of the wire and the protocol (issue 26).

Whatever bytes or values arrive, the only failures are :class:`~flodl_exp.protocol.wire.WireError` (and its
subclass :class:`~flodl_exp.protocol.messages.ProtocolError`), nothing hangs, a frame costs no more memory before
its MAC than :func:`~flodl_exp.protocol.wire.recv_allocation_bound` allows, and whatever decodes re-encodes to
itself. Seeded (``derandomize``) and bounded, so it runs in ``make test-fast`` and fails the same way twice.
"""
from __future__ import annotations

import dataclasses
import json
import math
import random
import select
import socket
import struct
import threading
import tracemalloc
import typing
from datetime import timedelta

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flodl_exp.protocol import codec, wire
from flodl_exp.protocol import messages as protocol
from flodl_exp.protocol.messages import PAYLOADS, Len, Num, ProtocolError
from flodl_exp.protocol.wire import Connection, Message, WireError

MiB = 2**20
CEILING = 4 * MiB
TOKEN = b"k" * 32
pytestmark = [pytest.mark.timeout(120), pytest.mark.fuzz]  # make test runs it; make test-fast does not (its 2-minute budget)


def fuzz(n: int) -> settings:
    """``n`` examples, seeded, no example database written into the checkout."""
    return settings(max_examples=n, derandomize=True, database=None, deadline=timedelta(seconds=5),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


# ---------------------------------------------------------------- strategies
HUGE_INTS = st.sampled_from([2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, 10**308, 10**309, 10**400, -(10**400)])
SPECIAL_FLOATS = st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324])
CHARS = st.sampled_from("az09 _-.\"\\/\n\t\x00\x1f\x7fé✓\u2028\ufeff\uffff😀")
"""The characters that matter to JSON and UTF-8 (quotes, escapes, controls, multi-byte, beyond the BMP):
drawing from all of Unicode costs most of the run and finds nothing these do not."""
texts = st.text(CHARS, max_size=12)
keys = st.one_of(st.sampled_from(["a", "ms", "loss", "rank", "n", ""]), st.text(CHARS, max_size=6))
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), HUGE_INTS, st.floats(), SPECIAL_FLOATS,
                         texts)
json_values = st.recursive(json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                 st.dictionaries(keys, inner, max_size=3)),
                           max_leaves=8)
json_fields = st.dictionaries(keys, json_values, max_size=4)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """A small tensor of any wire dtype; its bytes come from a drawn seed (drawing them byte by byte costs
    more than the rest of a message), so NaN payloads, subnormals and odd bools all occur."""
    dtype = draw(st.sampled_from(list(wire.dtypes().values())))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    n = math.prod(shape)
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    raw = random.Random(draw(st.integers(0, 2**32))).randbytes(n * dtype.itemsize)
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()
    if dtype is torch.bool:
        t = t % 2
    return t.view(dtype).reshape(shape)


messages = st.builds(Message, kind=st.text(CHARS, min_size=1, max_size=12), fields=json_fields,
                     tensors=st.dictionaries(keys, tensors(), max_size=2))


def _frame_or_none(msg: Message) -> bytes | None:
    try:
        return wire.encode(msg)
    except WireError:
        return None


valid_frames = messages.map(_frame_or_none).filter(lambda f: f is not None)


EDIT_OPS = ("flip", "set", "insert", "delete", "truncate", "lengths")
edits = st.lists(st.tuples(st.sampled_from(EDIT_OPS), st.integers(0, 2**16), st.integers(0, 2**32 - 1),
                           st.integers(0, 2**32 - 1), st.binary(min_size=1, max_size=8)), min_size=1, max_size=4)
"""Byte-level edits of a frame: (op, where, two numbers, bytes); drawn apart from the frame, applied by ``_edit``."""


def _edit(frame: bytes, ops: list[tuple[str, int, int, int, bytes]]) -> bytes:
    """``frame`` after flips, overwrites, inserts, deletes, a truncation, a rewritten length field."""
    b = bytearray(frame)
    for op, where, x, y, blob in ops:
        at = where % len(b) if b else 0
        if op == "flip" and b:
            b[at] ^= 1 << (x % 8)
        elif op == "set" and b:
            b[at] = x % 256
        elif op == "insert":
            b[at:at] = blob
        elif op == "delete":
            del b[at:at + 1 + x % 8]
        elif op == "truncate":
            del b[at:]
        elif op == "lengths" and len(b) >= 12:
            b[4:12] = struct.pack(">II", x, y)
    return bytes(b)


mutated_frames = st.builds(_edit, valid_frames, edits)


ESCAPES = ["\\ud800", "\\uDFFF", "\\ud83d\\ude00", "\\ud83d", "\\u0000", "\\u00e9", "\\\"", "\\\\", "a", "\\n"]


def _escaped_frame(parts: list[str]) -> bytes:
    """A frame whose header spells a string with JSON escapes: lone and paired surrogates among them."""
    header = ('{"kind":"k","fields":{"s":"' + "".join(parts) + '"},"tensors":[]}').encode()
    return struct.pack(">4sII", wire.MAGIC, len(header), 0) + header


any_bytes = st.one_of(st.binary(max_size=512),
                      st.builds(lambda rest: wire.MAGIC + rest, st.binary(max_size=512)),  # past the magic at least
                      mutated_frames,
                      st.lists(st.sampled_from(ESCAPES), max_size=4).map(_escaped_frame))


def _same_message(a: Message, b: Message) -> bool:
    return wire.encode(a) == wire.encode(b)  # byte equality: NaN fields and tensor bits included


def _check_re_encodes(msg: Message) -> None:
    """A decoded message encodes (no WireError), and that encoding decodes back to the same bytes."""
    again = wire.encode(msg)
    back = wire.decode(again, CEILING)
    assert back.kind == msg.kind and list(back.tensors) == list(msg.tensors)
    assert wire.encode(back) == again


# ---------------------------------------------------------------- (a) wire.decode
@fuzz(250)
@given(any_bytes)
def test_decode_of_any_bytes_is_a_message_that_re_encodes_or_a_wire_error(frame):
    try:
        msg = wire.decode(frame, CEILING)
    except WireError:
        return
    _check_re_encodes(msg)


@fuzz(150)
@given(valid_frames)
def test_a_valid_frame_decodes_and_re_encodes_byte_for_byte(frame):
    assert wire.encode(wire.decode(frame, CEILING)) == frame


# ---------------------------------------------------------------- (b) Connection.recv / read_ready
def _feed(sock: socket.socket, data: bytes) -> threading.Thread:
    """Write ``data`` then EOF from a thread (a frame may be larger than the socket's buffers)."""
    def run() -> None:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the reader gave up and closed first
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _session(stall: float = 2.0) -> tuple[Connection, Connection]:
    a, b = socket.socketpair()
    client, server = Connection(a, max_frame_bytes=CEILING), Connection(b, max_frame_bytes=CEILING, stall_timeout=stall)
    for c, is_server in ((client, False), (server, True)):
        c._start_session(TOKEN, b"s" * 32, b"c" * 32, server=is_server)
    return client, server


def _drain_recv(conn: Connection, limit: int = 1000) -> tuple[list[Message], WireError]:
    got: list[Message] = []
    for _ in range(limit):
        try:
            got.append(conn.recv(timeout=5))
        except WireError as e:
            return got, e
    raise AssertionError("the stream never ended")


def _drain_read_ready(conn: Connection, limit: int = 10_000) -> tuple[list[Message], WireError]:
    got: list[Message] = []
    scratch = memoryview(bytearray(4096))
    for _ in range(limit):
        assert select.select([conn.sock], [], [], 5)[0], "read_ready: nothing to read and no EOF (a hang)"
        try:
            got += conn.read_ready(scratch)
        except WireError as e:
            assert conn.buffered == 0 and conn.read_error is e
            return got, e
    raise AssertionError("the stream never ended")


@fuzz(120)
@given(st.lists(any_bytes, min_size=1, max_size=3), st.booleans())
def test_an_unauthenticated_stream_of_anything_ends_in_a_wire_error(chunks, blocking):
    a, b = socket.socketpair()
    conn = Connection(b, max_frame_bytes=CEILING, stall_timeout=2)
    writer = _feed(a, b"".join(chunks))
    try:
        got, err = _drain_recv(conn) if blocking else _drain_read_ready(conn)
        assert isinstance(err, WireError)
        for m in got:
            _check_re_encodes(m)
    finally:
        conn.close()
        writer.join(5)
        a.close()


@st.composite
def session_streams(draw: st.DrawFn) -> tuple[list[Message], bytes, bytes]:
    """Messages a client MACs and sends, the exact bytes that went out, and those bytes after a few edits."""
    msgs = draw(st.lists(messages, min_size=1, max_size=4))
    msgs = [m for m in msgs if _frame_or_none(m) is not None]
    client, server = _session()
    out = bytearray()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(client, "_sendall", out.extend)
        for m in msgs:
            client.send(m)
    client.close()
    server.close()
    sent = bytes(out)
    return msgs, sent, _edit(sent, draw(edits)) if draw(st.booleans()) else sent


@fuzz(120)
@given(session_streams(), st.booleans())
def test_a_tampered_session_delivers_exactly_the_untouched_frames_then_a_wire_error(stream, blocking):
    msgs, sent, received = stream
    a, b = socket.socketpair()
    conn = Connection(b, max_frame_bytes=CEILING, stall_timeout=2)
    conn._start_session(TOKEN, b"s" * 32, b"c" * 32, server=True)
    writer = _feed(a, received)
    try:
        got, err = _drain_recv(conn) if blocking else _drain_read_ready(conn)
    finally:
        conn.close()
        writer.join(5)
        a.close()
    assert isinstance(err, WireError)
    # the MAC and the sequence let through only frames that arrived exactly as sent, in order
    intact = next((i for i, (x, y) in enumerate(zip(sent, received)) if x != y), min(len(sent), len(received)))
    ends = [sum(len(wire.encode(m)) + wire.MAC_BYTES for m in msgs[:i + 1]) for i in range(len(msgs))]
    whole = sum(1 for end in ends if end <= intact)
    # exactly the frames wholly before the first changed byte arrive, by either read path (read_ready
    # included: the frames before a bad one in the same read are not lost with it)
    assert len(got) == whole and all(_same_message(g, m) for g, m in zip(got, msgs))
    if received == sent:
        assert isinstance(err, wire.ConnectionClosed)


BIG = 64 * MiB
claims = st.one_of(st.integers(0, BIG), st.sampled_from([BIG, BIG // 2, wire.RECV_STEP, wire.RECV_STEP + 1, 3 * MiB]))
arrivals = st.one_of(st.integers(0, 3 * MiB), st.sampled_from([0, wire.RECV_STEP - 1, wire.RECV_STEP + 7, 3 * MiB]))


@fuzz(50)
@given(claims, st.integers(2, wire.MAX_HEADER_BYTES), arrivals, st.booleans())
def test_recv_before_the_mac_holds_no_more_than_what_arrived_plus_one_step(claim, header_len, arrive, session):
    """A prefix claiming any payload within a 64 MiB ceiling (a session frame: any header length too; before
    the handshake: a header describing that payload), then ``arrive`` zero bytes, then EOF: recv's peak
    allocation stays within wire.recv_allocation_bound of what arrived, whatever was claimed."""
    a, b = socket.socketpair()
    conn = Connection(b, max_frame_bytes=BIG + wire.MAX_HEADER_BYTES, stall_timeout=2)
    if session:
        conn._start_session(TOKEN, b"s" * 32, b"c" * 32, server=True)
        head = struct.pack(">4sII", wire.MAGIC_AUTH, header_len, claim)
    else:
        header = json.dumps({"kind": "x", "fields": {}, "tensors": [
            {"name": "t", "dtype": "uint8", "shape": [claim], "nbytes": claim}]}).encode()
        head = struct.pack(">4sII", wire.MAGIC, len(header), claim) + header
    data = head + b"\0" * arrive
    writer = _feed(a, data)
    tracemalloc.start()
    try:
        try:
            conn.recv(timeout=5)  # before the handshake, all the claim arrived: a complete frame
            assert not session and arrive >= claim
        except WireError:
            pass
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        conn.close()
        writer.join(5)
        a.close()
    assert peak <= wire.recv_allocation_bound(len(data)) + 64 * 1024, (peak, len(data), claim)


# ---------------------------------------------------------------- (c) codec.decode of anything
def _rule_of(hint: typing.Any) -> tuple[typing.Any, Num | None, int | None]:
    """(the bare type, its Num rule, its Len) of an annotation."""
    if typing.get_origin(hint) is typing.Annotated:
        base, *meta = typing.get_args(hint)
        num = next((m for m in meta if isinstance(m, Num)), None)
        length = next((m.n for m in meta if isinstance(m, Len)), None)
        return base, num, length
    return hint, None, None


def valid_values(hint: typing.Any) -> st.SearchStrategy[typing.Any]:
    """Values that fit ``hint`` and its rules (protocol's module docstring)."""
    hint, num, length = _rule_of(hint)
    origin = typing.get_origin(hint)
    if origin is typing.Union:
        inner = next(a for a in typing.get_args(hint) if a is not type(None))
        return st.none() | valid_values(inner)
    if origin is list:
        elem = valid_values(typing.get_args(hint)[0])
        return st.lists(elem, min_size=length or 0, max_size=length if length is not None else 4)
    if origin is dict:
        return st.dictionaries(keys, valid_values(typing.get_args(hint)[1]), max_size=3)
    rule = num or Num()
    if hint is int:
        return st.one_of(st.integers(max(rule.lo, -(2**40)), min(rule.hi, 2**40)), st.sampled_from([rule.lo, rule.hi]))
    if hint is float:
        return st.floats(allow_nan=not rule.finite, allow_infinity=not rule.finite)
    if hint is str:
        return texts
    if hint is bool:
        return st.booleans()
    raise AssertionError(f"no strategy for {hint!r}")


def _payload_strategy(cls: type) -> st.SearchStrategy[typing.Any]:
    """Valid payloads of ``cls``: every required field, each optional one or not. Built once per class.
    :class:`~flodl_exp.protocol.messages.Batches` holds one invariant the hints do not say: its columns are one length."""
    hints = typing.get_type_hints(cls, include_extras=True)
    if cls is protocol.Batches:
        def columns(n: int) -> st.SearchStrategy[typing.Any]:
            return st.fixed_dictionaries({
                f.name: st.lists(valid_values(typing.get_args(hints[f.name])[0]), min_size=n, max_size=n)
                for f in dataclasses.fields(cls)})
        return st.integers(0, 4).flatmap(columns).map(lambda kw: cls(**kw))
    required: dict[str, st.SearchStrategy[typing.Any]] = {}
    optional: dict[str, st.SearchStrategy[typing.Any]] = {}
    for f in dataclasses.fields(cls):
        strategy = st.dictionaries(keys, tensors(), max_size=2) if f.name == "tensors" else valid_values(hints[f.name])
        bare = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        (required if bare else optional)[f.name] = strategy
    return st.fixed_dictionaries(required, optional=optional).map(lambda kw: cls(**kw))


any_payload = st.one_of([_payload_strategy(cls) for _, cls in sorted(PAYLOADS.items())])


@st.composite
def fuzzed_messages(draw: st.DrawFn) -> Message:
    """A known kind whose fields are a valid payload's with some replaced by anything, some dropped, some added."""
    fields = dict(codec.encode(draw(any_payload)).fields)
    kind = draw(st.sampled_from(sorted(PAYLOADS)))
    for name in draw(st.lists(st.sampled_from(sorted(fields) or ["x"]), max_size=3)):
        fields[name] = draw(json_values)
    for name in draw(st.lists(st.sampled_from(sorted(fields) or ["x"]), max_size=1)):
        fields.pop(name, None)
    fields.update(draw(st.dictionaries(keys, json_values, max_size=2)))
    tensors_ = draw(st.dictionaries(keys, tensors(), max_size=1))
    return Message(kind, fields if draw(st.integers(0, 30)) else draw(json_values), tensors_)


def _canon(p: typing.Any) -> tuple[typing.Any, ...]:
    """A payload as comparable values: its type, its fields as JSON (NaN == NaN there), its tensors' bytes."""
    m = codec.encode(p)
    return type(p), json.dumps(m.fields, sort_keys=True), wire.encode(Message("t", {}, m.tensors))


@fuzz(200)
@given(fuzzed_messages())
def test_protocol_decode_of_any_fields_is_a_payload_that_round_trips_or_a_protocol_error(msg):
    try:
        p = codec.decode(msg)
    except ProtocolError:
        return
    assert p is not None and type(p) is PAYLOADS[msg.kind]
    again = codec.encode(p)
    assert _canon(codec.decode(again)) == _canon(p)
    frame = wire.encode(again)  # and it travels: JSON-serialisable, within the header cap
    assert _canon(codec.decode(wire.decode(frame, CEILING))) == _canon(p)


@fuzz(200)
@given(st.sampled_from(sorted(PAYLOADS)), json_fields)
def test_protocol_decode_of_arbitrary_json_raises_only_protocol_errors(kind, fields):
    try:
        p = codec.decode(Message(kind, fields))
    except ProtocolError:
        return
    assert _canon(codec.decode(codec.encode(p))) == _canon(p)


# ---------------------------------------------------------------- (d) valid payloads round trip
@fuzz(250)
@given(any_payload)
def test_every_valid_payload_round_trips_through_a_frame(p):
    frame = wire.encode(codec.encode(p))
    back = codec.decode(wire.decode(frame, CEILING))
    assert _canon(back) == _canon(p)
