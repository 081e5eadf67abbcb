"""A failed run's first cause in one line: the rank, the user's exception and the user's own innermost frame.

Pure (no I/O, no imports of torch or submitit): the rank task calls :func:`user_error` on the exception it dies of
and keeps the result in its death record; the launcher calls :func:`headline` on the coordinator's failure text and
those records. Framework frames (flodl_exp, torch, submitit, hydra, omegaconf, the standard library) are skipped:
the line points at the user's file, e.g. ``my_model.py:58 in get_batch``, and the full traceback stays in a file.
"""
from __future__ import annotations

import importlib.util
import os
import re
import sysconfig
import traceback
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional

FRAMEWORK_PACKAGES = ("flodl_exp", "torch", "submitit", "hydra", "omegaconf")
"""Top-level packages whose frames are never the user's (their own folders, found without importing them)."""


@lru_cache(maxsize=1)
def framework_roots() -> tuple[str, ...]:
    """The folders whose files are framework code: the packages of :data:`FRAMEWORK_PACKAGES` that are installed,
    and the standard library's (``sysconfig``'s stdlib paths). Absolute, each ending with a separator."""
    roots: list[str] = []
    for name in FRAMEWORK_PACKAGES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        for loc in (spec.submodule_search_locations or []) if spec is not None else []:
            roots.append(loc)
    paths = sysconfig.get_paths()
    roots.extend(paths[k] for k in ("stdlib", "platstdlib") if paths.get(k))
    return tuple(sorted({os.path.join(os.path.realpath(r), "") for r in roots}))


def is_framework_file(filename: str, roots: Optional[Sequence[str]] = None) -> bool:
    """``filename`` (a frame's) is framework code: under one of ``roots`` (default :func:`framework_roots`), or not a
    real file (``<frozen importlib._bootstrap>``, ``<string>``)."""
    if not filename or filename.startswith("<"):
        return True
    path = os.path.realpath(filename)
    return any(path.startswith(root) for root in (framework_roots() if roots is None else roots))


def frame_label(frame: traceback.FrameSummary) -> str:
    """``my_model.py:58 in get_batch``: the file's name (its folder is in the traceback file), line and function."""
    return f"{os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}"


def cause_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` then its causes, outermost first, as Python prints them in reverse (each once: chains can loop)."""
    seen: set[int] = set()
    cur: Optional[BaseException] = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ if cur.__cause__ is not None else (None if cur.__suppress_context__ else cur.__context__)


def innermost_user_frame(frames: Iterable[traceback.FrameSummary],
                         roots: Optional[Sequence[str]] = None) -> Optional[traceback.FrameSummary]:
    """The last (innermost) frame of ``frames`` that is not framework code, or None."""
    found = None
    for fs in frames:
        if not is_framework_file(fs.filename, roots):
            found = fs
    return found


@dataclass(frozen=True)
class UserError:
    """What a rank died of, told in the user's terms."""

    error: str
    """``ValueError: bad sample 7``: the exception that holds the user's frame (the innermost cause that does), else
    the one the rank died of; its message's first line."""
    frame: Optional[str]
    """``my_model.py:58 in get_batch``, or None when no frame of the traceback is the user's."""


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (``Type`` alone for an empty message)."""
    msg = first_line(str(exc))
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def user_error(exc: BaseException, roots: Optional[Sequence[str]] = None) -> UserError:
    """The user's view of ``exc``: the innermost cause whose traceback passes through the user's code, and the
    innermost such frame. A framework error wrapping the user's (``raise ... from e``) is told as the user's own;
    one that never touched user code is told as it is, without a frame."""
    for cause in reversed(list(cause_chain(exc))):  # the root cause first: it is where the user's code raised
        fs = innermost_user_frame(traceback.extract_tb(cause.__traceback__), roots)
        if fs is not None:
            return UserError(one_line(cause), frame_label(fs))
    return UserError(one_line(exc), None)


_RANK = re.compile(r"\brank (\d+)\b")


def blamed_rank(failure: Optional[str], deaths: Sequence[Mapping[str, Any]] = ()) -> Optional[int]:
    """The rank a run's failure names first (the coordinator leads with the first cause: ``rank 1 was lost before
    training started: ...; after it, rank 2 failed``, ``single_survivor: rank 1 ...``), else the first rank
    declared dead, else None."""
    first = (failure or "").strip().splitlines()[:1]
    m = _RANK.search(first[0]) if first else None
    if m:
        return int(m.group(1))
    for d in deaths:
        if isinstance(d, Mapping) and isinstance(d.get("rank"), int):
            return int(d["rank"])
    return None


def setup_headline(lines: Sequence[str], failure: Optional[str] = None) -> str:
    """One line for ranks that could not set up (``lines``: ``rank <r> could not set up: ...``, the first to fail
    first): the rank the coordinator blamed, else the first, and the other ranks by number only (each one's line is
    in the run's error tag and its own traceback file)."""
    blamed = blamed_rank(failure)
    first = next((ln for ln in lines if blamed is not None and ln.startswith(f"rank {blamed} ")), lines[0])
    others = [ln.split()[1] for ln in lines if ln is not first and ln.startswith("rank ")]
    if not others:
        return first
    return f"{first}; rank{'s' if len(others) > 1 else ''} {', '.join(others)} could not set up either"


def rank_line(rank: int, error: str, frame: Optional[str], traceback_path: Optional[str]) -> str:
    """``rank 1 failed: ValueError: bad sample 7 at my_model.py:31 in get_batch (full traceback: <path>)``."""
    where = f" at {frame}" if frame else ""
    full = f" (full traceback: {traceback_path})" if traceback_path else ""
    return f"rank {rank} failed: {first_line(error)}{where}{full}"


def headline(failure: Optional[str], deaths: Sequence[Mapping[str, Any]], records: Mapping[int, Mapping[str, Any]],
             fallback: str, log_path: Optional[str] = None, rank_logs: Optional[Mapping[int, str]] = None) -> str:
    """One line for a failed run's first cause.

    ``failure``: the coordinator's text (None when it wrote none); ``deaths``: its death list (result.json);
    ``records``: this attempt's rank death records by rank (``ranks/death.r<rank>.json``, with ``user_error``,
    ``user_frame`` and ``traceback_path`` where the rank's task kept its traceback); ``fallback``: the text when
    the coordinator said nothing (the task's error); ``log_path``: where to look when no rank is to blame (the
    coordinator's log); ``rank_logs``: each rank's task log, named for a rank that left no record. The blamed
    rank's own record tells its error in the user's terms; a rank that left none (killed: no Python error to tell)
    is told by the coordinator's first line, which names it."""
    rank = blamed_rank(failure, deaths)
    rec = records.get(rank) if rank is not None else None
    if rank is not None and rec and (rec.get("user_error") or rec.get("error")):
        return rank_line(rank, str(rec.get("user_error") or rec.get("error")), rec.get("user_frame"),
                         rec.get("traceback_path"))
    if failure:
        first = first_line(failure)
    else:  # the task's error: flodl_exp's own RuntimeError says what happened without its type
        first = error_line(fallback or "").removeprefix("RuntimeError: ").rstrip(":").strip()
        first = first or "the job ended without a result"
    if rank is None:
        return f"{first}; its log: {log_path}" if log_path else first
    if not first.startswith(f"rank {rank} "):
        first = f"rank {rank} was lost: {first}"
    log = (rank_logs or {}).get(rank)
    return f"{first} (its log: {log})" if log else first


def first_line(text: str) -> str:
    """The first non-blank line of ``text``, stripped."""
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), "")


_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failed|Lost|Timeout)\b[^:]*:")
_NOISE = ("Traceback ", "The above exception", "During handling", "You can check full logs", "---")


def error_line(text: str) -> str:
    """The line that says what went wrong in a task's error text (submitit's ``FailedJobError``: a traceback, then
    its advice): the last exception line (``RuntimeError: ...``), never a frame, a caret line or the advice."""
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    plain = [ln for ln in lines if not ln[0].isspace() and not ln.startswith(_NOISE)]
    excs = [ln for ln in plain if _EXC_LINE.match(ln)]
    return (excs or plain or [""])[-1].strip()
