"""The coordinator's sink when its launcher delivers the records: a journal file, no MLflow (records_journal.py).

:class:`JournalSink` has :class:`~flodl_exp.tracking.MlflowSink`'s surface. ``log_*`` calls append a line to a buffer
and return; a thread writes the buffer to ``<job>/records.jsonl`` every :data:`FLUSH_S` (opened and closed each
time, so a launcher on another host sees it) and watches the launcher's lease. :meth:`close` writes what is left
and a close line and returns: the launcher delivers them after the job ends, so the run's end waits for no MLflow.

When the lease goes stale (no new beat for ``stale_s``), or the journal cannot be written (a full disk), the
delivery is taken over: a sink process (:func:`~flodl_exp.sink_process.start_sink`) gets the journal from the
launcher's delivered offset, then every record as it comes (still written to the journal too, while it can be), and
:meth:`close` waits for it as the coordinator's sink always did.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any, Mapping, Optional, Sequence

from flodl_exp.records_journal import JOURNAL_FILE, claim, close_line, read_lease, read_lines, record_line, taken
from flodl_exp.tracking import RecordSurface

log = logging.getLogger(__name__)

FLUSH_S = 0.1
"""How often buffered lines go to the journal (a record reaches the store within this plus the relay's beat)."""

LEASE_CHECK_S = 0.25
"""How often the lease is read (a small file)."""

BEAT_FRESH_S = 1.0
"""At close, a beat seen this recently (two of the relay's) says the launcher is there."""

CLOSE_FRESH_S = 3.0
"""At close, without a fresh beat, how long a new one is waited for: else the job delivers its records itself."""


class JournalSink(RecordSurface):
    """Records to ``<job>/records.jsonl`` for the launcher's relay; see the module's doc."""

    def __init__(self, uri: str, run_id: str, job_dir: str, import_paths: Sequence[str] = (), *,
                 stale_s: float = 30.0, clock: Any = time.monotonic) -> None:
        self.uri = uri
        self.run_id = run_id
        self.job_dir = job_dir
        self.import_paths = list(import_paths)
        self.stale_s = float(stale_s)
        self.path = os.path.join(job_dir, JOURNAL_FILE)
        self.lost = 0
        self.errors = 0
        self.delivered = 0
        self._clock = clock
        self._last_ts = 0
        self._lines: list[bytes] = []
        self._cond = threading.Condition()
        self._closing = False
        self._journal_ok = True
        self._sink: Optional[Any] = None  # the sink process, once the delivery is taken over
        self._beat: Any = None
        self._beat_seen = clock()  # the lease gets stale_s from now to show its first beat
        self._lease_read = 0.0
        self._taking = threading.Lock()  # one takeover at a time (the thread's, close's)
        _end_torn_line(self.path)
        if taken(job_dir):  # an earlier attempt took the delivery over: this one delivers from the start
            self._sink = self._start_sink()
        self._thread = threading.Thread(target=self._loop, name="journal-sink", daemon=True)
        self._thread.start()

    # -- MlflowSink's surface -------------------------------------------------------------------------------------

    def _put(self, kind: str, payload: Any) -> None:
        if (len(payload) if kind in ("metrics", "tags") else 1) == 0:
            return
        line = record_line(kind, payload)
        with self._cond:
            self._lines.append(line)
            sink = self._sink
        if sink is not None:
            sink._put(kind, payload)

    @property
    def pending(self) -> int:
        """Lines not yet in the journal (what the launcher has yet to deliver is its own count)."""
        with self._cond:
            n = len(self._lines)
            sink = self._sink
        return n + (sink.pending if sink is not None else 0)

    @property
    def relayed(self) -> bool:
        """The launcher delivers (the delivery was not taken over)."""
        with self._cond:
            return self._sink is None

    def close(self, status: Optional[str] = None, timeout: float = 60.0) -> None:
        """The rest and a close line to the journal. The launcher delivers them unless its lease is stale, in which
        case this takes the delivery over and waits for it (at most ``timeout`` s, as the sink process's close)."""
        with self._cond:
            self._closing = True
            self._lines.append(close_line(status))
            self._cond.notify_all()
        self._thread.join(5.0)
        self.settle_delivery()
        with self._cond:
            unwritten = bool(self._lines)
        if self._sink is None and unwritten:  # the journal took no more: nobody could relay these
            self._take_over("the journal cannot be written")
        with self._cond:
            self._lines.clear()
        sink = self._sink
        if sink is None:
            return
        sink.close(status, timeout)
        self.lost += int(getattr(sink, "lost", 0) or 0)
        self.errors += int(getattr(sink, "errors", 0) or 0)
        self.delivered = int(getattr(sink, "delivered", 0) or 0)
        self.run_id = self.run_id or str(getattr(sink, "run_id", "") or "")

    # -- the thread -------------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._closing:
                    self._cond.wait(FLUSH_S)
                lines, self._lines = self._lines, []
                closing = self._closing
            try:
                if lines and not self._write(lines):
                    with self._cond:
                        self._lines[:0] = lines  # close() hands them to the takeover
                    if self._sink is None:
                        self._take_over("the journal cannot be written")
                if self._sink is None and not closing:
                    self._check_lease()
            except Exception:  # never the end of this thread: the next turn, or close, tries again
                log.exception("records journal: delivery check failed")
            if closing:
                return

    def _write(self, lines: list[bytes]) -> bool:
        if not self._journal_ok:
            return self._sink is not None  # the sink process has them; the journal stopped at its last good line
        try:
            with open(self.path, "ab") as fh:
                fh.write(b"".join(lines))
            return True
        except OSError as e:
            self._journal_ok = False
            log.error("records journal %s: %s", self.path, e)
            return False

    def _check_lease(self, force: bool = False, stale_s: Optional[float] = None) -> None:
        """Read the lease (every :data:`LEASE_CHECK_S`); take the delivery over when it is stale or stopped.
        ``stale_s`` given: only note a new beat (the caller decides)."""
        now = self._clock()
        if not force and now - self._lease_read < LEASE_CHECK_S:
            return
        self._lease_read = now
        lease = read_lease(self.job_dir)
        beat = lease.get("beat") if lease else None
        if beat is not None and beat != self._beat:
            self._beat, self._beat_seen = beat, now
        if lease and lease.get("stopped"):
            self._take_over("the launcher stopped relaying")
        elif stale_s is None and now - self._beat_seen > self.stale_s:
            self._take_over(f"no beat from the launcher's relay for {now - self._beat_seen:.0f} s")

    def settle_delivery(self) -> bool:
        """At the run's end: leave the rest to the launcher only if it beat lately (a beat seen within
        :data:`BEAT_FRESH_S`, else a new one within :data:`CLOSE_FRESH_S`); otherwise take the delivery over, so the
        run's records never wait on a dead launcher. True: the launcher delivers (the coordinator asks it for what
        only a waiting launcher does, the model's export)."""
        if self._sink is None:
            self._lease_at_close()
        return self.relayed

    def _lease_at_close(self) -> None:
        deadline = self._clock() + CLOSE_FRESH_S
        while True:
            self._check_lease(force=True, stale_s=CLOSE_FRESH_S)
            if self._sink is not None or self._clock() - self._beat_seen <= BEAT_FRESH_S:
                return
            if self._clock() >= deadline:
                self._take_over(f"no beat from the launcher's relay for {self._clock() - self._beat_seen:.0f} s")
                return
            time.sleep(0.05)

    def _take_over(self, why: str) -> None:
        """The sink process delivers from the launcher's delivered offset on: what is in the journal, then the rest.
        One at a time (a second caller finds it done); never raises (a record may go twice, never nowhere)."""
        with self._taking:
            with self._cond:
                if self._sink is not None:
                    return
            lease = read_lease(self.job_dir) or {}
            offset = int(lease.get("offset", 0) or 0)
            try:
                replay = claim(self.job_dir, offset)
            except OSError as e:  # a full disk: the relay may not see a claim, so replay (duplicates, not losses)
                log.error("records: could not claim the delivery (%s): replaying anyway", e)
                replay = True
            log.warning("records: %s: the job delivers them itself from byte %d of %s", why, offset, JOURNAL_FILE)
            sink = self._start_sink()
            if replay:
                while True:
                    batch, offset_after = read_lines(self.path, offset)
                    if not batch:
                        break
                    for _, line in batch:
                        if line and "kind" in line:
                            sink._put(str(line["kind"]), line["payload"])
                    offset = offset_after
            with self._cond:  # held while the rest goes: a record logged meanwhile comes after it, in order
                self._sink = sink
                # lines buffered but not yet written: the journal's next write has them too, the sink gets them now
                for raw in self._lines:
                    line = json.loads(raw)
                    if "kind" in line:
                        sink._put(str(line["kind"]), line["payload"])

    def _start_sink(self) -> Any:
        from flodl_exp.sink_process import start_sink

        return start_sink(self.uri, self.run_id, self.job_dir, self.import_paths)


def _end_torn_line(path: str) -> None:
    """A journal whose last line was torn (a coordinator killed mid-write) gets its newline first: the next
    attempt's first record then starts a line of its own instead of merging into the unreadable fragment."""
    try:
        with open(path, "rb+") as fh:
            if fh.seek(0, os.SEEK_END) and (fh.seek(-1, os.SEEK_END), fh.read(1))[1] != b"\n":
                fh.write(b"\n")
    except OSError:  # no journal yet (the common case), or unwritable: the first write says so
        pass


def relayed_by_launcher(config: Mapping[str, Any]) -> bool:
    """The job's launcher delivers its records: it waits on the job (``run.wait``) with ``tracking.relay`` on."""
    # (a spec written before relays existed has no tracking.relay: its launcher does not relay)
    return bool((config.get("run") or {}).get("wait", True)) and bool((config.get("tracking") or {}).get("relay", False))
