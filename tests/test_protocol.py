"""Typed messages: every payload survives the real wire, and bad fields are refused, not guessed."""
from __future__ import annotations

import dataclasses
import typing

import pytest
import torch

from flodl_exp import wire
from flodl_exp.protocol import PAYLOADS, Batch, Kind, ProtocolError, Snapshot, StartEpoch, Telemetry, Update, decode, encode

SAMPLE = {int: 3, float: 1.5, str: "s", bool: True}


def _example(cls: type) -> typing.Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name == "tensors":
            kwargs[f.name] = {"p0": torch.arange(4, dtype=torch.float32), "b0": torch.ones(2, dtype=torch.bfloat16)}
            continue
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        base = args[0] if typing.get_origin(hint) is typing.Union else hint
        origin = typing.get_origin(base)
        kwargs[f.name] = [1, 2] if origin is list else {"a": [1.0, 2.0]} if origin is dict else SAMPLE[base]
    return cls(**kwargs)


@pytest.mark.parametrize("kind", sorted(PAYLOADS))
def test_every_payload_round_trips_through_a_frame(kind):
    p = _example(PAYLOADS[kind])
    back = decode(wire.decode(wire.encode(encode(p)), 1 << 20))
    assert type(back) is type(p)
    for f in dataclasses.fields(p):
        a, b = getattr(p, f.name), getattr(back, f.name)
        if f.name == "tensors":
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        else:
            assert a == b, f.name


def test_one_payload_per_kind():
    assert {k.value for k in Kind} == set(PAYLOADS)


def test_unknown_kinds_decode_to_none_and_extra_fields_are_ignored():
    assert decode(wire.Message("from_the_future", {"x": 1})) is None
    msg = encode(StartEpoch(epoch=1, offset=0, size=8, chunk=4))
    msg.fields["added_later"] = True
    assert decode(msg) == StartEpoch(epoch=1, offset=0, size=8, chunk=4)


@pytest.mark.parametrize(("fields", "match"), [
    ({"epoch": 1, "offset": 0, "size": 8}, "missing field 'chunk'"),
    ({"epoch": "1", "offset": 0, "size": 8, "chunk": 0}, "start_epoch.epoch: expected int"),
    ({"epoch": True, "offset": 0, "size": 8, "chunk": 0}, "start_epoch.epoch: expected int"),
    ({"epoch": 1.5, "offset": 0, "size": 8, "chunk": 0}, "start_epoch.epoch: expected int"),
])
def test_bad_fields_are_refused(fields, match):
    with pytest.raises(ProtocolError, match=match):
        decode(wire.Message("start_epoch", fields))


def test_optional_and_float_fields():
    b = decode(wire.Message("batch", {"ms": 2, "data_ms": 0.5, "chunk": 1, "loss": None}))
    assert b == Batch(ms=2.0, data_ms=0.5, chunk=1, loss=None, lr=None) and isinstance(b.ms, float)
    with pytest.raises(ProtocolError, match="batch.loss"):
        decode(wire.Message("batch", {"ms": 2, "data_ms": 0.5, "chunk": 1, "loss": "x"}))
    t = decode(wire.Message("telemetry", {"cpu_pct": 50.0, "rss_gb": 0.2}))
    assert isinstance(t, Telemetry) and t.values() == {"cpu_pct": 50.0, "rss_gb": 0.2}


def test_tensors_travel_raw_not_as_fields():
    msg = encode(Update(n=3, alpha=0.5, tensors={"p0": torch.zeros(3)}))
    assert "tensors" not in msg.fields and list(msg.tensors) == ["p0"]
    snap = decode(wire.Message("snapshot", {"n": 2}, {"p0": torch.ones(1)}))
    assert isinstance(snap, Snapshot) and snap.n == 2 and torch.equal(snap.tensors["p0"], torch.ones(1))
