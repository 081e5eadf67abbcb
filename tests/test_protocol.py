"""Typed messages: every payload survives the real wire, and bad fields are refused, not guessed."""
from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl_exp.protocol import codec, wire
from flodl_exp.protocol.codec import decode, encode
from flodl_exp.protocol.messages import (
    PAYLOADS,
    Batch,
    ChunkMetrics,
    EvalResult,
    Intent,
    Kind,
    Len,
    Num,
    ProtocolError,
    Snapshot,
    StartEpoch,
    SyncAck,
    Telemetry,
    Update,
)

SAMPLE = {int: 3, float: 1.5, str: "s", bool: True}


def _sample(hint: typing.Any) -> typing.Any:
    """A value that fits ``hint`` and its rules (Optional -> the inner type, a Len record at its length)."""
    origin = typing.get_origin(hint)
    if origin is typing.Annotated:
        base, *meta = typing.get_args(hint)
        n = next((m.n for m in meta if isinstance(m, Len)), 2)
        return [_sample(typing.get_args(base)[0]) for _ in range(n)] if typing.get_origin(base) is list else _sample(base)
    if origin is typing.Union:
        return _sample(next(a for a in typing.get_args(hint) if a is not type(None)))
    if origin is list:
        return [_sample(typing.get_args(hint)[0]) for _ in range(2)]
    if origin is dict:
        return {"a": _sample(typing.get_args(hint)[1])}
    return SAMPLE[hint]


P = typing.TypeVar("P")


def _decoded(kind: str, fields: dict[str, typing.Any], cls: type[P]) -> P:
    """The ``kind`` message with ``fields``, decoded (asserted to be a ``cls``)."""
    p = decode(wire.Message(kind, fields))
    assert isinstance(p, cls), p
    return p


def _example(cls: type) -> typing.Any:
    hints = typing.get_type_hints(cls, include_extras=True)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name == "tensors":
            kwargs[f.name] = {"p0": torch.arange(4, dtype=torch.float32), "b0": torch.ones(2, dtype=torch.bfloat16)}
            continue
        kwargs[f.name] = _sample(hints[f.name])
    return cls(**kwargs)


@pytest.mark.parametrize("kind", sorted(PAYLOADS))
def test_every_payload_round_trips_through_a_frame(kind):
    p = _example(PAYLOADS[kind])
    back = decode(wire.decode(wire.encode(encode(p)), 1 << 20))
    assert type(back) is type(p)
    for f in dataclasses.fields(PAYLOADS[kind]):
        a, b = getattr(p, f.name), getattr(back, f.name)
        if f.name == "tensors":
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        else:
            assert a == b, f.name


def test_a_bundle_holds_several_messages_and_refuses_what_it_cannot_hold():
    from flodl_exp.protocol.codec import BUNDLE, bundle, decode, unbundle
    from flodl_exp.protocol.messages import ProtocolError, SetGlobalStep, StartEpoch, Update

    t = {"p0": torch.ones(2)}
    frame = wire.decode(wire.encode(bundle([Update(n=1, tensors=t), SetGlobalStep(global_step=3)])), 1 << 20)
    assert frame.kind == BUNDLE and decode(frame) is None, "not a payload: old ranks ignore it as an unknown kind"
    first, second = (decode(m) for m in unbundle(frame))
    assert isinstance(first, Update) and torch.equal(first.tensors["p0"], t["p0"]) and second == SetGlobalStep(global_step=3)
    one = encode(StartEpoch(epoch=0, offset=0, size=8, chunk=1))
    assert unbundle(one) == [one]
    with pytest.raises(ValueError):
        bundle([SetGlobalStep(global_step=3), Update(n=1, tensors=t)])  # tensors only on the first
    with pytest.raises(ValueError):
        bundle([])
    bad: tuple[dict[str, Any], ...] = ({}, {"parts": []}, {"parts": "x"}, {"parts": [1]}, {"parts": [{"kind": "x"}]},
                                      {"parts": [{"kind": BUNDLE, "fields": {}}]}, {"parts": [{"kind": 3, "fields": {}}]})
    for fields in bad:
        with pytest.raises(ProtocolError, match="bundle"):
            unbundle(wire.Message(BUNDLE, fields))


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


# ---------------------------------------------------------------- issue 26: the fields' schema rules
_BATCH = {"ms": 1.0, "data_ms": 1.0, "chunk": 0}
_METRICS = {"epoch": 0, "chunk": 0, "avg_loss": 1.0, "batches": 2, "samples": 8, "epoch_ms": 1.0,
            "share_complete_ms": 1.0, "compute_only_ms": 1.0, "data_starve_ms": 0.0}
_NAN, _INF = float("nan"), float("inf")


@pytest.mark.parametrize(("kind", "fields", "match"), [
    # a JSON integer of 309+ digits in a float field: OverflowError at float(value) before the rules
    pytest.param("batch", {**_BATCH, "ms": 10**400}, r"batch\.ms: .*does not fit a float", id="batch-ms-overflow"),
    pytest.param("batch", {**_BATCH, "data_ms": -(10**309)}, r"batch\.data_ms", id="batch-data-ms-overflow"),
    pytest.param("metrics", {**_METRICS, "epoch_ms": 10**400}, r"metrics\.epoch_ms", id="metrics-overflow"),
    pytest.param("sync_ack", {"n": 1, "d": 10**400}, r"sync_ack\.d", id="reading-overflow"),
    # times are finite
    pytest.param("batch", {**_BATCH, "ms": _NAN}, r"batch\.ms: expected a finite float, got nan", id="batch-ms-nan"),
    pytest.param("batch", {**_BATCH, "data_ms": _INF}, r"batch\.data_ms: expected a finite", id="batch-data-ms-inf"),
    pytest.param("metrics", {**_METRICS, "compute_only_ms": -_INF}, r"metrics\.compute_only_ms", id="metrics-ms-inf"),
    pytest.param("eval_result", {"epoch": 0, "elapsed_ms": _NAN}, r"eval_result\.elapsed_ms", id="elapsed-nan"),
    pytest.param("loop_notice", {"message": "m", "held_s": _INF}, r"loop_notice\.held_s", id="held-inf"),
    pytest.param("telemetry", {"cpu_pct": _NAN}, r"telemetry\.cpu_pct", id="telemetry-nan"),
    pytest.param("update", {"n": 1, "alpha": _INF}, r"update\.alpha", id="alpha-inf"),
    # ints are signed 64-bit; ids, indices and counts are non-negative
    pytest.param("batch", {**_BATCH, "chunk": 2**63}, r"batch\.chunk: .* outside \[0, 2\*\*63\)", id="chunk-2**63"),
    pytest.param("batch", {**_BATCH, "chunk": -1}, r"batch\.chunk", id="chunk-negative"),
    pytest.param("start_epoch", {"epoch": -1, "offset": 0, "size": 8, "chunk": 0}, r"start_epoch\.epoch", id="epoch-negative"),
    pytest.param("exiting", {"rank": 0, "pid": 1, "hash": "h", "steps": 2**64, "global_step": 0}, r"exiting\.steps",
                 id="steps-2**64"),
    pytest.param("intent", {"kind": "eval", "epoch": -(2**63) - 1}, r"intent\.epoch: .* outside \[-2\*\*63, 2\*\*63\)",
                 id="signed-below-i64"),
    pytest.param("heartbeat", {"steps": 10**5000}, r"heartbeat\.steps: an int of \d+ bits", id="int-too-long-to-print"),
    # list and dict contents are typed
    pytest.param("regroup", {"generation": 1, "new_rank": 0, "world_size": 2, "ranks": [0, "1"]},
                 r"regroup\.ranks\[1\]: expected int", id="list-int-str"),
    pytest.param("regroup", {"generation": 1, "new_rank": 0, "world_size": 2, "ranks": [0, 1.0]},
                 r"regroup\.ranks\[1\]: expected int", id="list-int-float"),
    pytest.param("regroup", {"generation": 1, "new_rank": 0, "world_size": 2, "ranks": [True]},
                 r"regroup\.ranks\[0\]", id="list-int-bool"),
    pytest.param("stage_advisory", {"segments": [[0, 1, 2], [0, 1]]}, r"stage_advisory\.segments\[1\]: expected a list of 3",
                 id="segment-length"),
    pytest.param("stage_advisory", {"counts": [1, -2]}, r"stage_advisory\.counts\[1\]", id="counts-negative"),
    pytest.param("update", {"n": 1, "next_plan": [0, 0, 8]}, r"update\.next_plan: expected a list of 4", id="plan-length"),
    pytest.param("metrics", {**_METRICS, "ranges": [[0, 8], [8]]}, r"metrics\.ranges\[1\]", id="ranges-pair"),
    pytest.param("metrics", {**_METRICS, "scalars": {"a": [1.0, "x"]}}, r"metrics\.scalars\['a'\]\[1\]: expected float",
                 id="scalars-value"),
    pytest.param("metrics", {**_METRICS, "scalars": {"a": 1.0}}, r"metrics\.scalars\['a'\]: expected a list", id="scalars-not-list"),
    pytest.param("eval_result", {"epoch": 0, "metrics": {"acc": "high"}}, r"eval_result\.metrics\['acc'\]", id="metric-str"),
    pytest.param("eval_result", {"epoch": 0, "metrics": {1: 2.0}}, r"eval_result\.metrics: key 1 is not a str", id="metric-key"),
    pytest.param("epoch_aggregated", {"epoch": 0, "metrics": {"loss": 10**400}}, r"epoch_aggregated\.metrics\['loss'\]",
                 id="metric-overflow"),
    pytest.param("save", {"stem": "s", "primary": 1, "model": True}, r"save\.primary: expected bool", id="bool-int"),
])
def test_schema_rules_refuse_with_a_protocol_error(kind, fields, match):
    with pytest.raises(ProtocolError, match=match):
        decode(wire.Message(kind, fields))


def test_the_batch_fast_path_and_the_generic_path_agree_on_the_rules():

    for bad in ({**_BATCH, "ms": _NAN}, {**_BATCH, "data_ms": -_INF}, {**_BATCH, "chunk": 2**63}, {**_BATCH, "chunk": -1}):
        assert codec._decode_batch(bad) is None  # off the fast path's shape: the generic path words the error
        with pytest.raises(ProtocolError):
            decode(wire.Message("batch", bad))
    ok = {**_BATCH, "loss": _NAN, "lr": _INF}
    fast = codec._decode_batch(ok)
    assert fast is not None and fast.loss is not None and math.isnan(fast.loss) and fast.lr == _INF


def test_readings_may_be_non_finite():
    """A diverging model reports NaN or inf losses, norms and metrics: the report still counts (the ledger
    skips a non-finite loss, the guards read NaN as 0), so those fields take any IEEE value."""
    b = decode(wire.Message("batch", {**_BATCH, "loss": _NAN, "lr": _INF, "ms": 3}))
    assert isinstance(b, Batch) and b.loss is not None and math.isnan(b.loss) and b.lr == _INF and b.ms == 3.0
    ack = decode(wire.Message("sync_ack", {"n": 1, "d": _NAN, "pre": -_INF, "post": 2}))
    assert isinstance(ack, SyncAck) and ack.d is not None and math.isnan(ack.d) and ack.pre == -_INF and ack.post == 2.0
    m = decode(wire.Message("metrics", {**_METRICS, "avg_loss": _NAN, "scalars": {"a": [_INF, 1]}}))
    assert isinstance(m, ChunkMetrics) and math.isnan(m.avg_loss) and m.scalars == {"a": [_INF, 1.0]}
    assert type(m.scalars["a"][1]) is float
    e = decode(wire.Message("eval_result", {"epoch": 0, "metrics": {"acc": _NAN}}))
    assert isinstance(e, EvalResult) and math.isnan(e.metrics["acc"])


def test_bounds_are_inclusive_at_the_edges():
    top = 2**63 - 1
    assert _decoded("batch", {**_BATCH, "chunk": top}, Batch).chunk == top
    assert _decoded("intent", {"kind": "eval", "epoch": -(2**63)}, Intent).epoch == -(2**63)
    assert _decoded("intent", {"kind": "eval", "epoch": -1}, Intent).epoch == -1  # asked before any epoch
    assert _decoded("batch", {**_BATCH, "ms": 10**308}, Batch).ms == 1e308  # a big int that fits a float


def test_a_message_whose_fields_are_not_an_object_is_refused():
    with pytest.raises(ProtocolError, match="fields"):
        decode(wire.Message("batch", [1, 2]))  # type: ignore[arg-type]


_ITEMS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(min_value=-2**70, max_value=2**70),
                   st.booleans(), st.none(), st.text(max_size=2))


@pytest.mark.parametrize("hint", [float, int, typing.Optional[float], typing.Optional[int],
                                  typing.Annotated[int, Num(lo=0)], typing.Annotated[float, Num(finite=False)],
                                  typing.Optional[typing.Annotated[float, Num(finite=False)]],
                                  typing.Annotated[int, Num(lo=-3, hi=7)]])
@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(v=st.lists(_ITEMS, max_size=6))
def test_a_plain_number_list_is_taken_whole_exactly_when_every_item_would_pass(hint: Any, v: list[Any]) -> None:
    """codec._plain_list, the whole-list test of number columns (a Batches frame's): it takes a list exactly when
    the item-by-item check returns the same list, never one that check refuses or would convert."""
    plain = codec._plain_list(hint)
    assert plain is not None
    item = codec._compile(hint)
    try:
        slow: Any = [item(x) for x in v]
    except codec._Bad:
        slow = None
    if plain(v):
        assert slow is not None and slow == v and [type(x) for x in slow] == [type(x) for x in v]
    fast_check = codec._list_check(item, None, plain)
    try:
        fast: Any = fast_check(v)
    except codec._Bad:
        fast = None
    assert (fast is None) == (slow is None)
    if slow is not None:
        assert [type(x) for x in fast] == [type(x) for x in slow]
        assert all((a == b) or (a != a and b != b) for a, b in zip(fast, slow))  # NaN equals NaN here


def test_only_number_lists_get_the_whole_list_test() -> None:
    assert codec._plain_list(str) is None and codec._plain_list(list[float]) is None
    assert codec._plain_list(typing.Union[int, str]) is None
