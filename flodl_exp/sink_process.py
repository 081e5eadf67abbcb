"""The MLflow sink in its own process: the coordinator never imports MLflow.

MLflow's import and the SQL store's first opening cost 2-3.5 s of CPU. In the coordinator's interpreter (the sink's
thread) that import held the GIL in turns with the event loop through the ranks' start-up and the first epochs: the
coordinator answered the ranks late (~300 ms over the first windows) and mode=auto's simulations ran 10x slower
beside it (0.2-0.5 s against 0.03 s alone; docs/reference/measurements.md, auto mode). In a child process the
import only takes a core the ranks are not using, and the coordinator's interpreter stays free for the ranks.

:class:`ProcessSink` has :class:`~flodl_exp.tracking.MlflowSink`'s surface. Its records go as JSON lines (never
pickles) over the child's stdin, written by a thread so a slow child never blocks the event loop; the child runs an
:class:`~flodl_exp.tracking.MlflowSink` (the same batching, retries, bounded buffer and loss counting) and answers
on stdout with what it delivered. A child that dies hands what it never received to an in-process sink, and what it
received but never delivered is counted in :attr:`ProcessSink.lost`: a record is never lost silently. A coordinator
that dies closes the child's stdin: the child delivers what it holds, then exits (:data:`ORPHAN_CLOSE_S`).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any, Mapping, Optional, Sequence

from flodl_exp.tracking import RecordSurface

log = logging.getLogger(__name__)

ORPHAN_CLOSE_S = 30.0
"""How long a child whose coordinator is gone (stdin closed without a close) keeps delivering before it exits."""

CLOSE_MARGIN_S = 10.0
"""What :meth:`ProcessSink.close` waits beyond its timeout for the child's answer (the terminal status's own budget)."""


def _count(kind: str, payload: Any) -> int:
    return len(payload) if kind in ("metrics", "tags") else 1


class ProcessSink(RecordSurface):
    """MLflow records delivered by a child process (``python -m flodl_exp.sink_process``); see the module's doc."""

    def __init__(self, uri: str, run_id: str, job_dir: str, import_paths: Sequence[str] = (),
                 max_records: int = 200_000) -> None:
        """``run_id``: the run's id, or "" when the launcher publishes it in ``job_dir`` later (the child waits)."""
        self.uri = uri
        self.run_id = run_id
        self.job_dir = job_dir
        self.import_paths = list(import_paths)
        self.max_records = int(max_records)
        self.lost = 0
        self.errors = 0
        self.delivered = 0
        self._last_ts = 0
        self._queue: deque[Optional[tuple[str, Any]]] = deque()  # None: the close message
        self._cond = threading.Condition()
        self._sent = 0  # records the child received
        self._queued = 0  # records in _queue
        self._closed: Optional[dict[str, Any]] = None  # the child's last answer
        self._close_args: tuple[Optional[str], float] = (None, 60.0)
        self._fallback: Optional[Any] = None  # an in-process MlflowSink once the child is gone
        self._proc = self._spawn()
        self._writer = threading.Thread(target=self._write_loop, name="mlflow-sink-writer", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="mlflow-sink-reader", daemon=True)
        self._writer.start()
        self._reader.start()

    def _spawn(self) -> subprocess.Popen[bytes]:
        pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([pkg_root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        cmd = [sys.executable, "-m", "flodl_exp.sink_process", "--uri", self.uri, "--run-id", self.run_id,
               "--job-dir", self.job_dir, "--max-records", str(self.max_records)]
        for p in self.import_paths:
            cmd += ["--path", p]
        return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)

    # -- MlflowSink's surface -------------------------------------------------------------------------------------

    def _put(self, kind: str, payload: Any) -> None:
        if _count(kind, payload) == 0:
            return
        with self._cond:
            if self._fallback is not None:
                fallback = self._fallback
            else:
                self._queue.append((kind, payload))
                self._queued += _count(kind, payload)
                # bounded as the sink's own buffer is: a child that stopped reading never grows this one past it
                # (the head may be on its way to the child: the next oldest goes)
                while self._queued > self.max_records and len(self._queue) > 2 and self._queue[1] is not None:
                    dropped = self._queue[1]
                    del self._queue[1]
                    assert dropped is not None
                    n = _count(*dropped)
                    self._queued -= n
                    if self.lost == 0:
                        log.warning("mlflow sink process: not reading (%d records queued): dropping the oldest",
                                    self.max_records)
                    self.lost += n
                self._cond.notify_all()
                return
        fallback._put(kind, payload)

    @property
    def pending(self) -> int:
        """Records not yet delivered (queued here, or held by the child)."""
        with self._cond:
            queued = sum(_count(*item) for item in self._queue if item is not None)
            return queued + max(0, self._sent - self.delivered) + (self._fallback.pending if self._fallback else 0)

    def close(self, status: Optional[str] = None, timeout: float = 60.0) -> None:
        """Deliver everything (at most ``timeout`` s), count what is left in :attr:`lost`, optionally end the run
        with ``status``: the child does it and answers; a child that does not answer in time is killed and what it
        held is counted lost."""
        deadline = time.monotonic() + timeout + CLOSE_MARGIN_S
        with self._cond:
            self._close_args = (status, float(timeout))
            if self._fallback is None:
                self._queue.append(None)
                self._cond.notify_all()
            while self._fallback is None and self._closed is None and time.monotonic() < deadline:
                self._cond.wait(min(0.5, max(0.0, deadline - time.monotonic())))
            closed, fallback = self._closed, self._fallback
        if closed is not None:
            self.run_id = str(closed.get("run_id") or self.run_id)
            self.errors = int(closed.get("errors", self.errors))
            self.delivered = int(closed.get("delivered", self.delivered))
            self.lost += int(closed.get("lost", 0))
            try:
                self._proc.wait(5.0)
            except subprocess.TimeoutExpired:  # it answered: what is left of it is its teardown
                self._kill()
            return
        if fallback is not None:
            fallback.close(status, timeout=max(1.0, deadline - CLOSE_MARGIN_S - time.monotonic()))
            self.lost += fallback.lost
            self.errors += fallback.errors
            self.run_id = self.run_id or fallback.run_id
            return
        log.error("mlflow sink process: no answer within %.0f s: stopped; what it held is lost", timeout + CLOSE_MARGIN_S)
        self._kill()
        with self._cond:
            self.lost += max(0, self._sent - self.delivered)
            self.lost += sum(_count(*item) for item in self._queue if item is not None)
            self._queue.clear()

    # -- the pipes --------------------------------------------------------------------------------------------------

    def _write_loop(self) -> None:
        stdin = self._proc.stdin
        assert stdin is not None
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                item = self._queue[0]
            line: dict[str, Any]
            if item is None:
                status, timeout = self._close_args
                line = {"close": {"status": status, "timeout": timeout}}
            else:
                line = {"kind": item[0], "payload": item[1]}
            try:
                stdin.write(json.dumps(line, allow_nan=True).encode() + b"\n")
                stdin.flush()
            except (OSError, ValueError):  # the child is gone: _read_loop takes over
                return
            with self._cond:
                self._queue.popleft()
                if item is None:
                    break
                self._queued -= _count(*item)
                self._sent += _count(*item)
        try:
            stdin.close()
        except OSError:
            pass

    def _read_loop(self) -> None:
        stdout = self._proc.stdout
        assert stdout is not None
        for raw in stdout:
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            with self._cond:
                if "run_id" in msg and msg["run_id"]:
                    self.run_id = str(msg["run_id"])
                if "delivered" in msg:
                    self.delivered = int(msg["delivered"])
                    self.errors = int(msg.get("errors", self.errors))
                if "closed" in msg:
                    self._closed = dict(msg["closed"])
                    self._cond.notify_all()
                    return
        self._proc.wait()
        self._take_over()

    def _take_over(self) -> None:
        """The child died before its close answer: an in-process sink delivers what it never received."""
        from flodl_exp.tracking import MlflowSink

        with self._cond:
            if self._closed is not None or self._fallback is not None:
                return
            lost = max(0, self._sent - self.delivered)
            rest = [item for item in self._queue if item is not None]
            self._queue.clear()
            self._queued = 0
            log.error("mlflow sink process exited (code %s): %d record(s) it held are lost; the rest go through "
                      "this process", self._proc.returncode, lost)
            self.lost += lost
            job_dir = self.job_dir
            fallback = MlflowSink(self.uri, self.run_id or (lambda: _wait_run_id(job_dir)), self.max_records)
            for kind, payload in rest:
                fallback._put(kind, payload)
            self._fallback = fallback
            self._cond.notify_all()

    def _kill(self) -> None:
        try:
            self._proc.kill()
            self._proc.wait(5.0)
        except (OSError, subprocess.TimeoutExpired):
            pass


def start_sink(uri: str, run_id: str, job_dir: str, import_paths: Sequence[str] = ()) -> Any:
    """The coordinator's sink: a :class:`ProcessSink`, or the in-process sink when no child process can start."""
    try:
        return ProcessSink(uri, run_id, job_dir, import_paths)
    except OSError as e:
        from flodl_exp.tracking import MlflowSink

        log.warning("mlflow sink process did not start (%s): the sink runs in the coordinator", e)
        return MlflowSink(uri, run_id or (lambda: _wait_run_id(job_dir)))


def _wait_run_id(job_dir: str) -> str:
    from flodl_exp.job_spec import wait_run_id

    return wait_run_id(job_dir)


# -- the child --------------------------------------------------------------------------------------------------------

class _Answers:
    """The child's stdout: one JSON line per message, from the sink's thread and the main one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._out = sys.stdout.buffer

    def send(self, msg: Mapping[str, Any]) -> None:
        with self._lock:
            try:
                self._out.write(json.dumps(msg).encode() + b"\n")
                self._out.flush()
            except (OSError, ValueError):
                pass


def child_main(argv: Sequence[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m flodl_exp.sink_process")
    p.add_argument("--uri", required=True)
    p.add_argument("--run-id", default="")
    p.add_argument("--job-dir", required=True)
    p.add_argument("--max-records", type=int, default=200_000)
    p.add_argument("--path", action="append", default=[])
    args = p.parse_args(argv)
    # The coordinator decides when records end (SLURM's SIGTERM goes to every process of the step): its close,
    # or its stdin's end, not a signal, ends this process.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from flodl_exp.background import yield_to_training

    yield_to_training()  # before any thread starts: MLflow's import and deliveries take only what the ranks leave idle
    logging.basicConfig(level=logging.INFO, format="%(asctime)s mlflow-sink %(levelname)s %(message)s", stream=sys.stderr)
    for path in reversed(args.path):  # the experiment's modules (a logged model is built here)
        if path not in sys.path:
            sys.path.insert(0, path)
    from flodl_exp.tracking import MlflowSink

    answers = _Answers()
    job_dir = args.job_dir
    sink = MlflowSink(args.uri, args.run_id or (lambda: _wait_run_id(job_dir)), args.max_records,
                      on_progress=lambda s: answers.send({"run_id": s.run_id, "delivered": s.delivered,
                                                          "errors": s.errors}))
    close: Optional[Mapping[str, Any]] = None
    for raw in sys.stdin.buffer:
        try:
            msg = json.loads(raw)
        except ValueError:
            log.error("mlflow sink process: an unreadable line from the coordinator (%d bytes) skipped", len(raw))
            continue
        if "close" in msg:
            close = msg["close"]
            break
        sink._put(str(msg["kind"]), msg["payload"])
    if close is None:
        log.warning("mlflow sink process: the coordinator is gone: delivering what is held (at most %.0f s)", ORPHAN_CLOSE_S)
        sink.close(None, timeout=ORPHAN_CLOSE_S)
        return 1
    sink.close(close.get("status"), timeout=float(close.get("timeout", 60.0)))
    answers.send({"closed": {"run_id": sink.run_id, "delivered": sink.delivered, "errors": sink.errors,
                             "lost": sink.lost}})
    return 0


if __name__ == "__main__":
    code = child_main(sys.argv[1:])
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # without MLflow's and SQLAlchemy's teardown
