"""Coordinator process entry: ``python -m flodl_exp.control.main <spec.json> <host>``.

Started by task 0 of the job. Binds the rank server (and, for the collective
backend, the TCPStore), writes rendezvous.json, runs the event loop, logs to
MLflow, and writes ``result.json``. Exit status 0 = FINISHED, 3 = PREEMPTED
(bundle written for a requeue, MLflow run left RUNNING), 1 = anything else.

Signals: ``SIGUSR1`` = save a bundle and stop for requeue (sent by task 0 on
submitit's preemption / time-limit signal); ``SIGUSR2`` (SLURM's ``--signal``
reaches every process of the step) is logged and left to task 0; ``SIGTERM``
on SLURM ends the run before the cluster's SIGKILL (see checkpointing.py).
"""
from __future__ import annotations

import json
import logging
import os
import queue
import signal
import sys
import time

from ..constants import PREEMPT_EXIT


class _Signals:
    """Signal handlers installed first thing (imports take seconds); they only set flags."""

    def __init__(self, slurm: bool) -> None:
        self.co = None
        self.preempt = False
        self.term = False
        signal.signal(signal.SIGUSR1, self._usr1)
        signal.signal(signal.SIGUSR2, self._usr2)  # default action would kill the coordinator
        if slurm:
            signal.signal(signal.SIGTERM, self._term)

    def attach(self, co) -> None:
        self.co = co
        if self.preempt:
            co.request_preempt()
        if self.term:
            co.request_terminate()

    def _usr1(self, signum, frame) -> None:
        logging.getLogger("flodl_exp.coordinator").warning("SIGUSR1: preemption / time limit: bundle, then stop for requeue")
        self.preempt = True
        if self.co is not None:
            self.co.request_preempt()

    def _usr2(self, signum, frame) -> None:
        logging.getLogger("flodl_exp.coordinator").info("SIGUSR2 from the cluster: task 0 asks for the bundle")

    def _term(self, signum, frame) -> None:
        logging.getLogger("flodl_exp.coordinator").warning("SIGTERM: the job step is being terminated")
        self.term = True
        if self.co is not None:
            self.co.request_terminate()
            if self.co.phase == "connecting":
                from .coordinator import RunFailure

                raise RunFailure("the job was terminated (SIGTERM) before every rank connected")


def main(argv: list[str]) -> int:
    spec_path, host = argv[1], argv[2]
    with open(spec_path) as fh:
        slurm = json.load(fh)["config"]["cluster"]["executor"] == "slurm"
    signals = _Signals(slurm)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s coordinator %(levelname)s %(message)s", stream=sys.stderr)
    log = logging.getLogger("flodl_exp.coordinator")
    with open(spec_path) as fh:
        spec = json.load(fh)
    job_dir = os.path.dirname(os.path.abspath(spec_path))
    cfg = spec["config"]
    w = int(cfg["cluster"]["nodes"]) * int(cfg["cluster"]["ranks_per_node"])

    from .. import wire
    from ..checkpoint import atomic_json
    from ..jobs.rendezvous import incarnation, write_rendezvous
    from ..tracking import MlflowSink
    from .coordinator import Coordinator, RunFailure
    from .server import RankServer, start_store

    token = wire.new_token()
    events: "queue.Queue[tuple]" = queue.Queue()
    server = RankServer(host, token, w, events)
    store = start_store(host, w) if cfg["mode"]["backend"] == "nccl" and w > 1 else None
    write_rendezvous(job_dir, {"host": host, "port": server.port, "store_port": store.port if store else None,
                               "token": token, "pid": os.getpid(), "incarnation": incarnation(int(spec.get("attempt", 0)))})
    log.info("listening on %s:%d (world size %d)", host, server.port, w)
    sink = MlflowSink(spec["tracking_uri"], spec["run_id"])
    co = Coordinator(spec, server, events, sink, job_dir)
    signals.attach(co)
    if slurm:
        srun_args = [str(a) for a in cfg["cluster"]["slurm"].get("srun_args") or []]
        co.kill_on_bad_exit = any(a in ("--kill-on-bad-exit", "--kill-on-bad-exit=1", "-K", "-K1") for a in srun_args)
    if os.environ.get("SLURM_JOB_ID"):
        sink.set_tags({"slurm_job_id": os.environ["SLURM_JOB_ID"], "slurm_restart_count": os.environ.get("SLURM_RESTART_COUNT", "0"),
                       "slurm_nodelist": os.environ.get("SLURM_JOB_NODELIST", "")})
    if spec.get("attempt"):
        co.emit({"event": "resumed", "attempt": int(spec["attempt"]), "stem": spec["resume"]["stem"],
                 "epoch": int(spec["resume"]["meta"]["epoch"]), "global_step": co.global_step})
    try:
        status = co.run(float(cfg["cluster"]["rendezvous_timeout_s"]))
    except RunFailure as e:
        co.failure, co.status = str(e), "FAILED"
        co._shutdown()
        status = "FAILED"
    except BaseException as e:
        log.exception("coordinator crashed")
        co.failure, co.status = f"coordinator crashed: {type(e).__name__}: {e}", "FAILED"
        co._shutdown()
        status = "FAILED"
    result = co.result()
    result["attempt"] = int(spec.get("attempt", 0))
    if getattr(co, "end_reason", None):
        result["end_reason"] = co.end_reason
    atomic_json(result, os.path.join(job_dir, "result.json"))
    co.emit({"event": "end", "status": status, "failure": co.failure})
    if getattr(co, "terminated", False) and status in ("FAILED", "KILLED"):
        # SIGTERM on SLURM: SIGKILL follows within KillWait. The terminal status first, the rest never.
        tags = {"end_reason": co.end_reason, "global_step": co.global_step}
        if co.failure:
            tags["error"] = co.failure[:5000]
        sink.set_tags(tags)
        sink.close(status, timeout=3.0)
        server.close()
        return 1
    if status == "PREEMPTED":
        # Bundle written; the requeued job resumes into this run, which stays RUNNING.
        sink.log_artifact(os.path.join(job_dir, "events.jsonl"), "run")
        sink.close(None, timeout=10.0)
        server.close()
        return PREEMPT_EXIT
    if slurm and status != "FINISHED":
        # A failed rank's task exiting makes srun (--kill-on-bad-exit) kill the step within KillWait:
        # the terminal status and the error go first, the artifacts after (large bundles take time).
        try:
            from ..tracking import client

            c = client(spec["tracking_uri"])
            if co.failure:
                c.set_tag(spec["run_id"], "error", co.failure[:5000])
            c.set_terminated(spec["run_id"], status=status)
        except Exception as e:
            log.warning("could not end the MLflow run early: %s", e)
    if co.failure:
        sink.set_tags({"error": co.failure[:5000]})
    sink.set_tags({"global_step": co.global_step, "syncs": co.version})
    sink.log_artifact(os.path.join(job_dir, "result.json"), "run")
    sink.log_artifact(os.path.join(job_dir, "events.jsonl"), "run")
    if co.records.enabled and os.path.isdir(co.records.dir):
        sink.log_artifact(co.records.dir, "record_log")
    dash = (cfg.get("dashboard") or {}).get("html")
    if dash:
        try:
            from ..dashboard import load_events, write_dashboard

            epochs, windows, evals = load_events(os.path.join(job_dir, "events.jsonl"))
            path = write_dashboard(dash, f"flodl_exp {spec['run_id'][:8]} {cfg['experiment']['name']}", epochs, windows,
                                   evals, theme=cfg["dashboard"]["theme"])
            sink.log_artifact(path, "dashboard")
        except Exception as e:  # the dashboard is a report, never a reason to fail the run
            log.warning("dashboard not written: %s", e)
    stem = spec["checkpoint_stem"]
    if status == "FINISHED":
        for suffix in (".pt", ".optim.pt", ".meta.json"):
            if os.path.exists(stem + suffix):
                sink.log_artifact(stem + suffix, "checkpoints")
    sink.close(status)
    server.close()
    time.sleep(0.05)
    return 0 if status == "FINISHED" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
