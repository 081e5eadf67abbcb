"""The launcher's side of the records journal (records_journal.py): it delivers the job's MLflow records.

:class:`RecordsRelay` starts as the job is submitted, before MLflow is even imported: from then on it renews its lease
every :data:`~flodl_exp.records_journal.BEAT_S` (so the coordinator knows somebody will deliver), and once the run
exists (:meth:`RecordsRelay.set_run`) it reads the journal's new lines at the same pace and hands them to an
in-process :class:`~flodl_exp.tracking.MlflowSink` (the same batching, retries, bounded buffer and loss counting as
the job's own sink). A coordinator's close with a status ends the run with it once everything before it is
delivered. :meth:`RecordsRelay.finish`, after the job is done, delivers the rest and says what was lost.

Its thread is nicer than the launcher's others (``yield_to_training(idle=False)``): the job's ranks train meanwhile.
A relay that stops before the job is done (the launcher gives up on it) says so in its lease, and the coordinator
delivers the rest itself; one killed stops beating, which the coordinator notices within ``tracking.relay_stale_s``.

``python -m flodl_exp.records_relay <job folder>`` delivers what a job's journal holds beyond the lease's offset: for
a launcher killed after its job's coordinator left (the run stays RUNNING until then).
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections import deque
from typing import Any, Optional

from flodl_exp.records_journal import BEAT_S, JOURNAL_FILE, LEASE_FILE, read_lease, read_lines, taken

log = logging.getLogger(__name__)

TERMINATE_WAIT_S = 60.0
"""How long a close's status waits for the records before it (then it is set anyway)."""


class RecordsRelay:
    """Delivers ``<job>/records.jsonl`` to the run; see the module's doc."""

    def __init__(self, job_dir: str, uri: str, run_id: str = "", *, offset: int = 0, beat_s: float = BEAT_S,
                 thread: bool = True) -> None:
        """``uri``: the store with its credentials (this process's own). ``thread`` False: no thread (the recovery
        command pumps by hand)."""
        self.job_dir = job_dir
        self.uri = uri
        self.path = os.path.join(job_dir, JOURNAL_FILE)
        self.beat_s = float(beat_s)
        self.lost = 0
        self.errors = 0
        self.delivered = 0
        self.skipped = 0
        """Journal lines that were not records (unreadable): logged, never delivered."""
        self.taken = False
        """A coordinator took the delivery over (this relay stopped handing records on)."""
        self._lock = threading.Lock()
        self._run_id = run_id
        self._offset = offset  # read up to here
        self._delivered_offset = offset  # delivered up to here (what a takeover replays from)
        self._handed: deque[tuple[int, int]] = deque()  # (points handed so far, journal offset after that record)
        self._points = 0
        self._sink: Any = None
        self._status: Optional[str] = None  # a close's status not yet applied
        self._status_since = 0.0
        self._status_at = 0  # where that close line starts: the delivered offset stays before it until it is applied
        self._lease_final = False  # the stopped lease is written: no beat may follow it
        self._beat = 0
        self._stop = threading.Event()
        self._finished = False
        self._thread: Optional[threading.Thread] = None
        if thread:
            self._write_lease()
            self._thread = threading.Thread(target=self._loop, name="flodl-records-relay", daemon=True)
            self._thread.start()

    def set_run(self, run_id: str) -> None:
        """The run now exists: deliveries start with the next beat."""
        with self._lock:
            self._run_id = run_id

    # -- the thread -------------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        from flodl_exp.background import yield_to_training

        yield_to_training(idle=False)  # the ranks train meanwhile; the sink's thread, started here, inherits it
        while not self._stop.wait(self.beat_s):
            try:
                self.pump()
            except Exception as e:  # a report; the next beat tries again, the lease goes on
                log.warning("records relay: %s: %s", type(e).__name__, e)
            if self._stop.is_set():
                break  # finish() owns the lease from here
            self._write_lease()

    def pump(self) -> None:
        """Hand the journal's new lines to the sink; apply a close's status once what came before is delivered."""
        with self._lock:
            run_id = self._run_id
        if not run_id or self.taken:
            return
        if taken(self.job_dir):
            self.taken = True
            log.warning("records relay: the job took the delivery over (%s)", os.path.join(self.job_dir, JOURNAL_FILE))
            return
        if self._sink is None:
            from flodl_exp.tracking import MlflowSink

            self._sink = MlflowSink(self.uri, run_id)
        while self._sink.pending < self._sink.max_records // 2:  # the journal keeps the rest while the store lags
            lines, after = read_lines(self.path, self._offset)
            if not lines:
                break
            start = self._offset
            for end, line in lines:
                if line is None or not ("kind" in line or "close" in line):
                    self.skipped += 1
                    log.warning("records relay: an unreadable line of %s skipped (ends at byte %d)", JOURNAL_FILE, end)
                elif "close" in line:
                    status = (line.get("close") or {}).get("status")
                    if status:
                        self._status, self._status_since, self._status_at = str(status), time.monotonic(), start
                else:
                    kind, payload = str(line["kind"]), line["payload"]
                    self._sink._put(kind, payload)
                    self._points += len(payload) if kind in ("metrics", "tags") else 1
                    self._handed.append((self._points, end))
                start = end
            self._offset = after
        self._settle()

    def _settle(self) -> None:
        """Move the delivered offset on; end the run with a close's status once nothing before it is pending."""
        sink = self._sink
        if sink is None:
            return
        delivered = int(sink.delivered) + int(sink.lost)
        while self._handed and self._handed[0][0] <= delivered:
            self._delivered_offset = self._handed.popleft()[1]
        if not self._handed:
            self._delivered_offset = self._offset
        if self._status:  # a recovery from this lease must still see the close line
            self._delivered_offset = min(self._delivered_offset, self._status_at)
        if self._status and (sink.pending == 0 or time.monotonic() - self._status_since > TERMINATE_WAIT_S):
            status, self._status = self._status, None
            from flodl_exp.tracking import client

            with self._lock:
                run_id = self._run_id
            try:
                client(self.uri).set_terminated(run_id, status=status)
            except Exception as e:
                self._status = status  # the next beat tries again
                raise RuntimeError(f"could not end the run {status}: {e}") from e

    def _write_lease(self, stopped: bool = False) -> None:
        from flodl_exp.fsio import atomic_bytes

        with self._lock:
            if self._lease_final:
                return
            self._lease_final = stopped
            self._beat += 1
            body = (f'{{"beat": {self._beat}, "offset": {self._delivered_offset}, "pid": {os.getpid()}, '
                    f'"stopped": {"true" if stopped else "false"}}}')
            with contextlib.suppress(OSError):  # the job folder gone or full: the coordinator sees no beat, takes over
                atomic_bytes(body.encode(), os.path.join(self.job_dir, LEASE_FILE), fsync=False)

    # -- the end ----------------------------------------------------------------------------------------------------

    def finish(self, timeout: float = 60.0, *, stopped: bool = False) -> None:
        """Deliver what is left (at most ``timeout`` s), then end the run with the last close's status if any.
        ``stopped``: the job may still run (a launcher giving up on it): the lease says so, so its coordinator
        delivers the rest. Idempotent."""
        if self._finished:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        alive = self._thread is not None and self._thread.is_alive()  # stuck on the store: it must not pump twice
        with contextlib.suppress(Exception):
            if not stopped and not alive:
                self.pump()
        sink = self._sink
        if sink is not None:
            sink.close(self._status, timeout=timeout)  # (a Ctrl-C in here: shutdown() calls this again)
            self._status = None
            self.lost, self.errors, self.delivered = int(sink.lost), int(sink.errors), int(sink.delivered)
            with contextlib.suppress(Exception):
                self._settle()
        self._write_lease(stopped=True)
        self._finished = True


def main(argv: list[str]) -> int:
    """Deliver a job's journal beyond its lease's offset (a launcher killed after its job ended)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m flodl_exp.records_relay",
                                description="Deliver the MLflow records a job's launcher did not (records.jsonl "
                                            "beyond records_relay.json's offset) and end its run.")
    p.add_argument("job_dir")
    p.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s records-relay %(levelname)s %(message)s")
    from flodl_exp.job_spec import JobSpec, RunIdMissing, read_run_id
    from flodl_exp.tracking import live_uri

    try:
        spec = JobSpec.load(os.path.join(args.job_dir, "spec.json"))
        run_id = spec.run_id or read_run_id(args.job_dir)
    except (ValueError, RunIdMissing) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not run_id:
        print(f"error: {args.job_dir}: no MLflow run id (run_id.json): the launcher never created the run",
              file=sys.stderr)
        return 2
    if taken(args.job_dir):
        print(f"{args.job_dir}: the job delivered its records itself ({JOURNAL_FILE} taken over): nothing to do")
        return 0
    offset = int((read_lease(args.job_dir) or {}).get("offset", 0) or 0)
    relay = RecordsRelay(args.job_dir, live_uri(spec.tracking_uri), run_id, offset=offset, thread=False)
    relay.pump()
    relay.finish(args.timeout)
    print(f"delivered {relay.delivered} record(s) of {args.job_dir} from byte {offset}; lost {relay.lost}")
    return 1 if relay.lost else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
