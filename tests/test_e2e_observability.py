"""Observability end to end: window records, reductions, record log, dashboard (sweeps as parent/child runs and
their report: tests/test_ui_browser.py, on the sweep its UI checks serve)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from conftest import base_overrides, compose

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]


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
