"""The launcher's side of a run's end: task 0 (the coordinator's host) lost, and Ctrl-C on a hung run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from conftest import ROOT, CliProcess, alive, base_overrides, launch_run, read_events, read_result, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

START_S = 180.0
"""Deadline for a run to start (both ranks joined): a cold start on a loaded 2-core machine takes tens of seconds."""


def _joined(job: Path) -> dict[int, int]:
    return {e["rank"]: e["pid"] for e in read_events(job) if e.get("event") == "joined"}


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[1])


def _held_cli_run(out: list[str]) -> tuple[str, Path, list[int]]:
    """A CLI run's id, job folder and processes (ranks, coordinator, submitit's controller), from the lines it
    printed, once both ranks joined; the run must be held open (a gate)."""
    wait_for(lambda: any(x.startswith("MLflow run ") for x in out), timeout=START_S, what="the run's folder")
    head = next(x for x in out if x.startswith("MLflow run "))
    run_id, controller, job = head.split()[2], int(head.split()[4]), Path(head.split(" folder ", 1)[1].strip())
    wait_for(lambda: len(_joined(job)) == 2, timeout=START_S, what="both ranks joined")
    pids = [*_joined(job).values(), json.loads((job / "rendezvous.json").read_text())["pid"], controller]
    assert not any(e.get("event") == "end" for e in read_events(job)), "the gate should hold the run open"
    return run_id, job, pids


def test_losing_the_coordinators_host_task_fails_the_run_in_one_line(store, tmp_path, monkeypatch):
    """Task 0 SIGKILLed: its coordinator dies with it and nobody writes the run's end. The launcher says so in one
    line, and leaves result.json, an end event and a FAILED MLflow run as any other failure does."""
    from flodl_exp.jobs.launcher import RunFailed

    gate = tmp_path / "gate"  # both ranks wait at their first batch: the run is in progress at the kill, on any machine
    monkeypatch.setenv("FLODL_FAULT_INJECT", f"0:1:gate:{gate},1:1:gate:{gate}")
    h = launch_run(store, "launcher_faults", "mode=nccl_cadence", "experiment.epochs=3", "cluster.heartbeat_timeout_s=10")
    job = Path(h.job_dir)
    try:
        wait_for(lambda: len(_joined(job)) == 2, timeout=START_S, what="both ranks joined")
        pids = _joined(job)
        coord = json.loads((job / "rendezvous.json").read_text())["pid"]
        assert _ppid(coord) == pids[0], "the coordinator runs under task 0, the process of rank 0"
        assert not any(e.get("event") == "end" for e in read_events(job)), "the gate should hold the run open"
        os.kill(pids[0], signal.SIGKILL)
    finally:
        gate.touch()
    with pytest.raises(RunFailed) as err:
        h.wait()
    msg = str(err.value)
    assert msg.startswith(f"the coordinator's host task (task 0, pid {pids[0]} on host {os.uname().nodename}) was lost"), msg
    assert "\n" not in msg and "UncompletedJobError" not in msg and "has not produced any output" not in msg
    res = read_result(job)
    assert res["status"] == "FAILED" and res["failure"] == msg and res["end_reason"] == "coordinator_host_lost"
    assert res["world_size"] == 2 and res["deaths"] == [] and res["stem"] == h.stem  # the coordinator's keys
    ends = [e for e in read_events(job) if e.get("event") == "end"]
    assert len(ends) == 1 and ends[0]["status"] == "FAILED" and ends[0]["failure"] == msg and "t" in ends[0]
    run = MlflowClient(store["uri"]).get_run(h.run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["end_reason"] == "coordinator_host_lost" and run.data.tags["error"] == msg
    job_pids = [*pids.values(), coord, int(h.job_id)]  # ranks, coordinator, submitit's controller
    wait_for(lambda: not any(alive(p) for p in job_pids), timeout=30, what="every process of the run to end")


def test_ctrl_c_cancels_a_hung_run_within_seconds(store, tmp_path):
    """Ctrl-C on the CLI while the run is hung (both ranks held at a gate that never opens in time): the launcher
    cancels the job, marks the run KILLED, says so in one line and exits 130, all within seconds. The signal goes
    to the CLI's whole process group, as a terminal's Ctrl-C does: the job's processes must leave it to the
    launcher (the coordinator would otherwise end the run FAILED as a crash, and task 0 outlive the cancel)."""
    gate = tmp_path / "gate"
    env = dict(os.environ, FLODL_FAULT_INJECT=f"0:1:gate:{gate},1:1:gate:{gate}")
    args = [*base_overrides(store, "launcher_faults"), "mode=cpu_cadence", "experiment.epochs=3"]
    # SIGINT's default disposition in the launcher, as in a terminal: a suite started in the background of a
    # non-interactive shell (`make test &`) runs with SIGINT ignored, which its children would inherit
    cli = CliProcess(args, env, start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    p, out, err = cli.proc, cli.out, cli.err
    try:
        run_id, job, pids = _held_cli_run(out)
        t0 = time.monotonic()
        os.killpg(p.pid, signal.SIGINT)
        try:
            rc = p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher did not exit within 10 s of Ctrl-C; stderr:\n{''.join(err)[-3000:]}")
        took = time.monotonic() - t0
    finally:
        gate.touch()
        if p.poll() is None:
            p.kill()
            p.wait()
    stderr = cli.output(5)[1]
    assert rc == 130, (rc, stderr[-3000:])
    said = [x for x in stderr.splitlines() if "interrupted" in x]
    assert len(said) == 1 and "KILLED" in said[0] and "Traceback" not in stderr, stderr[-3000:]
    assert took < 10
    run = MlflowClient(store["uri"]).get_run(run_id)
    assert run.info.status == "KILLED" and run.data.tags["error"] == "cancelled by the user"
    wait_for(lambda: not any(alive(q) for q in pids), timeout=10, what="every process of the run to end")


def test_a_launcher_killed_mid_run_leaves_the_records_to_the_job(store, tmp_path):
    """The CLI SIGKILLed while its run trains (both ranks held at a gate): its records relay stops beating, the job
    takes the delivery over (records_journal.py) and the MLflow run still ends FINISHED with every epoch's metrics,
    the model logged by the job itself (nobody is left to export it)."""
    gate = tmp_path / "gate"
    env = dict(os.environ, FLODL_FAULT_INJECT=f"0:1:gate:{gate},1:1:gate:{gate}")
    args = [*base_overrides(store, "launcher_faults"), "mode=cpu_cadence", "experiment.epochs=2",
            "tracking.relay_stale_s=2", "tracking.log_model=true"]
    p = subprocess.Popen([sys.executable, "-m", "flodl_exp", *args], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(p.stdout or []), daemon=True)
    reader.start()
    pids: list[int] = []
    try:
        run_id, job, pids = _held_cli_run(out)
        assert (job / "records.jsonl").exists() and (job / "records_relay.json").exists()
        p.kill()  # the launcher, only: the job goes on
        p.wait(10)
        wait_for(lambda: (job / "records_taken.json").exists(), timeout=60, what="the job to take the delivery over")
    finally:
        gate.touch()
        if p.poll() is None:
            p.kill()
            p.wait()
    try:
        wait_for(lambda: (job / "result.json").exists(), timeout=START_S, what="the run's result")
        c = MlflowClient(store["uri"])
        wait_for(lambda: c.get_run(run_id).info.status != "RUNNING", timeout=120, what="the job to end its run")
        run = c.get_run(run_id)
        assert run.info.status == "FINISHED" and read_result(job)["status"] == "FINISHED"
        assert sorted(m.step for m in c.get_metric_history(run_id, "loss")) == [0, 1]
        assert "checkpoints" in [a.path for a in c.list_artifacts(run_id)]
        assert "log_model_error" not in run.data.tags
        import mlflow

        mlflow.set_tracking_uri(store["uri"])
        assert mlflow.models.get_model_info(f"runs:/{run_id}/model").signature is not None  # exported by the job
        assert not (job / "model_export.json").exists()
    finally:
        for q in pids:
            if alive(q):
                os.kill(q, signal.SIGKILL)
