"""Coordinator process entry: ``python -m flodl_exp.coordinator.main <spec.json> <host> [<store port>]``.

Started by task 0 of the job. Binds the rank server, writes rendezvous.json (with
the port of the collective backend's TCPStore, which task 0 hosts:
jobs/collective_store.py), runs the event loop, logs to MLflow, and writes
``result.json``. In the nccl modes it never imports torch. Exit status 0 = FINISHED, 3 = PREEMPTED
(bundle written for a requeue, MLflow run left RUNNING), 1 = anything else.

Signals: ``SIGUSR1`` = save a bundle and stop for requeue (sent by task 0 on
submitit's preemption / time-limit signal); ``SIGUSR2`` (SLURM's ``--signal``
reaches every process of the step) is logged and left to task 0; ``SIGTERM``
on SLURM ends the run before the cluster's SIGKILL (see preemption.py).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import queue
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Optional

from flodl_exp import events as ev
from flodl_exp.constants import PREEMPT_EXIT
from flodl_exp.core.lifecycle import Phase, RunFailure  # import-light: the handlers go in before torch loads
from flodl_exp.fsio import atomic_json
from flodl_exp.job_spec import JobSpec

if TYPE_CHECKING:
    from flodl_exp.coordinator.coordinator import Coordinator


class _Signals:
    """Signal handlers installed first thing (imports take seconds); they only set flags."""

    def __init__(self, slurm: bool) -> None:
        self.co: Optional[Coordinator] = None
        self.preempt = False
        self.term = False
        signal.signal(signal.SIGUSR1, self._usr1)
        signal.signal(signal.SIGUSR2, self._usr2)  # default action would kill the coordinator
        if slurm:
            signal.signal(signal.SIGTERM, self._term)

    def attach(self, co: Coordinator) -> None:
        self.co = co
        if self.preempt:
            co.request_preempt()
        if self.term:
            co.request_terminate()

    def _usr1(self, signum: int, frame: Any) -> None:
        logging.getLogger("flodl_exp.coordinator").warning("SIGUSR1: preemption / time limit: bundle, then stop for requeue")
        self.preempt = True
        if self.co is not None:
            self.co.request_preempt()

    def _usr2(self, signum: int, frame: Any) -> None:
        logging.getLogger("flodl_exp.coordinator").info("SIGUSR2 from the cluster: task 0 asks for the bundle")

    def _term(self, signum: int, frame: Any) -> None:
        logging.getLogger("flodl_exp.coordinator").warning("SIGTERM: the job step is being terminated")
        self.term = True
        if self.co is not None:
            self.co.request_terminate()
            if self.co.view.is_(Phase.CONNECTING):
                raise RunFailure("the job was terminated (SIGTERM) before every rank connected")


def main(argv: list[str]) -> int:
    spec_path, host = argv[1], argv[2]
    store_port = int(argv[3]) if len(argv) > 3 else None
    spec = JobSpec.load(spec_path)
    slurm = spec.config["cluster"]["executor"] == "slurm"
    signals = _Signals(slurm)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s coordinator %(levelname)s %(message)s", stream=sys.stderr)
    job_dir = os.path.dirname(os.path.abspath(spec_path))
    for path in reversed(spec.import_paths):  # the experiment's modules (the logged model is built here)
        if path not in sys.path:
            sys.path.insert(0, path)

    from flodl_exp.config import RunShape, load_config
    from flodl_exp.coordinator.coordinator import Coordinator
    from flodl_exp.coordinator.prediction import RecordTap
    from flodl_exp.coordinator.server import RankServer
    from flodl_exp.journal_sink import JournalSink, relayed_by_launcher
    from flodl_exp.protocol import wire
    from flodl_exp.rendezvous import incarnation, write_rendezvous
    from flodl_exp.sink_process import start_sink

    cfg = load_config(spec.config)
    shape = RunShape.of(cfg)
    w = shape.world_size
    token = wire.new_token()
    events: queue.Queue[tuple[Any, ...]] = queue.Queue()
    # a rank that accepts no byte for this long is dead: it never holds the event loop past half the heartbeat timeout
    server = RankServer(host, token, w, events, send_stall_timeout=max(2.0, min(10.0, cfg.cluster.heartbeat_timeout_s / 2)))
    write_rendezvous(job_dir, {"host": host, "port": server.port, "store_port": store_port,
                               "token": token, "pid": os.getpid(), "incarnation": incarnation(spec.attempt)})
    log.info("listening on %s:%d (world size %d)", host, server.port, w)
    if not shape.mode.is_nccl or cfg.mode.auto:
        # The cpu backend averages tensors, and mode=auto simulates the cpu modes: torch loads now, beside the
        # ranks' start-up, not on the first snapshot (read thread) or the choice while every rank waits.
        threading.Thread(target=_load_torch, name="load-torch", daemon=True).start()
    # Without a launcher to deliver the records (run.wait=false, tracking.relay=false), the sink's own process
    # imports MLflow and opens the store (2-3.5 s of CPU) while the ranks finish their start-up, never holding this
    # interpreter's GIL (sink_process.py). Started before this process's own imports
    # it delayed the coordinator's start by ~0.8 s on 2 cores (measurements.md, start-up). The launcher creates
    # the MLflow run after submitting the job: until it publishes the id, the sink keeps records.
    if relayed_by_launcher(spec.config):  # the launcher delivers: this job imports no MLflow (records_journal.py)
        sink: Any = JournalSink(spec.tracking_uri, spec.run_id, spec.job_dir, spec.import_paths,
                                stale_s=float(cfg.tracking.relay_stale_s))
    else:
        sink = start_sink(spec.tracking_uri, spec.run_id, spec.job_dir, spec.import_paths)
    sink = RecordTap(sink)  # what the run's prediction reads, kept as logged (coordinator/prediction.py)
    co = Coordinator(spec, server, events, sink, job_dir, rejected=lambda: server.rejected, owns_process=True)
    signals.attach(co)
    if os.environ.get("SLURM_JOB_ID"):
        sink.set_tags({"slurm_job_id": os.environ["SLURM_JOB_ID"], "slurm_restart_count": os.environ.get("SLURM_RESTART_COUNT", "0"),
                       "slurm_nodelist": os.environ.get("SLURM_JOB_NODELIST", "")})
    if spec.attempt and spec.resume is not None:
        co.events.emit(ev.Resumed(attempt=spec.attempt, stem=spec.resume.stem, epoch=spec.resume.meta.epoch,
                                  global_step=co.view.global_step))
    try:
        status = co.run(cfg.cluster.rendezvous_timeout_s).value
    except RunFailure as e:
        co.fail(str(e))
        status = "FAILED"
    except BaseException as e:
        log.exception("coordinator crashed")
        co.fail(f"coordinator crashed: {type(e).__name__}: {e}")
        status = "FAILED"
    return _close(co, spec, cfg, job_dir, sink, server, status, slurm)


def _load_torch() -> None:
    try:
        import torch  # noqa: F401

        from flodl_exp import averaging  # noqa: F401
    except Exception as e:  # the first tensor tries again, and says why there
        log.warning("torch did not load ahead of the first reduce: %s", e)


def _close(co: Coordinator, spec: JobSpec, cfg: Any, job_dir: str, sink: Any, server: Any, status: str,
           slurm: bool) -> int:
    """Write result.json, end the MLflow run (terminal status first where SIGKILL may follow), log artifacts."""
    co.close()  # the core settles the final status (a failed last bundle ends FAILED)
    status = co.view.status.value
    failure = co.view.failure
    result, result_path = _write_result(co, spec, job_dir)
    co.events.emit(ev.End(status=status, failure=failure))
    spec = _with_run_id(spec, sink)  # (the launcher publishes it as the job starts: there long before, but a new store)
    if co.view.terminated and status in ("FAILED", "KILLED"):
        # SIGTERM on SLURM: SIGKILL follows within KillWait. The terminal status first, the rest never.
        tags: dict[str, Any] = {"end_reason": co.view.end_reason, "global_step": co.view.global_step}
        if failure:
            tags["error"] = failure[:5000]
        sink.set_tags(tags)
        sink.close(status, timeout=3.0)
        server.close()
        return 1
    if status == "PREEMPTED":
        # Bundle written; the requeued job resumes into this run, which stays RUNNING.
        sink.log_artifact(co.events.path, "run")
        sink.close(None, timeout=10.0)
        _record_tracking_loss(sink, result, result_path)
        server.close()
        return PREEMPT_EXIT
    if slurm and status != "FINISHED":
        _end_run_early(spec, status, failure)
    if failure:
        sink.set_tags({"error": failure[:5000]})
    sink.set_tags({"global_step": co.view.global_step, "syncs": co.view.syncs})
    if status == "FINISHED":
        _predict(spec, cfg, sink, result, result_path)
    _log_run_artifacts(co, spec, cfg, job_dir, sink, status)
    sink.close(status)
    _record_tracking_loss(sink, result, result_path)
    server.close()
    time.sleep(0.05)
    return 0 if status == "FINISHED" else 1


def _predict(spec: JobSpec, cfg: Any, sink: Any, result: dict[str, Any], path: str) -> None:
    """``tracking.predict`` on a finished run of 2+ ranks: ``predicted/*`` and the ``measured/*`` they are compared
    with logged at its last epoch, and kept in
    result.json (``prediction``, or ``prediction_error``) for the launcher's summary."""
    from flodl_exp.config import world_size
    from flodl_exp.coordinator.prediction import RecordTap, predict_finished_run

    if not (cfg.tracking.predict and world_size(cfg) >= 2 and isinstance(sink, RecordTap)):
        return
    epochs = [step for step, _, _ in sink.history.get("epoch_time_s", [])]
    if not epochs:
        return
    prediction: Optional[dict[str, float]]
    why: Optional[str]
    if spec.attempt:  # this process saw only its own attempt's records: the replay reads every attempt's
        prediction, why = None, "a requeued attempt: `python -m flodl_exp.simulate --from-run` replays the whole run"
    else:
        prediction, why = predict_finished_run(spec.config, sink, result)
    if prediction is not None:
        finite = {k: v for k, v in prediction.items() if math.isfinite(v)}
        logged = {k: v for k, v in finite.items() if k.startswith(("predicted/", "measured/"))}  # both, always
        sink.log_metrics(logged, step=max(epochs))
        result["prediction"] = finite
    else:
        log.warning("the simulator's prediction (predicted/*) was not made: %s", why)
        result["prediction_error"] = why
    try:
        atomic_json(result, path)
    except OSError as e:
        log.warning("could not record the prediction in result.json: %s", e)


def _run_label(spec: JobSpec) -> str:
    """The run in a report's title: its id's first 8 characters, or the job folder's name before the run exists."""
    return spec.run_id[:8] or os.path.basename(os.path.normpath(spec.job_dir))


def _with_run_id(spec: JobSpec, sink: Any) -> JobSpec:
    """The spec with the run id the launcher published (it created the run after submitting the job): the sink's,
    else read from the job folder. A launcher that delivers the records itself is not waited for (its run may be
    created after a short run's end: the model export request then names none, and the export reads it later);
    one that never published it leaves the spec as it is (the sink counts what it could not deliver)."""
    if spec.run_id:
        return spec
    if getattr(sink, "run_id", ""):
        return dataclasses.replace(spec, run_id=sink.run_id)
    from flodl_exp.job_spec import RunIdMissing, read_run_id

    if getattr(sink, "relayed", False):
        try:
            return dataclasses.replace(spec, run_id=read_run_id(spec.job_dir) or "")
        except RunIdMissing:
            return spec

    try:
        return spec.with_run_id(10.0)
    except RunIdMissing as e:
        log.error("%s", e)
        return spec


def _write_result(co: Coordinator, spec: JobSpec, job_dir: str) -> tuple[dict[str, Any], str]:
    """``<job>/result.json``: the coordinator's result with the attempt, the end reason, failed bundles and
    dropped log writes; returns it and its path."""
    result = co.result()
    result["attempt"] = spec.attempt
    if co.view.end_reason:
        result["end_reason"] = co.view.end_reason
    failed_bundles = co.view.failed_bundles
    if failed_bundles:
        result["failed_bundles"] = failed_bundles
    dropped = co.events.dropped + co.records.write_errors
    if dropped:
        result["dropped_log_writes"] = dropped
    result_path = os.path.join(job_dir, "result.json")
    atomic_json(result, result_path)
    return result, result_path


def _end_run_early(spec: JobSpec, status: str, failure: Optional[str]) -> None:
    """A failed rank's task exiting makes srun (--kill-on-bad-exit) kill the step within KillWait:
    the terminal status and the error go first, the artifacts after (large bundles take time)."""
    try:
        from flodl_exp.tracking import client

        c = client(spec.tracking_uri)
        if failure:
            c.set_tag(spec.run_id, "error", failure[:5000])
        c.set_terminated(spec.run_id, status=status)
    except Exception as e:
        log.warning("could not end the MLflow run early: %s", e)


def _log_run_artifacts(co: Coordinator, spec: JobSpec, cfg: Any, job_dir: str, sink: Any, status: str) -> None:
    """result.json, the event and record logs, the timeline, the dashboard and, when FINISHED, the final bundle."""
    sink.log_artifact(os.path.join(job_dir, "result.json"), "run")
    sink.log_artifact(co.events.path, "run")
    if co.records.dir is not None and os.path.isdir(co.records.dir):
        sink.log_artifact(co.records.dir, "record_log")
    timeline = _write_timeline(co, spec, cfg, job_dir, status)
    if timeline:
        sink.log_artifact(timeline, "timeline")
    if cfg.dashboard.html:
        _write_dashboard(co, spec, cfg, sink, timeline)
    stem = co.view.bundle_stem
    if status == "FINISHED":
        for suffix in (".pt", ".optim.pt", ".meta.json"):
            if os.path.exists(stem + suffix):
                sink.log_artifact(stem + suffix, "checkpoints")
        if cfg.tracking.log_model and os.path.exists(stem + ".pt"):
            settle = getattr(sink, "settle_delivery", None)  # a launcher relaying the records is still there
            if cfg.run.wait and (settle is None or settle()):  # it exports it after the run's end, off the critical path
                from flodl_exp.model_export import write_export_request

                write_export_request(job_dir, spec.run_id, stem, dict(spec.config["experiment"]), list(spec.import_paths))
            else:  # nobody waits (a detached job, a launcher gone): the job exports it before it ends
                sink.log_model(stem, spec.config["experiment"])


def _write_dashboard(co: Coordinator, spec: JobSpec, cfg: Any, sink: Any, timeline: Optional[str]) -> None:
    try:
        from flodl_exp.dashboard import load_events, write_dashboard

        epochs, windows, evals = load_events(co.events.path)
        path = write_dashboard(cfg.dashboard.html, f"flodl_exp {_run_label(spec)} {cfg.experiment.name}", epochs, windows,
                               evals, theme=cfg.dashboard.theme,
                               links=[("Timeline", "../timeline/timeline.html")] if timeline else [])
        sink.log_artifact(path, "dashboard")
    except Exception as e:  # the dashboard is a report, never a reason to fail the run
        log.warning("dashboard not written: %s", e)


def _write_timeline(co: Coordinator, spec: JobSpec, cfg: Any, job_dir: str, status: str) -> Optional[str]:
    """The run's timeline (timeline.json/.csv/.html) in ``<job>/timeline/``; its folder, or None when it failed
    (a report, never a reason to fail the run)."""
    try:
        from flodl_exp.timeline_report import write_timeline

        out = os.path.join(job_dir, "timeline")
        meta = {"title": f"flodl_exp {_run_label(spec)} {cfg.experiment.name} timeline", "run_id": spec.run_id,
                "mode": cfg.mode.name, "experiment": cfg.experiment.name, "status": status}
        write_timeline(out, co.timeline, meta)
        return out
    except Exception as e:
        log.warning("timeline not written: %s", e)
        return None


def _record_tracking_loss(sink: Any, result: dict[str, Any], path: str) -> None:
    """MLflow records the sink could not deliver (after retries): counted in result.json."""
    lost = int(getattr(sink, "lost", 0) or 0)
    if lost:
        result["tracking_lost_records"] = lost
        try:
            atomic_json(result, path)
        except OSError as e:
            log.warning("could not record the lost MLflow records in result.json: %s", e)


log = logging.getLogger("flodl_exp.coordinator")

if __name__ == "__main__":
    code = main(sys.argv)
    # Everything is written and closed (result.json, events, the bundle, the MLflow sink joined): leave without
    # the interpreter's teardown of torch and mlflow (~1.3 s), which task 0 would wait for on every run's end.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
