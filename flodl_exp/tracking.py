"""MLflow sink: one run per Hydra job, params/tags at launch, metrics off the hot loop.

The launcher creates the run (params = flattened resolved config, tags) and
ends it when the job fails or is cancelled; the coordinator logs per-epoch
metrics and artifacts through :class:`MlflowSink`, whose background thread
batches points into ``MlflowClient.log_batch`` so training never waits on the
store. Embedded default: ``sqlite:///<cwd>/outputs/mlflow.db`` with artifacts
under ``outputs/mlartifacts``.
"""
from __future__ import annotations

import abc
import logging
import os
import subprocess
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Union
from urllib.parse import parse_qsl, urlencode, urlsplit

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

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


SECRET_QUERY_KEYS = ("password", "passwd", "pwd", "token", "access_token", "secret", "api_key", "apikey", "key",
                     "sslpassword", "auth", "authorization", "sig", "signature", "x-amz-security-token", "credential")
REDACTED = "***"
URI_ENV = "FLODL_TRACKING_URI"
"""The credentialed tracking URI, in the environment only (submitit's local executor and
``sbatch --export=ALL`` hand it to every task); files and the store see :func:`redact_uri`'s form."""


def redact_uri(uri: str) -> str:
    """``uri`` without secrets: a userinfo password becomes ``***`` (the user name stays) and so do the
    values of secret-looking query parameters (``password=``, ``token=`` ...). Pure; other URIs unchanged."""
    if not uri or "://" not in uri:
        return uri
    try:
        parts = urlsplit(uri)
    except ValueError:
        return uri
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user, sep, _pw = userinfo.partition(":")
        netloc = f"{user}:{REDACTED}@{host}" if sep else f"{userinfo}@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(k.lower() in SECRET_QUERY_KEYS for k, _ in pairs):
            query = urlencode([(k, REDACTED if k.lower() in SECRET_QUERY_KEYS else v) for k, v in pairs], safe="*")
    if netloc == parts.netloc and query == parts.query:
        return uri
    # By hand: urlunsplit drops the empty authority of sqlite:////abs/path.
    return (uri[:uri.index("://") + 3] + netloc + parts.path + (f"?{query}" if query else "")
            + (f"#{parts.fragment}" if parts.fragment else ""))


def live_uri(uri: str) -> str:
    """The URI to connect with: the credentialed one from ``FLODL_TRACKING_URI`` (or ``MLFLOW_TRACKING_URI``)
    when ``uri`` is its redacted form, else ``uri`` itself."""
    if REDACTED not in uri:
        return uri
    for var in (URI_ENV, "MLFLOW_TRACKING_URI"):
        full = os.environ.get(var)
        if full and redact_uri(full) == uri:
            return full
    return uri


def client(uri: str) -> MlflowClient:
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    from mlflow.tracking import MlflowClient

    # a new SQLite store's "Creating initial MLflow database tables..." lines are MLflow's housekeeping, not the
    # user's business (warnings and errors still show)
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
    return MlflowClient(tracking_uri=live_uri(uri))


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


def get_or_create_experiment(c: MlflowClient, name: str, artifact_location: Optional[str]) -> str:
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


def _import_mlflow(uri: str) -> None:
    """Import what a client of ``uri`` needs without opening the store (an MlflowClient opens it as it is built)."""
    try:
        import mlflow.entities
        import mlflow.tracking

        if uri.startswith(("sqlite:", "postgresql", "mysql", "mssql")):
            import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
    except Exception:  # the client's own construction says what is wrong
        pass


class RecordSurface(abc.ABC):
    """What the coordinator calls on every sink (MlflowSink, sink_process.ProcessSink, journal_sink.JournalSink):
    each call becomes one ``_put(kind, payload)`` record, stamped here, so all three carry the same records.
    Metric points get strictly increasing timestamps in ms (the SQL store drops a point equal in key, step, value
    and time), stamped when logged, not when delivered; ``timestamp_ms`` is the caller's own stamp
    (coordinator/prediction.py keeps the points it stamped)."""

    _last_ts = 0

    @abc.abstractmethod
    def _put(self, kind: str, payload: Any) -> None:
        """Take one record (``kind``: metrics, tags, artifact, inputs, model) toward the store."""

    def log_metrics(self, metrics: Mapping[str, float], step: int, timestamp_ms: Optional[int] = None) -> None:
        ts = max(int(time.time() * 1000), self._last_ts + 1) if timestamp_ms is None else int(timestamp_ms)
        self._last_ts = max(self._last_ts, ts)
        self._put("metrics", [(k, float(v), ts, int(step)) for k, v in metrics.items() if v is not None])

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        self._put("tags", {k: str(v) for k, v in tags.items()})

    def log_artifact(self, path: str, artifact_path: Optional[str] = None) -> None:
        self._put("artifact", (path, artifact_path))

    def log_inputs(self, inputs: list[dict[str, Any]]) -> None:
        """The run's data sets (:func:`flodl_exp.model_export.dataset_input` dicts) as MLflow inputs."""
        if inputs:
            self._put("inputs", list(inputs))

    def log_model(self, stem: str, experiment: Mapping[str, Any]) -> None:
        """The bundle ``stem``'s consensus model as an MLflow model (built from the ``experiment`` config)."""
        self._put("model", (stem, dict(experiment)))


class MlflowSink(RecordSurface):
    """Background logger: ``log_metrics``/``set_tags``/``log_artifact`` enqueue, a thread delivers.

    Never blocks training and never loses a record silently: a delivery that fails (a SQLite lock
    held past MLflow's 20 s busy timeout, a tracking server down) keeps its records and retries
    with exponential backoff (:data:`RETRY_MIN_S` doubling to :data:`RETRY_MAX_S`). The buffer is
    bounded (``max_records`` metric points/tags/artifacts): when full the oldest records go first,
    counted in :attr:`lost`. :meth:`close` delivers everything left within its timeout; what
    could not be delivered is counted in :attr:`lost` (the caller records it in result.json) and
    tagged ``tracking_lost_records`` on the run when the store takes it.
    """

    RETRY_MIN_S = 0.5
    RETRY_MAX_S = 30.0

    def __init__(self, uri: str, run_id: Union[str, Callable[[], str]], max_records: int = 200_000,
                 on_progress: Optional[Callable[[MlflowSink], None]] = None) -> None:
        """``run_id``: the run's id, or a function that waits for it (the launcher creates the run after it submits
        the job): called on the sink's thread before its first delivery, again after a failure; records wait.
        ``on_progress``: called on the sink's thread once the store is open and after each delivery (the sink
        process answers its coordinator with it: flodl_exp/sink_process.py)."""
        self._on_progress = on_progress
        self.uri = uri
        self._resolve_run_id: Optional[Callable[[], str]] = None if isinstance(run_id, str) else run_id
        self.run_id = run_id if isinstance(run_id, str) else ""
        self.max_records = int(max_records)
        self._buf: deque[tuple[str, Any]] = deque()
        self._size = 0
        self._cond = threading.Condition()
        self._stop_deadline: Optional[float] = None
        self._inflight = 0
        self._thread = threading.Thread(target=self._loop, name="mlflow-sink", daemon=True)
        self.errors = 0
        """Failed deliveries (each retried)."""
        self.lost = 0
        """Records never delivered: dropped from a full buffer, or left when close ran out of time."""
        self.delivered = 0
        self._last_ts = 0
        self._thread.start()

    @staticmethod
    def _count(kind: str, payload: Any) -> int:
        return len(payload) if kind in ("metrics", "tags") else 1

    def _put(self, kind: str, payload: Any) -> None:
        n = self._count(kind, payload)
        if n == 0:
            return
        with self._cond:
            self._buf.append((kind, payload))
            self._size += n
            while self._size > self.max_records and len(self._buf) > 1:
                k, p = self._buf.popleft()  # drop oldest
                c = self._count(k, p)
                self._size -= c
                if self.lost == 0:
                    log.warning("mlflow sink: buffer full (%d records): dropping the oldest", self.max_records)
                self.lost += c
            self._cond.notify()

    @property
    def pending(self) -> int:
        """Records not yet delivered (buffered or being delivered)."""
        with self._cond:
            return self._size + self._inflight

    def _flush_metrics(self, c: MlflowClient, points: list) -> None:
        from mlflow.entities import Metric

        for i in range(0, len(points), 900):
            c.log_batch(self.run_id, metrics=[Metric(k, v, ts, s) for k, v, ts, s in points[i:i + 900]])

    def _deliver(self, c: MlflowClient, kind: str, payload: Any) -> None:
        if kind == "metrics":
            self._flush_metrics(c, payload)
        elif kind == "tags":
            from mlflow.entities import RunTag

            c.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in payload.items()])
        elif kind == "artifact":
            path, ap = payload
            if os.path.isdir(path):
                c.log_artifacts(self.run_id, path, ap)
            elif os.path.exists(path):
                c.log_artifact(self.run_id, path, ap)
        elif kind == "inputs":
            from flodl_exp.model_export import log_inputs

            log_inputs(c, self.run_id, payload)
        elif kind == "model":
            from flodl_exp.model_export import log_consensus_model

            stem, experiment = payload
            try:
                uri = log_consensus_model(self.uri, self.run_id, stem, experiment)
            except Exception as e:  # the model (not the store) failed: say so on the run, do not retry it
                log.warning("consensus model not logged to MLflow: %s", e)
                c.set_tag(self.run_id, "log_model_error", f"{type(e).__name__}: {e}"[:2000])
            else:
                log.info("consensus model logged: %s", uri)

    def _take(self) -> list[tuple[str, Any]]:
        """The next delivery: consecutive metric records coalesced (up to 900 points), else one record."""
        items = [self._buf.popleft()]
        if items[0][0] == "metrics":
            n = len(items[0][1])
            while self._buf and self._buf[0][0] == "metrics" and n + len(self._buf[0][1]) <= 900:
                items.append(self._buf.popleft())
                n += len(items[-1][1])
        return items

    def _connect(self) -> Any:
        """The client, with the store opened (MLflow's import and the SQL engine cost seconds the first time):
        done as the sink starts, so it overlaps the ranks' start-up instead of delaying the run's end."""
        if not self.run_id and self._resolve_run_id is not None:
            # MLflow's modules first (the seconds), the wait for the id after, the store opened last: once the id is
            # published the launcher has created the run, and so a fresh store's tables, which nobody else may race
            _import_mlflow(self.uri)
            self.run_id = self._resolve_run_id()
        c = client(self.uri)
        if self.uri.startswith("sqlite:"):  # a tracking server that is down would hold this for MLflow's retries
            try:
                c.get_run(self.run_id)
            except Exception:  # a locked store: the deliveries retry with backoff
                pass
        return c

    def _loop(self) -> None:
        try:
            c = self._connect()
        except Exception:
            c = None
        self._progress()
        backoff = self.RETRY_MIN_S
        failing = False
        while True:
            with self._cond:
                while not self._buf and self._stop_deadline is None:
                    self._cond.wait()
                if not self._buf:
                    return  # stopped, everything delivered
                if self._stop_deadline is not None and time.monotonic() > self._stop_deadline:
                    return  # close's time is up: close counts what is left
                items = self._take()
                n = sum(self._count(k, p) for k, p in items)
                self._size -= n
                self._inflight = n
            try:
                if c is None:
                    c = self._connect()
                if items[0][0] == "metrics":
                    self._flush_metrics(c, [pt for _, p in items for pt in p])
                else:
                    self._deliver(c, *items[0])
            except Exception as e:  # the store must never kill training: keep the records, retry later
                self.errors += 1
                if not failing:
                    log.warning("mlflow sink: delivery failed, retrying with backoff (records kept): %s",
                                str(e).splitlines()[0][:300] if str(e) else type(e).__name__)
                failing = True
                with self._cond:
                    self._inflight = 0
                    self._buf.extendleft(reversed(items))
                    self._size += n
                    wait = backoff
                    if self._stop_deadline is not None:
                        wait = min(wait, max(0.0, self._stop_deadline - time.monotonic()))
                    self._cond.wait(wait)  # a close() wakes it early
                backoff = min(backoff * 2, self.RETRY_MAX_S)
                continue
            with self._cond:
                self._inflight = 0
                self.delivered += n
            self._progress()
            if failing:
                log.warning("mlflow sink: the store answers again (%d failed deliveries so far)", self.errors)
            failing, backoff = False, self.RETRY_MIN_S

    def _progress(self) -> None:
        if self._on_progress is not None:
            try:
                self._on_progress(self)
            except Exception:  # a report, never a reason to stop delivering
                pass

    def close(self, status: Optional[str] = None, timeout: float = 60.0) -> None:
        """Deliver everything buffered (retrying, at most ``timeout`` s in all), count what is left in
        :attr:`lost`, then optionally terminate the run with ``status``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._stop_deadline = deadline
            self._cond.notify_all()
        self._thread.join(max(0.0, deadline - time.monotonic()) + 0.5)
        with self._cond:
            left = self._size + self._inflight
            self._buf.clear()
            self._size = 0
        if left:
            self.lost += left
        if self.lost:
            log.error("mlflow sink: %d record(s) could not be delivered to %s", self.lost, redact_uri(self.uri))
        rest = max(1.0, deadline - time.monotonic())
        if self.lost or status:
            self._finish(status, rest)

    def _finish(self, status: Optional[str], budget_s: float) -> None:
        """The loss tag and the terminal status, in a helper thread so a hung store cannot hold close past its budget."""
        def work() -> None:
            try:
                if not self.run_id and self._resolve_run_id is not None:
                    self.run_id = self._resolve_run_id()
                c = client(self.uri)
                if self.lost:
                    c.set_tag(self.run_id, "tracking_lost_records", str(self.lost))
                if status:
                    c.set_terminated(self.run_id, status=status)
            except Exception as e:
                log.warning("mlflow sink: could not end run: %s", e)

        t = threading.Thread(target=work, name="mlflow-sink-end", daemon=True)
        t.start()
        t.join(budget_s)
