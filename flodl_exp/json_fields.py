"""Typed reads of a JSON object's fields: each refusal is one line naming the key, the value and what is allowed.

The values that cross a file or process boundary as JSON and come back as dataclasses (the job spec,
flodl_exp/job_spec.py; the rank's hello, flodl_exp/protocol/hello.py; the bundle meta, flodl_exp/bundle_meta.py)
read their fields through :class:`Fields`, so a bad file or peer is refused as
``<where> <key> <value> is not <what>`` (or ``<where> <key> is missing``) and never as a ``KeyError`` or an
``int()`` deep inside a run. Stdlib only: the CLI and the coordinator read these before torch loads.
"""
from __future__ import annotations

import math
from typing import Any, Optional

I64_MAX = 2**63 - 1


class FieldError(ValueError):
    """A field that is missing or whose value its rule refuses (the message is one line)."""


def show(v: Any) -> str:
    """A short, always printable account of a value (``repr`` of a 5,000-digit int raises)."""
    if isinstance(v, int) and not isinstance(v, bool):
        return repr(v) if -(10**30) < v < 10**30 else f"an int of {v.bit_length()} bits"
    if v is None or isinstance(v, (bool, float)):
        return repr(v)
    if isinstance(v, str):
        return repr(v[:40]) + ("..." if len(v) > 40 else "")
    return f"a {type(v).__name__}"


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def finite(v: int | float) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:  # an int too large for a float
        return False


class Fields:
    """The fields of one JSON object ``d``, read by rule; ``where`` opens every message (``job spec``, ``hello``).

    A key that is absent or ``None`` is missing: a required read refuses it, an optional one returns its
    default. Keys nobody reads are not checked (a newer writer may add some)."""

    def __init__(self, where: str, d: Any) -> None:
        if not isinstance(d, dict):
            raise FieldError(f"{where} is not an object, got {show(d)}")
        self.where, self.d = where, d

    def _bad(self, key: str, v: Any, what: str) -> FieldError:
        return FieldError(f"{self.where} {key} {show(v)} is not {what}")

    def _get(self, key: str, required: bool) -> Any:
        v = self.d.get(key)
        if v is None and required:
            raise FieldError(f"{self.where} {key} is missing")
        return v

    def int_(self, key: str, *, lo: int = 0, hi: int = I64_MAX, what: Optional[str] = None,
             default: Optional[int] = None) -> int:
        """An int (not a bool) in ``[lo, hi]``; required unless a ``default`` is given."""
        v = self.opt_int(key, lo=lo, hi=hi, what=what)
        if v is None:
            if default is None:
                raise FieldError(f"{self.where} {key} is missing")
            return default
        return v

    def opt_int(self, key: str, *, lo: int = 0, hi: int = I64_MAX, what: Optional[str] = None) -> Optional[int]:
        v = self._get(key, False)
        if v is not None and not (is_int(v) and lo <= v <= hi):
            raise self._bad(key, v, what or ("a non-negative int" if lo == 0 and hi == I64_MAX
                                             else f"an int in [{lo}, {hi}]"))
        return None if v is None else int(v)

    def opt_float(self, key: str, *, allow_nan: bool = False) -> Optional[float]:
        """A number (an int is taken as a float); finite unless ``allow_nan``."""
        v = self._get(key, False)
        if v is None:
            return None
        if not is_number(v) or not (allow_nan or finite(v)):
            raise self._bad(key, v, "a number" if allow_nan else "a finite number")
        return float(v)

    def str_(self, key: str) -> str:
        v = self._get(key, True)
        if not isinstance(v, str):
            raise self._bad(key, v, "a str")
        return v

    def opt_str(self, key: str) -> Optional[str]:
        v = self._get(key, False)
        if v is not None and not isinstance(v, str):
            raise self._bad(key, v, "a str")
        return v

    def obj(self, key: str) -> dict[str, Any]:
        v = self._get(key, True)
        if not isinstance(v, dict):
            raise self._bad(key, v, "an object")
        return v

    def opt_obj(self, key: str) -> Optional[dict[str, Any]]:
        v = self._get(key, False)
        if v is not None and not isinstance(v, dict):
            raise self._bad(key, v, "an object")
        return v

    def opt_list(self, key: str, elem: type, what: str) -> Optional[list[Any]]:
        """A list whose every element is an ``elem`` (``what`` names it: ``a str``, ``an object``)."""
        v = self._get(key, False)
        if v is None:
            return None
        if not isinstance(v, list):
            raise self._bad(key, v, "a list")
        for i, x in enumerate(v):
            if not isinstance(x, elem) or (elem is not bool and isinstance(x, bool)):
                raise self._bad(f"{key}[{i}]", x, what)
        return v
