"""``rendezvous.json``: how ranks find the coordinator.

The coordinator writes host, port, store port and the job token into the job
folder (mode 0600, written atomically by :mod:`flodl_exp.fsio` so a reader never sees half a file);
ranks poll for it with a bounded wait. On SLURM the job folder is on shared
storage, which submitit already requires.
"""
from __future__ import annotations

import json
import os
import time
from typing import Callable, Optional

from flodl_exp.fsio import atomic_text

FILENAME = "rendezvous.json"


def write_rendezvous(job_dir: str, info: dict) -> str:
    path = os.path.join(job_dir, FILENAME)
    atomic_text(json.dumps(info), path, mode=0o600)  # the job token: the owner's only
    return path


class RendezvousTimeout(RuntimeError):
    pass


def incarnation(attempt: int) -> str:
    """Which run of the job this is: the spec's attempt (bumped by each checkpoint requeue) and
    SLURM's restart count (bumped by any requeue, e.g. after a node failure)."""
    return f"{int(attempt)}.{os.environ.get('SLURM_RESTART_COUNT', '0')}"


def wait_rendezvous(job_dir: str, timeout: float, alive: Optional[Callable[[], Optional[str]]] = None,
                    attempt: int = 0, since: Optional[float] = None) -> dict:
    """Wait up to ``timeout`` s (counted from ``since``, a ``time.monotonic()``, default now) for the
    coordinator's file; ``alive()`` returns a reason when it died.

    A file left by an earlier incarnation of a requeued job names a dead port: it is ignored
    until this incarnation's coordinator replaces it (see :func:`incarnation`).
    """
    path = os.path.join(job_dir, FILENAME)
    deadline = (time.monotonic() if since is None else since) + timeout
    want = incarnation(attempt)
    while True:
        try:
            with open(path) as fh:
                info = json.load(fh)
            if str(info.get("incarnation", "0.0")) == want:
                return info
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        if alive is not None:
            dead = alive()
            if dead:
                raise RendezvousTimeout(f"coordinator exited before rendezvous: {dead}")
        if time.monotonic() > deadline:
            raise RendezvousTimeout(
                f"no {FILENAME} in {job_dir} after {timeout:.0f}s: the coordinator did not start "
                "(see its log in the job folder); raise cluster.rendezvous_timeout_s if the cluster is slow")
        time.sleep(0.1)


def rank_marker_path(job_dir: str, rank: int) -> str:
    return os.path.join(job_dir, "ranks", f"rank{rank}.json")


DEATH_RECORD_SCHEMA = 1
"""The version of a rank's own death record (``ranks/death.r<rank>.json``)."""


def death_record_path(job_dir: str, rank: int) -> str:
    return os.path.join(job_dir, "ranks", f"death.r{rank}.json")


def write_death_record(job_dir: str, rank: int, world_size: int, error: str, traceback: str, *,
                       attempt: int = 0, phase: str = "training") -> Optional[str]:
    """The rank's own record of why it fails (the reference's per-rank death record: rank, world size, error,
    time, a schema number), written before it tells the coordinator: an error frame that never reaches the
    coordinator (it is gone, the link broke) still leaves its cause in the job folder. The coordinator keeps its
    own summary of every death (``<stem>.death.json``). Returns the path, or None when it could not be written
    (a full disk must not hide the original error). ``phase``: ``setup`` (before the rank joined: the coordinator
    names this error as the run's cause) or ``training``."""
    path = death_record_path(job_dir, rank)
    record = {"schema_version": DEATH_RECORD_SCHEMA, "rank": rank, "world_size": world_size, "error": error,
              "traceback": traceback, "unix_time": time.time(), "host": os.uname().nodename, "pid": os.getpid(),
              "incarnation": incarnation(attempt), "phase": phase}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_text(json.dumps(record), path, mode=0o600)
    except OSError:
        return None
    return path


def rank_traceback_path(job_dir: str, rank: int) -> str:
    """Where a rank's task keeps the full traceback of the exception it ended with (the console shows one line)."""
    return os.path.join(job_dir, "ranks", f"rank{rank}.traceback")


def note_user_error(job_dir: str, rank: int, attempt: int, user_error: str, user_frame: Optional[str],
                    traceback_path: Optional[str], traceback: str) -> Optional[str]:
    """Add the rank's error in the user's terms (``user_error``, ``user_frame``, ``traceback_path``) to its death
    record of this incarnation, which the rank wrote when it reported its failure; a rank that failed before it
    could report (a dial that failed) gets a record of phase ``task`` now. The launcher's one-line failure reads
    these keys (flodl_exp/failure_cause.py). Returns the path, or None when it could not be written."""
    path = death_record_path(job_dir, rank)
    record = _read_record(path, attempt)
    if record is None and write_death_record(job_dir, rank, 0, user_error, traceback[-4000:], attempt=attempt,
                                             phase="task") is not None:
        record = _read_record(path, attempt)
    if record is None:
        return None
    record.update(user_error=user_error, user_frame=user_frame, traceback_path=traceback_path)
    try:
        atomic_text(json.dumps(record), path, mode=0o600)
    except OSError:
        return None
    return path


def _load_record(path: str) -> Optional[dict]:
    """The death record at ``path``, or None (absent, unreadable, not an object)."""
    try:
        with open(path) as fh:
            record = json.load(fh)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _read_record(path: str, attempt: int) -> Optional[dict]:
    """The death record at ``path`` when it is this incarnation's, else None."""
    record = _load_record(path)
    return record if record is not None and str(record.get("incarnation")) == incarnation(attempt) else None


def read_death_records(job_dir: str, world_size: int, attempt: Optional[int] = None) -> dict[int, dict]:
    """Every rank's death record by rank (of ``attempt`` when given: the launcher, outside the job, knows the attempt
    but not SLURM's restart count, the second half of an incarnation)."""
    out: dict[int, dict] = {}
    for rank in range(world_size):
        rec = _load_record(death_record_path(job_dir, rank))
        if rec is not None and (attempt is None or str(rec.get("incarnation", "")).split(".")[0] == str(attempt)):
            out[rank] = rec
    return out


def death_record_of(job_dir: str, rank: int, attempt: int) -> Optional[dict]:
    """``rank``'s death record of this incarnation (any phase), or None."""
    return _read_record(death_record_path(job_dir, rank), attempt)


def setup_failure(job_dir: str, rank: int, attempt: int) -> Optional[str]:
    """The one-line error of ``rank`` when this incarnation's rank failed to set up (its death record says so), else
    None."""
    rec = death_record_of(job_dir, rank, attempt)
    if rec is None or rec.get("phase") != "setup":
        return None
    return str(rec.get("error"))


def write_rank_marker(job_dir: str, rank: int, attempt: int) -> None:
    """Each task says who runs rank ``rank`` (pid, host, incarnation) before it dials the coordinator, so a
    rank lost before it connected can be named at once instead of after a process-group timeout."""
    path = rank_marker_path(job_dir, rank)
    atomic_text(json.dumps({"pid": os.getpid(), "host": os.uname().nodename, "incarnation": incarnation(attempt)}),
                path, mode=0o600)


def lost_before_join(job_dir: str, rank: int, attempt: int) -> Optional[str]:
    """Why ``rank`` can no longer connect (its task's process on this host is gone), or None when
    it may still: no marker yet, a marker of another incarnation, or a process on another host."""
    try:
        with open(rank_marker_path(job_dir, rank)) as fh:
            info = json.load(fh)
    except (OSError, ValueError):
        return None
    if str(info.get("incarnation")) != incarnation(attempt) or info.get("host") != os.uname().nodename:
        return None
    pid = int(info.get("pid", 0))
    if pid <= 0:
        return None
    gone = f"its process {pid} on {info.get('host')} exited before it connected"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return gone
    except PermissionError:
        return None
    return gone if _exited_unreaped(pid) else None


def process_state(pid: int) -> Optional[str]:
    """The one-letter state of ``pid`` from Linux's /proc (``R``, ``S``, ``Z`` zombie, ``X`` dead...), or None
    when it cannot be read (gone, or not Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:stat.rfind(")") + 3] or None


def _exited_unreaped(pid: int) -> bool:
    """``pid`` exited but its parent (the task manager, which polls) has not reaped it yet: signal 0 still
    reaches a zombie, and a killed rank is one for that while, which is when its peers' collateral failures
    arrive. Linux's /proc; elsewhere a zombie reads as alive until it is reaped."""
    return process_state(pid) in ("Z", "X")
