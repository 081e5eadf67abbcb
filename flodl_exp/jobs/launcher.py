"""Compose launcher, coordinator and ranks: ``launch(cfg) -> RunHandle``.

The launcher validates the config, writes the job spec into a fresh job folder,
submits one submitit job of ``world_size`` tasks and then creates the MLflow run
(params, tags), while the job's processes start: MLflow's import and the run's
creation are off the job's start-up, and the run's id reaches the job through
``<job>/run_id.json`` (spec.publish_run_id). The handle mirrors the reference's: ``next_metrics()``,
``poll_metrics()``, ``join()`` (the final consensus state) and ``shutdown()``.
Progress comes from ``events.jsonl``, which the coordinator appends to.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Optional, cast

from omegaconf import DictConfig, OmegaConf

from flodl_exp.bundle_meta import resolve_shuffle_seed
from flodl_exp.config import ConfigError, RunShape, mode_name, world_size
from flodl_exp.config_rules import validate
from flodl_exp.events import End, EventRecord
from flodl_exp.hooks import HookCaller
from flodl_exp.policy.controllers import guard_name


class RunFailed(RuntimeError):
    """The run ended FAILED (or was cancelled); the message carries the reason in full (the coordinator's text, the
    task's traceback), ``headline`` its first cause in one line (the rank, the user's exception and own frame, the
    traceback file: flodl_exp/failure_cause.py), which is what the CLI prints unless ``run.verbose``."""

    def __init__(self, message: str, headline: Optional[str] = None) -> None:
        super().__init__(message)
        from flodl_exp.failure_cause import first_line

        self.headline = headline or first_line(message) or message


class SubmitFailed(RuntimeError):
    """The scheduler refused the job (or could not be asked): one line, and the exit status for the CLI
    (2: no ``sbatch`` / SLURM not reachable or not configured; 1: the job itself was refused)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


_SLURM_UNREACHABLE = ("unable to contact slurm controller", "could not establish a configuration source",
                      "slurm.conf", "slurm_conf", "communication connection failure", "zero bytes were transmitted",
                      "authentication failure", "munge", "connection refused")


def _stderr(line: str) -> None:
    """A warning for the launching process's user (launch()'s hooks run there)."""
    print(f"warning: {line}", file=sys.stderr)


def submit_error(e: BaseException, executor: str) -> SubmitFailed:
    """One line for a refused submission: sbatch's own message and what to check."""
    if (isinstance(e, FileNotFoundError) or (isinstance(e, OSError) and e.errno == 2)
            or "could not detect" in str(e).lower()):  # submitit: 'Could not detect "srun"'
        what = getattr(e, "filename", None) or "sbatch"
        return SubmitFailed(f"submit failed: {what} not found on PATH: cluster=slurm needs the SLURM client "
                            "commands (sbatch) on this machine (or use cluster=local)", 2)
    lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
    msg = next((x for x in reversed(lines) if "error" in x.lower()), lines[-1] if lines else type(e).__name__)
    if executor != "slurm":
        return SubmitFailed(f"submit failed: {msg}", 1)
    if any(k in msg.lower() for k in _SLURM_UNREACHABLE):
        return SubmitFailed(f"submit failed: {msg} (check that slurmctld is up and reachable from here and that "
                            "SLURM_CONF / slurm.conf names it: `scontrol ping`)", 2)
    return SubmitFailed(f"submit failed: {msg} (check cluster.slurm.* against what the cluster allows: partition, "
                        "account, qos, time_min, mem_gb, gpus_per_node; `sinfo`, `sacctmgr show assoc user=$USER`)", 1)


def _private_dir(path: str) -> None:
    """``path`` owner-only (0700): nobody else may plant files (submitit pickles) in it."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)


def _private_write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def _redact_config(resolved: dict[str, Any], uri: str) -> dict[str, Any]:
    """The resolved config with every copy of the tracking URI (and its redacted form) stripped of secrets."""
    from flodl_exp.tracking import redact_uri

    def walk(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, str) and "://" in v:
            return redact_uri(v)
        return v

    return cast(dict[str, Any], walk(resolved))


def run_name(cfg: Any) -> str:
    spec = RunShape.of(cfg).outer
    outer = "" if not spec.stateful else f"/{spec.target.rpartition('.')[2] if spec.target else spec.kind}"
    mode = "auto" if getattr(cfg.mode, "auto", False) else mode_name(cfg)  # auto: the tag mode says what it chose
    return cfg.tracking.run_name or f"{cfg.experiment.name}/{mode}/{guard_name(cfg.guard).rpartition('.')[2]}{outer}"


def _tags(cfg: Any, root: str) -> dict[str, str]:
    from flodl_exp.tracking import git_commit

    tags = {
        "mode": mode_name(cfg), "policy": cfg.mode.policy, "backend": cfg.mode.backend, "guard": guard_name(cfg.guard),
        "cluster": cfg.cluster.name, "world_size": str(world_size(cfg)), "experiment": cfg.experiment.name,
        "outer": RunShape.of(cfg).outer.describe(),
    }
    commit = git_commit(root)
    if commit:
        tags["git_commit"] = commit
    try:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
        tags["hydra.output_dir"] = hc.runtime.output_dir
        if hc.mode is not None and str(hc.mode).endswith("MULTIRUN"):
            tags["sweep_dir"] = hc.sweep.dir
    except Exception:
        pass
    return tags


CANCEL_WAIT_S = 20.0
"""SLURM: how long :meth:`RunHandle.shutdown` waits for the scheduler to report the cancelled job ended."""
KILL_WAIT_S = 5.0
"""Local: how long :meth:`RunHandle.shutdown` waits for the killed processes of the job to be gone."""
HOST_LOST = "coordinator_host_lost"
"""``end_reason`` of a run whose task 0 (the coordinator's host) ended without a result."""


def _children(parents: set[int]) -> set[int]:
    """The processes whose parent is in ``parents`` (Linux /proc; empty where it cannot be read)."""
    out: set[int] = set()
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid in parents:
            out.add(int(name))
    return out


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def kill_tree(root: int) -> set[int]:
    """SIGKILL ``root`` and every process under it; returns their pids.

    Each process is frozen (SIGSTOP) as it is found, before its children are looked up: a frozen
    process starts nothing and is not reaped, so none escapes the walk by being reparented to init
    in between (task 0 dying first would hand the coordinator to init, and we would miss it)."""
    found: set[int] = set()
    todo = {root}
    for _ in range(64):  # bounded: a tree deeper than this is not ours
        todo -= found
        if not todo:
            break
        found |= {p for p in todo if _signal(p, signal.SIGSTOP)}
        todo = _children(todo)
    for p in found:
        _signal(p, signal.SIGKILL)
    return found


def _alive(pid: int) -> bool:
    """Alive and not a zombie (a killed child of a dead parent waits for init to reap it)."""
    from flodl_exp.rendezvous import process_state

    return process_state(pid) not in (None, "Z", "X")


@contextlib.contextmanager
def _sigint_ignored(on: bool) -> Iterator[None]:
    """SIGINT ignored while the job's processes are started, so they inherit the disposition (exec keeps an
    ignored signal ignored, and Python then installs no KeyboardInterrupt handler). Only from the main thread:
    elsewhere Python cannot change a handler."""
    if not on or threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old if old is not None else signal.default_int_handler)


MetricsFn = Callable[[int, dict[str, float]], None]
"""``metrics_fn(epoch, metrics)``: an epoch's aggregated metrics (loss, samples/s, per-rank ...)."""
EvalResultFn = Callable[[int, dict[str, float]], None]
"""``eval_result_fn(epoch, metrics)``: a periodic or final eval's metrics (``eval/<name>``)."""


class RunHandle:
    """A submitted run: its progress events, its result, and the user's callbacks.

    ``metrics_fn`` and ``eval_result_fn`` (the reference's builder hooks) are called in this process, in order, as
    the events reach it: from :meth:`wait`, :meth:`poll_events`, :meth:`poll_metrics` and :meth:`next_metrics`. A
    callback that raises is called again for the next record, as the reference's are: each distinct error is
    printed once on stderr, and the counts when the run ends (flodl_exp/hooks.py). ``hooks.metrics_fn`` /
    ``hooks.eval_result_fn`` in the config are the same hooks called in the coordinator's job instead."""

    def __init__(self, *, cfg: Any, run_id: str, tracking_uri: str, job_dir: str, job: Any, stem: str,
                 live_uri: Optional[str] = None, metrics_fn: Optional[MetricsFn] = None,
                 eval_result_fn: Optional[EvalResultFn] = None) -> None:
        self.cfg = cfg
        self.run_id = run_id
        self.tracking_uri = tracking_uri  # without credentials: what is printed and written
        self._live_uri = live_uri or tracking_uri  # with them, in this object only: what this process connects with
        self.job_dir = job_dir
        self.job = job
        self.stem = stem
        self._offset = 0
        self._buffer = ""
        self._queue: list[dict] = []
        self.events: list[dict] = []
        self.result: Optional[dict] = None
        self._ended = False
        self.model_export: Optional[Any] = None
        """The background MLflow model export (a Popen) once the run FINISHED with ``tracking.log_model``."""
        self._last_force = 0.0
        self._t0 = time.monotonic()
        self._callbacks: dict[str, HookCaller] = {"epoch": HookCaller("metrics_fn", metrics_fn, _stderr),
                                                   "eval": HookCaller("eval_result_fn", eval_result_fn, _stderr)}
        self.prediction: Optional[dict[str, float]] = None
        """Once FINISHED: the simulator's ``predicted/*`` for this run (and ``measured/samples_per_s``), as logged."""
        self.relay: Optional[Any] = None
        """The :class:`~flodl_exp.records_relay.RecordsRelay` delivering the job's MLflow records (``tracking.relay``
        with ``run.wait``), else None (the job delivers them)."""

    @property
    def job_id(self) -> str:
        return str(self.job.job_id)

    def client(self) -> Any:
        """An MlflowClient on the run's store, connected with the credentials ``tracking_uri`` hides."""
        from flodl_exp.tracking import client

        return client(self._live_uri)

    @property
    def on_slurm(self) -> bool:
        return self.cfg.cluster.executor == "slurm"

    def log_paths(self) -> dict[str, str]:
        """Where the job writes: task 0's submitit logs, the coordinator log, the events stream."""
        paths = {"coordinator": os.path.join(self.job_dir, "coordinator.log"),
                 "events": os.path.join(self.job_dir, "events.jsonl")}
        try:
            t0 = self.job.task(0) if self.job.num_tasks > 1 else self.job
            paths["task0 stdout"], paths["task0 stderr"] = str(t0.paths.stdout), str(t0.paths.stderr)
        except Exception:
            pass
        return paths

    def queue_state(self) -> str:
        """The scheduler's view: ``PENDING (Resources)``, ``RUNNING``, ... (SLURM: squeue, then sacct)."""
        if not self.on_slurm:
            return "RUNNING" if not self.job.done() else "DONE"
        import subprocess

        try:
            out = subprocess.run(["squeue", "-h", "-j", self.job_id, "-o", "%T|%r"], capture_output=True, text=True,
                                 timeout=10).stdout.strip()
            if out:
                state, _, reason = out.splitlines()[0].partition("|")
                return f"{state} ({reason})" if reason and reason not in ("None", "(null)") else state
        except (OSError, subprocess.SubprocessError):
            pass
        try:
            return str(self.job.state)
        except Exception:
            return "UNKNOWN"

    def _read_events(self) -> None:
        path = os.path.join(self.job_dir, "events.jsonl")
        try:
            with open(path) as fh:
                fh.seek(self._offset)
                chunk = fh.read()
                self._offset = fh.tell()
        except FileNotFoundError:
            return
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split("\n")
        for line in lines:
            if line.strip():
                try:
                    ev = json.loads(line)
                except ValueError:  # a line torn by a writer killed mid-write (the next one starts afresh)
                    continue
                self.events.append(ev)
                self._queue.append(ev)
                self._call_back(ev)

    def _call_back(self, ev: dict) -> None:
        """launch()'s ``metrics_fn`` / ``eval_result_fn`` with an epoch's or an eval's record (flodl_exp/hooks.py:
        called again after one raises, each distinct error printed once, the counts when the run ends)."""
        kind = str(ev.get("event"))
        hook = self._callbacks.get(kind)
        if hook is None or not isinstance(ev.get("epoch"), int):
            return
        skip = ("event", "epoch", "t", "wall", "final")
        metrics = {k: float(v) for k, v in ev.items() if k not in skip and isinstance(v, (int, float))}
        if kind == "eval" and not metrics:
            return  # a failed eval (logged and tagged by the job): no hook call, as in the coordinator
        if ev.get("final") is True:
            metrics["final"] = 1.0
        hook(int(ev["epoch"]), metrics)

    def poll_events(self) -> list[dict]:
        """Every new event (started, epoch, eval, end, ...) since the last call."""
        self._read_events()
        out, self._queue = self._queue, []
        return out

    def poll_metrics(self) -> list[dict]:
        """New aggregated epoch metrics since the last call, without blocking."""
        return [e for e in self.poll_events() if e.get("event") == "epoch"]

    def next_metrics(self, timeout: Optional[float] = None) -> Optional[dict]:
        """Block until the next epoch's metrics (None when the run ended first)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._read_events()
            for i, ev in enumerate(self._queue):
                if ev.get("event") == "epoch":
                    del self._queue[: i + 1]
                    return ev
            if self.done() or (deadline is not None and time.monotonic() > deadline):
                return None
            time.sleep(0.1)

    def done(self) -> bool:
        if self.on_slurm and time.monotonic() - self._last_force > 3.0:
            # submitit's sacct watcher backs off to minutes on long jobs; ask every few seconds.
            self._last_force = time.monotonic()
            try:
                self.job.get_info(mode="force")
            except Exception:
                pass
        return self.job.done()

    def wait(self) -> dict:
        """Wait for every task; end the MLflow run; return result.json. Raises RunFailed."""
        from flodl_exp.tracking import end_run

        error: Optional[str] = None
        while not self.done():
            # the events as they come: the callbacks in time, and the simulator's import once the run started
            self._read_events()
            time.sleep(0.1)
        path = os.path.join(self.job_dir, "result.json")
        if not self.on_slurm or os.path.exists(path):
            # submitit waits 15 s per task for a result pickle that is not there. Locally every task wrote its
            # pickle before its process ended, so one missing now never comes; on SLURM, with result.json
            # written, it is a task SIGKILLed by SLURM.
            for j in [self.job, *getattr(self.job, "_sub_jobs", [])]:
                j._results_timeout_s = 2 if self.on_slurm else 0
        try:
            self.job.results()
        except Exception as e:  # FailedJobError / UncompletedJobError carry the task's traceback tail
            error = f"{type(e).__name__}: {e}"
        self._read_events()
        for hook in self._callbacks.values():  # each hook's error counts, once
            hook.close()
        self._finish_relay()
        if os.path.exists(path):
            with open(path) as fh:
                self.result = json.load(fh)
            self._record_relay_loss(path)
        else:
            lost = self._host_task_lost()
            if lost is not None:
                self._fail_host_lost(lost)
                raise RunFailed(lost)
        result = self.result or {}
        status = result.get("status")
        if status == "FINISHED":
            # Tasks of ranks the coordinator declared dead and recovered from fail in submitit's eyes;
            # the run itself finished, so it is FINISHED with the deaths recorded.
            if error is not None:
                self.client().set_tag(self.run_id, "recovered_task_errors", _tail_lines(error, 20)[:5000])
            end_run(self._live_uri, self.run_id, "FINISHED")
            self._ended = True
            self._log_prediction(result)
            self._start_model_export()  # after the prediction: the export's imports (seconds of CPU) do not slow it
            return result
        setup = self._setup_failures(result.get("attempt"))
        reason = result.get("failure") or error or "the job ended without a result"
        if setup and not result.get("failure"):
            reason = "; ".join(setup)  # the ranks said why in one line each (their tracebacks: ranks/, MLflow)
        elif error and result.get("failure") and error not in reason and "could not set up" not in reason:
            reason = f"{reason}\n{error}"
        end_run(self._live_uri, self.run_id, "FAILED", error=reason)
        self._ended = True
        if setup:
            from flodl_exp.failure_cause import setup_headline

            headline = setup_headline(setup, result.get("failure"))
        else:
            headline = self._headline(result, error)
        raise RunFailed(_tail_lines(reason, 40), headline=headline)

    def _headline(self, result: dict, error: Optional[str]) -> str:
        """The failed run's first cause in one line: the rank the coordinator blamed first, told by its own death
        record (the user's exception and innermost frame, the traceback file) or, when it left none (killed), by
        the coordinator's first line; without a coordinator's word, the task's error line."""
        from flodl_exp.constants import COORDINATOR_LOG
        from flodl_exp.failure_cause import headline
        from flodl_exp.rendezvous import read_death_records

        attempt = result.get("attempt")
        records = read_death_records(self.job_dir, world_size(self.cfg), None if attempt is None else int(attempt))
        return headline(result.get("failure"), result.get("deaths") or [], records, error or "",
                        os.path.join(self.job_dir, COORDINATOR_LOG), self._task_logs())

    def _task_logs(self) -> dict[int, str]:
        """Each rank's task log (submitit's stderr file; task ``r`` runs rank ``r``), where submitit says."""
        logs: dict[int, str] = {}
        for rank in range(world_size(self.cfg)):
            try:
                task = self.job.task(rank) if self.job.num_tasks > 1 else self.job
                logs[rank] = str(task.paths.stderr)
            except Exception:  # a job submitit cannot describe: the line goes without it
                continue
        return logs

    def _finish_relay(self, timeout: float = 60.0, *, stopped: bool = False) -> None:
        """The job's records delivered (its journal read to the end), before the run is ended below."""
        if self.relay is not None:
            try:
                self.relay.finish(timeout, stopped=stopped)
            except Exception as e:  # a report: the run's status is still set below
                print(f"warning: the job's MLflow records were not all delivered: {type(e).__name__}: {e}",
                      file=sys.stderr)

    def _record_relay_loss(self, path: str) -> None:
        """Records the relay could not deliver: counted in result.json, as the job's own sink counts its losses."""
        lost = int(getattr(self.relay, "lost", 0) or 0)
        if lost and self.result is not None:
            from flodl_exp.fsio import atomic_json

            self.result["tracking_lost_records"] = int(self.result.get("tracking_lost_records", 0) or 0) + lost
            with contextlib.suppress(OSError):
                atomic_json(self.result, path)

    def _predicts(self) -> bool:
        """``tracking.predict`` is on and the run has ranks to compare (world size 2+)."""
        return bool(getattr(self.cfg.tracking, "predict", True)) and world_size(self.cfg) >= 2

    def _log_prediction(self, result: dict) -> None:
        """The simulator's prediction for this run's mode on its measured rig: the coordinator made it and logged
        ``predicted/*`` (flodl_exp/coordinator/prediction.py); here it is only read from result.json for the summary.
        One that failed is one warning line, never the run's failure."""
        if not self._predicts():
            return
        pred, why = result.get("prediction"), result.get("prediction_error")
        if isinstance(pred, dict):
            self.prediction = {str(k): float(v) for k, v in pred.items()}
        elif why:
            print(f"warning: the simulator's prediction (predicted/*) was not logged: {why}", file=sys.stderr)

    def _start_model_export(self) -> None:
        """The consensus model's MLflow export (``tracking.log_model``), asked by the coordinator, in a process of
        its own started after the run is FINISHED: the run's end does not wait the seconds MLflow's export takes,
        and the process outlives this command (the run is tagged ``model_export`` pending, then done or failed).
        :meth:`wait_model` waits for it."""
        import subprocess

        from flodl_exp.model_export import EXPORT_LOG, EXPORT_REQUEST, URI_ENV

        request = os.path.join(self.job_dir, EXPORT_REQUEST)
        claimed = request + ".claimed"
        try:
            os.replace(request, claimed)  # one export per request, however often wait() is called
        except FileNotFoundError:
            return
        try:
            with open(claimed) as fh:
                req = json.load(fh)
            if not req.get("run_id"):  # the job asked before this launcher had created the run
                from flodl_exp.fsio import atomic_json

                atomic_json({**req, "run_id": self.run_id}, claimed, mode=0o600)
            self.client().set_tag(self.run_id, "model_export", "pending")
            fd = os.open(os.path.join(self.job_dir, EXPORT_LOG), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            with os.fdopen(fd, "ab") as out:
                self.model_export = subprocess.Popen(
                    [sys.executable, "-m", "flodl_exp.model_export", claimed], stdout=out, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True, env={**os.environ, URI_ENV: self._live_uri})
        except Exception as e:  # the run is FINISHED; the model is a copy of its bundle
            print(f"warning: the model export did not start: {type(e).__name__}: {e}", file=sys.stderr)
            with contextlib.suppress(Exception):
                self.client().set_tag(self.run_id, "model_export", "failed")

    def wait_model(self, timeout: Optional[float] = None) -> Optional[int]:
        """Wait for the background model export; its exit code (0: logged), or None when none was started."""
        if self.model_export is None:
            return None
        return self.model_export.wait(timeout)

    def _setup_failures(self, attempt: Any = None) -> list[str]:
        """One line per rank that could not set up in this job (its death record; of attempt ``attempt`` when the
        coordinator's result names one), its full traceback logged to the MLflow run
        (``ranks/setup_error.r<rank>.txt``)."""
        import glob

        from flodl_exp.jobs.job import setup_error_path
        from flodl_exp.rendezvous import incarnation, read_death_records

        timed: list[tuple[float, str]] = []
        for rank, rec in read_death_records(self.job_dir, world_size(self.cfg)).items():
            if attempt is not None and str(rec.get("incarnation")) != incarnation(int(attempt)):
                continue
            if rec.get("phase") == "setup":
                where = f" at {rec['user_frame']}" if rec.get("user_frame") else ""  # the user's own frame
                timed.append((float(rec.get("unix_time") or 0.0), f"rank {rank} could not set up: {rec.get('error')}"
                              f"{where} (full traceback: {setup_error_path(self.job_dir, rank)})"))
        lines = [line for _, line in sorted(timed, key=lambda t: t[0])]  # the first to fail first
        for path in sorted(glob.glob(os.path.join(self.job_dir, "ranks", "setup_error.r*.txt"))):
            try:
                self.client().log_artifact(self.run_id, path, "ranks")
            except Exception as e:  # the record is in the job folder either way
                print(f"warning: could not log {path} to MLflow: {e}", file=sys.stderr)
        return lines

    # -- task 0 lost: the coordinator went with it and wrote nothing -----------------
    def _task0(self) -> Any:
        return self.job.task(0) if self.job.num_tasks > 1 else self.job

    def _host_task_lost(self) -> Optional[str]:
        """One line when task 0 (the coordinator's host) ended without a result of its own, else None.

        A task that ends in Python leaves submitit a result pickle (its return or its traceback), and a
        coordinator that ends writes result.json; a task 0 killed outright (SIGKILL, the OOM killer, a lost
        node) leaves neither, and its coordinator dies with it (PR_SET_PDEATHSIG): nothing else records the
        run's end. Its exit status went to submitit's controller (or srun), which keeps it to itself."""
        try:
            if self._task0().paths.result_pickle.exists():
                return None
        except Exception:
            return None
        from flodl_exp.rendezvous import rank_marker_path

        who = "pid unknown"
        try:
            with open(rank_marker_path(self.job_dir, 0)) as fh:
                marker = json.load(fh)
            who = f"pid {marker['pid']} on host {marker['host']}"
        except (OSError, ValueError, KeyError):
            joined = [e for e in self.events if e.get("event") == "joined" and e.get("rank") == 0]
            if joined:
                who = f"pid {joined[-1].get('pid')} on host {joined[-1].get('host')}"
        limit = float(self.cfg.run.timeout_min) * 60
        if self.on_slurm:
            cause = f"killed: SIGKILL, the OOM killer, a lost node; SLURM state {self.queue_state()}"
        elif time.monotonic() - self._t0 >= limit:
            cause = f"killed by submitit at the job's time limit, run.timeout_min={self.cfg.run.timeout_min}"
        else:
            cause = "killed: SIGKILL, the OOM killer"
        try:
            log = f"; its log: {self._task0().paths.stderr}"
        except Exception:
            log = ""
        return (f"the coordinator's host task (task 0, {who}) was lost: it ended without a result or a traceback "
                f"({cause}), and the coordinator with it{log}")

    def _lost_result(self, failure: str) -> dict:
        """result.json for a run whose coordinator wrote none: the coordinator's keys (Coordinator.result and
        _close), with what the launcher knows (the config, the events) and empty values for the rest."""
        epochs = [e for e in self.events if e.get("event") == "epoch"]
        first = next((e for e in self.events if "wall" in e and "t" in e), None)
        wall_s = time.time() - (first["wall"] - first["t"]) if first else time.monotonic() - self._t0
        resume = self.cfg.checkpoint.resume_from
        return {
            "status": "FAILED", "failure": failure, "end_reason": HOST_LOST, "world_size": world_size(self.cfg),
            "epochs": int(self.cfg.experiment.epochs), "global_step": epochs[-1].get("global_step", 0) if epochs else 0,
            "syncs": int(epochs[-1].get("syncs", 0)) if epochs else 0, "final_eval": {},
            "evals": [e for e in self.events if e.get("event") == "eval"], "finals": {}, "coverage": {},
            "total_picks": None, "wall_s": round(wall_s, 3), "callback_rank": None, "stem": self.stem,
            "rejected_connections": 0, "deaths": [], "errors": {}, "regroups": 0, "saved_stem": None,
            "resumed_from": str(resume) if resume else None, "attempt": self._attempt(),
        }

    def _attempt(self) -> int:
        """The attempt the job was on (a requeue bumps it; rank 0's marker names it)."""
        from flodl_exp.rendezvous import rank_marker_path

        try:
            with open(rank_marker_path(self.job_dir, 0)) as fh:
                return int(str(json.load(fh)["incarnation"]).split(".")[0])
        except (OSError, ValueError, KeyError):
            return 0

    def _append_event(self, record: EventRecord) -> None:
        """Append one event as the coordinator does (same keys: ``t`` on its clock, from its first event)."""
        path = os.path.join(self.job_dir, "events.jsonl")
        first = next((e for e in self.events if "wall" in e and "t" in e), None)
        now = time.time()
        event = dict(record.record(), t=round(now - (first["wall"] - first["t"]), 3) if first else 0.0, wall=round(now, 3))
        try:
            with open(path, "rb") as fh:
                fh.seek(-1, os.SEEK_END)
                torn = fh.read(1) != b"\n"  # the coordinator was killed mid-line: end it first
        except OSError:
            torn = False
        with open(path, "a") as fh:
            fh.write(("\n" if torn else "") + json.dumps(event, default=str) + "\n")

    def _fail_host_lost(self, failure: str) -> None:
        """Record the run's end as the coordinator would have: result.json, an ``end`` event, the MLflow run
        FAILED (with ``end_reason``) and both files as run artifacts. A write that fails is said, never raised
        over the run's own failure."""
        from flodl_exp.fsio import atomic_json
        from flodl_exp.jobs.job import fail_run_if_running

        self.result = self._lost_result(failure)
        path = os.path.join(self.job_dir, "result.json")
        try:
            atomic_json(self.result, path)
        except OSError as e:
            print(f"warning: could not write {path}: {e}", file=sys.stderr)
        if not any(e.get("event") == "end" for e in self.events):
            try:
                self._append_event(End(status="FAILED", failure=failure))
            except OSError as e:
                print(f"warning: could not append the end event to events.jsonl: {e}", file=sys.stderr)
        fail_run_if_running(self._live_uri, self.run_id, failure, {"end_reason": HOST_LOST})
        self._ended = True
        for name in ("result.json", "events.jsonl"):
            try:
                self.client().log_artifact(self.run_id, os.path.join(self.job_dir, name), "run")
            except Exception as e:  # a report, never a reason to hide the failure
                print(f"warning: could not log {name} to MLflow: {str(e).splitlines()[0] if str(e) else e}",
                      file=sys.stderr)

    def join(self) -> dict:
        """Wait for the run and return the final consensus model state (from the bundle)."""
        self.wait()
        from flodl_exp.checkpoint import load_model_state

        return load_model_state(self.stem)

    def shutdown(self) -> Optional[str]:
        """Cancel the job (Ctrl-C, a bench run past its time) and mark the run KILLED unless it already ended;
        returns the run's status after (None when this handle had already ended it).

        Local: the job's whole process tree (submitit's controller, every task, the coordinator under task 0)
        is frozen and SIGKILLed, then waited for (:data:`KILL_WAIT_S`). submitit's own cancel is a SIGINT
        to its controller, whose cleanup (SIGINT to the tasks, 1 s, SIGKILL) a second SIGINT cuts short,
        leaving task 0 and the coordinator running; a CLI job ignores SIGINT altogether (``launch``'s
        ``own_sigint``). SLURM: scancel, then the scheduler's state, asked every few seconds, for at most
        :data:`CANCEL_WAIT_S`."""
        if self.on_slurm or not os.path.isdir("/proc"):
            try:
                self.job.cancel(check=False)
            except Exception:
                pass
            deadline = time.monotonic() + CANCEL_WAIT_S
            while not self.done() and time.monotonic() < deadline:
                time.sleep(0.2)
        else:
            self._kill_local()
        self._finish_relay(10.0)  # what the cancelled job wrote reaches the run before it is marked KILLED
        if self._ended:
            return None
        self._ended = True
        c = self.client()
        status = str(c.get_run(self.run_id).info.status)
        if status in ("RUNNING", "SCHEDULED"):
            c.set_tag(self.run_id, "error", "cancelled by the user")
            c.set_terminated(self.run_id, status="KILLED")
            status = "KILLED"
        return status

    def _kill_local(self) -> None:
        proc = getattr(self.job, "_process", None)
        if proc is None or proc.poll() is not None:
            # Not ours to walk: the controller ended (its tasks with it) and its pid may be another process's now.
            # Until we reap it, a controller that ends after this check keeps its pid (a zombie).
            return
        pids = kill_tree(proc.pid)
        with contextlib.suppress(Exception):  # the controller is our child: reap it
            proc.wait(KILL_WAIT_S)
        deadline = time.monotonic() + KILL_WAIT_S
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)


def _nicer(fn: Callable[[], str], late: Callable[[str], object]) -> str:
    """``fn()`` in a helper thread made nicer (``yield_to_training(idle=False)``), joined: MLflow's import and the
    run's creation (2-3 s of CPU) overlap the job's start-up, whose processes (interpreters, torch, the first
    batches) get the cores first. The caller's own thread keeps its priority (it may be a user's program).
    Interrupted (Ctrl-C) while it runs: it is given :data:`KILL_WAIT_S` more, and a run it created then is handed to
    ``late`` (which ends it), so no run is left RUNNING behind a cancelled launch."""
    box: dict[str, Any] = {}

    def work() -> None:
        from flodl_exp.background import yield_to_training

        yield_to_training(idle=False)
        try:
            box["out"] = fn()
        except BaseException as e:  # handed to the caller as raised
            box["error"] = e

    th = threading.Thread(target=work, name="flodl-create-run", daemon=True)
    th.start()
    try:
        th.join()
    except BaseException:
        th.join(KILL_WAIT_S)
        if "out" in box:
            with contextlib.suppress(Exception):
                late(str(box["out"]))
        raise
    if "error" in box:
        raise box["error"]
    return str(box["out"])


def _end_run(uri: str, run_id: str, status: str, error: str) -> None:
    from flodl_exp.tracking import end_run

    end_run(uri, run_id, status, error=error)


def _tail_lines(text: str, n: int) -> str:
    lines = text.strip().splitlines()
    return "\n".join(lines[-n:]) if len(lines) > n else text.strip()


def experiment_import_paths(root: str) -> list[str]:
    """Where every task imports experiment modules from: the launch directory (Hydra's original
    working directory, which holds a user's own modules), then ``PYTHONPATH``. On SLURM these must be
    on storage every node shares, like the job folder."""
    paths = [root]
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            paths.insert(0, os.path.abspath(HydraConfig.get().runtime.cwd))
    except Exception:
        pass
    paths += [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return list(dict.fromkeys(paths))


@contextlib.contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    """``extra`` in ``os.environ`` for the block (what a submission's processes inherit); as it was after it."""
    before = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def launch(cfg: Any, *, root: Optional[str] = None, parent_run_id: Optional[str] = None,
           own_sigint: bool = False, metrics_fn: Optional[MetricsFn] = None,
           eval_result_fn: Optional[EvalResultFn] = None) -> RunHandle:
    """Validate, submit the job, create the MLflow run (while the job starts); returns with a RunHandle.

    ``own_sigint``: the caller answers Ctrl-C by cancelling the whole job (:meth:`RunHandle.shutdown`, as the CLI
    does), so a local job's processes start with SIGINT ignored. A terminal's Ctrl-C reaches every process of its
    foreground process group, the local job's included, and each would act on its own: the coordinator ends the
    run FAILED as a crash, submitit's controller prints a traceback and starts a cleanup the launcher's cancel
    cuts short, task 0 waits on its coordinator. Off by default: a program that does not cancel on
    KeyboardInterrupt would leave the job running.

    ``metrics_fn(epoch, metrics)`` and ``eval_result_fn(epoch, metrics)``: called in this process as each epoch
    aggregates and each eval reports, while the caller waits on the handle (:class:`RunHandle`)."""
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.structured(cfg)
    for w in validate(cfg):  # the one validation pass; warnings go to stderr, errors raise ConfigError
        print(f"warning: {w}", file=sys.stderr)
    from flodl_exp.torch_version import installed_torch_problem

    old_torch = installed_torch_problem()  # before a job starts ranks that would each refuse it
    if old_torch:
        raise ConfigError(old_torch)
    root = os.path.abspath(root or os.getcwd())
    import_paths = experiment_import_paths(root)  # the tasks add them (JobSpec.import_paths); here the checks below
    from flodl_exp.preflight import build_user_classes, importable_from, preflight

    # every _target_ and function path resolves as the tasks will resolve it: before any folder, run or process
    preflight(cast(dict[str, Any], OmegaConf.to_container(cfg.experiment, resolve=True)), import_paths, import_paths[0],
              hooks=cast(dict[str, Any], OmegaConf.to_container(cfg.hooks, resolve=True)) if "hooks" in cfg else None,
              others={"guard._target_": cfg.guard.get("_target_"), "outer._target_": cfg.outer.get("_target_")})
    build_user_classes({g: cast(dict[str, Any], OmegaConf.to_container(cfg[g], resolve=True)) for g in ("guard", "outer")},
                       import_paths)
    resume = None
    if cfg.checkpoint.resume_from:  # flodl_exp.checkpoint imports torch (~2 s): only when resuming
        from flodl_exp.checkpoint import validate_resume

        with importable_from(import_paths):  # it builds the experiment's model to compare shapes
            resume = validate_resume(cfg)
    from flodl_exp.job_spec import JobSpec
    from flodl_exp.jobs.executor import make_executor
    from flodl_exp.tracking import URI_ENV, redact_uri, resolve_tracking

    full_uri, art = resolve_tracking(cfg.tracking, root)
    # Credentials never reach a file or the store: params, config.yaml, spec.json and the handle's tracking_uri
    # carry the redacted URI. The tasks get the credentialed one in the environment of the submission only
    # (submitit's local executor copies os.environ into its controller, sbatch --export=ALL copies it into the
    # job), where tracking.client() finds it; neither spec.json nor the pickled submission may hold it, both
    # being files in the job folder. This process connects with it through the handle.
    uri = redact_uri(full_uri)
    task_env = {URI_ENV: full_uri} if uri != full_uri else {}
    resolved = _redact_config(cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True)), full_uri)
    job_root = cfg.run.job_root or os.path.join(root, "outputs", "jobs")
    tag = uuid.uuid4().hex  # the folder is made before the run (whose id it carried until the run came after the job)
    job_dir = os.path.join(job_root, f"{time.strftime('%Y%m%d-%H%M%S')}-{tag[:8]}-{tag[8:12]}")
    os.makedirs(job_root, exist_ok=True)
    _private_dir(job_dir)
    for sub in ("submitit", "checkpoints", "ranks"):
        _private_dir(os.path.join(job_dir, sub))
    stem = cfg.checkpoint.save_path or os.path.join(job_dir, "checkpoints", "final")
    shuffle_seed, adopted = resolve_shuffle_seed(int(cfg.seed), resume.meta if resume is not None else None)
    if adopted:
        print(adopted, file=sys.stderr)
    # run_id "": the run is created once the job is submitted (below), and published in <job>/run_id.json
    spec = JobSpec(config=resolved, run_id="", tracking_uri=uri, job_dir=job_dir,
                   checkpoint_stem=os.path.abspath(stem), shuffle_seed=shuffle_seed, resume=resume,
                   import_paths=tuple(import_paths), cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
    spec_path = os.path.join(job_dir, "spec.json")
    _private_write(spec_path, json.dumps(spec.to_dict(), indent=1))
    _private_write(os.path.join(job_dir, "config.yaml"), OmegaConf.to_yaml(OmegaConf.create(resolved)))

    def new_run(extra: dict[str, str]) -> str:
        from flodl_exp.tracking import create_run

        return create_run(full_uri, cfg.tracking.experiment_name, art, run_name(cfg), resolved,
                          {**_tags(cfg, root), **extra}, parent_run_id)

    # The job first, the MLflow run after: its processes start (interpreters, torch) while this one imports MLflow
    # and creates the run (~1.5-2.5 s); the coordinator reads the id from <job>/run_id.json when it needs it.
    from flodl_exp.jobs.job import run_task

    try:
        ex = make_executor(cfg.cluster, os.path.join(job_dir, "submitit"), cfg.run.timeout_min, run_name(cfg))
        with contextlib.redirect_stderr(io.StringIO()), _environ(task_env), \
                _sigint_ignored(own_sigint and cfg.cluster.executor == "local"):
            # (submitit echoes sbatch's stderr: it goes in our one line)
            job = ex.submit(run_task, spec_path)
    except Exception as e:
        from flodl_exp.tracking import end_run

        err = submit_error(e, cfg.cluster.executor)
        run_id = new_run({})  # a refused job still leaves its FAILED run, as before
        end_run(full_uri, run_id, "FAILED", error=str(err))
        raise err from e
    extra = {"job_id": str(job.job_id), "job_dir": job_dir}
    if resume is not None:
        extra["resumed_from"] = resume.stem
    if cfg.cluster.executor == "slurm":
        extra["slurm_job_id"] = str(job.job_id)
    handle = RunHandle(cfg=cfg, run_id="", tracking_uri=uri, job_dir=job_dir, job=job, stem=os.path.abspath(stem),
                       live_uri=full_uri, metrics_fn=metrics_fn, eval_result_fn=eval_result_fn)
    from flodl_exp.journal_sink import relayed_by_launcher

    if relayed_by_launcher(resolved):  # this process delivers the job's records (records_relay.py): its lease now
        from flodl_exp.records_relay import RecordsRelay

        handle.relay = RecordsRelay(job_dir, full_uri)
    from flodl_exp.job_spec import publish_run_id

    try:
        run_id = _nicer(lambda: new_run(extra), late=lambda rid: _end_run(full_uri, rid, "KILLED", "cancelled by the user"))
    except BaseException as e:  # no run to log into: the job must not train unrecorded
        with contextlib.suppress(Exception):
            publish_run_id(job_dir, error=f"{type(e).__name__}: {e}")
        handle._ended = True
        with contextlib.suppress(Exception):
            handle.shutdown()
        raise
    publish_run_id(job_dir, run_id)
    handle.run_id = run_id
    if handle.relay is not None:
        handle.relay.set_run(run_id)
    from flodl_exp.tracking import client

    client(full_uri).log_artifact(run_id, os.path.join(job_dir, "config.yaml"), "run")
    return handle


__all__ = ["launch", "RunHandle", "RunFailed", "SubmitFailed", "ConfigError"]
