"""The launcher's side of a run's end: Ctrl-C on a hung run."""
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

from conftest import ROOT, alive, base_overrides, read_events, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

START_S = 180.0
"""Deadline for a run to start (both ranks joined): a cold start on a loaded 2-core machine takes tens of seconds."""


def _joined(job: Path) -> dict[int, int]:
    return {e["rank"]: e["pid"] for e in read_events(job) if e.get("event") == "joined"}


def test_ctrl_c_cancels_a_hung_run_within_seconds(store, tmp_path):
    """Ctrl-C on the CLI while the run is hung (both ranks held at a gate that never opens in time): the launcher
    cancels the job, marks the run KILLED, says so in one line and exits 130, all within seconds. The signal goes
    to the CLI's whole process group, as a terminal's Ctrl-C does: the job's processes must leave it to the
    launcher (the coordinator would otherwise end the run FAILED as a crash, and task 0 outlive the cancel)."""
    gate = tmp_path / "gate"
    env = dict(os.environ, FLODL_FAULT_INJECT=f"0:1:gate:{gate},1:1:gate:{gate}")
    args = [*base_overrides(store, "launcher_faults"), "mode=cpu_cadence", "experiment.epochs=3"]
    p = subprocess.Popen([sys.executable, "-m", "flodl_exp", *args], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    out: list[str] = []
    err: list[str] = []
    readers = [threading.Thread(target=lambda s=s, buf=buf: buf.extend(s), daemon=True)
               for s, buf in ((p.stdout, out), (p.stderr, err))]
    for t in readers:
        t.start()
    try:
        wait_for(lambda: any(x.startswith("MLflow run ") for x in out), timeout=START_S, what="the run's folder")
        head = next(x for x in out if x.startswith("MLflow run "))
        run_id, controller, job = head.split()[2], int(head.split()[4]), Path(head.split(" folder ", 1)[1].strip())
        wait_for(lambda: len(_joined(job)) == 2, timeout=START_S, what="both ranks joined")
        pids = [*_joined(job).values(), json.loads((job / "rendezvous.json").read_text())["pid"], controller]
        assert not any(e.get("event") == "end" for e in read_events(job)), "the gate should hold the run open"
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
    for t in readers:
        t.join(5)
    stderr = "".join(err)
    assert rc == 130, (rc, stderr[-3000:])
    said = [x for x in stderr.splitlines() if "interrupted" in x]
    assert len(said) == 1 and "KILLED" in said[0] and "Traceback" not in stderr, stderr[-3000:]
    assert took < 10
    run = MlflowClient(store["uri"]).get_run(run_id)
    assert run.info.status == "KILLED" and run.data.tags["error"] == "cancelled by the user"
    wait_for(lambda: not any(alive(q) for q in pids), timeout=10, what="every process of the run to end")
