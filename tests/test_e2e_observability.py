"""Observability end to end: sweeps as parent/child runs, window records, reductions, record log, dashboard."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from conftest import base_overrides, compose, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]


def test_sweep_is_one_parent_with_a_child_per_job_and_a_report(store, tmp_path):
    ov = [o for o in base_overrides(store, "sweep_e2e") if not o.startswith("hydra.run")]
    r = run_cli(["-m", "mode=cpu_sync,cpu_cadence", "experiment.epochs=2", "run.progress=off", *ov,
                 f"hydra.sweep.dir={tmp_path}/sweep"], timeout=380)
    assert r.returncode == 0, r.stderr[-3000:]
    c = MlflowClient(store["uri"])
    exp = c.get_experiment_by_name("sweep_e2e")
    assert exp is not None
    runs = c.search_runs([exp.experiment_id])
    parents = [x for x in runs if x.data.tags.get("flodl.sweep") == "parent"]
    assert len(parents) == 1
    pid = parents[0].info.run_id
    children = [x for x in runs if x.data.tags.get("mlflow.parentRunId") == pid]
    assert sorted(x.data.tags["mode"] for x in children) == ["cpu_cadence", "cpu_sync"]
    assert all(x.info.status == "FINISHED" for x in children) and parents[0].info.status == "FINISHED"
    assert sorted(x.info.run_name for x in children) == ["digits_mlp/cpu_cadence/trend", "digits_mlp/cpu_sync/trend"]
    report = tmp_path / "sweep" / "report" / "report.md"
    assert report.exists() and "cpu_cadence" in report.read_text()
    assert (tmp_path / "sweep" / "report" / "loss_vs_time.png").exists()
    assert {a.path for a in c.list_artifacts(pid, "report")} >= {"report/report.md", "report/loss_vs_time.png"}


def test_windows_reductions_record_log_and_dashboard(store, tmp_path):
    from flodl_exp.jobs.launcher import launch

    epochs = 3
    h = launch(compose([*base_overrides(store, "observability"), "mode=cpu_sync", f"experiment.epochs={epochs}",
                        "reports_per_epoch=4", "+scalar_reductions.ones=sum", "+scalar_reductions.label_mean=max",
                        "experiment.train_step=flodl_exp.zoo.digits.train_step_recording",
                        f"record_log.dir={tmp_path}/records", "record_log.max_bytes=1024",
                        f"dashboard.html={tmp_path}/dash.html"]))
    res = h.wait()
    assert res["status"] == "FINISHED"
    c = MlflowClient(store["uri"])
    assert len(c.get_metric_history(h.run_id, "window/loss")) == 4 * epochs
    m = c.get_run(h.run_id).data.metrics
    assert m["ones"] == pytest.approx(2.0)  # declared sum over 2 ranks of a constant 1.0
    assert m["label_mean"] == pytest.approx(max(m["rank0/label_mean"], m["rank1/label_mean"]))
    logs = [p for p in Path(tmp_path, "records").rglob("*.log")]
    assert {p.name for p in logs} == {"root.log", "rank0.log", "rank1.log"}
    assert all(os.path.getsize(p) <= 1024 for p in logs)
    html = Path(tmp_path, "dash.html").read_text()
    assert "<svg" in html and "http://" not in html and "https://" not in html
    assert {a.path for a in c.list_artifacts(h.run_id, "dashboard")} == {"dashboard/dash.html"}
