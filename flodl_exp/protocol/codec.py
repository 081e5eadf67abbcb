"""Payloads <-> wire messages: :func:`encode` and :func:`decode` by the field rules ``protocol/messages.py`` declares on
its dataclasses, and :func:`bundle` / :func:`unbundle` for several messages in one frame.

The shell's half of the protocol (the coordinator's outbox and server, the rank's inbox and worker): the control
core imports the payloads (``protocol/messages.py``) and never this module or the wire.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Optional, Union

from flodl_exp.json_fields import show
from flodl_exp.protocol.messages import I64_MAX, I64_MIN, PAYLOADS, Batch, Len, Num, Payload, ProtocolError, Tensors
from flodl_exp.protocol.wire import Message


def encode(p: Any) -> Message:
    """The message for payload ``p`` (tensors travel raw, everything else as JSON fields)."""
    fields: dict[str, Any] = {}
    tensors: Tensors = {}
    for f in dataclasses.fields(p):
        v = getattr(p, f.name)
        if f.name == "tensors":
            tensors = v
        else:
            fields[f.name] = v
    return Message(p.KIND.value, fields, tensors)


BUNDLE = "bundle"
"""The kind of a frame holding several coordinator -> rank messages (:func:`bundle`); not a payload of its own."""


def bundle(payloads: list[Any]) -> Message:
    """Several messages to one rank in one frame, in order, as :func:`unbundle` gives them back: a cpu reduce's
    update and what follows it to that rank (its global step, its staging advisory, its report pace) cost one
    JSON header, one MAC and one send instead of three or four (at 1,024 ranks, most of the reduce's fan-out).
    Only the first may carry tensors (the update's consensus)."""
    msgs = [encode(p) for p in payloads]
    if not msgs or any(m.tensors for m in msgs[1:]):
        raise ValueError("a bundle holds one or more messages, and only its first may carry tensors")
    return Message(BUNDLE, {"parts": [{"kind": m.kind, "fields": m.fields} for m in msgs]}, msgs[0].tensors)


def unbundle(msg: Message) -> list[Message]:
    """The messages of a :func:`bundle` frame, in order (the frame's tensors go to the first); any other frame
    as itself. Raises ProtocolError for a bundle of the wrong shape (nested, empty, a part not a kind and
    fields); each part then decodes, or fails to, as a frame of its own would."""
    if msg.kind != BUNDLE:
        return [msg]
    parts = msg.fields.get("parts") if type(msg.fields) is dict else None
    if type(parts) is not list or not parts:
        raise ProtocolError(f"bundle.parts: must be a non-empty list, got {show(parts)}")
    out: list[Message] = []
    for i, part in enumerate(parts):
        if type(part) is not dict or type(part.get("kind")) is not str or type(part.get("fields")) is not dict \
                or part["kind"] == BUNDLE:
            raise ProtocolError(f"bundle.parts[{i}]: must be {{kind: a message kind, fields: an object}}, got {show(part)}")
        out.append(Message(part["kind"], part["fields"], msg.tensors if i == 0 else {}))
    return out


class _Bad(Exception):
    """A value a rule refuses; ``path`` (``[3]``, ``['loss']``) is built as it unwinds out of containers,
    so the common case (nothing wrong) formats no string."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what
        self.path = ""


def _bound(n: int) -> str:
    return {I64_MIN: "-2**63", I64_MAX + 1: "2**63"}.get(n, str(n))


_Check = Callable[[Any], Any]


def _compile(hint: Any, rule: Num | None = None, length: int | None = None) -> _Check:
    """A checker for values of ``hint`` (see the module docstring): returns the value as the payload holds it
    (floats converted, containers copied) or raises :class:`_Bad`. Built once per field at import."""
    origin = typing.get_origin(hint)
    if origin is Annotated:
        base, *meta = typing.get_args(hint)
        rule = next((m for m in meta if isinstance(m, Num)), rule)
        length = next((m.n for m in meta if isinstance(m, Len)), length)
        return _compile(base, rule, length)
    if origin is Union:  # Optional[X]
        (inner_hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
        inner = _compile(inner_hint, rule, length)
        return lambda v: None if v is None else inner(v)
    if origin is list:
        (elem_hint,) = typing.get_args(hint)
        return _list_check(_compile(elem_hint), length, _plain_list(elem_hint))
    if origin is dict:
        key_hint, value_hint = typing.get_args(hint)
        if key_hint is not str:
            raise TypeError(f"protocol dicts have str keys (JSON objects), not {key_hint}")
        return _dict_check(_compile(value_hint))
    r = rule or Num()
    if hint is int:
        return _int_check(r.lo, r.hi)
    if hint is float:
        return _float_check(r.finite)
    if hint is str:
        return _type_check(str)
    if hint is bool:
        return _type_check(bool)
    raise TypeError(f"no protocol rule for {hint!r}")


def _int_check(lo: int, hi: int) -> _Check:
    def check(v: Any) -> int:
        if not isinstance(v, int) or isinstance(v, bool):
            raise _Bad(f"expected int, got {show(v)}")
        if not lo <= v <= hi:
            raise _Bad(f"{show(v)} is outside [{_bound(lo)}, {_bound(hi + 1)})")
        return v
    return check


def _float_check(finite: bool) -> _Check:
    def check(v: Any) -> float:
        if isinstance(v, float):
            f = float(v)
        elif isinstance(v, int) and not isinstance(v, bool):
            try:
                f = float(v)
            except OverflowError:
                raise _Bad(f"{show(v)} does not fit a float") from None
        else:
            raise _Bad(f"expected float, got {show(v)}")
        if finite and not math.isfinite(f):
            raise _Bad(f"expected a finite float, got {f!r}")
        return f
    return check


def _type_check(t: type) -> _Check:
    def check(v: Any) -> Any:
        if not isinstance(v, t) or (t is not bool and isinstance(v, bool)):
            raise _Bad(f"expected {t.__name__}, got {show(v)}")
        return v
    return check


def _plain_list(hint: Any) -> Optional[Callable[[list[Any]], bool]]:
    """For a list of numbers (``hint`` its items' type: a float, an int in a range, either optional), a test run at C
    speed (``map``, ``set``, ``min``/``max``) that every item already is what its own check would return unchanged;
    such a list is then taken whole instead of item by item. A Batches frame is such columns: checked item by item
    they were a third of the coordinator's main-thread cost per report frame (issue 52). None for any other item
    type, and a list that fails the test is checked item by item, naming the bad item."""
    rule, optional = Num(), False
    for _ in range(2):  # Optional[Annotated[...]] or Annotated[Optional[...]]
        origin = typing.get_origin(hint)
        if origin is Annotated:
            hint, *meta = typing.get_args(hint)
            rule = next((m for m in meta if isinstance(m, Num)), rule)
        elif origin is Union:
            args = [a for a in typing.get_args(hint) if a is not type(None)]
            if len(args) != 1:
                return None
            hint, optional = args[0], True
    if typing.get_origin(hint) is not None:
        return None
    allowed = {hint, type(None)} if optional else {hint}
    if hint is float:
        if rule.finite and optional:
            return lambda v: set(map(type, v)) <= allowed and all(math.isfinite(x) for x in v if x is not None)
        if rule.finite:
            return lambda v: set(map(type, v)) <= allowed and all(map(math.isfinite, v))
        return lambda v: set(map(type, v)) <= allowed
    if hint is int:
        lo, hi = rule.lo, rule.hi

        def ints(v: list[Any]) -> bool:
            if not set(map(type, v)) <= allowed:  # type() is int: a bool is refused, as by the item check
                return False
            present = [x for x in v if x is not None] if optional else v
            return not present or (min(present) >= lo and max(present) <= hi)
        return ints
    return None


def _list_check(elem: _Check, length: int | None, plain: Optional[Callable[[list[Any]], bool]] = None) -> _Check:
    def check(v: Any) -> list[Any]:
        if not isinstance(v, list):
            raise _Bad(f"expected a list, got {show(v)}")
        if length is not None and len(v) != length:
            raise _Bad(f"expected a list of {length}, got {len(v)} items")
        if plain is not None and plain(v):
            return list(v)
        out = []
        for i, x in enumerate(v):
            try:
                out.append(elem(x))
            except _Bad as e:
                e.path = f"[{i}]{e.path}"
                raise
        return out
    return check


def _dict_check(value: _Check) -> _Check:
    def check(v: Any) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise _Bad(f"expected a dict, got {show(v)}")
        out = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise _Bad(f"key {show(k)} is not a str")
            try:
                out[k] = value(x)
            except _Bad as e:
                e.path = f"[{show(k)}]{e.path}"
                raise
        return out
    return check


@dataclass(frozen=True)
class _Field:
    name: str
    check: Optional[_Check]
    """None: the message's tensors."""
    required: bool


def _fields_of(cls: type) -> tuple[_Field, ...]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return tuple(_Field(f.name, None if f.name == "tensors" else _compile(hints[f.name]),
                        f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                 for f in dataclasses.fields(cls))


_DECODERS: dict[type, tuple[_Field, ...]] = {cls: _fields_of(cls) for cls in PAYLOADS.values()}
"""Every payload's field checkers, compiled at import (a field type without a rule fails here, not on a message)."""


def _decode_batch(f: dict[str, Any]) -> Optional[Batch]:
    """The hot message (one per trained batch per rank) without the generic walk; None when anything is
    off the common shape (a missing field, a type to check or convert, a value out of its rules), so the
    generic path decides and words the error the same way. The rules, inline: ``ms``/``data_ms``/``age_ms``
    finite floats, ``chunk`` a :data:`Count`, ``loss``/``lr`` any float or None."""
    try:
        ms, data_ms, chunk = f["ms"], f["data_ms"], f["chunk"]
    except KeyError:
        return None
    loss, lr, age = f.get("loss"), f.get("lr"), f.get("age_ms", 0.0)
    if (type(ms) is float and type(data_ms) is float and type(chunk) is int and type(age) is float
            and ms - ms == 0.0 and data_ms - data_ms == 0.0 and age - age == 0.0  # finite: inf - inf, nan - nan are nan
            and 0 <= chunk <= I64_MAX
            and (loss is None or type(loss) is float) and (lr is None or type(lr) is float)):
        return Batch(ms, data_ms, chunk, loss, lr, age)
    return None


def decode(msg: Message) -> Optional[Payload]:
    """The payload of ``msg``; ``None`` for a kind this version does not know. Raises ProtocolError, and
    nothing else, for fields that do not fit (see the module docstring for the rules)."""
    fields = msg.fields
    if type(fields) is not dict:
        raise ProtocolError(f"{msg.kind!r:.50}: fields must be an object, got {show(fields)}")
    if msg.kind == "batch" and not msg.tensors:
        fast = _decode_batch(fields)
        if fast is not None:
            return fast
    cls = PAYLOADS.get(msg.kind) if isinstance(msg.kind, str) else None
    if cls is None:
        return None
    kwargs: dict[str, Any] = {}
    for f in _DECODERS[cls]:
        if f.check is None:
            kwargs["tensors"] = msg.tensors
        elif f.name in fields:
            try:
                kwargs[f.name] = f.check(fields[f.name])
            except _Bad as e:
                raise ProtocolError(f"{msg.kind}.{f.name}{e.path}: {e.what}") from None
        elif f.required:
            raise ProtocolError(f"{msg.kind}: missing field {f.name!r}")
    return typing.cast(Payload, cls(**kwargs))
