"""The job's MLflow records as a file: the format both of its ends share.

A job whose launcher waits on it (``run.wait``, ``tracking.relay``) imports no MLflow at all: the coordinator appends
its records (metrics, tags, artifacts, inputs) as JSON lines to ``<job>/records.jsonl`` (:class:`JournalSink`,
flodl_exp/journal_sink.py), and the launcher, which imports MLflow anyway to create the run, delivers them
(:class:`RecordsRelay`, flodl_exp/records_relay.py). MLflow's import and the SQL store's opening (2-3.5 s of CPU)
then run once per job instead of twice, and the job's end does not wait for either (docs/reference/measurements.md,
start-up).

The launcher renews a lease, ``<job>/records_relay.json``, every :data:`BEAT_S` with a beat counter and how far it
delivered. A coordinator that sees no new beat for ``tracking.relay_stale_s`` (a launcher killed, a laptop asleep)
takes the delivery over: it claims ``<job>/records_taken.json`` (created exclusively), starts its own sink process
from the delivered offset, and the relay stops when it sees the claim. A record can then be delivered twice (MLflow
keeps one copy of an identical metric point or tag), never lost silently.

Lines: ``{"kind": k, "payload": p}`` (the sink process's own line format) and ``{"close": {"status": s}}`` for a
coordinator's close (``status`` null: a preempted attempt; its requeue appends more). A line is read only once its
newline is there (a writer mid-line, or a torn last line of a crash, is not read). Never unpickled: JSON only.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

JOURNAL_FILE = "records.jsonl"
LEASE_FILE = "records_relay.json"
TAKEN_FILE = "records_taken.json"

BEAT_S = 0.5
"""How often the launcher's relay renews its lease (and reads the journal)."""


def record_line(kind: str, payload: Any) -> bytes:
    return json.dumps({"kind": kind, "payload": payload}, allow_nan=True).encode() + b"\n"


def close_line(status: Optional[str]) -> bytes:
    return json.dumps({"close": {"status": status}}).encode() + b"\n"


def read_lines(path: str, offset: int, max_bytes: int = 16 << 20) -> tuple[list[tuple[int, Optional[dict]]], int]:
    """The complete lines of ``path`` from byte ``offset`` (at most about ``max_bytes``): ``(end offset, parsed)`` per
    line (``parsed`` None: not a JSON object, skipped by the reader), and the offset after the last complete line.
    The file is opened for each read: on NFS a reader sees what a writer closed (close-to-open)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read(max_bytes)
    except OSError:  # not there yet, or unreadable: nothing to read this time
        return [], offset
    end = data.rfind(b"\n")
    if end < 0:
        return [], offset
    out: list[tuple[int, Optional[dict]]] = []
    pos = 0
    while pos <= end:
        nl = data.index(b"\n", pos)
        try:
            parsed = json.loads(data[pos:nl])
        except ValueError:
            parsed = None
        out.append((offset + nl + 1, parsed if isinstance(parsed, dict) else None))
        pos = nl + 1
    return out, offset + end + 1


def read_lease(job_dir: str) -> Optional[dict[str, Any]]:
    """The relay's lease (None: none yet, or unreadable this instant)."""
    try:
        with open(os.path.join(job_dir, LEASE_FILE)) as fh:
            d = json.load(fh)
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def taken(job_dir: str) -> bool:
    """A coordinator took the delivery over (the relay stops delivering)."""
    return os.path.exists(os.path.join(job_dir, TAKEN_FILE))


def claim(job_dir: str, offset: int) -> bool:
    """Create :data:`TAKEN_FILE` exclusively (False: it was there: an earlier attempt took the delivery over)."""
    try:
        fd = os.open(os.path.join(job_dir, TAKEN_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as fh:
        json.dump({"from_offset": offset, "pid": os.getpid()}, fh)
    return True
