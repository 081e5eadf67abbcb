"""Coordinator process entry: ``python -m flodl_exp.control.main <spec.json> <host>``.

Started by task 0 of the job. Binds the rank server (and, for the collective
backend, the TCPStore), writes rendezvous.json, runs the event loop, logs to
MLflow, and writes ``result.json``. Exit status 0 = FINISHED.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import sys
import time


def main(argv: list[str]) -> int:
    spec_path, host = argv[1], argv[2]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s coordinator %(levelname)s %(message)s", stream=sys.stderr)
    log = logging.getLogger("flodl_exp.coordinator")
    with open(spec_path) as fh:
        spec = json.load(fh)
    job_dir = os.path.dirname(os.path.abspath(spec_path))
    cfg = spec["config"]
    w = int(cfg["cluster"]["nodes"]) * int(cfg["cluster"]["ranks_per_node"])

    from .. import wire
    from ..checkpoint import atomic_json
    from ..launch.rendezvous import write_rendezvous
    from ..tracking import MlflowSink
    from .coordinator import Coordinator, RunFailure
    from .server import RankServer, start_store

    token = wire.new_token()
    events: "queue.Queue[tuple]" = queue.Queue()
    server = RankServer(host, token, w, events)
    store = start_store(host, w) if cfg["mode"]["backend"] == "nccl" and w > 1 else None
    write_rendezvous(job_dir, {"host": host, "port": server.port, "store_port": store.port if store else None,
                               "token": token, "pid": os.getpid()})
    log.info("listening on %s:%d (world size %d)", host, server.port, w)
    sink = MlflowSink(spec["tracking_uri"], spec["run_id"])
    co = Coordinator(spec, server, events, sink, job_dir)
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
    atomic_json(result, os.path.join(job_dir, "result.json"))
    co.emit({"event": "end", "status": status, "failure": co.failure})
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
