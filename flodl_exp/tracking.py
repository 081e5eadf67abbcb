"""MLflow sink: one run per Hydra job, params/tags at launch, metrics off the hot loop.

The launcher creates the run (params = flattened resolved config, tags) and
ends it when the job fails or is cancelled; the coordinator logs per-epoch
metrics and artifacts through :class:`MlflowSink`, whose background thread
batches points into ``MlflowClient.log_batch`` so training never waits on the
store. Embedded default: ``sqlite:///<cwd>/outputs/mlflow.db`` with artifacts
under ``outputs/mlartifacts``.
"""
from __future__ import annotations

import logging
import os
import queue
import subprocess
import threading
import time
from typing import Any, Mapping, Optional

log = logging.getLogger(__name__)

PARAM_VALUE_MAX = 6000


def default_uri(root: str) -> str:
    return f"sqlite:///{os.path.abspath(os.path.join(root, 'outputs', 'mlflow.db'))}"


def resolve_tracking(tracking: Any, root: str) -> tuple[str, Optional[str]]:
    """(tracking uri, artifact location for a new experiment)."""
    uri = tracking.uri or default_uri(root)
    art = tracking.artifact_location
    if art is None and uri.startswith("sqlite:///"):
        # Artifacts beside the store (never MLflow's ./mlruns default in whatever cwd we run from).
        art = os.path.join(os.path.dirname(os.path.abspath(uri[len("sqlite:///"):])), "mlartifacts")
    if uri.startswith("sqlite:///"):
        os.makedirs(os.path.dirname(uri[len("sqlite:///"):]) or ".", exist_ok=True)
    return uri, art


def client(uri: str):
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = str(v)[:PARAM_VALUE_MAX]
    return out


def git_commit(cwd: str) -> Optional[str]:
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5)
        return r.stdout.strip() or None if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def get_or_create_experiment(c, name: str, artifact_location: Optional[str]) -> str:
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        art = f"file://{artifact_location}" if artifact_location and "://" not in artifact_location else artifact_location
        return c.create_experiment(name, artifact_location=art)
    except Exception:  # a concurrent creator won the race
        exp = c.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def create_run(uri: str, experiment_name: str, artifact_location: Optional[str], run_name: str,
               params: Mapping[str, Any], tags: Mapping[str, str], parent_run_id: Optional[str] = None) -> str:
    from mlflow.entities import Param

    c = client(uri)
    exp_id = get_or_create_experiment(c, experiment_name, artifact_location)
    all_tags = dict(tags)
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    run = c.create_run(exp_id, run_name=run_name, tags=all_tags)
    items = [Param(k, v) for k, v in flatten(params).items()]
    for i in range(0, len(items), 100):
        c.log_batch(run.info.run_id, params=items[i:i + 100])
    return run.info.run_id


def end_run(uri: str, run_id: str, status: str, error: Optional[str] = None) -> None:
    """Terminate a run unless it already ended (the coordinator may have ended it)."""
    c = client(uri)
    if error:
        c.set_tag(run_id, "error", error[:5000])
    run = c.get_run(run_id)
    if run.info.status in ("RUNNING", "SCHEDULED"):
        c.set_terminated(run_id, status=status)


class MlflowSink:
    """Background logger: ``log_metrics`` enqueues, a thread batches into ``log_batch``."""

    def __init__(self, uri: str, run_id: str) -> None:
        self.uri = uri
        self.run_id = run_id
        self._q: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="mlflow-sink", daemon=True)
        self._client = None
        self.errors = 0
        self._last_ts = 0
        self._thread.start()

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        # Strictly increasing timestamps: the SQL store drops a point equal in (key, step, value, time).
        ts = max(int(time.time() * 1000), self._last_ts + 1)
        self._last_ts = ts
        self._q.put(("metrics", [(k, float(v), ts, int(step)) for k, v in metrics.items() if v is not None]))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        self._q.put(("tags", {k: str(v) for k, v in tags.items()}))

    def log_artifact(self, path: str, artifact_path: Optional[str] = None) -> None:
        self._q.put(("artifact", (path, artifact_path)))

    def _flush_metrics(self, c, points: list) -> None:
        from mlflow.entities import Metric

        for i in range(0, len(points), 900):
            c.log_batch(self.run_id, metrics=[Metric(k, v, ts, s) for k, v, ts, s in points[i:i + 900]])

    def _loop(self) -> None:
        c = client(self.uri)
        while True:
            kind, payload = self._q.get()
            if kind == "stop":
                self._q.task_done()
                return
            batch: list = []
            items = [(kind, payload)]
            while True:  # coalesce whatever queued up meanwhile
                try:
                    items.append(self._q.get_nowait())
                except queue.Empty:
                    break
            stop = False
            try:
                for k, p in items:
                    if k == "metrics":
                        batch.extend(p)
                        continue
                    if batch:
                        self._flush_metrics(c, batch)
                        batch = []
                    if k == "tags":
                        for tk, tv in p.items():
                            c.set_tag(self.run_id, tk, tv)
                    elif k == "artifact":
                        path, ap = p
                        if os.path.isdir(path):
                            c.log_artifacts(self.run_id, path, ap)
                        elif os.path.exists(path):
                            c.log_artifact(self.run_id, path, ap)
                    elif k == "stop":
                        stop = True
                if batch:
                    self._flush_metrics(c, batch)
            except Exception as e:  # the store must never kill training
                self.errors += 1
                log.warning("mlflow sink: %s", e)
            for _ in items:
                self._q.task_done()
            if stop:
                return

    def close(self, status: Optional[str] = None, timeout: float = 60.0) -> None:
        """Flush everything queued, then optionally terminate the run with ``status``."""
        self._q.put(("stop", None))
        self._thread.join(timeout)
        if status:
            try:
                client(self.uri).set_terminated(self.run_id, status=status)
            except Exception as e:
                log.warning("mlflow sink: could not end run: %s", e)
